"""Which leaves the loss also uses outside their covered layers.

A covered layer's factors give the part of a leaf's gradient that flows through that
layer's call. A leaf used anywhere else as well (a tied head written ``h @ embed.weight.T``,
a weight read by a module no rule covers) has more gradient than its factors hold, so its
norm from them would be silently too small. ``used_outside`` finds such leaves in the
program itself: it traces ``fun`` once and follows each leaf forward through the
equations, cut at the output tag of each covered layer that owns it (what the layer's
input depended on flows on). A leaf that still reaches an output is used outside. Calls
(``jit``, ``checkpoint``), ``cond``, ``scan`` and ``while`` are followed operand by
operand into their bodies by the one walk (``_walker``; loops to a fixed point over their
carries, whose outputs also hold what their carries held before a step: a loop may run none); any other equation
with a body (custom derivative rules, ``shard_map``) conservatively makes each output depend
on every operand and on everything its body reaches. Conservative means a leaf may be sent
to the fallback where its factors would have been enough, never the other way round.
"""

from __future__ import annotations

from typing import Optional

from .. import _compat, _higher_order
from .._tag import tag_p
from .._walker import Walker

__all__ = ["used_outside"]


def used_outside(
    jaxpr, n_leaves: int, owned: dict[str, set[int]], reads: Optional[dict[tuple, tuple[int, int]]] = None, whole: frozenset = frozenset(),
    inputs: Optional[dict[str, str]] = None,
) -> set[int]:
    """Indices of the leaves (``jaxpr``'s first ``n_leaves`` invars) on which the jaxpr's first output
    depends other than through their layers.

    ``owned`` maps a covered layer's tag name (its path) to the leaves its rule covers; ``reads``
    maps an equation that reads a leaf on factors (``_reads``), as the ``id``s of the calls that
    hold it and its own, to ``(the operand that is the leaf or its transpose, the leaf)``; ``whole``: leaves
    whose every use the pass reads where it meets the examples (none flows on); ``inputs`` maps the tag
    of a covered layer's input to the layer's path (``Plan.roles``).
    """
    masks = [0 if i in whole else 1 << i for i in range(n_leaves)] + [0] * (len(jaxpr.invars) - n_leaves)
    cut = {name: sum(1 << i for i in idx) for name, idx in owned.items()}
    flows = _Flows(cut, {k: (operand, 1 << i) for k, (operand, i) in (reads or {}).items()}, inputs or {})
    reached = flows.forward(jaxpr, masks)[0]
    return {i for i in range(n_leaves) if reached >> i & 1}


def _union(masks) -> int:
    m = 0
    for x in masks:
        m |= x
    return m


class _Flows(Walker):
    """Bit masks of leaves, propagated forward through a jaxpr (bit ``i``: depends on leaf ``i``).
    Custom derivative rules and ``shard_map`` bodies are not entered: ``equation`` treats them whole."""

    bottom = 0
    enters = frozenset({_higher_order.CALL, _higher_order.REMAT, _higher_order.COND, _higher_order.SCAN, _higher_order.WHILE})

    def __init__(self, cut: dict[str, int], reads: dict[tuple, tuple[int, int]], inputs: dict[str, str]):
        self.cut = cut
        self.inputs = inputs  # a covered layer's input tag -> the layer's path
        self.reads = reads  # (ids of the calls and scans, id(equation)) -> (operand, the bit of the leaf it reads there on factors)
        self.last_input: dict[str, int] = {}  # layer -> the leaves its current call's input depends on

    def join(self, a: int, b: int) -> int:
        return a | b

    def before(self, eqn, ins: list, ctx: tuple):
        read = self.reads.get((*map(id, ctx), id(eqn)))
        if read is None:
            return None
        operand, bit = read  # a read on factors: its leaf's part flows no further
        return [_union(x & ~bit if k == operand else x for k, x in enumerate(ins))]

    def equation(self, eqn, ins: list, ctx: tuple) -> list:
        """Every output depends on every operand; an equation with bodies (a custom rule, ``shard_map``)
        also on everything those bodies reach from them."""
        m = _union(ins)
        for body in _higher_order.bodies(eqn):
            jaxpr, _ = _compat.jaxpr_and_consts(body)
            m |= _union(self.forward(jaxpr, [m] * len(jaxpr.invars), (*ctx, eqn), [m] * len(jaxpr.constvars)))
        return [m] * len(eqn.outvars)

    def tag(self, eqn, ins: list, ctx: tuple) -> list:
        name, m = eqn.params["name"], ins[0]
        if self.inputs.get(name) in self.cut:
            self.last_input[self.inputs[name]] = m
            return [m]
        if name in self.cut and name in self.last_input:
            # The layer's output: its own leaves flowed through it (their factors hold that part);
            # whatever its input depended on still flows on.
            return [(m & ~self.cut[name]) | self.last_input[name]]
        return [m]

    rules = {
        tag_p.name: tag,
        "stop_gradient": lambda self, eqn, ins, ctx: [0] * len(eqn.outvars),  # no derivative flows: a frozen leaf's gradient is zero
    }
