"""What keeping a ``jt.NormHistory`` in the training step costs, against the plain step.

    python benchmarks/spike_history.py [--quick] [--rounds N] [--models guide,mlp,rnn,attention,cnn] [--size 16]

The models are ``models.py``'s MLP, RNN, attention and CNN, with their weights and inputs, held in an
equinox module and written with a loss per example whose mean is ``models.py``'s loss (the CNN's
convolutions as ``eqx.nn.Conv2d``, the same weights in OIHW, the images NCHW: a raw
``lax.conv_general_dilated`` of a leaf has no per-example rule and would take the exact path); and
``guide``, the training-statistics guide's own ``eqx.nn.MLP`` 8-32x3-1 at batch 64. Columns,
each one jitted step of the model's arrays (the static part closed over) with an optax Adam update:

- ``plain``: ``eqx.filter_value_and_grad`` of the mean loss and the update (the base of the ratios);
- ``history``: ``jt.value_grad_and_norms`` (the mean loss's gradient and each example's squared
  gradient norm per leaf, one pass), the update, and ``history.push`` into a ``jt.NormHistory`` of
  ``--size`` steps carried in (and donated to) the step;
- ``norms, no push``: the same without the history (what the norms cost alone);
- ``clipped_grad``: ``jt.clipped_grad`` (bound 1.0) divided by the batch size, and the update: the
  DP-SGD step, which forms the same norms and a weighted sum from the same pass (what the norms step
  should cost no more than: it is that sum with every weight 1).

Each round calls every column ``repeats`` times in a random order, waiting for each call; a column's
figure is the median over rounds of its time over ``plain``'s in the same round, in process CPU time
(the load of a shared machine disturbs it least) and wall time. The load is printed at the start and
the end: on a shared machine read the ratios, not the milliseconds. It prints how far the gradient of
``jt.value_grad_and_norms`` is from ``eqx.filter_grad``'s (float32, relative to the largest entry) and
the norms the history step pushed from ``jt.per_example_norms``'.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
if (ROOT / "jaxtrace").is_dir():
    sys.path.insert(0, str(ROOT))  # run from a checkout: this tree's jaxtrace
sys.path.insert(0, str(ROOT / "benchmarks"))
import jaxtrace as jt  # noqa: E402
import models  # noqa: E402
from timers import device  # noqa: E402


class Params(eqx.Module):
    """``models.py``'s parameters as the leaves of an equinox module (its convolutions as ``eqx.nn.Conv2d``)."""

    params: object


def _ln(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def mlp_losses(m, x):
    h = x
    for w in m.params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2, axis=-1)


def rnn_losses(m, xs):  # xs: (steps, batch, width)
    w, u = m.params["w"], m.params["u"]
    h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x @ u), None), jnp.zeros((xs.shape[1], w.shape[0]), xs.dtype), xs)
    return jnp.mean(h**2, axis=-1)


def attention_losses(m, x, heads=4):  # x: (batch, seq, d)
    b, t, d = x.shape
    dh = d // heads
    mask = jnp.tril(jnp.ones((t, t), bool))
    for p in m.params:
        q, k, v = jnp.split(_ln(x) @ p["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, dh).transpose(0, 2, 1, 3) for a in (q, k, v))
        logits = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh), -1e9)
        x = x + (jax.nn.softmax(logits, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d) @ p["o"]
        x = x + jax.nn.gelu(_ln(x) @ p["up"], approximate=True) @ p["down"]
    return jnp.mean(x**2, axis=(1, 2))


def cnn_losses(m, x):  # x: (batch, 3, H, W)
    def one(h):
        for conv in m.params["convs"]:
            h = jax.nn.relu(conv(h))
        return -jax.nn.log_softmax(h.mean(axis=(1, 2)) @ m.params["head"])[0]

    return jax.vmap(one)(x)


def conv2d(w_hwio, stride):
    """An ``eqx.nn.Conv2d`` without bias holding ``models.cnn``'s HWIO weight, "SAME" padding as ``models.cnn``'s."""
    kh, kw, cin, cout = w_hwio.shape
    conv = eqx.nn.Conv2d(cin, cout, (kh, kw), stride=stride, padding="SAME", use_bias=False, key=jax.random.key(0))
    return eqx.tree_at(lambda c: c.weight, conv, jnp.asarray(np.transpose(w_hwio, (3, 2, 0, 1))))


def guide_losses(model, x, y):
    return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)


def build(name: str, quick: bool):
    """``(label, module, losses, batch)`` of ``models.py``'s model ``name`` (its quick sizes with ``quick``), or
    ``"guide"``: the MLP of the training-statistics guide's spike section (``eqx.nn.MLP`` 8-32x3-1, batch 64)."""
    if name == "guide":
        x = jax.random.normal(jax.random.key(1), (64, 8), jnp.float32)
        return "the guide's MLP 8-32x3-1, batch 64", eqx.nn.MLP(8, 1, 32, 3, key=jax.random.key(0)), guide_losses, (x, jnp.sin(x[:, :1]))
    (spec,) = [m for m in models.models(quick) if m.name == name]
    p = jax.tree.map(jnp.asarray, spec.params)
    label = spec.describe.split(", a tag")[0].split("; tags")[0]
    if name == "mlp":
        return label, Params(p), mlp_losses, (jnp.asarray(spec.x),)
    if name == "rnn":
        return label, Params(p), rnn_losses, (jnp.asarray(spec.x),)
    if name == "attention":
        return label, Params(p), attention_losses, (jnp.asarray(spec.x),)
    convs = [conv2d(np.asarray(w), 1 if i == 0 else 2) for i, w in enumerate(spec.params["convs"])]
    return label, Params({"convs": convs, "head": p["head"]}), cnn_losses, (jnp.asarray(spec.x).transpose(0, 3, 1, 2),)


def check_loss(name, module, losses, batch, quick):
    """The mean of the per-example losses is ``models.py``'s loss (the same model, written per example)."""
    if name == "guide":
        return
    (spec,) = [m for m in models.models(quick) if m.name == name]
    ours, theirs = float(jnp.mean(losses(module, *batch))), float(spec.loss(spec.params, spec.x, models.identity))
    assert abs(ours - theirs) <= 1e-4 * abs(theirs), (name, ours, theirs)


def columns(module, losses, batch, size: int):
    """``{name: (compiled step, its arguments)}``; each step returns the new weights first."""
    arrays, static = eqx.partition(module, eqx.is_array)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(arrays)
    fun = jt.value_grad_and_norms(losses)

    def plain(arrays, opt_state, *batch):
        model = eqx.combine(arrays, static)
        loss, grads = eqx.filter_value_and_grad(lambda m, *b: jnp.mean(losses(m, *b)))(model, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, arrays)
        return optax.apply_updates(arrays, updates), opt_state, loss

    def history_step(arrays, opt_state, history, *batch):
        per_example, (grads, sq_norms) = fun(eqx.combine(arrays, static), *batch)
        updates, opt_state = optimizer.update(grads, opt_state, arrays)
        return optax.apply_updates(arrays, updates), opt_state, history.push(per_example, sq_norms), jnp.mean(per_example)

    def no_push(arrays, opt_state, *batch):
        per_example, (grads, sq_norms) = fun(eqx.combine(arrays, static), *batch)
        updates, opt_state = optimizer.update(grads, opt_state, arrays)
        return optax.apply_updates(arrays, updates), opt_state, jnp.mean(per_example), sq_norms

    losses_shape, (_, sq_shape) = jax.eval_shape(lambda a, *b: fun(eqx.combine(a, static), *b), arrays, *batch)
    history = jt.NormHistory.init(size, losses_shape, sq_shape)
    history_c = jax.jit(history_step, donate_argnums=(2,)).lower(arrays, opt_state, history, *batch).compile()
    fresh = lambda: jax.tree.map(jnp.copy, history)  # noqa: E731  (donated: a buffer per call)
    def clipped(arrays, opt_state, *batch):
        per_example, summed = clip(eqx.combine(arrays, static), *batch)
        grads = jax.tree.map(lambda g: g / per_example.shape[0], summed)
        updates, opt_state = optimizer.update(grads, opt_state, arrays)
        return optax.apply_updates(arrays, updates), opt_state, jnp.mean(per_example)

    clip = jt.clipped_grad(losses, 1.0)
    return {
        "plain": (jax.jit(plain).lower(arrays, opt_state, *batch).compile(), lambda: (arrays, opt_state, *batch)),
        "history": (history_c, lambda: (arrays, opt_state, fresh(), *batch)),
        "norms, no push": (jax.jit(no_push).lower(arrays, opt_state, *batch).compile(), lambda: (arrays, opt_state, *batch)),
        "clipped_grad": (jax.jit(clipped).lower(arrays, opt_state, *batch).compile(), lambda: (arrays, opt_state, *batch)),
    }, (arrays, static, fun, history)


def agreement(cols, arrays, static, fun, losses, batch) -> str:
    """The gradient ``jt.value_grad_and_norms`` gives against ``eqx.filter_grad``'s, and the norms the history
    step pushed against ``jt.per_example_norms``'."""
    model = eqx.combine(arrays, static)
    _, (grads, _) = eqx.filter_jit(fun)(model, *batch)
    plain = eqx.filter_jit(eqx.filter_grad(lambda m, *b: jnp.mean(losses(m, *b))))(model, *batch)
    diff = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain)))
    ours_c, ours_args = cols["history"]
    history = ours_c(*ours_args())[2]
    _, sq = jax.jit(lambda a, *b: jt.per_example_norms(losses)(eqx.combine(a, static), *b))(arrays, *batch)
    ref = np.stack([np.asarray(s) for s in jax.tree.leaves(sq)], -1)
    norms = float(np.max(np.abs(np.asarray(history.sq_norms[0]) - ref) / np.maximum(np.abs(ref), 1e-30)))
    return f"gradient vs eqx.filter_grad's {diff:.1e} (of the largest entry), pushed norms vs per_example_norms' {norms:.1e}"


def measure(cols: dict, rounds: int, repeats: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    names = list(cols)
    args = {n: [cols[n][1]() for _ in range(repeats)] for n in names}  # made ahead: donated buffers outside the timing
    for n in names:  # warm up
        jax.block_until_ready(cols[n][0](*cols[n][1]()))
    out = {n: {"wall": [], "cpu": []} for n in names}
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            n = names[i]
            fn, made = cols[n][0], args[n]
            t, c = time.perf_counter(), time.process_time()
            for k in range(repeats):
                jax.block_until_ready(fn(*made[k]))
            out[n]["wall"].append((time.perf_counter() - t) / repeats)
            out[n]["cpu"].append((time.process_time() - c) / repeats)
        args = {n: [cols[n][1]() for _ in range(repeats)] for n in names}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="models.py's quick sizes, a few rounds")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--models", default="guide,mlp,rnn,attention,cnn")
    parser.add_argument("--size", type=int, default=16, help="the steps the history holds")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    start = time.perf_counter()
    print(f"JAX {jax.__version__}, equinox {eqx.__version__}, {device()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f} (1 min) at the start; history of {args.size} steps")
    print("\n| model | column | process CPU (ms, median) | x plain (median [IQR] of per-round ratios) | wall (ms) | x plain (wall) |")
    print("|---|---|---|---|---|---|")
    notes = []
    for name in args.models.split(","):
        label, module, losses, batch = build(name, args.quick)
        check_loss(name, module, losses, batch, args.quick)
        cols, (arrays, static, fun, history) = columns(module, losses, batch, args.size)
        notes.append(f"{name}: {agreement(cols, arrays, static, fun, losses, batch)}; "
                     f"history {history.sq_norms.shape} ({len(history.names)} leaves)")
        base = measure({"plain": cols["plain"]}, 1, 1)["plain"]["cpu"][0]
        repeats = max(1, min(50, int(0.2 / max(base, 1e-4))))  # about 0.2 s per column and round
        samples = measure(cols, rounds, repeats)
        for col in cols:
            cells = []
            for figure in ("cpu", "wall"):
                r = np.array(samples[col][figure]) / np.array(samples["plain"][figure])
                cells.append(f"{np.median(samples[col][figure]) * 1e3:.2f} | {np.median(r):.3f} "
                             f"[{np.percentile(r, 25):.3f}, {np.percentile(r, 75):.3f}]")
            print(f"| {label} | {col} | {' | '.join(cells)} |", flush=True)
    print()
    for line in notes:
        print(line)
    print(f"{rounds} rounds; load {os.getloadavg()[0]:.1f} (1 min) at the end; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
