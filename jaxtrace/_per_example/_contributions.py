"""What contributes to a leaf's gradient, one record each, and the factors each gives from the pass.

A leaf's per-example gradient is the sum of its contributions: the calls of a covered layer that
multiplies it (``LayerCalls``), a read of it by one primitive outside its layers (``LeafRead``,
``_reads``), or the leaf used as it is where every use meets the examples (``WholeLeaf``: ``h + b``,
a whole position table). Each record holds the names of the tags the pass puts on it and, where its
value is shared by every example, the places it meets them (``Meeting``); from what the pass
recorded at those tags (``Recorded``) its ``uses`` are the leaf's factors (``_factors.Use``,
``_conv.ConvUse`` or ``_factors.PerStep``), or ``Reasons`` gets why there are none. ``cut`` says
which part of the leaf's flow through the program those factors hold (``_uses.used_outside``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .. import _compat, _higher_order
from .._module_tags import INPUT_SUFFIX
from ._factors import Loop, PerStep, Use, examples_first, over_loops, with_rows
from ._leaf_sums import step_module
from ._meetings import shared_gradient
from ._owners import Every
from ._plan import Layer

__all__ = ["Cut", "LayerCalls", "LeafRead", "Meeting", "Reasons", "Recorded", "WholeLeaf", "compute_dtype"]


def compute_dtype(dtype):
    """The dtype a leaf's per-example results are computed in: at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Meeting:
    """A value shared by every example meeting them at ``use`` (a ``_proof.SharedUse``): the pass tags
    its broadcast there ``tag``, whose cotangent gives each example's gradient (``shared_gradient``)."""

    tag: str
    use: Any


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What the pass recorded: each tag's ``values`` and ``grads`` (of ``sum(losses)``), by tag name,
    and what reading them needs: the ``proof``, the ``batch`` size, each leaf's compute ``dtypes``."""

    values: dict
    grads: dict
    proof: Any
    batch: int
    dtypes: list

    def at_meetings(self, meetings: tuple, n_loops: int = 0):
        """Each example's gradient at a shared value from its ``meetings``' cotangents, ``(B, *shape)``
        (in ``n_loops`` scans: one per step, the steps' axes first)."""
        proof, batch = self.proof, self.batch
        return sum(
            _over_steps(lambda c, u=m.use: shared_gradient(c, u, proof, batch), n_loops)(self.grads[m.tag]) for m in meetings
        )


@dataclasses.dataclass(frozen=True)
class Cut:
    """Where the factors found hold a leaf's flow through the program (``_uses.used_outside``'s
    arguments): ``owned``, ``{layer path: its leaves on factors}``; ``reads``, ``{(ids of the calls
    that hold a read, id of its equation): (operand, leaf)}``; ``whole``, leaves every use of which
    meets the examples."""

    owned: dict = dataclasses.field(default_factory=dict)
    reads: dict = dataclasses.field(default_factory=dict)
    whole: frozenset = frozenset()

    def __or__(self, other: "Cut") -> "Cut":
        owned = dict(self.owned)
        for path, leaves in other.owned.items():
            owned[path] = owned.get(path, set()) | leaves
        return Cut(owned, self.reads | other.reads, self.whole | other.whole)


class Reasons:
    """Why a leaf is not on factors, as its contributions say it: a layer's word on its leaves (the last
    one stands) and a read's (the first stands; an unproven read's, given at the start, before any)."""

    def __init__(self, reads: Optional[dict] = None):
        self.layer: dict = {}
        self.read: dict = dict(reads or {})

    def at_layer(self, leaf: int, why: str) -> None:
        self.layer[leaf] = why

    def at_read(self, leaf: int, why: str) -> None:
        self.read.setdefault(leaf, why)


@dataclasses.dataclass(frozen=True)
class LayerCalls:
    """A covered layer's calls: ``groups`` (``_groups.Group``s, the calls of one layout each, each one
    stacked tag ``group.name``, its input ``group.name + ":in"``), the places its output meets the
    examples where that output is shared by every example (``meetings``), and ``why`` none of its
    leaves is on factors (called inside a function with a custom derivative rule; groups the pass
    cannot tell apart), else None."""

    layer: Layer
    groups: tuple
    meetings: tuple
    why: Optional[str] = None

    @property
    def tags(self) -> set:
        return {n for g in self.groups for n in (g.name, g.name + INPUT_SUFFIX)} | {m.tag for m in self.meetings}

    def cut(self, leaves: set) -> Cut:
        return Cut(owned={self.layer.path: set(leaves)}) if leaves else Cut()

    def uses(self, rec: Recorded, why: Reasons) -> dict:
        """``{leaf: [a use per group]}`` for each of the layer's leaves that is on factors in every
        group of its calls; ``why`` gets the reason for the others."""
        layer = self.layer
        if self.why is not None:
            for i in layer.leaves.values():
                why.at_layer(i, self.why)
            return {}
        occs = rec.proof.occurrences.get(layer.path, [])
        if not layer.leaves or not occs or not self.groups or any(g.name not in rec.grads for g in self.groups):
            return {}  # never called: its leaves are zero unless used elsewhere
        origins = {}  # attribute -> _proof.Origin: the leaf (or one scan step's slice of it) it multiplies
        for attr, i in layer.leaves.items():
            found = {occ.params.get(attr) for occ in occs}
            origin = found.pop() if len(found) == 1 else None
            if origin is None:
                why.at_layer(i, f"its layer {layer.path!r} multiplies a value computed from it, not the leaf itself")
                continue
            origins[attr] = origin
        per_group = [self._group_uses(origins, group, rec, why) for group in self.groups]
        return {
            origin.leaf: [uses[attr] for uses in per_group]
            for attr, origin in origins.items()
            if all(uses.get(attr) is not None for uses in per_group)
        }

    def _inputs(self, group, rec: Recorded):
        """``((x, g, (axis, inner)), None)``: the input and output gradient of the calls in ``group``, the
        examples located; or ``(None, why not)``."""
        layer, proof, batch = self.layer, rec.proof, rec.batch
        x, g = rec.values.get(group.name + INPUT_SUFFIX), rec.grads.get(group.name)
        if not isinstance(x, jax.Array) or not isinstance(g, jax.Array):
            return None, "its input or output is not one array"
        if self.meetings:
            occs = proof.occurrences[layer.path]
            if len(occs) != 1:
                return None, "a layer applied to a value shared by every example is called once only"
            # each example's gradient in the program's layout of the output; ``x`` and ``g`` have the
            # vmap axes first (an eqx.nn.Linear without bias under jax.vmap: (features, T) against (T, features))
            g = jnp.transpose(rec.at_meetings(self.meetings), (0, *(1 + a for a in occs[0].order)))
            return (jnp.broadcast_to(x, (batch, *x.shape)), g, (0, 1)), None
        where = proof.example_axis(group.occurrences, g.ndim, batch)
        if where is not None:
            return (x, g, where), None
        every = next((occ.out for occ in reversed(group.occurrences) if isinstance(occ.out, Every)), None)
        eqn = every.eqn if isinstance(every, Every) else None
        if eqn is not None and _higher_order.kind(eqn) == _higher_order.CUSTOM:
            return None, (
                f"its output's gradient comes through a custom derivative rule ({_compat.construct(eqn)}) "
                "that is not proven to keep each example's cotangent to that example"
            )
        return None, "its output reaches several examples' losses" + (f" ({_compat.construct(eqn)})" if eqn is not None else "")

    def _group_uses(self, origins: dict, group, rec: Recorded, why: Reasons) -> dict:
        """``{attribute: Use or PerStep}`` of the calls in ``group``, for the attributes ``origins``
        names; ``why`` gets the reason for those it gives none."""
        layer = self.layer
        got, reason = self._inputs(group, rec)
        if got is None:
            for origin in origins.values():
                why.at_layer(origin.leaf, f"at its layer {layer.path!r}: {reason}")
            return {}
        x, g, (axis, inner) = got
        ri, ro = layer.rule.ranks(layer.module)
        n_lead = x.ndim - ri
        if n_lead < 1 or g.ndim - ro != n_lead or x.shape[:n_lead] != g.shape[:n_lead] or axis >= n_lead:
            for origin in origins.values():
                why.at_layer(origin.leaf, f"its layer {layer.path!r} is called with inputs of unexpected shapes")
            return {}
        stepped = {a for a, origin in origins.items() if origin.stepped}
        dt = functools.reduce(jnp.promote_types, [rec.dtypes[o.leaf] for o in origins.values()], compute_dtype(g.dtype))
        xf = x if not jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(dt)
        per_step = self._stepped_uses(origins, stepped, group, xf, g, (axis, inner, n_lead), dt, why) if stepped else {}
        if per_step is None:
            return {}
        factors = {}
        if set(origins) - stepped:
            gf = g.astype(dt)
            xb, gb = examples_first(xf, axis, inner, n_lead), examples_first(gf, axis, inner, n_lead)
            factors = layer.rule.factors(layer.module, xb, gb)
            if n_lead == 1:  # one (B * K, d) array each: the weighted sum reads them, not their views
                factors = with_rows(factors, [(v, f) for v, f in ((xb, xf), (gb, gf)) if f.ndim == 2])
        return {attr: per_step.get(attr) if attr in stepped else factors.get(attr) for attr in origins}

    def _stepped_uses(self, origins: dict, stepped: set, group, xf, g, where: tuple, dt, why: Reasons) -> Optional[dict]:
        """``{attribute: PerStep or None}`` for the ``stepped`` attributes (each call multiplies one scan
        step's slice of the leaf): the rule's factors at each step, mapped over the loops around the calls;
        ``None`` (no factors from the group) where those loops are not one stack's."""
        layer, (axis, inner, n_lead) = self.layer, where
        loops = _stepped_loops(list(group.occurrences), {origins[a].depth for a in stepped}, axis)
        if loops is None:
            for a in stepped:
                why.at_layer(
                    origins[a].leaf,
                    f"its layer {layer.path!r} is stacked and called in different loops, or its stack is sliced by two nested scans",
                )
            return None
        n, module = len(loops), step_module(layer.module, xf.shape[loops.index(Loop.STEPPED)])
        step = lambda v: examples_first(v, axis - n, inner, n_lead - n)  # noqa: E731
        per_step = over_loops(
            lambda xs, gs: {a: f for a, f in layer.rule.factors(module, step(xs), step(gs.astype(dt))).items() if a in stepped},
            loops, xf, g,
        )
        for a in stepped:
            per_step.setdefault(a, None)
            if per_step[a] is None:
                why.at_layer(
                    origins[a].leaf,
                    f"its layer {layer.path!r} is stacked in a scan and called in a loop nested in it, which its rule does not cover",
                )
        return per_step


@dataclasses.dataclass(frozen=True)
class LeafRead:
    """A proven read of a leaf by one primitive outside its layers (``_reads.Read``): the pass tags its
    output ``name`` and its recorded operand ``name + ":in"``; where its output is shared by every
    example, it is tagged where it meets them (``meetings``) instead, and where it adds up with other
    reads' outputs, their sum is (``grad_tag``, ``_read_tags``)."""

    name: str
    read: Any
    meetings: tuple = ()
    grad_tag: Optional[str] = None  # the tag whose gradient is its output's, where not ``name`` (``_read_tags``)

    @property
    def tags(self) -> set:
        return {self.grad_tag or self.name, self.name + INPUT_SUFFIX} | {m.tag for m in self.meetings}

    def cut(self, leaves: set) -> Cut:
        read = self.read
        return Cut(reads={(*map(id, read.ctx), id(read.eqn)): (read.operand, read.leaf)}) if leaves else Cut()

    def uses(self, rec: Recorded, why: Reasons) -> dict:
        """``{leaf: [its Use]}`` (in scans: one value per step, per scan), or ``{}`` and ``why`` gets why not."""
        read, i = self.read, self.read.leaf
        x = rec.values.get(self.name + INPUT_SUFFIX) if read.other is not None else None
        use = None
        if self.meetings:  # each example's gradient where the shared output meets it (in scans: one per step)
            g = rec.at_meetings(self.meetings, len(read.loops))
            dt = jnp.promote_types(rec.dtypes[i], compute_dtype(g.dtype))
            use = over_loops(lambda xs, gs: read.shared_factors(xs, gs, dt), read.loops, x, g)
        elif read.other is None or isinstance(x, jax.Array):
            g = rec.grads.get(self.grad_tag or self.name)
            if isinstance(g, jax.Array):
                axis, inner = rec.proof.axis_at(read.eqn.outvars[0], rec.batch, read.ctx)
                dt = jnp.promote_types(rec.dtypes[i], compute_dtype(g.dtype))
                use = over_loops(lambda xs, gs: read.factors(xs, gs, axis, inner, dt), read.loops, x, g)
        if use is None:
            why.at_read(i, f"its read {_compat.construct(read.eqn)} does not keep the examples on its own axes")
            return {}
        return {i: [use]}


@dataclasses.dataclass(frozen=True)
class WholeLeaf:
    """A leaf used as it is where every use meets the examples (``h + b``; a whole position table
    ``wpe[:T]``, ``T`` its length): each example's gradient is the cotangent of its broadcast at the
    ``meetings``. ``loops``: the scans around those uses (``Loop``s, outermost first; none at the
    top level): ``h + b[l]`` in a scan over ``b``, ``h + b`` in a scan whose body closes over ``b``.
    ``name`` names its meetings' tags."""

    name: str
    leaf: int
    meetings: tuple
    loops: tuple = ()

    @property
    def tags(self) -> set:
        return {m.tag for m in self.meetings}

    def cut(self, leaves: set) -> Cut:
        return Cut(whole=frozenset({self.leaf}))

    def uses(self, rec: Recorded, why: Reasons) -> dict:
        """``{leaf: [its Use]}``: a ``PerStep`` where a scan slices it (each step's own slice)."""
        loops, dtype = self.loops, rec.dtypes[self.leaf]
        g = rec.at_meetings(self.meetings, len(loops))  # in scans: one cotangent per step, per scan
        # the whole leaf at every step of a scan that closes over it: each example's gradient sums over those steps
        g = g.sum(tuple(k for k, loop in enumerate(loops) if loop == Loop.REPEATED))
        if Loop.STEPPED in loops:
            return {self.leaf: [PerStep(Use(g.reshape(g.shape[0], rec.batch, 1, -1).astype(dtype), None))]}
        return {self.leaf: [Use(g.reshape(rec.batch, 1, -1).astype(dtype), None)]}


def _stepped_loops(occs, depths: set, axis: int) -> Optional[tuple]:
    """The loops around a stacked layer's calls, outermost first: ``Loop.STEPPED``, the scan that slices
    the stack (at ``depths``' one depth), and ``Loop.REPEATED``, a scan that closes over it; ``None``
    unless every call is in the same loops (called twice a step: positions side by side), one scan
    slices the stack and the examples are not on a loop's axis (``axis``, in the stacked values)."""
    n = occs[0].steps
    if n < 1 or axis < n or len(depths) != 1 or len({tuple(map(id, occ.ctx)) for occ in occs}) != 1:
        return None
    (depth,) = depths
    return tuple(Loop.STEPPED if k == depth else Loop.REPEATED for k in range(n))


def _over_steps(f, n: int):
    """``f`` mapped over ``n`` leading (loop) axes."""
    for _ in range(n):
        f = jax.vmap(f)
    return f
