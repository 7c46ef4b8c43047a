"""Where a ``jax.shard_map`` body's values sit in the global arrays, for ``find_nonfinite``.

A body value is one shard's block. Its *layout* says, per axis, which manual mesh axes split that
axis across the shards, major first (as an entry of a ``PartitionSpec``): index ``k`` on the shard
at coordinates ``c`` is index ``linear(c over those axes) * local size + k`` of the global array;
``()`` an axis that every shard holds whole; ``None`` an axis jaxtrace cannot follow. It is how a
NaN at example 1 of the shard ``data=2, model=1`` is named as example 11 of the batch.

``site_layouts(program)`` walks the program to each ``shard_map`` and runs its body forward from
the ``in_specs`` on the one walk (``_walker``), one rule per primitive (``RULES``): entry-by-entry
operations, broadcasts, reshapes, transposes, reductions, ``dot_general``, convolutions, gathers,
slices, the collectives; the walk enters calls, scans and conds (a loop's carry to a fixed point).
An axis follows an operation only where each index keeps its identity along it (a ``cumsum`` or a
``rev`` along a split axis loses it); a primitive without a rule makes what it returns unknown,
unless every operand is whole (then so is its result).
"""

from __future__ import annotations

from typing import Callable

from . import _compat, _equation_params, _higher_order
from ._elementwise import ELEMENTWISE
from ._tag import is_tag
from ._walker import Walker

__all__ = ["RULES", "site_layouts"]

Layout = tuple  # per axis: a tuple of mesh axis names (() whole), or None (unknown)


def site_layouts(program) -> dict:
    """``{site key: (layout of the tagged value, in the program's layout, invariant axes)}`` for the
    tags inside a ``shard_map`` body; ``invariant``: the manual axes along which the value is the
    same on every shard (``check_vma``)."""
    found: dict = {}
    _find(program.jaxpr, found)
    return found


def _find(jaxpr, found: dict) -> None:
    jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
    for eqn in jaxpr.eqns:
        if _higher_order.kind(eqn) == _higher_order.SHARD_MAP:
            p = _equation_params.shard_map_params(eqn)
            ins = [_from_spec(spec, len(_shape(v)), p.axes) for spec, v in zip(p.in_specs, eqn.invars)]
            _Walk(found, p).forward(p.body, ins)
        else:
            for body in _higher_order.bodies(eqn):
                _find(body, found)


def _from_spec(spec, rank: int, manual: tuple) -> Layout:
    entries = tuple(spec) + (None,) * (rank - len(tuple(spec)))
    names = lambda e: () if e is None else tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in manual)  # noqa: E731
    return tuple(names(e) for e in entries[:rank])


def _shape(atom) -> tuple:
    return tuple(getattr(atom.aval, "shape", ()))


def _whole(atom) -> Layout:
    return ((),) * len(_shape(atom))


def _unknown(atom) -> Layout:
    return (None,) * len(_shape(atom))


def _combine(layouts) -> Layout:
    """The layout of a value computed entry by entry from values of these layouts (one shape); also
    of one value seen several times (a loop's carry from step to step, a tag called twice, a
    cond's branches): a whole axis agrees with a split one (the split one's blocks are what each
    shard holds), two different splits do not."""
    out = []
    for dims in zip(*layouts):
        split = {d for d in dims if d != ()}
        out.append(None if None in split or len(split) > 1 else split.pop() if split else ())
    return tuple(out)


class _Walk(Walker):
    """A shard_map body's layouts, forward: ``RULES`` per primitive (in ``equation``), calls, scans and
    conds entered (a loop's carries to a fixed point, their layouts joined by ``_combine``); the
    bodies of any other equation (a while loop: its tags hold the last iteration) walked with their
    layouts unknown, and its results unknown unless every operand is whole."""

    enters = frozenset({*_higher_order.CALL_LIKE, _higher_order.COND, _higher_order.SCAN})

    def __init__(self, found: dict, params):
        self.found, self.params = found, params

    def join(self, a, b):
        return b if a is None else a if b is None else _combine([a, b])

    def literal(self, atom):
        return _whole(atom)

    def constant(self, var):
        return _whole(var)

    def before(self, eqn, layouts: list, ctx: tuple):
        if is_tag(eqn):
            key = (eqn.params["name"], eqn.params["leaf"])
            varying = self.params.varying_axes(eqn.invars[0].aval)
            invariant = tuple(a for a in self.params.axes if a not in varying)
            seen = self.found.get(key)
            layout = layouts[0] if seen is None else _combine([seen[0], layouts[0]])
            self.found[key] = (layout, invariant)
        return None

    def into_loop(self, eqn, role: str, layout, ctx: tuple):
        if role != "xs":
            return layout
        return layout[1:] if layout[:1] == ((),) else (None,) * (len(layout) - 1)  # one step's slice

    def out_of_loop(self, eqn, role: str, layout, ctx: tuple):
        return ((), *layout) if role == "ys" else layout  # the steps stacked: every shard holds them all

    def equation(self, eqn, layouts: list, ctx: tuple) -> list:
        rule = RULES.get(eqn.primitive.name)
        out = rule(self, eqn, layouts) if rule is not None else None
        if out is not None:
            return out
        for body in _higher_order.bodies(eqn):
            jaxpr, _ = _compat.jaxpr_and_consts(body)
            self.forward(jaxpr, [_unknown(v) for v in jaxpr.invars], (*ctx, eqn))
        if all(d == () for layout in layouts for d in layout):
            return [_whole(v) for v in eqn.outvars]  # made of whole values: whole
        return [_unknown(v) for v in eqn.outvars]


# --- per-primitive rules: (walk, eqn, operand layouts) -> result layouts (None: no rule applies) ---

RULES: dict[str, Callable] = {}


def _rule(*names):
    def deco(rule):
        for name in names:
            RULES[name] = rule
        return rule

    return deco


@_rule(*ELEMENTWISE, "pvary", "pcast", "pbroadcast")
def _entrywise(walk, eqn, layouts):
    rank = len(_shape(eqn.outvars[0]))
    if len(eqn.outvars) > 1:  # optimization_barrier: each result is its operand
        return layouts if len(layouts) == len(eqn.outvars) else None
    same = [layout for layout, a in zip(layouts, eqn.invars) if len(_shape(a)) == rank]
    return [_combine(same) if same else ((),) * rank]


@_rule("broadcast_in_dim")
def _broadcast(walk, eqn, layouts):
    shape, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    result: list = [()] * len(out)
    for k, d in enumerate(eqn.params["broadcast_dimensions"]):
        result[d] = layouts[0][k] if shape[k] == out[d] or layouts[0][k] == () else None
    return [tuple(result)]


@_rule("reshape")
def _reshape(walk, eqn, layouts):
    """Axes group where the products of the leading sizes agree (size-1 axes aside); in a group, a
    split major axis stays the group's major axis (its blocks stay blocks) if the rest are whole."""
    a, b, layout = _shape(eqn.invars[0]), _shape(eqn.outvars[0]), layouts[0]
    lost = any(n == 1 and d != () for n, d in zip(a, layout))  # a split axis of one entry per shard
    result: list = [None if lost else ()] * len(b)
    ins = [k for k, n in enumerate(a) if n != 1]
    outs = [k for k, n in enumerate(b) if n != 1]
    before_a, before_b = _leading_products([a[k] for k in ins]), _leading_products([b[k] for k in outs])
    cuts = sorted(set(before_a) & set(before_b))
    for lo, hi in zip(cuts, cuts[1:]):
        group_in = [k for k, p in zip(ins, before_a) if lo <= p < hi]
        group_out = [k for k, p in zip(outs, before_b) if lo <= p < hi]
        split = [(k, layout[k]) for k in group_in if layout[k] != ()]
        for k in group_out:
            result[k] = ()
        if split:
            major = len(split) == 1 and split[0][0] == group_in[0] and split[0][1] is not None
            for k in group_out:
                result[k] = (split[0][1] if k == group_out[0] else ()) if major else None
    return [tuple(result)]


def _leading_products(shape: list) -> list:
    """The product of the sizes before each axis, and of all."""
    out, p = [], 1
    for n in shape:
        out.append(p)
        p *= n
    return out + [p]


@_rule("squeeze")
def _squeeze(walk, eqn, layouts):
    gone = {d % len(layouts[0]) for d in eqn.params["dimensions"]}
    return [tuple(d for i, d in enumerate(layouts[0]) if i not in gone)]


@_rule("transpose")
def _transpose(walk, eqn, layouts):
    return [tuple(layouts[0][p] for p in eqn.params["permutation"])]


@_rule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin")
def _reduce(walk, eqn, layouts):
    axes = set(eqn.params["axes"])
    return [tuple(d for i, d in enumerate(layouts[0]) if i not in axes)] * len(eqn.outvars)


@_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "rev")
def _along(walk, eqn, layouts):
    """Entries mixed (or moved) along some axes: a split one loses its index."""
    p = eqn.params
    axes = set(p["dimensions"]) if "dimensions" in p else {p["axis"] if "axis" in p else p["dimension"]}
    return [tuple(None if i in axes and d != () else d for i, d in enumerate(layout)) for layout in layouts][: len(eqn.outvars)]


@_rule("dot_general")
def _dot(walk, eqn, layouts):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = layouts
    batch = [_combine([(lhs[i],), (rhs[j],)])[0] for i, j in zip(lb, rb)]
    free_l = [d for i, d in enumerate(lhs) if i not in lc and i not in lb]
    free_r = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
    return [(*batch, *free_l, *free_r)]


@_rule("conv_general_dilated")
def _conv(walk, eqn, layouts):
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs = layouts
    if eqn.params.get("batch_group_count", 1) != 1 or any(lhs[d] != () for d in lhs_spec[2:]):
        return None
    result: list = [()] * len(out_spec)
    result[out_spec[0]] = lhs[lhs_spec[0]]
    result[out_spec[1]] = rhs[rhs_spec[0]]
    return [tuple(result)]


@_rule("gather")
def _gather(walk, eqn, layouts):
    """An embedding lookup: the batch axes of the indices, and the operand's axes taken whole."""
    operand, indices = layouts
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    if getattr(dn, "operand_batching_dims", ()):
        return None
    out_rank = len(_shape(eqn.outvars[0]))
    taken = [i for i in range(len(operand)) if i not in dn.collapsed_slice_dims]
    batch = list(indices[:-1])  # the last axis of the indices is the index vector
    result = []
    for k in range(out_rank):
        if k in dn.offset_dims:
            i = taken[list(dn.offset_dims).index(k)]
            whole = sizes[i] == _shape(eqn.invars[0])[i]
            result.append(operand[i] if whole or operand[i] == () else None)
        else:
            result.append(batch.pop(0) if batch else None)
    return [tuple(result)]


@_rule("concatenate")
def _concatenate(walk, eqn, layouts):
    axis = eqn.params["dimension"]
    out = list(_combine(layouts))
    out[axis] = () if all(layout[axis] == () for layout in layouts) else None
    return [tuple(out)]


@_rule("pad", "slice", "dynamic_slice", "dynamic_update_slice")
def _cut(walk, eqn, layouts):
    """An axis that keeps its size keeps its layout; a split one that is cut or padded loses it."""
    shape, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    base = layouts[0]
    if eqn.primitive.name == "dynamic_update_slice":
        update = _shape(eqn.invars[1])
        base = tuple(_combine([(d,), (u,)])[0] if n == m else d for d, u, n, m in zip(base, layouts[1], shape, update))
    return [tuple(d if n == m or d == () else None for d, n, m in zip(base, shape, out))]


@_rule("psum", "psum2", "psum_invariant", "pmax", "pmin", "pmax_invariant", "pmin_invariant", "ppermute", "all_to_all")
def _collective(walk, eqn, layouts):
    """Shards combined (or moved) along mesh axes: an array axis split over them loses its index."""
    names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    names = set(names if isinstance(names, (tuple, list)) else (names,))
    return [tuple(None if d is None or names & set(d) else d for d in layout) for layout in layouts][: len(eqn.outvars)]


@_rule("all_gather", "all_gather_invariant")
def _all_gather(walk, eqn, layouts):
    p = eqn.params
    names = p["axis_name"] if isinstance(p["axis_name"], tuple) else (p["axis_name"],)
    axis, layout = p["all_gather_dimension"], list(layouts[0])
    if p.get("tiled", False):
        layout[axis] = () if layout[axis] == tuple(names) else None
    else:
        layout.insert(axis, ())
    return [tuple(None if d is None or set(names) & set(d) else d for d in layout)]


@_rule("axis_index", "iota")
def _made(walk, eqn, layouts):
    return [_whole(v) for v in eqn.outvars]


