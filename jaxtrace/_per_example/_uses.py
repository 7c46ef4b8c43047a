"""Which leaves the loss also uses outside their covered layers.

A covered layer's factors give the part of a leaf's gradient that flows through that
layer's call. A leaf used anywhere else as well (a tied head written ``h @ embed.weight.T``,
a weight read by a module no rule covers) has more gradient than its factors hold, so its
norm from them would be silently too small. ``used_outside`` finds such leaves in the
program itself: it traces ``fun`` once and follows each leaf forward through the
equations, cut at the output tag of each covered layer that owns it (what the layer's
input depended on flows on). A leaf that still reaches an output is used outside. Calls
(``jit``, ``checkpoint``), ``cond``, ``scan`` and ``while`` are followed operand by
operand into their bodies (loops to a fixed point over their carries); any other equation
with a body (custom derivative rules, ``shard_map``) conservatively makes each output depend
on every operand and on everything its body reaches. Conservative means a leaf may be sent
to the fallback where its factors would have been enough, never the other way round.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .. import _compat, _equation_params, _higher_order
from .._module_tags import INPUT_SUFFIX
from .._tag import is_tag

__all__ = ["used_outside"]


def used_outside(
    jaxpr, n_leaves: int, owned: dict[str, set[int]], reads: Optional[dict[tuple, tuple[int, int]]] = None, whole: frozenset = frozenset()
) -> set[int]:
    """Indices of the leaves (``jaxpr``'s first ``n_leaves`` invars) on which the jaxpr's first output
    depends other than through their layers.

    ``owned`` maps a covered layer's tag name (its path) to the leaves its rule covers; ``reads``
    maps an equation that reads a leaf on factors (``_reads``), as the ``id``s of the calls that
    hold it and its own, to ``(the operand that is the leaf or its transpose, the leaf)``; ``whole``: leaves
    whose every use the pass reads where it meets the examples (none flows on).
    """
    masks = [0 if i in whole else 1 << i for i in range(n_leaves)] + [0] * (len(jaxpr.invars) - n_leaves)
    cut = {name: sum(1 << i for i in idx) for name, idx in owned.items()}
    flows = _Flows(cut, {k: (operand, 1 << i) for k, (operand, i) in (reads or {}).items()})
    reached = flows.run(jaxpr, [0] * len(jaxpr.constvars) + masks, ())[0]
    return {i for i in range(n_leaves) if reached >> i & 1}


class _Flows:
    """Bit masks of leaves, propagated through a jaxpr (bit ``i``: depends on leaf ``i``)."""

    def __init__(self, cut: dict[str, int], reads: dict[int, int]):
        self.cut = cut
        self.reads = reads  # (ids of the calls, id(equation)) -> (operand, the bit of the leaf it reads there on factors)
        self.last_input: dict[str, int] = {}  # layer -> the leaves its current call's input depends on

    def run(self, jaxpr, masks: Sequence[int], ctx: Optional[tuple]) -> list[int]:
        """The masks of ``jaxpr``'s outputs, given those of its constvars and invars (in that order);
        ``ctx``: the ``id``s of the calls and scans that hold it (``None`` inside any other body)."""
        env = dict(zip((*jaxpr.constvars, *jaxpr.invars), masks))
        for eqn in jaxpr.eqns:
            ins = [0 if isinstance(v, _compat.Literal) else env.get(v, 0) for v in eqn.invars]
            key = None if ctx is None else (*ctx, id(eqn))
            if key in self.reads:  # a read on factors: its leaf's part flows no further
                operand, bit = self.reads[key]
                m = 0
                for k, x in enumerate(ins):
                    m |= x & ~bit if k == operand else x
                outs = [m]
            elif is_tag(eqn):
                outs = [self._tag(eqn.params["name"], ins[0])]
            else:
                outs = self._equation(eqn, ins, key)
            for v, m in zip(eqn.outvars, outs):
                env[v] = m
        return [0 if isinstance(v, _compat.Literal) else env.get(v, 0) for v in jaxpr.outvars]

    def _tag(self, name: str, m: int) -> int:
        if name.endswith(INPUT_SUFFIX) and name[: -len(INPUT_SUFFIX)] in self.cut:
            self.last_input[name[: -len(INPUT_SUFFIX)]] = m
            return m
        if name in self.cut and name in self.last_input:
            # The layer's output: its own leaves flowed through it (their factors hold that part);
            # whatever its input depended on still flows on.
            return (m & ~self.cut[name]) | self.last_input[name]
        return m

    def _equation(self, eqn, ins: list[int], key: Optional[tuple]) -> list[int]:
        name, kind, n_out = eqn.primitive.name, _higher_order.kind(eqn), len(eqn.outvars)
        if name == "stop_gradient":  # no derivative flows through it: a frozen leaf's gradient is zero
            return [0] * n_out
        if kind == _higher_order.SCAN:
            p = _equation_params.scan_params(eqn)
            return self._loop(p.body, ins, p.num_consts, p.num_carry, key)  # (reads in its body: _reads)
        if kind == _higher_order.WHILE:
            p = _equation_params.while_params(eqn)
            body_ins = ins[p.cond_nconsts:]  # (body consts, carry) -> carry; the predicate carries no gradient
            return self._loop(p.body, body_ins, p.body_nconsts, len(body_ins) - p.body_nconsts)
        if kind == _higher_order.COND:
            outs = [0] * n_out
            for branch in _equation_params.cond_branches(eqn):
                outs = [a | b for a, b in zip(outs, self._call(branch, ins[1:]))]
            return outs
        if kind in (_higher_order.CALL, _higher_order.REMAT):
            return self._call(_higher_order.body(eqn), ins, key)
        bodies = _higher_order.bodies(eqn)  # anything else: every output depends on every operand
        m = 0
        for x in ins:
            m |= x
        for body in bodies:
            jaxpr, _ = _compat.jaxpr_and_consts(body)
            for x in self.run(jaxpr, [m] * (len(jaxpr.constvars) + len(jaxpr.invars)), None):
                m |= x
        return [m] * n_out

    def _call(self, body, ins: list[int], ctx: Optional[tuple] = None) -> list[int]:
        jaxpr, _ = _compat.jaxpr_and_consts(body)
        return self.run(jaxpr, [0] * len(jaxpr.constvars) + list(ins), ctx)

    def _loop(self, body, ins: list[int], n_consts: int, n_carry: int, ctx: Optional[tuple] = None) -> list[int]:
        """A loop body ``(consts, carry, xs) -> (carry, ys)``: carries fed back to a fixed point."""
        ins = list(ins)
        while True:
            outs = self._call(body, ins, ctx)
            carry = [a | b for a, b in zip(ins[n_consts : n_consts + n_carry], outs[:n_carry])]
            if carry == ins[n_consts : n_consts + n_carry]:
                return outs
            ins[n_consts : n_consts + n_carry] = carry
