"""Leaves read by one primitive outside any layer: ``table[ids]``, ``table[:n]``, ``W[i]``, ``h @ W.T``.

A ported model often reads a parameter without calling its module: GPT-2's token table as
``wte.weight[ids]``, its position table as ``wpe.weight[:T]`` and its tied head as
``h @ wte.weight.T``; NNX's ``LinearGeneral`` reads its kernel by one ``dot_general``. Each
such read is a layer of its own, with the same factors: a row gather is an embedding (the ids
against the output gradient), a product with the leaf contracted on its leading or trailing
axes a linear layer (the other operand against the output gradient), a slice of rows an
embedding of fixed ids, one row by a traced index (``self.w[i]`` in a ``lax.fori_loop`` over
stacked layers) an embedding of one id every example shares. ``READS`` maps a primitive's name to its rules (tried in order): whether an equation is such a
read (``match``) and, from the other operand and the output gradient the pass records there,
the leaf's factors (``factors``; ``shared`` where the read's output is shared by every
example, as ``wpe.weight[:T]`` inside ``jax.vmap(model)`` is, and meets them later).

``find_reads`` looks at the program's top level and into the ``jit`` and ``checkpoint``
bodies it calls (``jnp.take`` and ``jnp.einsum`` are such bodies), where the leaf is the
program's own input or its ``transpose``, outside the covered layers' calls; and into the
body of a ``lax.scan``: of one step's slice where the scan runs over a leaf's leading axis
(layers stacked as arrays ``(L, ...)``; ``stepped``: each slice is a parameter of its own,
with its own factors), or of a whole leaf the body closes over (a recurrent weight;
``repeated``: each step's factors are more positions of the one leaf's); and so on into nested
scans (recurrent layers stacked in a scan over layers: each layer's slice read at every time
step), a leaf stepped by one of them at most. A read in a ``while`` loop, a branch or a custom
rule's body is not listed, and its leaf keeps the exact path. The
pass then proves, as for a layer, that each position of the read's output reaches one
example's loss (a shared output: that the proof finds where it meets the examples, at the
top level), and cuts the read out of the leaf's other uses (``_uses``): a leaf also used in
any other way keeps the exact path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from .. import _higher_order
from .._tag import is_tag
from .._walker import Walker
from ._factors import Index, Loop, Use, examples_first

__all__ = ["READS", "Read", "find_reads"]


@dataclasses.dataclass(frozen=True)
class Read:
    """One equation ``eqn`` reading leaf ``leaf`` as operand ``operand`` (through a ``transpose``
    where ``transposed``), at the top level or in the calls ``ctx``; ``other`` is the operand the
    pass records beside the output gradient (the ids of a gather, the activations of a product)."""

    eqn: Any
    leaf: int
    operand: int
    transposed: bool
    rule: "ReadRule"
    ctx: tuple = ()  # the jit, checkpoint and scan equations that hold it, outermost first
    # per scan in ``ctx``, outermost first: ``Loop.STEPPED`` (a scan over the leaf's leading axis; its body reads
    # one step's slice) or ``Loop.REPEATED`` (the scan's body closes over it and reads it at every step)
    loops: tuple = ()

    @property
    def other(self) -> Optional[int]:
        """The operand recorded beside the output gradient (``None``: the leaf is the only one)."""
        return None if len(self.eqn.invars) == 1 else 1 - self.operand

    def factors(self, x, g, axis: int, inner: int, dtype) -> Optional[Use]:
        """The leaf's ``Use`` from the recorded operand ``x`` and output gradient ``g`` (examples on
        output axis ``axis``, each ``inner`` long); ``None`` where the examples are not on an axis
        the factors can keep apart."""
        return None if self.rule.factors is None else self.rule.factors(self, x, g, axis, inner, dtype)

    def shared_factors(self, x, g, dtype) -> Optional[Use]:
        """The leaf's ``Use`` where the read's output is shared by every example (``wpe[:T]`` inside
        ``jax.vmap(model)``): ``g`` is each example's gradient there, ``(B, *output)``, and ``x`` the
        recorded operand, shared too; ``None`` where the rule has no such case."""
        return None if self.rule.shared is None else self.rule.shared(self, x, g, dtype)


@dataclasses.dataclass(frozen=True)
class ReadRule:
    """``match(eqn, operand, leaf_shape) -> bool``: operand ``operand`` (a 2-D or larger leaf, as the
    equation sees it) is read as this rule covers; ``factors``, ``shared``: as ``Read.factors`` and
    ``Read.shared_factors`` (``None``: not covered)."""

    match: Callable[[Any, int, tuple], bool]
    factors: Optional[Callable[..., Optional[Use]]]
    shared: Optional[Callable[..., Optional[Use]]] = None
    transposable: bool = False  # it reads a matrix's transpose too (a product; rows of ``W.T`` are not rows)


READS: dict[str, tuple[ReadRule, ...]] = {}  # a primitive's rules, tried in order: the first that matches reads it


def _register(name: str, rule: ReadRule) -> None:
    READS[name] = (*READS.get(name, ()), rule)


def find_reads(jaxpr, n_leaves: int, inputs: dict) -> list[Read]:
    """The reads of leaves (``jaxpr``'s first ``n_leaves`` invars) by equations of the top level or of
    the ``jit`` and ``checkpoint`` bodies it calls (``jnp.take`` and ``jnp.einsum`` are such bodies),
    and of one step's slice in the body of a ``lax.scan`` over a leaf, in program order, outside
    the calls of the covered layers (their rules hold what those read), each from the tag of its input
    (``inputs``: that tag's name -> the layer's path, from ``Plan.roles``) to its output's."""
    finder = _Finder(inputs)
    finder.forward(jaxpr, [(i, False, ()) for i in range(n_leaves)] + [None] * (len(jaxpr.invars) - n_leaves))
    return finder.found


class _Finder(Walker):
    """The walk that finds reads. A value is ``(leaf, transposed, loops)``, the leaf itself or seen
    through ``_VIEWS`` (``loops``: per scan around it, as ``Read.loops``), or None. Calls and scans
    are entered (their bodies walked once), nothing else; no value flows out of a body."""

    enters = frozenset({_higher_order.CALL, _higher_order.REMAT, _higher_order.SCAN})
    fixed_point = False

    def __init__(self, inputs: dict):
        self.inputs, self.found = inputs, []
        self.open_calls: dict = {}  # ctx -> the covered layers whose call the walk of that body is in

    def before(self, eqn, ins: list, ctx: tuple):
        open_calls = self.open_calls.setdefault(ctx, [])
        if is_tag(eqn):  # a covered layer's call runs from its input's tag to its output's
            name = eqn.params["name"]
            if name in self.inputs:
                open_calls.append(self.inputs[name])
            elif open_calls and name == open_calls[-1]:
                open_calls.pop()
            return [None] * len(eqn.outvars)
        return [None] * len(eqn.outvars) if open_calls else None

    def enter(self, eqn, ins: list, ctx: tuple) -> bool:
        return super().enter(eqn, ins, ctx) and any(x is not None for x in ins)

    def into_loop(self, eqn, role: str, value, ctx: tuple):
        """A ``lax.scan`` (forward or reversed: the tags in its body stack their values in the order of
        ``xs``, as its ``ys`` do): leaves among its ``xs`` (not transposed, not a slice already) are read
        one step's slice at a time in its body, leaves among its consts whole at every step."""
        if value is None or role == "carry":
            return None
        leaf, transposed, loops = value
        if role == "const":
            return (leaf, transposed, (*loops, Loop.REPEATED))
        return None if transposed or Loop.STEPPED in loops else (leaf, False, (*loops, Loop.STEPPED))

    def out_of_body(self, eqn, value, ctx: tuple):
        return None

    def equation(self, eqn, ins: list, ctx: tuple) -> list:
        outs = [None] * len(eqn.outvars)
        name = eqn.primitive.name
        view = _VIEWS.get(name)
        if view is not None:
            flips = view(eqn) if len(ins) == 1 and ins[0] is not None else None
            if flips is not None:
                leaf, t, loops = ins[0]
                outs[0] = (leaf, t != flips, loops)
            return outs
        for rule in READS.get(name, ()):
            for k, x in enumerate(ins):
                if x is None or (x[1] and not rule.transposable):
                    continue
                others = [y for j, y in enumerate(ins) if j != k]
                if rule.match(eqn, k, tuple(eqn.invars[k].aval.shape)) and all(y is None for y in others):
                    leaf, t, loops = x
                    self.found.append(Read(eqn, leaf, k, t, rule, ctx, loops))
                    return outs
        return outs


def _transpose_view(eqn) -> Optional[bool]:
    return True if tuple(eqn.params["permutation"]) == (1, 0) else None


def _convert_view(eqn) -> Optional[bool]:
    """A cast between floating dtypes (mixed precision: ``W.astype(jnp.bfloat16)``): its pullback casts back."""
    src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    return False if jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating) else None


# The views of a leaf a read may see it through: primitive -> (eqn -> whether it transposes a
# matrix, or None where it is not such a view).
_VIEWS = {"transpose": _transpose_view, "convert_element_type": _convert_view}


# --- dot_general: h @ W, h @ W.T, W @ h, jnp.einsum, nnx.LinearGeneral ------------------------------


def _leaf_contract(shape, dims) -> Optional[bool]:
    """Whether the leaf's contracted axes ``dims`` are its leading axes (``True``) or its trailing ones
    (``False``), each block in order; ``None`` where they are interleaved with its free axes."""
    n, dims = len(shape), tuple(int(d) for d in dims)
    if not dims or len(dims) == n:
        return None
    if tuple(sorted(dims)) == tuple(range(len(dims))):
        return True
    if tuple(sorted(dims)) == tuple(range(n - len(dims), n)):
        return False
    return None


def _dot_match(eqn, k, shape) -> bool:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return len(shape) >= 2 and not lb and not rb and _leaf_contract(shape, (lc, rc)[k]) is not None


def _dot_factors(read, x, g, axis, inner, dtype) -> Optional[Use]:
    """``y = contract(x, M)`` over some axes of ``M`` (the leaf, or a matrix's transpose): the leaf's
    gradient is ``sum_k x_k (x) g_k`` over the positions ``k`` of ``x``'s free axes, ``x_k`` its
    contracted axes flattened in the leaf's order, ``g_k`` the leaf's free axes; laid out as the leaf
    is (contracted axes first, or last)."""
    (lc, rc), _ = read.eqn.params["dimension_numbers"]
    leaf_dims, x_dims = (lc, rc)[read.operand], (lc, rc)[read.other]
    shape = read.eqn.invars[read.operand].aval.shape
    leading = _leaf_contract(shape, leaf_dims)
    pairs = sorted(zip((int(d) for d in leaf_dims), (int(d) for d in x_dims)))  # in the leaf's axis order
    free, n_free_leaf = x.ndim - len(pairs), len(shape) - len(pairs)
    # the output: lhs's free axes, then rhs's
    lead_at = 0 if read.other == 0 else n_free_leaf
    if not lead_at <= axis < lead_at + free:
        return None
    xv = jnp.moveaxis(x, [d for _, d in pairs], list(range(free, x.ndim)))
    xv = xv.reshape(*xv.shape[:free], -1).astype(dtype)  # (F..., prod contracted)
    leaf_out = list(range(g.ndim - n_free_leaf, g.ndim)) if read.other == 0 else list(range(n_free_leaf))
    gv = jnp.moveaxis(g, leaf_out, list(range(free, g.ndim)))
    gv = gv.reshape(*gv.shape[:free], -1).astype(dtype)  # (F..., prod free of the leaf)
    xb, gb = (examples_first(v, axis - lead_at, inner, free) for v in (xv, gv))
    if read.transposed:  # a matrix seen through its transpose
        leading = not leading
    return Use(xb, gb, out="b") if leading else Use(gb, xb)


_register("dot_general", ReadRule(_dot_match, _dot_factors, transposable=True))


# --- gather: table[ids] --------------------------------------------------------------------------


def _gather_match(eqn, k, shape) -> bool:
    if k != 0:
        return False
    d = eqn.params["dimension_numbers"]
    n_out = len(eqn.outvars[0].aval.shape)
    rest = len(shape) - 1
    return (
        tuple(d.collapsed_slice_dims) == (0,)
        and tuple(d.start_index_map) == (0,)
        and not tuple(getattr(d, "operand_batching_dims", ()))
        and tuple(eqn.params["slice_sizes"]) == (1, *shape[1:])
        and tuple(d.offset_dims) == tuple(range(n_out - rest, n_out))
        and eqn.invars[1].aval.shape[-1:] == (1,)
    )


def _gather_factors(read, ids, g, axis, inner, dtype) -> Optional[Use]:
    """The selected rows (a one-hot ``Index``) against the output gradient; ids out of range are
    clamped (``"clip"``, ``"promise_in_bounds"``) or get no gradient (``"fill"``), as the gather does."""
    size = read.eqn.invars[0].aval.shape[0]
    ids = ids[..., 0]
    lead = ids.ndim
    if axis >= lead:
        return None
    g = g.astype(dtype)
    if read.eqn.params.get("mode") == jax.lax.GatherScatterMode.FILL_OR_DROP:
        inside = (ids >= 0) & (ids < size)
        g = g * inside.reshape(*inside.shape, *(1,) * (g.ndim - lead)).astype(dtype)
    ids = jnp.clip(ids, 0, size - 1)
    gv = g.reshape(*g.shape[:lead], math.prod(g.shape[lead:]))
    return Use(Index(_flat_ids(ids, axis, inner), size), examples_first(gv, axis, inner, lead))


def _flat_ids(ids, axis, inner):
    """Ids ``(F...)`` with the examples on ``axis`` -> ``(B, L)``."""
    return examples_first(ids[..., None], axis, inner, ids.ndim)[..., 0]


def _gather_shared(read, ids, g, dtype) -> Optional[Use]:
    """Ids shared by every example (``table[jnp.arange(T)]`` inside ``jax.vmap(model)``)."""
    return _gather_factors(read, jnp.broadcast_to(ids, (g.shape[0], *ids.shape)), g, 0, 1, dtype)


_register("gather", ReadRule(_gather_match, _gather_factors, _gather_shared))


def _row_gather_match(eqn, k, shape) -> bool:
    """``W[i]`` by a traced index as JAX 0.12.1 writes it: a gather of one row at a start index per axis
    (the index vector ``(i, 0, ...)``, no axis collapsed), which earlier releases wrote as ``dynamic_slice``."""
    d, n = eqn.params["dimension_numbers"], len(shape)
    return (
        k == 0
        and n >= 1
        and not tuple(d.collapsed_slice_dims)
        and tuple(d.start_index_map) == tuple(range(n))
        and not tuple(getattr(d, "operand_batching_dims", ()))
        and tuple(d.offset_dims) == tuple(range(n))
        and tuple(eqn.params["slice_sizes"]) == (1, *shape[1:])
        and tuple(eqn.invars[1].aval.shape) == (n,)
    )


def _row_gather_shared(read, start, g, dtype) -> Optional[Use]:
    """``dynamic_slice``'s row by a shared index, from the gather's index vector ``start``: clamped
    (``"clip"``, ``jnp``'s mode for ``W[i]``), or under ``"fill"`` a start out of range drops the row, which
    then has no gradient."""
    if read.eqn.params.get("mode") == jax.lax.GatherScatterMode.FILL_OR_DROP:
        room = jnp.asarray(read.eqn.invars[0].aval.shape) - jnp.asarray(read.eqn.params["slice_sizes"])
        g = g * jnp.all((start >= 0) & (start <= room)).astype(g.dtype)
    return _dynamic_slice_shared(read, start[0], g, dtype)


_register("gather", ReadRule(_row_gather_match, None, _row_gather_shared))


# --- slice: table[:T] ----------------------------------------------------------------------------


def _slice_match(eqn, k, shape) -> bool:
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"] or (1,) * len(shape)
    return len(shape) >= 1 and all(
        (s, l, st) == (0, n, 1) for s, l, st, n in zip(start[1:], limit[1:], strides[1:], shape[1:])
    )


def _slice_shared(read, _, g, dtype) -> Optional[Use]:
    """Rows ``start, start + stride, ...`` of the leaf, shared by every example (``wpe.weight[:T]``
    inside ``jax.vmap(model)``): those rows against each example's output gradient."""
    size = read.eqn.invars[0].aval.shape[0]
    start, stride = read.eqn.params["start_indices"][0], (read.eqn.params["strides"] or (1,))[0]
    b, n = g.shape[:2]
    rows = jnp.broadcast_to(start + stride * jnp.arange(n), (b, n))
    return Use(Index(rows, size), g.reshape(b, n, -1).astype(dtype))


_register("slice", ReadRule(_slice_match, None, _slice_shared))


# --- dynamic_slice: W[i] by a traced index (lax.fori_loop over stacked layers) ------------------------


def _dynamic_slice_match(eqn, k, shape) -> bool:
    return k == 0 and len(shape) >= 1 and tuple(eqn.params["slice_sizes"]) == (1, *shape[1:])


def _dynamic_slice_shared(read, start, g, dtype) -> Optional[Use]:
    """Row ``start`` of the leaf, picked by an index every example shares (``self.w[i]`` in the body of
    a ``lax.fori_loop`` over stacked layers): that row against each example's output gradient. The
    start is clamped into range, as ``dynamic_slice`` does."""
    if not isinstance(start, jax.Array):
        return None
    size, b = read.eqn.invars[0].aval.shape[0], g.shape[0]
    rows = jnp.broadcast_to(jnp.clip(start, 0, size - 1), (b, 1))
    return Use(Index(rows, size), g.reshape(b, 1, -1).astype(dtype))


_register("dynamic_slice", ReadRule(_dynamic_slice_match, None, _dynamic_slice_shared))
