"""Ownership: which example's loss each element of a value can reach, and the per-primitive rules.

``Axis(unit)``: the element with flat index ``f`` reaches only the loss of example
``(f // unit) % B``; ``Step(level, inner)``: it is in the body of a scan whose steps are the
examples (``lax.map`` over the batch) and reaches only the loss of its step's example; ``Every(reach,
eqn)``: it may reach every example's loss (``Reach``: why); ``None``: no loss. ``OWNERS`` maps a primitive's name to its rule ``(analysis, eqn, output states, ctx) ->
operand states`` (``None`` where the rule cannot read the layout: the operands then reach every
loss, ``Reach.UNKNOWN``). The analysis that runs them is ``_proof``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .. import _compat
from .._elementwise import ELEMENTWISE

__all__ = ["Axis", "ELEMENTWISE", "Every", "MULTI", "OWNERS", "Positions", "Reach", "SHAPE_ONLY", "Step", "axis_of", "elementwise", "inexact", "register", "shape_of", "unit"]

# --- ownership states ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Axis:
    """Element with flat (row-major) index ``f`` reaches only the loss of example ``(f // unit) % B``."""

    unit: int


@dataclasses.dataclass(frozen=True)
class Step:
    """Reaches only the loss of the example its loop step belongs to: in the body of the scan at
    nesting ``level`` (0: the outermost scan around it), step ``s`` is example ``s // inner``'s. Every
    element of a value in such a body is that one example's (``jax.lax.map(lambda xi: loss(m, xi), x)``)."""

    level: int
    inner: int = 1


class Reach(enum.StrEnum):
    """Why a value reaches every example's loss (``Every.kind``)."""

    SHARED = "shared"  # a value broadcast to every example
    MIX = "mix"  # an operation that reads several examples
    UNKNOWN = "unknown"  # no rule reads the layout: no claim is made


@dataclasses.dataclass(frozen=True)
class Every:
    """Reaches every example's loss: ``kind`` says why (a ``Reach``), ``eqn`` where."""

    kind: Reach
    eqn: Any

    def __post_init__(self):
        object.__setattr__(self, "kind", Reach(self.kind))  # (a ``Reach``'s value names it as well)


class Positions(enum.StrEnum):
    """What an integer array known to hold positions holds (the analysis's ``iota`` facts, a tuple led by one of these)."""

    IOTA = "iota"  # (IOTA, axis): each entry its own index along ``axis`` (``arange``)
    FALSE = "false"  # (FALSE,): a mask false everywhere (``arange(n) < 0``, as jnp indexing builds it)
    COMPONENTS = "components"  # (COMPONENTS, axis, {k: axis_k}): index vectors along ``axis``, component k an IOTA along axis_k


def axis_of(shape: Sequence[int], state: Axis, batch: int) -> Optional[tuple[int, int]]:
    """``(axis, inner)``: the example of index ``k`` along ``axis`` is ``k // inner``; None if no axis is."""
    after = 1
    for j in range(len(shape) - 1, -1, -1):
        if state.unit % after == 0:
            inner = state.unit // after
            if shape[j] == batch * inner:
                return j, inner
        after *= shape[j]
    return None


def unit(shape: Sequence[int], axis: int, inner: int) -> Axis:
    return Axis(inner * math.prod(shape[axis + 1 :]))


def shape_of(atom) -> tuple:
    return tuple(getattr(atom.aval, "shape", ()))


def inexact(atom) -> bool:
    dtype = getattr(atom.aval, "dtype", None)
    return dtype is not None and np.issubdtype(dtype, np.inexact)


# --- per-primitive ownership rules: (analysis, eqn, out states, ctx) -> operand states ---------

OWNERS: dict[str, Callable] = {}
MULTI = {"split", "sort", "top_k"}


def register(*names):
    def deco(rule):
        for n in names:
            OWNERS[n] = rule
        return rule

    return deco


SHAPE_ONLY = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy"}


@register(*ELEMENTWISE)
def elementwise(an, eqn, outs, ctx):
    out_shape = shape_of(eqn.outvars[0])
    where = axis_of(out_shape, outs[0], an.batch)
    ins = []
    for a in eqn.invars:
        shape = shape_of(a)
        if where is None:  # keep the flat pattern where shapes agree
            ins.append(outs[0] if shape == out_shape else Every(Reach.UNKNOWN, eqn))
        elif len(shape) != len(out_shape):
            ins.append(Every(Reach.SHARED, eqn))  # a scalar operand reaches every example
        elif shape[where[0]] == out_shape[where[0]]:
            ins.append(unit(shape, *where))
        else:
            ins.append(Every(Reach.SHARED, eqn))  # broadcast along the examples (a size-1 axis)
    return ins


@register("broadcast_in_dim")
def _broadcast(an, eqn, outs, ctx):
    out_shape, shape = shape_of(eqn.outvars[0]), shape_of(eqn.invars[0])
    where = axis_of(out_shape, outs[0], an.batch)
    if where is None:
        return None
    dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
    rest = [None] * (len(eqn.invars) - 1)
    if where[0] in dims and shape[dims.index(where[0])] == out_shape[where[0]]:
        return [unit(shape, dims.index(where[0]), where[1]), *rest]
    return [Every(Reach.SHARED, eqn), *rest]


@register("reshape", "squeeze", "expand_dims")
def _reshape(an, eqn, outs, ctx):
    return [outs[0]] + [None] * (len(eqn.invars) - 1)  # the flat index is unchanged


@register("transpose")
def _transpose(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    if where is None:
        return None
    perm = eqn.params["permutation"]
    return [unit(shape_of(eqn.invars[0]), int(perm[where[0]]), where[1])]


def _kept_axis(eqn, outs, an, removed):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    if where is None:
        return None
    kept = [i for i in range(len(shape_of(eqn.invars[0]))) if i not in removed]
    return unit(shape_of(eqn.invars[0]), kept[where[0]], where[1])


@register("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin")
def _reduce(an, eqn, outs, ctx):
    s = _kept_axis(eqn, outs, an, {int(a) for a in eqn.params["axes"]})
    return None if s is None else [s] + [None] * (len(eqn.invars) - 1)


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "rev")
def _along(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    axes = eqn.params.get("dimensions", (eqn.params.get("axis"),))
    if where is None:
        return None
    if where[0] in {int(a) for a in axes}:
        return [Every(Reach.MIX, eqn)]
    return [outs[0]]


@register("sort", "split", "top_k")
def _sorted(an, eqn, outs, ctx):
    states = [s for s in outs if s is not None]
    if eqn.primitive.name == "split":
        axis = int(eqn.params["axis"])
        wheres = {axis_of(shape_of(v), s, an.batch) for v, s in zip(eqn.outvars, outs) if s is not None}
        if len(wheres) != 1 or None in wheres or next(iter(wheres))[0] == axis:
            return None
        return [unit(shape_of(eqn.invars[0]), *next(iter(wheres)))]
    axis = int(eqn.params.get("dimension", len(shape_of(eqn.invars[0])) - 1))
    wheres = {axis_of(shape_of(eqn.outvars[0]), s, an.batch) for s in states}
    if len(wheres) != 1 or None in wheres:
        return None
    where = next(iter(wheres))
    if where[0] == axis:
        return [Every(Reach.MIX, eqn)] * len(eqn.invars)
    return [unit(shape_of(a), *where) for a in eqn.invars]


@register("dot_general")
def _dot(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    if where is None:
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    lfree = [i for i in range(len(lhs)) if i not in lc and i not in lb]
    rfree = [i for i in range(len(rhs)) if i not in rc and i not in rb]
    j, inner = where
    if j < len(lb):
        return [unit(lhs, int(lb[j]), inner), unit(rhs, int(rb[j]), inner)]
    if j < len(lb) + len(lfree):
        return [unit(lhs, lfree[j - len(lb)], inner), Every(Reach.SHARED, eqn)]
    return [Every(Reach.SHARED, eqn), unit(rhs, rfree[j - len(lb) - len(lfree)], inner)]


@register("conv_general_dilated")
def _conv(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    dn = eqn.params["dimension_numbers"]
    if where is None or eqn.params.get("batch_group_count", 1) != 1 or where[0] != dn.out_spec[0]:
        return None
    return [unit(shape_of(eqn.invars[0]), int(dn.lhs_spec[0]), where[1]), Every(Reach.SHARED, eqn)]


@register("gather")
def _gather(an, eqn, outs, ctx):
    out_shape = shape_of(eqn.outvars[0])
    where = axis_of(out_shape, outs[0], an.batch)
    if where is None:
        return None
    j, inner = where
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    operand, indices = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    offset = tuple(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()))
    if j in offset:
        od = [d for d in range(len(operand)) if d not in collapsed][offset.index(j)]
        if sizes[od] != operand[od]:  # an axis taken whole (its start, if any, clamped to 0 or the slice dropped)
            return None
        return [unit(operand, od, inner), Every(Reach.SHARED, eqn)]
    # an output batch dimension: an axis of the indices (their last axis holds the index vector)
    batch_out = [d for d in range(len(out_shape)) if d not in offset]
    idim = [d for d in range(len(indices) - 1)][batch_out.index(j)]
    idx_state = unit(indices, idim, inner)
    obd, ibd = tuple(getattr(dn, "operand_batching_dims", ())), tuple(getattr(dn, "start_indices_batching_dims", ()))
    if idim in ibd:
        return [unit(operand, int(obd[ibd.index(idim)]), inner), idx_state]
    info = an.iota.get((ctx, eqn.invars[1])) if not isinstance(eqn.invars[1], _compat.Literal) else None
    if inner == 1 and info and info[0] == Positions.COMPONENTS and info[1] == len(indices) - 1:
        for k, d in info[2].items():
            od = dn.start_index_map[k]
            if d == idim and od in collapsed and operand[od] == an.batch:
                return [unit(operand, od, 1), idx_state]
    return [Every(Reach.SHARED, eqn), idx_state]


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
def _reduce_window(an, eqn, outs, ctx):
    """Pooling (``eqx.nn.MaxPool2d``, ``AvgPool2d``, ``flax.linen.max_pool``): per example where the
    window along the examples' axis is one element, unpadded and undilated."""
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    if where is None:
        return None
    j, p = where[0], eqn.params
    if (int(p["window_dimensions"][j]), int(p["window_strides"][j]), tuple(p["padding"][j])) != (1, 1, (0, 0)):
        return None
    if int(p["base_dilation"][j]) != 1 or int(p["window_dilation"][j]) != 1:
        return None
    n = len(eqn.outvars)  # the generic reduce_window: its operands, then their initial values
    if any(axis_of(shape_of(v), s, an.batch) != where for v, s in zip(eqn.outvars, outs) if s is not None):
        return None
    return [unit(shape_of(a), *where) for a in eqn.invars[:n]] + [Every(Reach.SHARED, eqn)] * (len(eqn.invars) - n)


@register("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max")
def _scatter(an, eqn, outs, ctx):
    """``x.at[...].set(u)`` (and ``.add``, ``.mul``, ``.min``, ``.max``) inside ``jax.vmap(model)``: per
    example where the examples' axis of ``x`` is one of the update's window axes, whole."""
    shape = shape_of(eqn.outvars[0])
    where = axis_of(shape, outs[0], an.batch)
    if where is None:
        return None
    j, dn = where[0], eqn.params["dimension_numbers"]
    skipped = {int(d) for d in dn.inserted_window_dims} | {int(d) for d in getattr(dn, "operand_batching_dims", ())}
    window = [d for d in range(len(shape)) if d not in skipped]
    if j not in window or j in {int(d) for d in dn.scatter_dims_to_operand_dims}:
        return None
    upd_dim, updates = int(dn.update_window_dims[window.index(j)]), shape_of(eqn.invars[2])
    if updates[upd_dim] != shape[j]:
        return None
    return [unit(shape, *where), None, unit(updates, upd_dim, where[1])] + [None] * (len(eqn.invars) - 3)


@register("dynamic_slice")
def _dynamic_slice(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    sizes, shape = eqn.params["slice_sizes"], shape_of(eqn.invars[0])
    if where is None or sizes[where[0]] != shape[where[0]]:
        return None
    return [unit(shape, *where)] + [None] * (len(eqn.invars) - 1)


@register("dynamic_update_slice")
def _dynamic_update(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    shape, upd = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    if where is None or upd[where[0]] != shape[where[0]]:
        return None
    return [unit(shape, *where), unit(upd, *where)] + [None] * (len(eqn.invars) - 2)


@register("slice")
def _slice(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    shape = shape_of(eqn.invars[0])
    if where is None or shape_of(eqn.outvars[0])[where[0]] != shape[where[0]]:
        return None
    return [unit(shape, *where)]


@register("pad")
def _pad(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    shape = shape_of(eqn.invars[0])
    if where is None or tuple(eqn.params["padding_config"][where[0]]) != (0, 0, 0):
        return None  # padding along the examples' axis moves them (negative low and positive high padding)
    return [unit(shape, *where), Every(Reach.SHARED, eqn)]


@register("concatenate")
def _concatenate(an, eqn, outs, ctx):
    where = axis_of(shape_of(eqn.outvars[0]), outs[0], an.batch)
    if where is None or where[0] == eqn.params["dimension"]:
        return None
    return [unit(shape_of(a), *where) for a in eqn.invars]


@register("iota", "rng_bit_generator", "random_bits", "random_seed", "random_wrap", "random_unwrap", "threefry2x32")
def _no_gradient(an, eqn, outs, ctx):
    return [None] * len(eqn.invars)
