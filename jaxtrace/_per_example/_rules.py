"""The per-layer rules: ``RULES``, keyed by module class, says which factors each parameter gets.

``rule_for(module)`` finds a module's rule; ``ensure_rules(framework)`` registers the rules
for equinox (Linear, Embedding, LayerNorm, RMSNorm, Conv) or Flax NNX (Linear, Embed,
LayerNorm, RMSNorm, Conv) the first time a model of that framework is planned.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ._factors import HIGHEST, Index, Use

@dataclasses.dataclass(frozen=True)
class Rule:
    """How one module class's parameters get their factors.

    ``ranks(module)`` gives the ranks of one call's input and output (the axes before
    them are batch, sequence and repeated-call axes), or ``None`` where this module's
    configuration is not covered. ``factors(module, x, g)`` gets the input ``x`` of shape
    ``(B, L, *input)`` and output gradient ``g`` of shape ``(B, L, *output)`` and returns
    ``{attribute name: Use}``.
    """

    ranks: Callable[[Any], Optional[tuple[int, int]]]
    factors: Callable[[Any, jax.Array, jax.Array], dict[str, Use]]
    params: Callable[[Any], tuple[str, ...]]


RULES: dict[type, Rule] = {}


def rule_for(module) -> Optional[Rule]:
    """The rule for ``module``: its class's (or a base's, when ``__call__`` is inherited)."""
    call = type(module).__call__
    for cls in type(module).__mro__:
        rule = RULES.get(cls)
        if rule is not None:
            return rule if call is cls.__call__ and rule.ranks(module) is not None else None
    return None


def _flat(x, rank):
    """``(B, L, *feat)`` -> ``(B, L * prod(feat[:-?]) ...)``: keep the last ``rank`` axes, flattened to one."""
    b, l = x.shape[:2]
    return x.reshape(b, l, int(np.prod(x.shape[2:], dtype=int)))


def _params(*names):
    return lambda m: tuple(n for n in names if getattr(m, n, None) is not None)


def _as_vectors(x, rank):
    """``(B, L, *s)`` with ``rank`` feature axes -> ``(B, L, prod(s))`` (rank 0: ``(B, L, 1)``)."""
    return x.reshape(*x.shape[:2], -1) if rank else x[..., None]


def _register_equinox():
    import equinox as eqx

    def lin_ranks(m):
        return (0 if m.in_features == "scalar" else 1, 0 if m.out_features == "scalar" else 1)

    def lin_factors(m, x, g):
        ri, ro = lin_ranks(m)
        gv = _as_vectors(g, ro)
        out = {"weight": Use(gv, _as_vectors(x, ri))}
        if m.bias is not None:
            out["bias"] = Use(gv, None)
        return out

    RULES[eqx.nn.Linear] = Rule(lin_ranks, lin_factors, _params("weight", "bias"))

    def emb_factors(m, x, g):
        return {"weight": Use(Index(x.reshape(*x.shape[:2]), m.weight.shape[0]), g)}

    RULES[eqx.nn.Embedding] = Rule(lambda m: (0, 1), emb_factors, _params("weight"))

    def norm_rule(cls):
        def ranks(m):
            r = len(m.shape)
            return (r, r)

        def factors(m, x, g):
            out = {}
            gv = _flat(g, 0)
            if m.use_weight:
                unit = eqx.tree_at(lambda n: n.weight, m, jnp.ones_like(m.weight))
                if m.use_bias:
                    unit = eqx.tree_at(lambda n: n.bias, unit, jnp.zeros_like(m.bias))
                b, l = x.shape[:2]
                xhat = jax.vmap(unit)(x.reshape(b * l, *x.shape[2:])).reshape(x.shape)
                out["weight"] = Use(gv * _flat(xhat, 0).astype(gv.dtype), None)
            if m.use_bias:
                out["bias"] = Use(gv, None)
            return out

        RULES[cls] = Rule(ranks, factors, _params("weight", "bias"))

    norm_rule(eqx.nn.LayerNorm)
    norm_rule(eqx.nn.RMSNorm)

    def conv_ranks(m):
        if m.groups != 1 or m.padding_mode != "ZEROS":
            return None
        return (m.num_spatial_dims + 1, m.num_spatial_dims + 1)

    def conv_factors(m, x, g):
        b, l = x.shape[:2]
        xs = x.reshape(b * l, *x.shape[2:])
        patches = jax.lax.conv_general_dilated_patches(
            xs, m.kernel_size, m.stride, m.padding, rhs_dilation=m.dilation, precision=HIGHEST
        )  # (N, in * prod(k), *out_spatial), features ordered (in, *k) as the weight's
        p = patches.reshape(b, l, patches.shape[1], -1)
        bfac = jnp.moveaxis(p, 2, 3).reshape(b, -1, patches.shape[1])
        gv = jnp.moveaxis(g.reshape(b, l, g.shape[2], -1), 2, 3).reshape(b, -1, g.shape[2])
        out = {"weight": Use(gv, bfac.astype(gv.dtype))}
        if m.use_bias:
            out["bias"] = Use(gv, None)
        return out

    RULES[eqx.nn.Conv] = Rule(conv_ranks, conv_factors, _params("weight", "bias"))


def _register_nnx():
    from flax import nnx

    def lin_factors(m, x, g):
        gv = _flat(g, 1)
        out = {"kernel": Use(_flat(x, 1), gv)}
        if m.bias is not None:
            out["bias"] = Use(gv, None)
        return out

    RULES[nnx.Linear] = Rule(lambda m: (1, 1), lin_factors, _params("kernel", "bias"))

    def emb_factors(m, x, g):
        return {"embedding": Use(Index(x.reshape(*x.shape[:2]), m.num_embeddings), g)}

    RULES[nnx.Embed] = Rule(lambda m: (0, 1), emb_factors, _params("embedding"))

    def last_axis(m):
        axes = [a if isinstance(a, int) else None for a in np.atleast_1d(np.array(m.reduction_axes, dtype=object))]
        feats = [a if isinstance(a, int) else None for a in np.atleast_1d(np.array(m.feature_axes, dtype=object))]
        return axes == [-1] and feats == [-1]

    def norm_rule(cls, scale_attr, bias_attr):
        def factors(m, x, g):
            out = {}
            gv = _flat(g, 1)
            if getattr(m, scale_attr, None) is not None:
                graphdef, state = nnx.split(m)
                unit = jax.tree.map(lambda v: v, state)
                unit[scale_attr] = jax.tree.map(jnp.ones_like, state[scale_attr])
                if getattr(m, bias_attr or "", None) is not None:
                    unit[bias_attr] = jax.tree.map(jnp.zeros_like, state[bias_attr])
                b, l = x.shape[:2]
                xhat = nnx.merge(graphdef, unit)(x.reshape(b * l, x.shape[-1])).reshape(x.shape)
                out[scale_attr] = Use(gv * _flat(xhat, 1).astype(gv.dtype), None)
            if bias_attr and getattr(m, bias_attr, None) is not None:
                out[bias_attr] = Use(gv, None)
            return out

        RULES[cls] = Rule(lambda m: (1, 1) if last_axis(m) else None, factors, _params(scale_attr, bias_attr or scale_attr))

    norm_rule(nnx.LayerNorm, "scale", "bias")
    norm_rule(nnx.RMSNorm, "scale", None)

    def conv_padding(m):
        pad = m.padding
        if isinstance(pad, str):
            return pad.upper() if pad.upper() in ("SAME", "VALID") else None
        d = len(m.kernel_size)
        if isinstance(pad, int):
            return [(pad, pad)] * d
        try:
            pairs = [(p, p) if isinstance(p, int) else tuple(p) for p in pad]
        except TypeError:
            return None
        return pairs if len(pairs) == d and all(len(p) == 2 for p in pairs) else None

    def conv_ranks(m):
        if m.feature_group_count != 1 or m.mask is not None or conv_padding(m) is None:
            return None
        return (len(m.kernel_size) + 1, len(m.kernel_size) + 1)

    def bcast(v, d):
        if v is None:
            return (1,) * d
        return (v,) * d if isinstance(v, int) else tuple(v)

    def conv_factors(m, x, g):
        d = len(m.kernel_size)
        b, l = x.shape[:2]
        xs = jnp.moveaxis(x.reshape(b * l, *x.shape[2:]), -1, 1)  # NHWC -> NCHW
        patches = jax.lax.conv_general_dilated_patches(
            xs,
            m.kernel_size,
            bcast(m.strides, d),
            conv_padding(m),
            lhs_dilation=bcast(m.input_dilation, d),
            rhs_dilation=bcast(m.kernel_dilation, d),
            precision=HIGHEST,
        )  # (N, in * prod(k), *out_spatial), features ordered (in, *k)
        cin = x.shape[-1]
        p = patches.reshape(b, l, cin, *m.kernel_size, -1)
        p = jnp.moveaxis(p, 2, 2 + d)  # features (*k, in), as the kernel (*k, in, out)
        bfac = jnp.moveaxis(p.reshape(b, l, cin * math.prod(m.kernel_size), -1), 2, 3)
        bfac = bfac.reshape(b, -1, bfac.shape[-1])
        gv = g.reshape(b, -1, g.shape[-1])
        out = {"kernel": Use(bfac.astype(gv.dtype), gv)}
        if m.bias is not None:
            out["bias"] = Use(gv, None)
        return out

    RULES[nnx.Conv] = Rule(conv_ranks, conv_factors, _params("kernel", "bias"))


_REGISTERED: set = set()


def ensure_rules(framework: str) -> None:
    if framework not in _REGISTERED:
        {"equinox": _register_equinox, "nnx": _register_nnx}[framework]()
        _REGISTERED.add(framework)
