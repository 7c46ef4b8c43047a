"""A large equinox model tagged by ``jt.tag_modules``: the benchmark row for models with hundreds of tags.

``transformer(...)`` is a pre-LayerNorm decoder stack built from ``eqx.nn`` layers
(``Embedding``, ``LayerNorm``, ``MultiheadAttention``, ``Linear``), so that
``jt.tag_modules`` finds every submodule: 11 tags per block. ``tagging(tag)`` runs
the same tagged modules with another tag function: the hook-style port (each output
through an identity ``custom_vjp`` that sends its cotangent to the host,
``models.HookStore``, which is what a PyTorch-style hook amounts to in JAX), the
recipe (``models.logged``) or the hand-written ``+ eps``. ``model(quick)`` is the
benchmark model in the form every driver takes (``models.Model``).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp

import jaxtrace as jt
import jaxtrace._module_tags as _jt_module_tags

import models as M


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d, hidden, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(d, hidden, key=k1)
        self.down = eqx.nn.Linear(hidden, d, key=k2)

    def __call__(self, x):
        return jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, d, heads, key):
        k1, k2 = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.ln2 = eqx.nn.LayerNorm(d)
        self.mlp = MLP(d, 4 * d, k2)

    def __call__(self, x, mask):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        return x + self.mlp(jax.vmap(self.ln2)(x))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    ln_f: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, vocab, d, heads, layers, key):
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
        self.blocks = [Block(d, heads, k) for k in keys[1:-1]]
        self.ln_f = eqx.nn.LayerNorm(d)
        self.unembed = eqx.nn.Linear(d, vocab, key=keys[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        mask = jnp.tril(jnp.ones((tokens.shape[0],) * 2, bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.unembed)(jax.vmap(self.ln_f)(x))


def transformer(layers=24, d=128, heads=4, vocab=256, seq=64, batch=4, seed=0):
    """``(model, tokens, targets)`` in float32."""
    key, k_tok = jax.random.split(jax.random.key(seed))
    model = Transformer(vocab, d, heads, layers, key)
    tokens = jax.random.randint(k_tok, (batch, seq + 1), 0, vocab)
    return model, tokens[:, :-1], tokens[:, 1:]


def loss(model, tokens, targets):
    logits = jax.vmap(model)(tokens)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@contextlib.contextmanager
def tagging(tag):
    """While tracing: ``jt.tag_modules`` models call ``tag(value, name)`` on each module's output
    instead of ``jt.tag``.

    Benchmark-only: it swaps the tag function that tagged modules call, so that the other
    variants (hook-style port, recipe, hand ``+ eps``) have exactly the same modules.
    """
    with mock.patch.object(_jt_module_tags, "module_tag", lambda value, name, repeated=False: tag(value, name)):
        yield


def hooked(store: M.HookStore):
    """While tracing: ``jt.tag_modules`` models send each module's cotangent to the host instead."""
    return tagging(store.tag)


def model(quick: bool, layers: int | None = None) -> M.Model:
    """The large model as a ``models.Model``: ``loss(params, (tokens, targets), tag, eps=None)``."""
    if quick:
        net, tokens, targets = transformer(layers=layers or 2, d=64, seq=16, batch=2)
    else:
        net, tokens, targets = transformer(layers=layers or 24)
    params, static = eqx.partition(net, eqx.is_array)
    tagged_params, tagged_static = eqx.partition(jt.tag_modules(net), eqx.is_array)

    def bench_loss(p, data, tag, eps=None):
        if tag is M.identity and eps is None:  # plain: the untagged model
            return loss(eqx.combine(p, static), *data)
        if tag is jt.tag:
            return loss(eqx.combine(p, tagged_static), *data)
        assert eps is None, "no hand-written + eps program for this model (see hand=False)"
        with tagging(tag):
            return loss(eqx.combine(p, tagged_static), *data)

    n_tags = count_tags(net, tokens, targets)
    return M.Model("large", bench_loss, tagged_params, (tokens, targets), "blocks.0.mlp",
                   f"equinox transformer: {len(net.blocks)} blocks, d {net.ln_f.shape[0]}, tokens {tokens.shape}; "
                   f"jt.tag_modules on every submodule: {n_tags} tags", plain_params=params, hand=False)


def count_tags(model, tokens, targets) -> int:
    tagged = jt.tag_modules(model)
    shapes = eqx.filter_eval_shape(jt.filter_value_and_grad(loss), tagged, tokens, targets)[1][1]
    return len(shapes)
