"""A TransformerLens model ported to equinox, with its hook names: gradients, activations, attribution patching.

Run:  python examples/transformerlens_port.py [--quick]

A small ``HookedTransformer`` (random init, 2 layers, attention + MLP +
LayerNorm, float64) is written again in equinox with ``jt.HookPoint`` fields
named as TransformerLens names its hook points; ``jaxtrace.torch.load_weights``
copies the weights across by path (TransformerLens's parameter names are the
port's field names), and ``jt.tag_modules(model, jt.HookPoint)`` tags every
hook point by its path, so the names are TransformerLens's
(``"blocks.0.attn.hook_z"``). Then, with ``jt.compare``:

1. the activation and the gradient of the loss at every hook point, against
   ``run_with_cache(tokens, return_type="loss", incl_bwd=True)``;
2. attribution patching both ways, ``(clean - corrupted) * grad at corrupted``
   (denoising) and ``(corrupted - clean) * grad at clean`` (noising), at every
   hook point, against TransformerLens's recipe (forward and backward hooks).

TransformerLens's ``ln1`` runs once each for the query, key and value inputs,
so ``blocks.{l}.ln1.hook_*`` fire three times per forward pass: jaxtrace stacks
the calls (``[3, batch, pos, ...]``); TransformerLens's cache keeps the last
forward call (``[-1]``) and, for ``"_grad"``, the last backward hook to fire,
which is the first call (``[0]``).

Needs ``transformer_lens`` 3.x (3.9 tested; 4.0 removed ``HookedTransformer``)
and torch; without them, or with TransformerLens 4, it says how to install
them and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
import time
import warnings

INSTALL = (
    "This example needs TransformerLens 3.x (3.9 tested) and PyTorch (a CPU build is enough):\n"
    "    pip install torch --index-url https://download.pytorch.org/whl/cpu\n"
    '    pip install "transformer-lens>=3.9,<4"\n'
    "TransformerLens 4.0 removed HookedTransformer, which this example compares against."
)


def _transformer_lens_major():
    """The installed TransformerLens's major version, or None without it."""
    if importlib.util.find_spec("transformer_lens") is None:
        return None
    try:
        return int(importlib.metadata.version("transformer_lens").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


_MAJOR = _transformer_lens_major()
if _MAJOR is None or _MAJOR >= 4 or importlib.util.find_spec("torch") is None:
    if _MAJOR is not None and _MAJOR >= 4:
        print(f"Found TransformerLens {importlib.metadata.version('transformer_lens')}, without HookedTransformer.")
    print(INSTALL)
    sys.exit(0)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402

import jaxtrace as jt  # noqa: E402
import jaxtrace.torch as jtt  # noqa: E402

jax.config.update("jax_enable_x64", True)

# --- the equinox port: the same fields, the same hook point names -----------------------------


class LayerNorm(eqx.Module):
    w: jax.Array
    b: jax.Array
    eps: float = eqx.field(static=True)
    hook_scale: jt.HookPoint = jt.HookPoint()
    hook_normalized: jt.HookPoint = jt.HookPoint()

    def __call__(self, x):
        x = x - x.mean(-1, keepdims=True)
        scale = self.hook_scale(jnp.sqrt((x**2).mean(-1, keepdims=True) + self.eps))
        return self.hook_normalized(x / scale) * self.w + self.b


class Attention(eqx.Module):
    W_Q: jax.Array  # (heads, d_model, d_head), as TransformerLens keeps them
    W_K: jax.Array
    W_V: jax.Array
    W_O: jax.Array  # (heads, d_head, d_model)
    b_Q: jax.Array
    b_K: jax.Array
    b_V: jax.Array
    b_O: jax.Array
    hook_q: jt.HookPoint = jt.HookPoint()
    hook_k: jt.HookPoint = jt.HookPoint()
    hook_v: jt.HookPoint = jt.HookPoint()
    hook_attn_scores: jt.HookPoint = jt.HookPoint()
    hook_pattern: jt.HookPoint = jt.HookPoint()
    hook_z: jt.HookPoint = jt.HookPoint()

    def __call__(self, q_in, k_in, v_in):  # (batch, pos, d_model) each
        q = self.hook_q(jnp.einsum("bpd,hde->bphe", q_in, self.W_Q) + self.b_Q)
        k = self.hook_k(jnp.einsum("bpd,hde->bphe", k_in, self.W_K) + self.b_K)
        v = self.hook_v(jnp.einsum("bpd,hde->bphe", v_in, self.W_V) + self.b_V)
        scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
        scores = self.hook_attn_scores(jnp.where(causal, scores, -jnp.inf))
        pattern = self.hook_pattern(jax.nn.softmax(scores, axis=-1))
        z = self.hook_z(jnp.einsum("bhqk,bkhe->bqhe", pattern, v))
        return jnp.einsum("bqhe,hed->bqd", z, self.W_O) + self.b_O


class MLP(eqx.Module):
    W_in: jax.Array
    b_in: jax.Array
    W_out: jax.Array
    b_out: jax.Array
    hook_pre: jt.HookPoint = jt.HookPoint()
    hook_post: jt.HookPoint = jt.HookPoint()

    def __call__(self, x):
        pre = self.hook_pre(x @ self.W_in + self.b_in)
        post = self.hook_post(jax.nn.gelu(pre, approximate=False))  # TransformerLens's "gelu" is exact
        return post @ self.W_out + self.b_out


class Block(eqx.Module):
    ln1: LayerNorm
    attn: Attention
    ln2: LayerNorm
    mlp: MLP
    hook_resid_pre: jt.HookPoint = jt.HookPoint()
    hook_attn_out: jt.HookPoint = jt.HookPoint()
    hook_resid_mid: jt.HookPoint = jt.HookPoint()
    hook_mlp_out: jt.HookPoint = jt.HookPoint()
    hook_resid_post: jt.HookPoint = jt.HookPoint()

    def __call__(self, resid_pre):
        resid_pre = self.hook_resid_pre(resid_pre)
        # As TransformerLens: ln1 once per input of the attention (so its hook points fire 3 times).
        attn_out = self.hook_attn_out(self.attn(self.ln1(resid_pre), self.ln1(resid_pre), self.ln1(resid_pre)))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(resid_mid)))
        return self.hook_resid_post(resid_mid + mlp_out)


class Embed(eqx.Module):
    W_E: jax.Array


class PosEmbed(eqx.Module):
    W_pos: jax.Array


class Unembed(eqx.Module):
    W_U: jax.Array
    b_U: jax.Array
    hook_in: jt.HookPoint = jt.HookPoint()
    hook_out: jt.HookPoint = jt.HookPoint()

    def __call__(self, x):
        return self.hook_out(self.hook_in(x) @ self.W_U + self.b_U)


class Transformer(eqx.Module):
    embed: Embed
    pos_embed: PosEmbed
    blocks: list
    ln_final: LayerNorm
    unembed: Unembed
    hook_embed: jt.HookPoint = jt.HookPoint()
    hook_pos_embed: jt.HookPoint = jt.HookPoint()

    def __call__(self, tokens):  # (batch, pos) -> logits (batch, pos, vocab)
        pos_embed = jnp.broadcast_to(self.pos_embed.W_pos[: tokens.shape[1]], (*tokens.shape, self.embed.W_E.shape[1]))
        x = self.hook_embed(self.embed.W_E[tokens]) + self.hook_pos_embed(pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_final(x))


def build(cfg) -> Transformer:
    """The port's structure, with zeros: ``load_weights`` fills in TransformerLens's values.

    The hook points are fields with a default, filled by the dataclass ``__init__`` (a module with
    its own ``__init__`` assigns them there: ``self.hook_z = jt.HookPoint()``).
    """
    d, h, e, z = cfg.d_model, cfg.n_heads, cfg.d_head, jnp.zeros

    def ln():
        return LayerNorm(jnp.ones(d), z(d), cfg.eps)

    def block():
        attn = Attention(z((h, d, e)), z((h, d, e)), z((h, d, e)), z((h, e, d)), z((h, e)), z((h, e)), z((h, e)), z(d))
        return Block(ln(), attn, ln(), MLP(z((d, cfg.d_mlp)), z(cfg.d_mlp), z((cfg.d_mlp, d)), z(d)))

    return Transformer(
        Embed(z((cfg.d_vocab, d))),
        PosEmbed(z((cfg.n_ctx, d))),
        [block() for _ in range(cfg.n_layers)],
        ln(),
        Unembed(z((d, cfg.d_vocab_out)), z(cfg.d_vocab_out)),
    )


def lm_loss(logits, tokens):
    """TransformerLens's ``return_type="loss"``: mean next-token cross-entropy."""
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))


# --- TransformerLens's side -------------------------------------------------------------------


def tl_cache_fwd_and_bwd(model, tokens, metric, names):
    """TransformerLens's attribution-patching recipe: a forward and a backward hook on every hook point."""
    model.reset_hooks()
    acts, grads = {}, {}

    def save(store):
        def hook(value, hook):
            store[hook.name] = value.detach().clone()

        return hook

    model.add_hook(lambda name: name in names, save(acts), "fwd")
    model.add_hook(lambda name: name in names, save(grads), "bwd")
    value = metric(model(tokens))
    value.backward()
    model.reset_hooks()
    return value.item(), acts, grads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="(the default size is already small)")
    parser.parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(0)
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_mlp=32, d_vocab=23, act_fn="gelu",
        normalization_type="LN", dtype=torch.float64, seed=0, device="cpu",
    )  # fmt: skip
    tl_model = HookedTransformer(cfg)
    with torch.no_grad():  # the init leaves biases at 0 and norms at 1: make every parameter count
        for p in tl_model.parameters():
            p.add_(0.1 * torch.randn_like(p))

    # The port: weights by path (TransformerLens's names are the port's fields), hook points tagged.
    # TransformerLens's attention keeps a constant buffer (IGNORE, the -inf fill value) that the
    # port writes inline, so load_weights's note that it did not copy it is expected here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"load_weights did not copy the torch buffer\(s\) '[^ ]*IGNORE")
        model = jtt.load_weights(eqx.filter_eval_shape(build, cfg), tl_model)
    model = jt.tag_modules(model, jt.HookPoint)
    tokens_t = torch.randint(0, cfg.d_vocab, (3, cfg.n_ctx))
    tokens = jnp.asarray(tokens_t.numpy())

    # 1. Every hook point: activations and gradients of the loss, against run_with_cache(incl_bwd=True).
    loss_t, cache = tl_model.run_with_cache(tokens_t, return_type="loss", incl_bwd=True)
    tl_acts = {k: v for k, v in cache.items() if not k.endswith("_grad")}
    tl_grads = {k.removesuffix("_grad"): v for k, v in cache.items() if k.endswith("_grad")}
    loss, (_, grads), acts = jax.jit(jt.value_and_grad(lambda m, t: lm_loss(m(t), t), with_values=True))(model, tokens)
    print(f"loss: jax {float(loss):.15f}, TransformerLens {loss_t.item():.15f}")
    for name in list(acts):
        if ".ln1." in name:  # three calls (q, k, v inputs): TL keeps the last forward call, the first backward one
            acts[name], grads[name] = acts[name][-1], grads[name][0]
    for what, mine, theirs in (("activations", acts, tl_acts), ("gradients", grads, tl_grads)):
        result = jt.compare(mine, theirs, rtol=1e-10, atol=1e-13, labels=("jaxtrace", "TransformerLens"))
        print(f"\n{what} at every hook point:\n{result}")
        result.assert_ok()
    # The parameters' gradients too, under TransformerLens's names.
    tl_model.zero_grad()
    tl_model(tokens_t, return_type="loss").backward()
    param_grads = jax.grad(lambda m: lm_loss(m(tokens), tokens))(model)
    result = jt.compare(
        jtt.named_grads(param_grads, tl_model),
        {n: p.grad for n, p in tl_model.named_parameters()},
        rtol=1e-10,
        atol=1e-13,
        labels=("jax", "TransformerLens"),
    )
    print(f"\nparameter gradients: {'OK' if result.ok else result} ({len(result.rows)} parameters)")
    result.assert_ok()

    # 2. Attribution patching, both ways. Corrupt the middle tokens; the metric is the logit of the
    # last token's continuation at the last position (any scalar works).
    corrupted_t = tokens_t.clone()
    corrupted_t[:, 2:5] = (corrupted_t[:, 2:5] + 7) % cfg.d_vocab
    corrupted = jnp.asarray(corrupted_t.numpy())
    answer = tokens_t[:, -1]

    def metric_t(logits):
        return logits[torch.arange(len(answer)), -1, answer].sum()

    answer_j = jnp.asarray(answer.numpy())

    def metric(m, t):
        return m(t)[jnp.arange(len(answer_j)), -1, answer_j].sum()

    # TransformerLens: a forward and a backward hook on every hook point, on each input.
    _, clean_t, clean_grad_t = tl_cache_fwd_and_bwd(tl_model, tokens_t, metric_t, tl_acts)
    _, corr_t, corr_grad_t = tl_cache_fwd_and_bwd(tl_model, corrupted_t, metric_t, tl_acts)
    # jaxtrace: one value_and_grad with the values, on each input.
    run = jax.jit(jt.value_and_grad(metric, with_values=True))
    _, (_, clean_grad), clean = run(model, tokens)
    _, (_, corr_grad), corr = run(model, corrupted)
    for store, index in ((clean, -1), (corr, -1), (clean_grad, 0), (corr_grad, 0)):
        for name in [n for n in store if ".ln1." in n]:
            store[name] = store[name][index]  # TransformerLens's choice among the three ln1 calls
    names = [n for n in clean_t if not n.endswith("hook_attn_scores")]  # -inf - -inf: no attribution there
    ways = {
        "denoising: (clean - corrupted) * grad at corrupted": (clean, corr, corr_grad, clean_t, corr_t, corr_grad_t),
        "noising: (corrupted - clean) * grad at clean": (corr, clean, clean_grad, corr_t, clean_t, clean_grad_t),
    }
    for title, (to, frm, grad, to_t, frm_t, grad_t) in ways.items():
        mine = {n: (to[n] - frm[n]) * grad[n] for n in names}
        theirs = {n: (to_t[n] - frm_t[n]) * grad_t[n] for n in names}
        result = jt.compare(mine, theirs, rtol=1e-10, atol=1e-13, labels=("jaxtrace", "TransformerLens"))
        heads = {n: np.asarray(mine[n]).sum(axis=(0, 1, 3)).round(4).tolist() for n in names if n.endswith("hook_z")}
        print(f"\nattribution patching, {title}: {'OK' if result.ok else result} ({len(result.rows)} hook points)")
        print(f"  per head (summed over batch, position, d_head): {heads}")
        result.assert_ok()
    print(f"\nall agree to 1e-10 in float64 ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
