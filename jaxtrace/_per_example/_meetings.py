"""Where a value shared by every example meets the examples: a tag there, and each example's gradient back.

A position table, a layer applied to ``arange(T)``'s embedding, a bias added as it is: one value
that every example reads. Its gradient is the sum of the examples', so the tag that gives each
example's own has to sit where the value meets the examples (``_proof.shared_uses`` finds those
places). ``Replay`` runs the traced program again with that tag at each meeting, broadcast to
the examples' shape (in a matrix product: the shared operand copied along a new batch axis;
where a broadcast itself lays the value along the examples' axis, its output), and a tag at each read the read rules (``_reads``) cover. ``shared_gradient`` turns the
cotangent of such a broadcast back into each example's gradient at the shared value.

Example (the program of ``h + b``, ``b`` shared, meets the examples at the ``add``)::

    replay = Replay(jaxpr, consts, out_tree, proof, batch, {"b:whole": [("b:whole:shared:0", use)]}, {})
    out = replay(leaves)  # as the program, with the tag "b:whole:shared:0" on the broadcast b
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .. import _compat
from .._module_tags import INPUT_SUFFIX
from .._fused_runs import bind_equation
from .._tag import scoped, tag as _tag
from .._walker import Walker
from ._read_tags import ReadTags

__all__ = ["Replay", "shared_gradient"]


@dataclasses.dataclass(frozen=True)
class Replay:
    """The traced program (``jaxpr``, ``consts``; outputs unflattened with ``out_tree``) run with a
    tag at each meeting (``shared_names``: ``{path: [(tag name, _proof.SharedUse)]}``) and each
    proven read (``reads``: ``{tag name: _reads.Read}``). The ``jit`` and ``checkpoint`` calls that
    hold such a place run inline, so that the tag sits at it; a ``lax.scan`` whose body holds a read
    runs as a scan again, its body replayed (the tag's values stack one per step): the one walk
    (``_walker``) over arrays; reads whose outputs add up are tagged once, on the sum, and the input
    of a read of a scan's ``xs`` slice on that ``xs`` (``read_tags``). The tags of a layer's
    calls of another layout (``renamed``: ``{key: name}``, keyed as the places are) are bound under
    names of their own (``_groups``), in the bodies that hold them run the same way."""

    jaxpr: object
    consts: list
    out_tree: object
    proof: object
    batch: int
    shared_names: dict
    reads: dict
    scope: object = None  # the scope of the tags it adds (``_tag.scoped``): the pass's own
    renamed: dict = dataclasses.field(default_factory=dict)  # a tag equation's key -> its name here (``_groups``)
    read_tags: ReadTags = ReadTags()  # the reads' tags put on their sum, or on a scan's xs (``_read_tags``)

    def __call__(self, leaves):
        at, inline = self._places
        with scoped(self.scope):
            outs = _Replayer(self, at, inline).forward(self.jaxpr, leaves, (), self.consts)
        return jax.tree_util.tree_unflatten(self.out_tree, outs)

    @functools.cached_property
    def _places(self) -> tuple[dict, set]:
        """``(at, inline)``: the tag name at each meeting and read, keyed by the ids of the calls that
        hold it and its equation's; the calls (as such key prefixes) to run inline or replay."""
        at, inline = {}, set()
        for uses in self.shared_names.values():
            for name, use in uses:
                ids = tuple(map(id, use.ctx))
                at[(*ids, id(use.eqn), use.index)] = name
                inline.update(ids[: k + 1] for k in range(len(ids)))
        for name, read in self.reads.items():
            ids = tuple(map(id, read.ctx))
            at[("read", *ids, id(read.eqn))] = name
            inline.update(ids[: k + 1] for k in range(len(ids)))
        for key in self.renamed:  # a layer's calls of another layout: their tags under a name of their own
            inline.update(key[: k + 1] for k in range(len(key) - 1))
        return at, inline

    def _dot_per_example(self, eqn, ins, index, name, ctx):
        """``eqn`` (a ``dot_general`` whose operand ``index`` is shared and whose other operand's free
        axis is the examples') with the shared operand broadcast along a new batch axis, one copy per
        example, tagged ``name``: the same product, and the tag's cotangent is each example's."""
        axis, _ = self.proof.axis_at(eqn.outvars[0], self.batch, ctx)
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
        rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
        up = lambda dims: tuple(int(d) + 1 for d in dims)  # noqa: E731
        if index == 1:  # the examples' axis is a free axis of lhs
            e = lfree[axis - len(lb)]
            rhs = _tag(jnp.broadcast_to(rhs, (self.batch, *rhs.shape)), name)
            dims = ((tuple(lc), up(rc)), ((*lb, e), (*up(rb), 0)))
        else:  # ... of rhs
            e = rfree[axis - len(lb) - len(lfree)]
            lhs = _tag(jnp.broadcast_to(lhs, (self.batch, *lhs.shape)), name)
            dims = ((up(lc), tuple(rc)), ((*up(lb), 0), (*rb, e)))
        out = jax.lax.dot_general(
            lhs, rhs, dims, precision=eqn.params.get("precision"), preferred_element_type=eqn.params.get("preferred_element_type")
        )  # the examples' axis comes right after lb's batch axes: move it back where eqn has it
        return jnp.moveaxis(out, len(lb), axis)


class _Replayer(Walker):
    """The walk that replays: the program evaluated again (``evaluates``), entering only the calls and
    scans that hold a meeting or a read (``inline``), every other equation bound as it is, but where
    a tag goes (``at``, ``Replay.renamed``)."""

    evaluates = True

    def __init__(self, replay: Replay, at: dict, inline: set):
        self.replay, self.at, self.inline = replay, at, inline

    def enter(self, eqn, ins: list, ctx: tuple) -> bool:
        return (*map(id, ctx), id(eqn)) in self.inline and super().enter(eqn, ins, ctx)

    def before(self, eqn, ins: list, ctx: tuple):
        """A scan whose body reads a slice of its ``xs``: the read's input tag on that ``xs`` (the whole array)."""
        on_xs, key = self.replay.read_tags.on_xs, (*map(id, ctx), id(eqn))
        for j in range(len(ins)):
            for name in on_xs.get((*key, j), ()):
                ins[j] = _tag(ins[j], name)
        return None

    def equation(self, eqn, ins: list, ctx: tuple) -> list:
        replay, at, key = self.replay, self.at, (*map(id, ctx), id(eqn))
        met = [(i, at[(*key, i)]) for i in range(len(ins)) if (*key, i) in at]
        if key in replay.renamed:
            return bind_equation(_compat.with_params(eqn, name=replay.renamed[key]), ins)
        if met and eqn.primitive.name == "dot_general":
            ((i, name),) = met
            return [replay._dot_per_example(eqn, ins, i, name, ctx)]
        if met and eqn.primitive.name == "broadcast_in_dim":  # its output holds one copy per example
            ((_, name),) = met
            return [_tag(bind_equation(eqn, ins)[0], name)]
        if ("read", *key) in at:  # a leaf read outside its layers: its operand and output
            name, placed = at[("read", *key)], replay.read_tags
            other = replay.reads[name].other
            if other is not None and name not in placed.moved_inputs:
                ins[other] = _tag(ins[other], name + INPUT_SUFFIX)
            (out,) = bind_equation(eqn, ins)
            # shared: tagged where it meets the examples; adding up with other reads: tagged on their sum
            return [out if name in replay.shared_names or name in placed.sums else _tag(out, name)]
        for i, name in met:
            ins[i] = _tag(jnp.broadcast_to(ins[i], eqn.outvars[0].aval.shape), name)
        outs = bind_equation(eqn, ins)
        summed = replay.read_tags.at_sums.get(key)
        return outs if summed is None else [_tag(outs[0], summed)]


def shared_gradient(ct, use, proof, batch: int):
    """Each example's gradient ``(batch, *shape)`` at a shared value from the cotangent ``ct`` of its
    broadcast where it meets the examples (``use``, a ``_proof.SharedUse``).

    ``shape`` is the value's own in the program (the operand of ``use.chain``'s first equation, or of
    the meeting), read from the use and never passed in: the chain replays the program's equations,
    so only the program's layout is right for it. A value whose layout differs (a layer output that
    jaxtrace gives with its vmap axes first) is the caller's to move (``_proof.Occurrence.order``).
    """
    axis, _ = proof.axis_at(use.eqn.outvars[0], batch, use.ctx)
    chain = use.chain
    start = chain[0].invars[0] if chain else use.eqn.invars[use.index]
    shape = tuple(start.aval.shape)

    def forward(y):
        for eqn in chain:
            (y,) = bind_equation(eqn, [y])
        return y

    operand_aval = use.eqn.invars[use.index].aval
    back = jax.linear_transpose(forward, jax.ShapeDtypeStruct(shape, start.aval.dtype))
    if use.eqn.primitive.name == "dot_general":  # (B, *operand): each example's cotangent already
        return jax.vmap(lambda c: back(c.astype(operand_aval.dtype))[0])(ct)
    if use.eqn.primitive.name == "broadcast_in_dim":  # the broadcast along the examples: one example's copy

        def one_copy(y):
            (out,) = bind_equation(use.eqn, [forward(y)])
            return jax.lax.index_in_dim(out, 0, axis, keepdims=False)

        back = jax.linear_transpose(one_copy, jax.ShapeDtypeStruct(shape, start.aval.dtype))
        return jax.vmap(lambda c: back(c.astype(use.eqn.outvars[0].aval.dtype))[0])(jnp.moveaxis(ct, axis, 0))
    ct = jnp.moveaxis(ct, axis, 0)  # (B, ...): one example's cotangent each, of the broadcast shape

    def one(c):
        c = jnp.expand_dims(c, axis)
        op_shape = operand_aval.shape
        if len(op_shape) != c.ndim:  # a scalar operand
            c = jnp.sum(c).reshape(op_shape)
        else:
            summed = tuple(i for i, (s, t) in enumerate(zip(op_shape, c.shape)) if s == 1 and t != 1)
            c = jnp.sum(c, axis=summed, keepdims=True)
        return back(c.astype(operand_aval.dtype))[0]

    return jax.vmap(one)(ct)
