"""Per-example clipping (DP-SGD): jaxtrace against its peers, side by side in one process.

    python benchmarks/per_example_peers.py [--quick | --sizes gpu] [--rounds N] [--models mlp,cnn,transformer,gpt2]
                                           [--columns SUBSTRING,...] [--gpt2-vocab V] [--tf32] ...

On a GPU (``--sizes gpu``: an MLP at batch 1,024, the CNN at batch 256, a 4-block transformer at
sequence 256) the torch models and batches live on the GPU where torch sees CUDA, each torch step
is timed between two ``torch.cuda.synchronize()`` calls, and its memory is the CUDA allocator's
peak. Float32 precision is the same on both sides: full float32 by default (JAX's ``highest``,
torch's ``allow_tf32`` off for matmuls and cuDNN), or TF32 on both with ``--tf32``.

Models (the same architecture and size in JAX/equinox and in PyTorch; weights are not equal,
which timing does not need):

- ``mlp``: ``eqx.nn.MLP`` 784 -> 3 x 512 -> 10 (ReLU), batch 128, cross-entropy;
- ``cnn``: 3 conv 3x3 (32, 64, 64 channels, ReLU, 2x2 max pool each) + Linear 1024 -> 128 -> 10
  on 32x32x3 images, batch 64;
- ``transformer``: a causal transformer, width 256, 4 heads, 2 blocks (LayerNorm, attention,
  GELU MLP), token embedding over 512 ids, a learned position embedding indexed by
  ``arange(T)`` inside the model, a head; batch 32, sequence 64; each example's loss is its
  mean token cross-entropy;
- ``gpt2``: ``transformers.GPT2LMHeadModel(GPT2Config(n_layer=1, ...))`` at GPT-2 small's sizes
  (width 768, 12 heads, vocabulary 50257, random init, no download), untied head
  (``tie_word_embeddings=False``, so every peer computes the same gradient), and an equinox
  model built from the same config; batch 4, sequence 128, position ids inside the model.

Columns, each one DP-SGD step up to the clipped sum of per-example gradients (no noise, no
optimizer update), clipping bound 1.0:

- ``jt.clipped_grad`` (the base of the ratios) and ``jt.per_example_norms`` (norms only);
- ``vmap(grad) + clip``: ``jax.vmap(eqx.filter_grad(one_example_loss))``, norms, weights, sum;
- ``filter_grad (no clipping)``: plain ``eqx.filter_grad`` of the summed loss (the floor);
- ``jax-privacy``: ``jax_privacy.clipping.clipped_grad`` (installed on Python 3.13 only);
- ``torch backward (no clipping)``: ``losses.sum().backward()`` (the PyTorch floor);
- ``Opacus ghost``: ``GradSampleModuleFastGradientClipping`` + ``DPOptimizerFastGradientClipping``
  + ``DPLossFastGradientClipping`` (ghost clipping: two backward passes);
- ``Opacus per-sample``: ``GradSampleModule`` + ``DPOptimizer.pre_step`` (per-example gradients);
- ``BackPACK BatchGrad + clip`` (per-example gradients, clipped and summed by hand) and
  ``BackPACK BatchL2Grad`` (norms only).

A peer that is not installed, or that refuses a model, is skipped with a printed note.
Every column is timed in the same process: each round runs every column once in a random
order, and each ratio is the median over rounds of (column's time / ``jt.clipped_grad``'s
time in the same round); >1 means jaxtrace is faster. Memory: for JAX columns, what the
compiled step allocates besides its arguments (``memory_analysis()``: temporaries + outputs;
deterministic); for torch columns, the peak of torch's CPU allocator over one step above what
was allocated before it (from ``torch.profiler`` memory events; glibc's own caching is not
seen). Both count the gradients the step returns.

The peers install into their own venv (Python 3.11, CPU torch; backpack-for-pytorch pulls a
CUDA torchvision that cannot load beside CPU torch and that nothing here imports), e.g.::

    python3.11 -m venv venv-peers
    printf 'torch==2.13.0+cpu\\ntransformers==5.24.0\\n' > constraints.txt
    venv-peers/bin/pip install -c constraints.txt torch==2.13.0+cpu transformers==5.24.0 \\
        jax jaxlib equinox flax optax opacus backpack-for-pytorch
    venv-peers/bin/pip uninstall -y torchvision
    venv-peers/bin/python benchmarks/per_example_peers.py --quick

and jax-privacy into a Python 3.13 one (``pip install jax-privacy equinox``), where the torch
columns are skipped. On a machine shared with other work pass ``--threads 1``: with more,
torch's OpenMP barriers stall whenever one of its threads is descheduled.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
import warnings
from typing import Callable


def _threads_flag():
    """``--threads N`` is read before JAX starts: XLA reads its thread flags once."""
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return None


if _threads_flag() == 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1").strip()
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the profiler's note on blocks allocated before it
warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus's and BackPACK's hooks
warnings.filterwarnings("ignore", message=".*Secure RNG turned off")
warnings.filterwarnings("ignore", message="Extension saving to")  # BackPACK's missing rules: a note names them
warnings.filterwarnings("ignore", message="For backward hooks to be called")  # BackPACK's hooks on HF containers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(os.path.dirname(HERE), "jaxtrace")):
    sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout: this tree's jaxtrace

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxtrace as jt  # noqa: E402
from timers import cuda_peak_bytes, device, interleave, median_ratio, synchronized, torch_sync  # noqa: E402

MAX_NORM = 1.0
BASE = "jt.clipped_grad"
TORCH_DEVICE = "cpu"  # main() sets "cuda" where torch sees a GPU
TORCH_POSITIONS = ("the torch models make their position ids inside forward as arange(T).repeat(B, 1): Opacus "
                   "crashes on the (1, T) ids GPT2Model makes by itself ('stack expects each tensor to be equal "
                   "size'), and its ghost embedding norm needs contiguous ids (arange(T).expand(B, T) fails in "
                   "input_ids.view)")


# --- sizes ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Sizes:
    mlp: dict
    cnn: dict
    transformer: dict
    gpt2: dict


def sizes(args) -> Sizes:
    if args.sizes == "gpu":  # the batches a GPU user trains with
        return Sizes(
            mlp=dict(batch=1024, d_in=784, width=512, depth=3, classes=10),
            cnn=dict(batch=256, image=32, channels=(32, 64, 64), hidden=128, classes=10),
            transformer=dict(batch=16, seq=256, vocab=512, d=256, heads=4, depth=4),
            gpt2=dict(batch=args.gpt2_batch, seq=args.gpt2_seq, vocab=args.gpt2_vocab, d=768, heads=12, layers=args.gpt2_layers),
        )
    if args.quick:
        return Sizes(
            mlp=dict(batch=8, d_in=16, width=16, depth=2, classes=4),
            cnn=dict(batch=4, image=8, channels=(4, 8, 8), hidden=16, classes=4),
            transformer=dict(batch=4, seq=8, vocab=32, d=16, heads=2, depth=1),
            gpt2=dict(batch=2, seq=8, vocab=64, d=16, heads=2, layers=1),
        )
    return Sizes(
        mlp=dict(batch=128, d_in=784, width=512, depth=3, classes=10),
        cnn=dict(batch=64, image=32, channels=(32, 64, 64), hidden=128, classes=10),
        transformer=dict(batch=32, seq=64, vocab=512, d=256, heads=4, depth=2),
        gpt2=dict(batch=args.gpt2_batch, seq=args.gpt2_seq, vocab=args.gpt2_vocab, d=768, heads=12, layers=args.gpt2_layers),
    )


# --- the JAX models ---------------------------------------------------------------------------


class CNN(eqx.Module):
    convs: list
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    pool: str = eqx.field(static=True, default="reshape")  # "reshape": a max over 2x2 blocks; "eqx": eqx.nn.MaxPool2d

    def __init__(self, image, channels, hidden, classes, key, pool="reshape"):
        keys = jax.random.split(key, len(channels) + 2)
        c_in = (3, *channels[:-1])
        self.convs = [eqx.nn.Conv2d(i, o, 3, padding=1, key=k) for i, o, k in zip(c_in, channels, keys)]
        flat = channels[-1] * (image // 2 ** len(channels)) ** 2
        self.fc1 = eqx.nn.Linear(flat, hidden, key=keys[-2])
        self.fc2 = eqx.nn.Linear(hidden, classes, key=keys[-1])
        self.pool = pool

    def __call__(self, x):  # x: (3, H, W), one example
        for conv in self.convs:
            x = jax.nn.relu(conv(x))
            c, h, w = x.shape
            if self.pool == "eqx":
                x = eqx.nn.MaxPool2d(2, 2)(x)  # lax.reduce_window_max
            else:
                x = jnp.max(x.reshape(c, h // 2, 2, w // 2, 2), axis=(2, 4))  # 2x2 max pool
        return self.fc2(jax.nn.relu(self.fc1(x.reshape(-1))))


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d, heads, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)  # q, k, v, out projections, no biases
        self.up, self.down = eqx.nn.Linear(d, 4 * d, key=k2), eqx.nn.Linear(4 * d, d, key=k3)

    def __call__(self, h):
        a = jax.vmap(self.ln1)(h)
        t = h.shape[0]
        h = h + self.attn(a, a, a, mask=jnp.tril(jnp.ones((t, t), bool)))
        return h + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(h))))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: list
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab, seq, d, heads, depth, key):
        keys = jax.random.split(key, depth + 3)
        self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
        self.pos = eqx.nn.Embedding(seq, d, key=keys[1])
        self.blocks = [Block(d, heads, k) for k in keys[2:-1]]
        self.ln = eqx.nn.LayerNorm(d)
        self.head = eqx.nn.Linear(d, vocab, key=keys[-1])

    def __call__(self, ids):  # ids: (T,), one example; position ids made here, inside the model
        h = jax.vmap(self.embed)(ids) + jax.vmap(self.pos)(jnp.arange(ids.shape[0]))
        for block in self.blocks:
            h = block(h)
        return jax.vmap(self.head)(jax.vmap(self.ln)(h))


class GPT2Block(eqx.Module):
    """transformers' GPT2Block: pre-LN attention (fused qkv ``c_attn``) and MLP, ``gelu_new``."""

    ln_1: eqx.nn.LayerNorm
    c_attn: eqx.nn.Linear
    attn_proj: eqx.nn.Linear
    ln_2: eqx.nn.LayerNorm
    c_fc: eqx.nn.Linear
    mlp_proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, config, key):
        d, eps = config.n_embd, config.layer_norm_epsilon
        inner = config.n_inner or 4 * d
        k = jax.random.split(key, 4)
        self.ln_1, self.ln_2 = eqx.nn.LayerNorm(d, eps=eps), eqx.nn.LayerNorm(d, eps=eps)
        self.c_attn, self.attn_proj = eqx.nn.Linear(d, 3 * d, key=k[0]), eqx.nn.Linear(d, d, key=k[1])
        self.c_fc, self.mlp_proj = eqx.nn.Linear(d, inner, key=k[2]), eqx.nn.Linear(inner, d, key=k[3])
        self.heads = config.n_head

    def __call__(self, h):
        t, d = h.shape
        q, k, v = jnp.split(jax.vmap(self.c_attn)(jax.vmap(self.ln_1)(h)), 3, axis=-1)
        q, k, v = (a.reshape(t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(d // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
        a = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, axis=-1), v).reshape(t, d)
        h = h + jax.vmap(self.attn_proj)(a)
        m = jax.nn.gelu(jax.vmap(self.c_fc)(jax.vmap(self.ln_2)(h)), approximate=True)
        return h + jax.vmap(self.mlp_proj)(m)


class GPT2(eqx.Module):
    """An equinox GPT2LMHeadModel (untied head) built from a ``transformers.GPT2Config``."""

    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    blocks: list
    ln_f: eqx.nn.LayerNorm
    lm_head: eqx.nn.Linear

    def __init__(self, config, key):
        keys = jax.random.split(key, config.n_layer + 3)
        d = config.n_embd
        self.wte = eqx.nn.Embedding(config.vocab_size, d, key=keys[0])
        self.wpe = eqx.nn.Embedding(config.n_positions, d, key=keys[1])
        self.blocks = [GPT2Block(config, k) for k in keys[2:-1]]
        self.ln_f = eqx.nn.LayerNorm(d, eps=config.layer_norm_epsilon)
        self.lm_head = eqx.nn.Linear(d, config.vocab_size, use_bias=False, key=keys[-1])

    def __call__(self, ids):  # ids: (T,); position ids inside the model, as GPT2Model makes them
        h = jax.vmap(self.wte)(ids) + jax.vmap(self.wpe)(jnp.arange(ids.shape[0]))
        for block in self.blocks:
            h = block(h)
        return jax.vmap(self.lm_head)(jax.vmap(self.ln_f)(h))


def gpt2_config(s):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=s["vocab"], n_positions=s["seq"], n_embd=s["d"], n_layer=s["layers"], n_head=s["heads"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
        bos_token_id=s["vocab"] - 1, eos_token_id=s["vocab"] - 1,  # GPT-2's 50256 when the vocabulary is full
    )


class _Config:  # GPT2Config's fields that the equinox GPT2 reads, for a run without transformers
    def __init__(self, s):
        self.vocab_size, self.n_positions, self.n_embd = s["vocab"], s["seq"], s["d"]
        self.n_layer, self.n_head, self.n_inner, self.layer_norm_epsilon = s["layers"], s["heads"], None, 1e-5


def classify_losses(model, x, y):
    logits = jax.vmap(model)(x)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


def lm_losses(model, ids, targets):
    logp = jax.nn.log_softmax(jax.vmap(model)(ids), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=-1)


@dataclasses.dataclass
class Case:
    """One model: its JAX model and losses, its batch as numpy arrays, and a torch model factory."""

    name: str
    describe: str
    jax_model: eqx.Module
    losses: Callable
    batch: tuple  # numpy arrays: (x, y) or (ids, targets)
    torch_model: Callable | None  # () -> torch module, given the batch's torch tensors in forward
    lm: bool  # per-example loss = mean token cross-entropy


def cases(s: Sizes, which: list[str]) -> list[Case]:
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    out = []
    if "mlp" in which:
        m = s.mlp
        x = rng.standard_normal((m["batch"], m["d_in"]), dtype=np.float32)
        y = rng.integers(0, m["classes"], m["batch"])
        model = eqx.nn.MLP(m["d_in"], m["classes"], m["width"], m["depth"], key=key)
        out.append(Case("MLP", f"MLP {m['d_in']} -> {m['depth']} x {m['width']} -> {m['classes']}, batch {m['batch']}",
                        model, classify_losses, (x, y), functools.partial(torch_mlp, m), False))
    if "cnn" in which:
        c = s.cnn
        x = rng.standard_normal((c["batch"], 3, c["image"], c["image"]), dtype=np.float32)
        y = rng.integers(0, c["classes"], c["batch"])
        model = CNN(c["image"], c["channels"], c["hidden"], c["classes"], key)
        out.append(Case("CNN", f"CNN {c['image']}x{c['image']}x3, conv {c['channels']}, batch {c['batch']}",
                        model, classify_losses, (x, y), functools.partial(torch_cnn, c), False))
    if "transformer" in which:
        t = s.transformer
        ids = rng.integers(0, t["vocab"], (t["batch"], t["seq"]))
        model = Transformer(t["vocab"], t["seq"], t["d"], t["heads"], t["depth"], key)
        out.append(Case("transformer",
                        f"causal transformer width {t['d']}, {t['depth']} blocks, vocab {t['vocab']}, "
                        f"batch {t['batch']}, seq {t['seq']}, position ids inside the model",
                        model, lm_losses, (ids, np.roll(ids, -1, axis=1)), functools.partial(torch_transformer, t), True))
    if "gpt2" in which:
        g = s.gpt2
        ids = rng.integers(0, g["vocab"], (g["batch"], g["seq"]))
        try:
            config = gpt2_config(g)
        except ImportError:
            config = None
            print("note: transformers is not installed: the GPT-2 model is built from the same sizes by hand, "
                  "and its torch columns are skipped")
        model = GPT2(config or _Config(g), key)
        out.append(Case("GPT-2 block",
                        f"GPT2Config(n_layer={g['layers']}, n_embd={g['d']}, n_head={g['heads']}, vocab_size={g['vocab']}), "
                        f"untied head, batch {g['batch']}, seq {g['seq']}",
                        model, lm_losses, (ids, np.roll(ids, -1, axis=1)),
                        functools.partial(torch_gpt2, config) if config is not None else None, True))
    return out


# --- the JAX columns --------------------------------------------------------------------------


def jax_columns(losses_fn):
    def one(model, *ex):
        return losses_fn(model, *(e[None] for e in ex))[0]

    def vmap_clipped(model, *batch):
        per = jax.vmap(eqx.filter_grad(one), in_axes=(None, *[0] * len(batch)))(model, *batch)
        leaves = jax.tree.leaves(per)
        total = sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), 1) for g in leaves)
        w = jnp.minimum(1.0, MAX_NORM / jnp.sqrt(total))
        return jax.tree.map(lambda g: jnp.tensordot(w, g, 1), per)

    cols = {
        "jt.clipped_grad": lambda model, *b: jt.clipped_grad(losses_fn, MAX_NORM)(model, *b)[1],
        "jt.per_example_norms": lambda model, *b: jt.per_example_norms(losses_fn, total=True)(model, *b)[1],
        "vmap(grad) + clip": vmap_clipped,
        "filter_grad (no clipping)": lambda model, *b: eqx.filter_grad(lambda m, *c: jnp.sum(losses_fn(m, *c)))(model, *b),
    }
    privacy = jax_privacy_column(losses_fn)
    if privacy is not None:
        cols["jax-privacy"] = privacy
    return cols


_NOTES: list[str] = []


def note(text):
    if text not in _NOTES:
        _NOTES.append(text)
        print(f"note: {text}", flush=True)


def jax_privacy_column(losses_fn):
    """``jax_privacy.clipping.clipped_grad`` of one example's loss, or None with a note."""
    try:
        from jax_privacy import clipping
    except ImportError as e:
        note(f"jax-privacy skipped: not installed here ({e}); it installs on Python 3.13: "
             "`python3.13 -m venv v && v/bin/pip install jax-privacy equinox`")
        return None

    def column(model, *batch):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        loss = lambda p, *ex: jnp.sum(losses_fn(eqx.combine(p, static), *ex))  # noqa: E731  (ex: a batch of 1)
        fn = clipping.clipped_grad(loss, l2_clip_norm=MAX_NORM, batch_argnums=tuple(range(1, 1 + len(batch))))
        return fn(params, *batch)

    return column


def compile_jax(case: Case, fns: dict, results: dict):
    arrays, static = eqx.partition(case.jax_model, eqx.is_array)
    batch = tuple(jnp.asarray(b) for b in case.batch)
    runs = {}
    for name, f in fns.items():
        jitted = jax.jit(lambda a, *b, f=f: f(eqx.combine(a, static), *b))
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            compiled = jitted.lower(arrays, *batch).compile()
            build, build_cpu = time.perf_counter() - t0, time.process_time() - c0
            ma = compiled.memory_analysis()
            mem = (ma.temp_size_in_bytes + ma.output_size_in_bytes) if ma is not None else float("nan")
            step = functools.partial(compiled, arrays, *batch)
            out = jax.block_until_ready(step())  # warm
        except Exception as e:  # a peer that refuses a model is a note, not a failed benchmark
            note(f"{case.name}: {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        results[name] = dict(mem=mem, build=build, build_cpu=build_cpu, out=out)
        runs[name] = lambda step=step: jax.block_until_ready(step())
    if BASE in results and "vmap(grad) + clip" in results:  # the clipped sums, leaf by leaf, from the warm calls
        ours, ref = (jax.tree.leaves(results[k]["out"]) for k in (BASE, "vmap(grad) + clip"))
        results["_check"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(np.asarray(b))), 1e-30))
                                for a, b in zip(ours, ref))
    for r in results.values():
        if isinstance(r, dict):
            r.pop("out", None)
    return runs


# --- the PyTorch models -----------------------------------------------------------------------


def torch_mlp(m):
    from torch import nn

    layers, d = [], m["d_in"]
    for _ in range(m["depth"]):
        layers += [nn.Linear(d, m["width"]), nn.ReLU()]
        d = m["width"]
    return nn.Sequential(*layers, nn.Linear(d, m["classes"]))


def torch_cnn(c):
    from torch import nn

    layers, c_in = [], 3
    for c_out in c["channels"]:
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c_in = c_out
    flat = c["channels"][-1] * (c["image"] // 2 ** len(c["channels"])) ** 2
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(flat, c["hidden"]), nn.ReLU(), nn.Linear(c["hidden"], c["classes"]))


def torch_transformer(t):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class TorchBlock(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h):
            b, n, d = h.shape
            a = self.ln1(h)
            q, k, v = (f(a).view(b, n, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d)
            h = h + self.o(att)
            return h + self.down(F.gelu(self.up(self.ln2(h)), approximate="tanh"))

    class TorchTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            d = t["d"]
            self.embed, self.pos = nn.Embedding(t["vocab"], d), nn.Embedding(t["seq"], d)
            self.blocks = nn.ModuleList(TorchBlock(d, t["heads"]) for _ in range(t["depth"]))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, t["vocab"])

        def forward(self, ids):
            # position ids made inside the model, with the batch axis that Opacus and BackPACK need
            pos = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
            h = self.embed(ids) + self.pos(pos)
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln(h))

    return TorchTransformer()


def torch_gpt2(config):
    import torch
    from torch import nn
    from transformers import GPT2LMHeadModel

    class Logits(nn.Module):  # GPT2LMHeadModel's logits, with position ids of shape (B, T)
        def __init__(self):
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(config)

        def forward(self, ids):
            pos = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
            return self.gpt2(input_ids=ids, position_ids=pos, use_cache=False).logits

    return Logits()


# --- the PyTorch columns ----------------------------------------------------------------------


def torch_losses(case: Case, logits, y):
    import torch.nn.functional as F

    if case.lm:
        b, t, v = logits.shape
        return F.cross_entropy(logits.reshape(b * t, v), y.reshape(-1), reduction="none").view(b, t).mean(1)
    return F.cross_entropy(logits, y, reduction="none")


def torch_columns(case: Case, wanted) -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> a builder that makes the column's model and returns its step, or raises."""
    import torch

    x = torch.as_tensor(case.batch[0]) if case.batch[0].dtype != np.int64 else torch.as_tensor(case.batch[0]).long()
    x, y = x.to(TORCH_DEVICE), torch.as_tensor(case.batch[1]).long().to(TORCH_DEVICE)
    batch = x.shape[0]
    cols = {}

    def plain():
        model = torch_model(case)

        def step():
            model.zero_grad(set_to_none=True)
            torch_losses(case, model(x), y).sum().backward()

        return step

    cols["torch backward (no clipping)"] = plain

    try:
        import opacus  # noqa: F401
    except ImportError as e:
        note(f"Opacus skipped: not installed ({e})")
    else:
        cols["Opacus ghost"] = lambda: opacus_ghost(case, x, y, batch)
        cols["Opacus per-sample"] = lambda: opacus_per_sample(case, x, y, batch)
    try:
        import backpack  # noqa: F401
    except ImportError as e:
        note(f"BackPACK skipped: not installed ({e})")
    else:
        cols["BackPACK BatchGrad + clip"] = lambda: backpack_step(case, x, y, l2_only=False)
        cols["BackPACK BatchL2Grad"] = lambda: backpack_step(case, x, y, l2_only=True)
    return {k: v for k, v in cols.items() if wanted(k)}


def opacus_per_sample(case, x, y, batch):
    import torch
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = GradSampleModule(torch_model(case), loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=MAX_NORM,
                      expected_batch_size=batch, loss_reduction="sum")

    def step():
        opt.zero_grad(set_to_none=True)
        torch_losses(case, model(x), y).sum().backward()
        opt.pre_step()  # per-example norms, clip, sum (+ zero noise): p.grad holds the clipped sum

    step.clipped = list(model.parameters())
    return step


def opacus_ghost(case, x, y, batch):
    import torch
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = GradSampleModuleFastGradientClipping(torch_model(case), max_grad_norm=MAX_NORM,
                                                 use_ghost_clipping=True, loss_reduction="sum")
    opt = DPOptimizerFastGradientClipping(torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                                          max_grad_norm=MAX_NORM, expected_batch_size=batch, loss_reduction="sum")
    criterion = DPLossFastGradientClipping(model, opt, _PerExample(case), loss_reduction="sum")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()  # the norms' backward pass, then the reweighted loss's
        opt.pre_step()

    step.clipped = list(model.parameters())
    return step


class _PerExample:
    """A criterion for DPLossFastGradientClipping: one loss per example, whatever ``reduction`` says
    (DPLossFastGradientClipping checks that it reads "sum", then sets "none" around its call)."""

    reduction = "sum"

    def __init__(self, case):
        self.case = case

    def __call__(self, logits, y):
        return torch_losses(self.case, logits, y)


def backpack_step(case, x, y, l2_only):
    import torch
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad, BatchL2Grad

    model = extend(torch_model(case))
    params = [p for p in model.parameters() if p.requires_grad]
    owner = {id(p): type(m).__name__ for m in model.modules() for p in m.parameters(recurse=False)}
    ext = BatchL2Grad() if l2_only else BatchGrad()
    attr = "batch_l2" if l2_only else "grad_batch"

    def step():
        model.zero_grad(set_to_none=True)
        with backpack(ext):  # a layer BackPACK does not support is a warning there, and no attribute
            torch_losses(case, model(x), y).sum().backward()
        missing = sorted({owner[id(p)] for p in params if getattr(p, attr, None) is None})
        if missing:
            raise NotImplementedError(f"BackPACK has no {type(ext).__name__} rule for {', '.join(missing)}")
        if l2_only:
            return sum(getattr(p, attr) for p in params)
        per = [p.grad_batch for p in params]
        total = sum(g.reshape(g.shape[0], -1).square().sum(1) for g in per)
        w = torch.clamp(MAX_NORM / total.sqrt(), max=1.0)
        for p, g in zip(params, per):
            p.grad = torch.tensordot(w, g, 1)
            p.grad_batch = None

    if not l2_only:
        step.clipped = params
    return step


def torch_model(case: Case):
    """The case's torch model in training mode, on ``TORCH_DEVICE``."""
    return case.torch_model().train().to(TORCH_DEVICE)


def torch_peak_bytes(step) -> float:
    """Peak of torch's CPU allocator over one ``step()``, above what was allocated before it: the
    running sum of each operation's own allocations less frees, in the order the operations started."""
    from torch.profiler import ProfilerActivity, profile

    stderr = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the profiler's start and stop lines
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(devnull)
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events())
    if not events:
        return float("nan")
    return float(np.max(np.cumsum([m for _, m in events]).clip(min=0)))


def build_torch(case: Case, wanted, results: dict) -> dict:
    import torch

    runs = {}
    if case.lm:
        note(TORCH_POSITIONS)
    for name, make in torch_columns(case, wanted).items():
        try:
            torch.manual_seed(0)
            t0, c0 = time.perf_counter(), time.process_time()
            step = make()
            build, build_cpu = time.perf_counter() - t0, time.process_time() - c0
            step()  # warm
            if hasattr(step, "clipped"):  # same seed, same weights: the torch clipped sums must agree
                grads = [p.grad.detach().clone() for p in step.clipped]
                if "_torch_ref" not in results:
                    results["_torch_ref"] = (name, grads)
                else:
                    ref_name, ref = results["_torch_ref"]
                    diff = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(grads, ref))
                    results.setdefault("_torch_check", []).append(f"{name} {diff:.1e}")
            mem = cuda_peak_bytes(step) if TORCH_DEVICE == "cuda" else torch_peak_bytes(step)
        except Exception as e:
            note(f"{case.name}: {name} skipped: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            continue
        results[name] = dict(mem=mem, build=build, build_cpu=build_cpu)
        runs[name] = step
    return runs


# --- main -------------------------------------------------------------------------------------


HEADER = ("| model | column | step (ms) | x jt.clipped_grad | memory (MiB) | build (s) | build CPU (s) |",
          "|---|---|---|---|---|---|---|")


def rows(case, results, samples) -> list[str]:
    """The table's header and one model's rows."""
    out = list(HEADER)
    for name in samples:
        ms = float(np.median([s["step"] for s in samples[name]])) * 1e3
        ratio = median_ratio(samples, name, "step", BASE)
        r = results[name]
        out.append(f"| {case.name} | {name} | {ms:.1f} | {ratio:.2f} | {r['mem'] / 2**20:.2f} | {r['build']:.1f} | {r['build_cpu']:.1f} |")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, every column once (a smoke run)")
    parser.add_argument("--sizes", choices=("default", "quick", "gpu"), default=None,
                        help="the models' sizes: default (CPU), quick (--quick), gpu (MLP batch 1,024, CNN batch 256, "
                        "a 4-block transformer at sequence 256)")
    parser.add_argument("--tf32", action="store_true", help="float32 matrix products and convolutions in TF32 on "
                        "both sides (JAX's 'tensorfloat32', torch's allow_tf32); default: full float32 on both")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (default 10; --quick: 1)")
    parser.add_argument("--models", default="mlp,cnn,transformer,gpt2", help="comma-separated: mlp,cnn,transformer,gpt2")
    parser.add_argument("--columns", default="", help="comma-separated substrings: run only the columns whose "
                        "name contains one (jt.clipped_grad always runs: it is the base)")
    parser.add_argument("--no-torch", action="store_true", help="skip every PyTorch column")
    parser.add_argument("--gpt2-batch", type=int, default=4)
    parser.add_argument("--gpt2-seq", type=int, default=128)
    parser.add_argument("--gpt2-vocab", type=int, default=50257)
    parser.add_argument("--gpt2-layers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="seed of the rounds' random column order")
    parser.add_argument("--threads", type=int, default=None, help="threads for torch and XLA (default: every "
                        "core; 1 on a loaded machine, where OpenMP's barriers stall when a thread is descheduled)")
    args = parser.parse_args()
    args.sizes = args.sizes or ("quick" if args.quick else "default")
    args.quick = args.sizes == "quick"
    rounds = 1 if args.quick else args.rounds
    subs = [c.strip() for c in args.columns.split(",") if c.strip()]
    wanted = lambda name: name == BASE or not subs or any(s in name for s in subs)  # noqa: E731
    which = [m.strip() for m in args.models.split(",") if m.strip()]

    torch_ok = False
    if not args.no_torch:
        try:
            import torch

            torch_ok = True
            if args.threads:
                torch.set_num_threads(args.threads)
            global TORCH_DEVICE
            TORCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
            # torch's defaults differ by op (cuDNN convolutions in TF32, matmuls not): one setting for both
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
        except ImportError as e:
            note(f"every PyTorch column (Opacus, BackPACK) skipped: torch is not installed ({e})")

    versions = [f"Python {sys.version.split()[0]}", f"JAX {jax.__version__}", f"equinox {eqx.__version__}"]
    for mod in ("torch", "transformers", "opacus", "backpack", "jax_privacy"):
        if mod in ("torch", "transformers", "opacus", "backpack") and not torch_ok:
            continue
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            pass
    print(", ".join(versions))
    jax.config.update("jax_default_matmul_precision", "tensorfloat32" if args.tf32 else "highest")
    precision = ("float32 matmuls and convolutions in TF32 on both sides" if args.tf32 else
                 "float32 matmuls and convolutions in full float32 on both sides (JAX precision 'highest', torch "
                 "allow_tf32 off)")
    dev = jax.devices()[0]
    print(f"JAX on {dev.platform} ({dev.device_kind}); torch on {TORCH_DEVICE if torch_ok else '-'}"
          + (f" ({torch.cuda.get_device_name()})" if torch_ok and TORCH_DEVICE == "cuda" else "") + f"; {precision}")
    threads = f"{args.threads} thread(s)" if args.threads else "every core"
    print(f"{device()}, {os.cpu_count()} cores, {threads}, load {os.getloadavg()[0]:.1f} (1 min) at the start, "
          f"{rounds} interleaved round(s), {args.sizes} sizes")

    tables = []
    start = time.perf_counter()
    for case in cases(sizes(args), which):
        results: dict = {}
        runs = compile_jax(case, {k: v for k, v in jax_columns(case.losses).items() if wanted(k)}, results)
        torch_runs = build_torch(case, wanted, results) if torch_ok and case.torch_model is not None else {}
        runs.update(torch_runs)
        if BASE not in runs:
            note(f"{case.name}: no {BASE}, so no ratios")
            continue
        sync = torch_sync(TORCH_DEVICE) if torch_ok else None  # JAX's steps block on their results themselves
        samples = interleave({k: synchronized(v, sync if k in torch_runs else None) for k, v in runs.items()},
                             rounds, seed=args.seed)
        tables.append((case, results, samples))
        print(f"  {case.name}: done at {time.perf_counter() - start:.0f} s", flush=True)
        print("\n".join(rows(case, results, samples)), flush=True)  # kept in the log if a later model runs out of time

    print("\n" + "\n".join(HEADER))
    for case, results, samples in tables:
        print("\n".join(rows(case, results, samples)[len(HEADER):]))
    print("\nModels:")
    for case, results, _ in tables:
        check = results.get("_check")
        extra = (f"; jt.clipped_grad against vmap(grad) + clip: largest difference {check:.1e} of a leaf's largest "
                 "entry" if check is not None else "")
        if results.get("_torch_check"):
            extra += f"; the torch clipped sums against {results['_torch_ref'][0]}'s: " + ", ".join(results["_torch_check"])
        print(f"- {case.name}: {case.describe}{extra}")
    print("\nMemory: JAX, the compiled step's temporaries + outputs (memory_analysis); torch, the peak of its "
          f"{'CUDA' if TORCH_DEVICE == 'cuda' else 'CPU'} allocator over one step above what it held before. Build: JAX, lower + compile; torch, wrapping "
          "the model (Opacus's and BackPACK's hooks). Timings on a shared machine move with its load: read the "
          "ratios (per round, then the median), not the milliseconds.")
    if _NOTES:
        print("Notes:\n" + "\n".join(f"- {n}" for n in _NOTES))
    print(f"load {os.getloadavg()[0]:.1f} (1 min) at the end; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
