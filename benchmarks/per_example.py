"""Per-example gradient norms and clipped gradients: jaxtrace against jax.vmap(jax.grad).

    python benchmarks/per_example.py [--quick] [--rounds N] [--models mlp,transformer,cnn,cnnpool,dwcnn,port,stacked,fori,vit,lstm,deeplstm,deeprnn]

For twelve equinox models (an MLP 1024 wide at batch 256; a 2-block transformer of width 256
at sequence 128, batch 32; issue 33's CNN: three 3x3 convolutions of 32, 64, 64 channels on
32x32x3 images, each with a 2x2 max pool (``cnnpool``: the same with ``eqx.nn.MaxPool2d``), batch 64; a MobileNet-style CNN of the same widths whose
blocks are a depthwise 3x3 (``groups`` = channels) and a pointwise 1x1; the GPT-2 port of
``examples/hf_gpt2_port.py`` at the transformer's sizes, which reads its token table as
``wte.weight[ids]``, its position table as ``wpe.weight[:T]`` and ties its head as
``h @ wte.weight.T``; a stack of 4 residual MLP blocks held as raw ``(4, d, 4d)`` and ``(4, 4d, d)``
arrays and run with ``lax.scan``, at the transformer's sizes, as hand-written deep models are
(``fori``: the same blocks run by ``lax.fori_loop``, reading ``up[i]`` and ``down[i]``); a
ViT of width 192, 4 blocks of 3 heads stacked with ``eqx.filter_vmap`` and run with ``lax.scan``, on
32x32x3 images in 4x4 patches with a class token concatenated before them, batch 32; an
``eqx.nn.LSTMCell`` of width 256 run by ``lax.scan`` over 64 tokens, batch 32; ``deeplstm``: 3
``eqx.nn.LSTMCell`` layers of width 128 stacked with ``eqx.filter_vmap``, a scan over the layers
running each over the 64 tokens; ``deeprnn``: the same with each cell an ``eqx.nn.Linear`` of
``[x_t, h]``, an Elman cell written by hand) it
compiles, side by side:

- ``vmap(grad)`` + norms: ``jax.vmap(eqx.filter_grad(one_example_loss))`` then each leaf's
  squared norm (what one writes today), and the same with the clipped sum (DP-SGD);
- ``jt.per_example_norms`` and ``jt.clipped_grad``;
- plain ``eqx.filter_value_and_grad`` of the summed loss (the floor);

and prints a Markdown table: peak temporary memory from ``compiled.memory_analysis()``
(deterministic) and the median step time over interleaved rounds (the variants take
turns, so load on the machine hits all of them alike), with the ratios to ``vmap(grad)``
and to the plain ``filter_grad`` step.

The peers (Opacus ghost and per-sample clipping, BackPACK, jax-privacy) on issue 33's models:
``per_example_peers.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxtrace as jt

import per_example_peers  # noqa: E402  (the same directory: its JAX models; torch is imported only where used)
from timers import device  # noqa: E402


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d, heads, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.up, self.down = eqx.nn.Linear(d, 4 * d, key=k2), eqx.nn.Linear(4 * d, d, key=k3)

    def __call__(self, h):
        a = jax.vmap(self.ln1)(h)
        t = h.shape[0]
        h = h + self.attn(a, a, a, mask=jnp.tril(jnp.ones((t, t), bool)))
        return h + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(h))))


CNN = per_example_peers.CNN  # issue 33's CNN: 3x3 convolutions, ReLU, 2x2 max pools, two Linears


class DepthwiseCNN(eqx.Module):
    """MobileNet-style: a 3x3 stem, then blocks of a depthwise 3x3 (``groups`` = channels) and a
    pointwise 1x1, each block followed by a 2x2 max pool; a Linear head."""

    stem: eqx.nn.Conv2d
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, image, channels, classes, key):
        keys = jax.random.split(key, 2 * len(channels) + 2)
        self.stem = eqx.nn.Conv2d(3, channels[0], 3, padding=1, key=keys[0])
        c_in = (channels[0], *channels[:-1])
        self.blocks = [
            (eqx.nn.Conv2d(i, i, 3, padding=1, groups=i, key=k1), eqx.nn.Conv2d(i, o, 1, key=k2))
            for i, o, k1, k2 in zip(c_in, channels, keys[1::2], keys[2::2])
        ]
        self.head = eqx.nn.Linear(channels[-1] * (image // 2 ** len(channels)) ** 2, classes, key=keys[-1])

    def __call__(self, x):  # x: (3, H, W), one example
        x = jax.nn.relu(self.stem(x))
        for depthwise, pointwise in self.blocks:
            x = jax.nn.relu(pointwise(jax.nn.relu(depthwise(x))))
            c, h, w = x.shape
            x = jnp.max(x.reshape(c, h // 2, 2, w // 2, 2), axis=(2, 4))  # 2x2 max pool
        return self.head(x.reshape(-1))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab, d, heads, depth, key):
        keys = jax.random.split(key, depth + 2)
        self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
        self.blocks = [Block(d, heads, k) for k in keys[1:-1]]
        self.ln = eqx.nn.LayerNorm(d)
        self.head = eqx.nn.Linear(d, vocab, key=keys[-1])

    def __call__(self, ids):
        t, d = ids.shape[0], self.embed.weight.shape[1]
        pos = jnp.arange(t)[:, None] / (10_000 ** (jnp.arange(d)[None, :] / d))  # fixed sinusoids
        h = jax.vmap(self.embed)(ids) + jnp.where(jnp.arange(d) % 2, jnp.cos(pos), jnp.sin(pos))
        for block in self.blocks:
            h = block(h)
        return jax.vmap(self.head)(jax.vmap(self.ln)(h))


class Stacked(eqx.Module):
    """Token table, 4 residual MLP blocks stacked as raw arrays and run with ``lax.scan`` (or, ``fori``,
    with ``lax.fori_loop`` reading ``up[i]`` and ``down[i]``), a head."""

    embed: jax.Array
    up: jax.Array
    down: jax.Array
    head: jax.Array
    fori: bool = eqx.field(static=True)

    def __init__(self, vocab, d, layers, key, fori=False):
        k = jax.random.split(key, 4)
        self.embed = jax.random.normal(k[0], (vocab, d)) * 0.02
        self.up = jax.random.normal(k[1], (layers, d, 4 * d)) / jnp.sqrt(d)
        self.down = jax.random.normal(k[2], (layers, 4 * d, d)) / jnp.sqrt(4 * d)
        self.head = jax.random.normal(k[3], (d, vocab)) / jnp.sqrt(d)
        self.fori = fori

    def __call__(self, ids):
        def block(h, w):
            up, down = w
            return h + jax.nn.gelu(h @ up) @ down, None

        if self.fori:
            h = jax.lax.fori_loop(0, self.up.shape[0], lambda i, h: block(h, (self.up[i], self.down[i]))[0], self.embed[ids])
        else:
            h, _ = jax.lax.scan(block, self.embed[ids], (self.up, self.down))
        return h @ self.head


class ViTBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    att: eqx.nn.MultiheadAttention
    fc: eqx.nn.Linear
    proj: eqx.nn.Linear

    def __init__(self, d, heads, key):
        k = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.att = eqx.nn.MultiheadAttention(heads, d, key=k[0])
        self.fc, self.proj = eqx.nn.Linear(d, 4 * d, key=k[1]), eqx.nn.Linear(4 * d, d, key=k[2])

    def __call__(self, h):
        x = jax.vmap(self.ln1)(h)
        h = h + self.att(x, x, x)
        return h + jax.vmap(self.proj)(jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln2)(h))))


class ViT(eqx.Module):
    """Patches by a strided Conv2d, a class token concatenated before them, a position table added
    whole, blocks stacked with ``eqx.filter_vmap`` and run with ``lax.scan``, a head on the class token."""

    patch: eqx.nn.Conv2d
    cls: jax.Array
    pos: jax.Array
    blocks: ViTBlock
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, image, patch, d, heads, layers, classes, key):
        k = jax.random.split(key, 5)
        self.patch = eqx.nn.Conv2d(3, d, patch, stride=patch, key=k[0])
        self.cls = jax.random.normal(k[1], (1, d)) * 0.02
        self.pos = jax.random.normal(k[2], ((image // patch) ** 2 + 1, d)) * 0.02
        self.blocks = eqx.filter_vmap(lambda k: ViTBlock(d, heads, k))(jax.random.split(k[3], layers))
        self.ln, self.head = eqx.nn.LayerNorm(d), eqx.nn.Linear(d, classes, key=k[4])

    def __call__(self, image):
        x = self.patch(image)
        h = jnp.concatenate([self.cls, x.reshape(x.shape[0], -1).T]) + self.pos
        params, static = eqx.partition(self.blocks, eqx.is_array)
        h, _ = jax.lax.scan(lambda h, p: (eqx.combine(p, static)(h), None), h, params)
        return self.head(self.ln(h[0]))


class LSTM(eqx.Module):
    """A token table, an ``eqx.nn.LSTMCell`` run by ``lax.scan`` (its body closes over the cell), a head."""

    embed: eqx.nn.Embedding
    cell: eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, vocab, d, key):
        k = jax.random.split(key, 3)
        self.embed, self.cell = eqx.nn.Embedding(vocab, d, key=k[0]), eqx.nn.LSTMCell(d, d, key=k[1])
        self.head = eqx.nn.Linear(d, vocab, key=k[2])

    def __call__(self, ids):
        def step(state, x_t):
            state = self.cell(x_t, state)
            return state, state[0]

        zeros = jnp.zeros(self.cell.hidden_size)
        _, hs = jax.lax.scan(step, (zeros, zeros), jax.vmap(self.embed)(ids))
        return jax.vmap(self.head)(hs)


class DeepLSTM(eqx.Module):
    """A token table, ``layers`` ``eqx.nn.LSTMCell``s stacked by ``eqx.filter_vmap`` and run by a scan over
    the layers, each running its cell over the positions (a scan nested in a scan), a head."""

    embed: eqx.nn.Embedding
    cells: eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, vocab, d, layers, key):
        k = jax.random.split(key, 3)
        self.embed, self.head = eqx.nn.Embedding(vocab, d, key=k[0]), eqx.nn.Linear(d, vocab, key=k[2])
        self.cells = eqx.filter_vmap(lambda kk: eqx.nn.LSTMCell(d, d, key=kk))(jax.random.split(k[1], layers))

    def __call__(self, ids):
        params, static = eqx.partition(self.cells, eqx.is_array)

        def layer(xs, p):
            cell = eqx.combine(p, static)

            def step(state, x_t):
                state = cell(x_t, state)
                return state, state[0]

            zeros = jnp.zeros(xs.shape[-1])
            return jax.lax.scan(step, (zeros, zeros), xs)[1], None

        hs, _ = jax.lax.scan(layer, jax.vmap(self.embed)(ids), params)
        return jax.vmap(self.head)(hs)


class DeepRNN(eqx.Module):
    """``DeepLSTM`` with its cells written by hand: each layer an ``eqx.nn.Linear`` of ``[x_t, h]``
    (an Elman cell), stacked by ``eqx.filter_vmap``, a scan over the layers running each over the positions."""

    embed: eqx.nn.Embedding
    cells: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, vocab, d, layers, key):
        k = jax.random.split(key, 3)
        self.embed, self.head = eqx.nn.Embedding(vocab, d, key=k[0]), eqx.nn.Linear(d, vocab, key=k[2])
        self.cells = eqx.filter_vmap(lambda kk: eqx.nn.Linear(2 * d, d, key=kk))(jax.random.split(k[1], layers))

    def __call__(self, ids):
        params, static = eqx.partition(self.cells, eqx.is_array)

        def layer(xs, p):
            cell = eqx.combine(p, static)
            step = lambda h, x_t: (jnp.tanh(cell(jnp.concatenate([x_t, h]))),) * 2  # noqa: E731
            return jax.lax.scan(step, jnp.zeros(xs.shape[-1]), xs)[1], None

        hs, _ = jax.lax.scan(layer, jax.vmap(self.embed)(ids), params)
        return jax.vmap(self.head)(hs)


def gpt2_port(vocab, d, heads, layers, positions, key):
    """The port of ``examples/hf_gpt2_port.py`` (its code, float32), from a config of these sizes."""
    import importlib.util
    import pathlib
    import sys
    import types

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_gpt2_port.py"
    spec = importlib.util.spec_from_file_location("hf_gpt2_port", path)
    port = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # equinox's dataclasses look it up
    spec.loader.exec_module(port)
    jax.config.update("jax_enable_x64", False)  # the example turns float64 on for its own checks
    cfg = types.SimpleNamespace(n_embd=d, n_head=heads, n_layer=layers, vocab_size=vocab, n_positions=positions,
                                layer_norm_epsilon=1e-5)
    model = port.make_port(cfg, key)
    return jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, model)


def mlp_losses(model, x, y):
    logits = jax.vmap(model)(x)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


def lm_losses(model, ids, targets):
    logp = jax.nn.log_softmax(jax.vmap(model)(ids), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=-1)


def variants(losses_fn, max_norm=1.0):
    def one(model, *ex):
        return losses_fn(model, *(e[None] for e in ex))[0]

    def per_example_grads(model, *batch):
        return jax.vmap(eqx.filter_grad(one), in_axes=(None, *[0] * len(batch)))(model, *batch)

    def vmap_norms(model, *batch):
        per = per_example_grads(model, *batch)
        return sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), 1) for g in jax.tree.leaves(per))

    def vmap_clipped(model, *batch):
        per = per_example_grads(model, *batch)
        total = sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), 1) for g in jax.tree.leaves(per))
        w = jnp.minimum(1.0, max_norm / jnp.sqrt(total))
        return jax.tree.map(lambda g: jnp.tensordot(w, g, 1), per)

    def ours_norms(model, *batch):
        return jt.per_example_norms(losses_fn, total=True)(model, *batch)[1]

    def ours_clipped(model, *batch):
        return jt.clipped_grad(losses_fn, max_norm)(model, *batch)[1]

    def plain(model, *batch):
        return eqx.filter_grad(lambda m, *b: jnp.sum(losses_fn(m, *b)))(model, *batch)

    return {
        "vmap(grad) + norms": vmap_norms,
        "jt.per_example_norms": ours_norms,
        "vmap(grad) + clip-and-sum": vmap_clipped,
        "jt.clipped_grad": ours_clipped,
        "filter_grad (no per-example)": plain,
    }


def measure(name, model, batch, losses_fn, rounds):
    arrays, static = eqx.partition(model, eqx.is_array)
    jitted = {k: jax.jit(lambda a, *b, f=f: f(eqx.combine(a, static), *b)) for k, f in variants(losses_fn).items()}
    fns = {}
    mem, times = {}, {k: [] for k in jitted}
    for k, f in jitted.items():
        compiled = f.lower(arrays, *batch).compile()
        ma = compiled.memory_analysis()
        mem[k] = ma.temp_size_in_bytes if ma is not None else float("nan")
        fns[k] = functools.partial(compiled, arrays)
        jax.block_until_ready(fns[k](*batch))  # warm
    model = ()
    check = np.asarray(fns["jt.per_example_norms"](*batch))
    ref = np.asarray(fns["vmap(grad) + norms"](*batch))
    rel = float(np.max(np.abs(check - ref) / np.abs(ref)))
    for _ in range(rounds):
        for k, f in fns.items():  # interleaved: each round runs every variant once
            t0 = time.perf_counter()
            jax.block_until_ready(f(*batch))
            times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    rows = []
    plain = med["filter_grad (no per-example)"]
    for k in fns:
        base = "vmap(grad) + clip-and-sum" if "clip" in k else "vmap(grad) + norms"
        rows.append(
            f"| {name} | {k} | {mem[k] / 2**20:.1f} | {mem[k] / mem[base]:.2f} | {med[k] * 1e3:.1f} | "
            f"{med[k] / med[base]:.2f} | {med[k] / plain:.2f} |"
        )
    return rows, rel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small models, for a smoke run")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--models", default="mlp,transformer,cnn,cnnpool,dwcnn,port,stacked,fori,vit,lstm,deeplstm,deeprnn",
                        help="comma-separated: mlp,transformer,cnn,cnnpool,dwcnn,port,stacked,fori,vit,lstm,deeplstm,deeprnn")
    args = parser.parse_args()
    which = args.models.split(",")
    key = jax.random.key(0)
    if args.quick:
        width, batch, d, t, tb, rounds = 64, 16, 32, 16, 4, 3
        image, channels, cb = 8, (4, 8, 8), 4
    else:
        width, batch, d, t, tb, rounds = 1024, 256, 256, 128, 32, args.rounds
        image, channels, cb = 32, (32, 64, 64), 64
    mlp = eqx.nn.MLP(width, 10, width, 3, key=key)
    x = jax.random.normal(key, (batch, width))
    y = jax.random.randint(key, (batch,), 0, 10)
    lm = Transformer(512, d, 4, 2, key)
    ids = jax.random.randint(key, (tb, t), 0, 512)
    print(f"JAX {jax.__version__}, {device()}, load {os.getloadavg()[0]:.1f} (1 min)")
    cnn = CNN(image, channels, 128, 10, key)
    xc = jax.random.normal(key, (cb, 3, image, image))
    yc = jax.random.randint(key, (cb,), 0, 10)
    cnn_pool = per_example_peers.CNN(image, channels, 128, 10, key, pool="eqx")
    dw = DepthwiseCNN(image, channels, 10, key)
    port = gpt2_port(512, d, 4, 2, t, key) if "port" in which else None
    stacked = Stacked(512, d, 4, key)
    fori = Stacked(512, d, 4, key, fori=True)
    vit = ViT(image, 4, 192 if not args.quick else 32, 3 if not args.quick else 2, 4, 10, key)
    xv = jax.random.normal(key, (tb, 3, image, image))
    lstm = LSTM(512, d, key)
    deep_lstm = DeepLSTM(512, d // 2, 3, key)
    deep_rnn = DeepRNN(512, d // 2, 3, key)
    print(f"MLP: {width} wide, 3 hidden layers, batch {batch}; transformer: width {d}, 2 blocks, seq {t}, batch {tb}; "
          f"CNN: {image}x{image}x3, conv {channels}, batch {cb}; depthwise CNN: the same, depthwise + pointwise blocks\n")
    print("| model | variant | temp memory (MiB) | x vmap(grad) | step (ms) | x vmap(grad) | x filter_grad |")
    print("|---|---|---|---|---|---|---|")
    rel = {}
    for name, m, b, f in (("MLP", mlp, (x, y), mlp_losses), ("transformer", lm, (ids, jnp.roll(ids, 1, axis=1)), lm_losses),
                          ("CNN", cnn, (xc, yc), mlp_losses), ("CNNpool", cnn_pool, (xc, yc), mlp_losses), ("dwCNN", dw, (xc, yc), mlp_losses),
                          ("port", port, (ids, jnp.roll(ids, 1, axis=1)), lm_losses),
                          ("stacked", stacked, (ids, jnp.roll(ids, 1, axis=1)), lm_losses),
                          ("fori", fori, (ids, jnp.roll(ids, 1, axis=1)), lm_losses),
                          ("ViT", vit, (xv, yc[:tb]), mlp_losses),
                          ("LSTM", lstm, (ids[:, : t // 2], jnp.roll(ids[:, : t // 2], 1, axis=1)), lm_losses),
                          ("deepLSTM", deep_lstm, (ids[:, : t // 2], jnp.roll(ids[:, : t // 2], 1, axis=1)), lm_losses),
                          ("deepRNN", deep_rnn, (ids[:, : t // 2], jnp.roll(ids[:, : t // 2], 1, axis=1)), lm_losses)):
        if name.lower() in which:
            rows, rel[name] = measure(name, m, b, f, rounds)
            print("\n".join(rows))
    print("\nlargest relative difference of the norms from vmap(grad)'s: " + ", ".join(f"{k} {v:.1e}" for k, v in rel.items()))
    print(f"load {os.getloadavg()[0]:.1f} (1 min) at the end")


if __name__ == "__main__":
    main()
