"""Porting a Hugging Face model: GPT-2 in equinox, checked against transformers layer by layer.

Run:  python examples/hf_gpt2_port.py [--quick]

A small ``GPT2LMHeadModel`` is built from a ``GPT2Config`` (random init, no
download) in float64. The port below is what a user writes: equinox modules
with the attribute names of the Hugging Face model, so that
``jaxtrace.torch.load_weights`` copies every weight by its path (HF's
``Conv1D`` layers, whose weight is ``(in, out)``, go into ``eqx.nn.Linear``
transposed) and ``jaxtrace.tag_modules`` names each block, attention and MLP
output as ``named_modules()`` does. One call on each side gives the loss, the
gradients at those outputs, their values (``with_values=True``) and the
parameter gradients; ``jaxtrace.compare`` puts them side by side.

GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``: the port reads
the embedding matrix for its head, as Hugging Face does, so the gradient of
``transformer.wte.weight`` is the sum of both uses on both sides.

Needs torch (a CPU build is enough: ``pip install torch --index-url
https://download.pytorch.org/whl/cpu``) and transformers (``pip install
transformers``); without them it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys

import equinox as eqx
import jax
import jax.numpy as jnp

import jaxtrace as jt

jax.config.update("jax_enable_x64", True)


# --- the port: what the user writes ------------------------------------------------------------
# PORT-START


class Attention(eqx.Module):
    c_attn: eqx.nn.Linear  # HF Conv1D(3 * d, d): load_weights transposes its (in, out) weight
    c_proj: eqx.nn.Linear
    n_head: int = eqx.field(static=True)

    def __call__(self, x):  # x: (T, d), one sequence
        T, d = x.shape
        q, k, v = jnp.split(jax.vmap(self.c_attn)(x), 3, axis=-1)
        q, k, v = (t.reshape(T, self.n_head, -1).transpose(1, 0, 2) for t in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) * (d // self.n_head) ** -0.5
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)  # causal
        weights = jax.nn.softmax(scores, axis=-1)
        out = (weights @ v).transpose(1, 0, 2).reshape(T, d)
        return jax.vmap(self.c_proj)(out), weights  # HF returns (attn_output, attn_weights)


class MLP(eqx.Module):
    c_fc: eqx.nn.Linear
    c_proj: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.c_proj)(jax.nn.gelu(jax.vmap(self.c_fc)(x), approximate=True))  # gelu_new


class Block(eqx.Module):
    ln_1: eqx.nn.LayerNorm
    attn: Attention
    ln_2: eqx.nn.LayerNorm
    mlp: MLP

    def __call__(self, x):
        x = x + self.attn(jax.vmap(self.ln_1)(x))[0]
        return x + self.mlp(jax.vmap(self.ln_2)(x))


class GPT2(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    h: list
    ln_f: eqx.nn.LayerNorm

    def __call__(self, ids):  # ids: (T,)
        x = self.wte.weight[ids] + self.wpe.weight[: ids.shape[0]]
        for block in self.h:
            x = block(x)
        return jax.vmap(self.ln_f)(x)


class GPT2LMHead(eqx.Module):
    transformer: GPT2

    def __call__(self, ids):  # lm_head is tied to wte, as in Hugging Face
        return self.transformer(ids) @ self.transformer.wte.weight.T


def make_port(cfg, key):
    d, lin = cfg.n_embd, lambda i, o, k: eqx.nn.Linear(i, o, key=k, dtype=jnp.float64)  # noqa: E731
    ln = lambda: eqx.nn.LayerNorm(d, eps=cfg.layer_norm_epsilon, dtype=jnp.float64)  # noqa: E731
    keys = iter(jax.random.split(key, 2 + 4 * cfg.n_layer))
    blocks = [
        Block(ln(), Attention(lin(d, 3 * d, next(keys)), lin(d, d, next(keys)), cfg.n_head), ln(),
              MLP(lin(d, 4 * d, next(keys)), lin(4 * d, d, next(keys))))
        for _ in range(cfg.n_layer)
    ]
    wte = eqx.nn.Embedding(cfg.vocab_size, d, key=next(keys), dtype=jnp.float64)
    wpe = eqx.nn.Embedding(cfg.n_positions, d, key=next(keys), dtype=jnp.float64)
    return GPT2LMHead(GPT2(wte, wpe, blocks, ln()))


def loss_fn(model, ids):  # the mean next-token cross entropy
    logp = jax.nn.log_softmax(jax.vmap(model)(ids)[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


# PORT-END
# --- loading and comparing: what the user writes too --------------------------------------------


def check(hf, cfg, ids_torch, rtol=1e-10):
    """Weights in, one call on each side, the comparisons; returns them."""
    import torch

    import jaxtrace.torch as jtt

    # COMPARE-START
    port = jtt.load_weights(eqx.filter_eval_shape(make_port, cfg, jax.random.key(0)), hf)  # no random init
    port = jt.tag_modules(port, where=lambda path, m: isinstance(m, (Block, Attention, MLP)))
    ids = jnp.asarray(ids_torch.numpy())
    value, (grads, tag_grads), tag_values = eqx.filter_jit(jt.filter_value_and_grad(loss_fn, with_values=True))(port, ids)
    def t_loss(out):  # not out.loss with labels=: Hugging Face computes that in float32
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids_torch[:, 1:].flatten())

    t_value, (t_params, t_grads), t_values = jtt.value_and_grad(
        hf, ids_torch, loss=t_loss, where=list(tag_grads), with_values=True
    )
    results = {
        "activations": jt.compare(tag_values, t_values, rtol=rtol, atol=0, labels=("jax", "torch")),
        "activation gradients": jt.compare(tag_grads, t_grads, rtol=rtol, atol=0, labels=("jax", "torch")),
        "parameter gradients": jt.compare(jtt.named_grads(grads, hf), t_params, rtol=rtol, atol=0, labels=("jax", "torch")),
    }
    # COMPARE-END
    return float(value), t_value, results


def _lines(marker_start: str, marker_end: str) -> int:
    """Non-blank, non-comment lines between two markers of this file: what the user writes."""
    source = inspect.getsource(sys.modules[__name__]).splitlines()
    start = next(i for i, line in enumerate(source) if line.strip() == f"# {marker_start}")
    end = next(i for i, line in enumerate(source) if line.strip() == f"# {marker_end}")
    return sum(1 for line in source[start + 1 : end] if line.strip() and not line.strip().startswith("#"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model (CI)")
    parser.add_argument("--out", default=None, help="unused (the examples' common flag)")
    args = parser.parse_args(argv)
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        how = {"torch": "pip install torch --index-url https://download.pytorch.org/whl/cpu (a CPU build is enough)",
               "transformers": "pip install transformers"}
        print(f"This example needs {' and '.join(missing)}: {'; '.join(how[m] for m in missing)}. Skipping.")
        return 0
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    layers, width = (2, 32) if args.quick else (4, 64)
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=width, n_layer=layers, n_head=4,
                                  attn_implementation="eager")  # eager: attention weights are returned
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).double().eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 11))
    value, t_value, results = check(hf, cfg, ids)
    print(f"GPT-2 from GPT2Config: {layers} blocks, width {width}, float64; loss jax {value:.12f} torch {t_value:.12f}")
    for what, result in results.items():
        print(f"\n== {what}")
        print(result)
    print(f"\nwhat you write: the port {_lines('PORT-START', 'PORT-END')} lines, "
          f"loading and comparing {_lines('COMPARE-START', 'COMPARE-END')} lines")
    ok = all(r.ok for r in results.values()) and abs(value - t_value) <= 1e-12 * abs(t_value)
    print("all agree to 1e-10" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
