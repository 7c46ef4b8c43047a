"""The per-layer rules: which factors each parameter of a covered module class gets.

``RULES`` maps a module class to its ``Rule``; ``rule_for(module)`` finds a module's. Each
rule is one module-level function per kind of layer (``linear``, ``embedding``, ``norm``,
``conv``), written once for equinox and Flax NNX: ``@register`` adds it for the classes it
names, with that framework's attribute names and readers as data. The classes are named by
their import path and imported by ``ensure_rules(package)`` the first time a model of that
framework is planned (Flax is optional; its classes are never imported before that).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._conv import ConvUse, conv_pads
from ._factors import Index, Use

__all__ = ["RULES", "Rule", "conv", "embedding", "ensure_rules", "linear", "norm", "register", "rule_for"]

Ranks = Callable[[Any], Optional[tuple[int, int]]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one module class's parameters get their factors.

    ``ranks(module)`` gives the ranks of one call's input and output (the axes before
    them are batch, sequence and repeated-call axes), or ``None`` where this module's
    configuration is not covered. ``factors(module, x, g)`` gets the input ``x`` of shape
    ``(B, L, *input)`` and output gradient ``g`` of shape ``(B, L, *output)`` and returns
    ``{attribute name: Use}`` (a convolution's weight: a ``ConvUse``, ``_conv.py``); it reads the
    module's configuration (shapes, flags, ``eps``), never its parameter arrays, which are ``None``
    where ``eqx.partition`` froze them away. ``names`` are the parameter attributes it covers.
    """

    ranks: Ranks
    factors: Callable[[Any, jax.Array, jax.Array], dict[str, Union[Use, ConvUse]]]
    names: tuple[str, ...]

    def params(self, module) -> tuple[str, ...]:
        """The attributes of ``names`` that ``module`` has (an absent bias is left out).

        Args:
            module: an instance of a class this rule is registered for.

        Returns:
            The attribute names, in the order of ``names``.
        """
        return tuple(n for n in self.names if _has(module, n))


RULES: dict[type, Rule] = {}
_PENDING: dict[str, list[tuple[str, Rule]]] = {}  # package -> (class path, rule), not imported yet


def register(*classes: str, ranks: Ranks, weight: str, bias: Optional[str] = "bias", **data) -> Callable:
    """Registers the decorated factors function for the module classes named by ``classes``.

    Args:
        *classes: import paths of module classes (``"equinox.nn.Linear"``), imported by
            ``ensure_rules`` with their package.
        ranks: ``ranks(module)``, as ``Rule.ranks``.
        weight: the attribute of the layer's weight (``"weight"``, ``"kernel"``, ``"scale"``).
        bias: the attribute of its bias, or ``None`` where the layer has none.
        **data: the framework's other readers and layout, passed on to the function.

    Returns:
        A decorator that registers ``factors(module, x, g, *, weight, bias, **data)`` and
        returns it unchanged (so that registrations stack).
    """

    def add(factors: Callable) -> Callable:
        names = (weight,) if bias is None else (weight, bias)
        rule = Rule(ranks, functools.partial(factors, weight=weight, bias=bias, **data), names)
        for path in classes:
            _PENDING.setdefault(path.split(".")[0], []).append((path, rule))
        return factors

    return add


def ensure_rules(package: str) -> None:
    """Imports the classes registered under ``package`` and adds their rules to ``RULES`` (once).

    Args:
        package: the top-level package of a model's framework, ``"equinox"`` or ``"flax"``.

    Returns:
        None.
    """
    for path, rule in _PENDING.pop(package, ()):
        module, _, name = path.rpartition(".")
        RULES[getattr(importlib.import_module(module), name)] = rule


def rule_for(module) -> Optional[Rule]:
    """The rule for ``module``: its class's (or a base's, when ``__call__`` is inherited).

    Args:
        module: an equinox or Flax NNX module.

    Returns:
        The rule, or ``None`` where no rule covers the module's class or its configuration.
    """
    call = type(module).__call__
    for cls in type(module).__mro__:
        rule = RULES.get(cls)
        if rule is not None:
            return rule if call is cls.__call__ and rule.ranks(module) is not None else None
    return None


# --- shared pieces ------------------------------------------------------------


def _has(module, name: Optional[str]) -> bool:
    """Whether ``module`` has the parameter ``name``: set, and not switched off by ``use_<name>``."""
    return name is not None and getattr(module, name, None) is not None and bool(getattr(module, "use_" + name, True))


def _uses(module, name: Optional[str]) -> bool:
    """Whether ``module``'s configuration has the parameter ``name`` (set or not: a frozen half holds ``None``)."""
    return name is not None and bool(getattr(module, "use_" + name, hasattr(module, name)))


def _flat(x):
    """``(B, L, *feat)`` -> ``(B, L, prod(feat))``."""
    b, l = x.shape[:2]
    return x.reshape(b, l, int(np.prod(x.shape[2:], dtype=int)))


def _as_vectors(x, rank):
    """``(B, L, *s)`` with ``rank`` feature axes -> ``(B, L, prod(s))`` (rank 0: ``(B, L, 1)``)."""
    return x.reshape(*x.shape[:2], -1) if rank else x[..., None]


def _with_bias(module, bias, gv, out: dict) -> dict:
    """``out`` with the bias's factors (the output gradient alone) where ``module`` has one."""
    if _has(module, bias):
        out[bias] = Use(gv, None)
    return out


# --- Linear -------------------------------------------------------------------


def _linear_ranks(m):
    """Equinox's ``"scalar"`` features are rank 0; NNX's are integers."""
    return (0 if m.in_features == "scalar" else 1, 0 if m.out_features == "scalar" else 1)


@register("equinox.nn.Linear", ranks=_linear_ranks, weight="weight", out_last=False)
@register("flax.nnx.Linear", ranks=_linear_ranks, weight="kernel", out_last=True)
def linear(m, x, g, *, weight, bias, out_last):
    """Linear: ``sum_k g_k x_k^T``; ``out_last``: the weight is ``(in, out)`` (NNX's kernel), else ``(out, in)``."""
    ri, ro = _linear_ranks(m)
    gv, xv = _as_vectors(g, ro), _as_vectors(x, ri)
    return _with_bias(m, bias, gv, {weight: Use(xv, gv, out="b") if out_last else Use(gv, xv)})


# --- Embedding ----------------------------------------------------------------


@register("equinox.nn.Embedding", ranks=lambda m: (0, 1), weight="weight", bias=None)
@register("flax.nnx.Embed", ranks=lambda m: (0, 1), weight="embedding", bias=None)
def embedding(m, x, g, *, weight, bias):
    """Embedding: the rows the ids select (a one-hot factor) against the output gradient."""
    return {weight: Use(Index(x.reshape(*x.shape[:2]), m.num_embeddings), g)}


# --- LayerNorm, RMSNorm ---------------------------------------------------------


def _eqx_norm_ranks(m):
    r = len(m.shape)
    return (r, r)


def _nnx_norm_ranks(m):
    """Covered where NNX normalises over, and scales, the last axis alone."""

    def ints(axes):
        return [a if isinstance(a, int) else None for a in np.atleast_1d(np.array(axes, dtype=object))]

    return (1, 1) if ints(m.reduction_axes) == [-1] and ints(m.feature_axes) == [-1] else None


def _eqx_unit(m, weight, bias):
    """The equinox layer with unit weight and zero bias, applied row by row: built from its configuration
    (``shape``, ``use_weight``, ``use_bias``), not its arrays, which are ``None`` where frozen away
    (the trained half of an ``eqx.partition``)."""
    import equinox as eqx

    fill = {name: value for name, value in ((weight, jnp.ones(m.shape)), (bias, jnp.zeros(m.shape))) if _uses(m, name)}
    names = tuple(fill)
    unit = eqx.tree_at(lambda n: tuple(getattr(n, a) for a in names), m, tuple(fill.values()), is_leaf=lambda v: v is None)
    return jax.vmap(unit)


def _nnx_unit(m, weight, bias):
    """The NNX layer with unit scale and zero bias (it normalises rows itself)."""
    from flax import nnx

    graphdef, state = nnx.split(m)
    unit = jax.tree.map(lambda v: v, state)
    unit[weight] = jax.tree.map(jnp.ones_like, state[weight])
    if _has(m, bias):
        unit[bias] = jax.tree.map(jnp.zeros_like, state[bias])
    return nnx.merge(graphdef, unit)


@register("equinox.nn.LayerNorm", "equinox.nn.RMSNorm", ranks=_eqx_norm_ranks, weight="weight", unit=_eqx_unit)
@register("flax.nnx.LayerNorm", "flax.nnx.RMSNorm", ranks=_nnx_norm_ranks, weight="scale", unit=_nnx_unit)
def norm(m, x, g, *, weight, bias, unit):
    """LayerNorm, RMSNorm: the scale's factor is ``g * xhat`` (``xhat`` from ``unit``: the layer with unit
    scale and no bias), the bias's ``g``; both elementwise, so one factor each."""
    out = {}
    gv = _flat(g)
    if _has(m, weight):
        b, l = x.shape[:2]
        xhat = unit(m, weight, bias)(x.reshape(b * l, *x.shape[2:])).reshape(x.shape)
        out[weight] = Use(gv * _flat(xhat).astype(gv.dtype), None)
    return _with_bias(m, bias, gv, out)


# --- Conv ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Window:
    """A convolution's geometry, as ``lax.conv_general_dilated_patches`` takes it."""

    kernel: tuple
    strides: Any
    padding: Any
    lhs_dilation: Any
    rhs_dilation: Any
    groups: int


def _eqx_window(m) -> Optional[_Window]:
    if m.padding_mode != "ZEROS":
        return None
    return _Window(m.kernel_size, m.stride, m.padding, None, m.dilation, m.groups)


def _nnx_window(m) -> Optional[_Window]:
    padding = _nnx_padding(m)
    if m.mask is not None or padding is None:
        return None
    d = len(m.kernel_size)
    dilations = _per_axis(m.input_dilation, d), _per_axis(m.kernel_dilation, d)
    return _Window(m.kernel_size, _per_axis(m.strides, d), padding, *dilations, m.feature_group_count)


def _nnx_padding(m):
    """NNX's ``padding`` as ``lax`` takes it, or ``None`` where it is not covered (``"CIRCULAR"``, ...)."""
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


def _per_axis(v, d):
    if v is None:
        return (1,) * d
    return (v,) * d if isinstance(v, int) else tuple(v)


def _conv_ranks(m, *, window):
    w = window(m)
    return None if w is None else (len(w.kernel) + 1, len(w.kernel) + 1)


_eqx_conv_ranks = functools.partial(_conv_ranks, window=_eqx_window)
_nnx_conv_ranks = functools.partial(_conv_ranks, window=_nnx_window)


@register("equinox.nn.Conv", ranks=_eqx_conv_ranks, weight="weight", window=_eqx_window, out_last=False)
@register("flax.nnx.Conv", ranks=_nnx_conv_ranks, weight="kernel", window=_nnx_window, out_last=True)
def conv(m, x, g, *, weight, bias, window, out_last):
    """Conv: each output position's input patch against its output gradient, as a ``ConvUse``
    (``_conv.py``: the per-example gradient from shifted slices of the input, no patch tensor).
    ``out_last``: channels last, the kernel ``(*k, in, out)`` (NNX); else channels first, the
    weight ``(out, in, *k)``. Grouped (``groups``, NNX's ``feature_group_count``; depthwise where it is
    the input channels): ``in`` is a group's input channels, each group's outputs against its inputs."""
    w = window(m)
    d = len(w.kernel)
    if out_last:  # (B, L, *S, C) -> (B, L, C, *S)
        x, g = jnp.moveaxis(x, -1, 2), jnp.moveaxis(g, -1, 2)
    strides, lhs, rhs = (_per_axis(v, d) for v in (w.strides, w.lhs_dilation, w.rhs_dilation))
    pads = conv_pads(x.shape[3:], tuple(w.kernel), strides, w.padding, lhs, rhs)
    use = ConvUse(x, g, tuple(w.kernel), strides, pads, lhs, rhs, out_last, int(w.groups))
    # the bias's per-example gradient: each call's output gradient summed over its positions, (B, L, O)
    # (one factor row per call, not per position: no (B * T, O) copy of g for the norm and the sum)
    return _with_bias(m, bias, jnp.sum(g.reshape(*g.shape[:3], -1), axis=3), {weight: use})
