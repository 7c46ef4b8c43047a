"""The proof's backward walk: which example's loss each element of each value reaches.

From the losses vector back (``_walker``), ``OWNERS``'s per-primitive rules carry ownership from
outputs to operands. A value that one use gives to one example and another use to every example
(a batch mean, an in-batch contrastive logit, attention across the batch) is where examples
interact: where it depends on a differentiated leaf, ``Backward.mixing`` names the operation and
its line. A custom derivative call is read by its primal body, then its rule is checked
(``keeps_examples``). A scan whose steps are the examples (``lax.map`` over the batch) gives its
body's values ``Step``.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from .. import _compat, _higher_order
from .._fused_runs import bind_equation
from .._tag import tag_p
from .._walker import Walker, loop_depth, scan_operands, scan_results
from ._owners import MULTI, OWNERS, Axis, Every, Reach, Step, axis_of, inexact, shape_of, unit
from ._proof_forward import Forward

__all__ = ["Backward", "is_call", "join_plain"]


def join_plain(a, b):
    """Two claims on one value (branches, loop steps): agreeing, or every example's."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    return a if isinstance(a, Every) else b if isinstance(b, Every) else Every(Reach.MIX, None)


def is_call(eqn) -> bool:
    """A ``jit`` or ``checkpoint`` call: its body runs once, as if inline."""
    return hasattr(eqn, "primitive") and _higher_order.kind(eqn) in (_higher_order.CALL, _higher_order.REMAT)  # (a cond branch in a ctx is a jaxpr)


class Backward(Walker):
    """The backward walk (see the module docstring), after ``forward`` (its ``dep``, ``iota`` and
    layer calls). ``state``: ``(ctx, var) -> ownership`` of every var."""

    enters = frozenset({*_higher_order.CALL_LIKE, _higher_order.COND, _higher_order.SCAN})

    def __init__(self, batch: int, forward: Forward):
        self.batch = batch
        self.forward_walk = forward
        self.layer_outputs: dict = {}  # (ctx, id(output tag eqn)) -> a covered layer call's output ownership, joined over its walks
        self.dep, self.iota, self.by_rules = forward.dep, forward.iota, forward.by_rules
        self.state: dict = {}  # (ctx, var) -> ownership
        self.mixing: Optional[str] = None
        self.rule_checks: dict = {}  # (id(eqn), outs, ins) -> whether its rule keeps the examples apart

    def join(self, a, b):
        return join_plain(a, b)

    def record(self, ctx: tuple, var, value) -> None:
        self.state[(ctx, var)] = value

    def enter(self, eqn, outs: list, ctx: tuple) -> bool:
        # one output that reaches every loss: so do the operands (a jit or checkpoint body is read: a
        # shared value in it meets the examples outside)
        return super().enter(eqn, outs, ctx) and (is_call(eqn) or not any(isinstance(s, Every) for s in outs))

    def combine(self, old, new, var, ctx: tuple, eqn):
        if old is None or old == new:
            return new
        if new is None:
            return old
        if isinstance(old, Step) or isinstance(new, Step):
            return Every(Reach.UNKNOWN, eqn)  # a step's example against another claim: no claim, never a refusal
        if isinstance(old, Every) and isinstance(new, Every):
            return old if old.kind is Reach.MIX or new.kind is not Reach.MIX else new
        # Two uses disagree: one example's element also reaches other examples' losses. Not with one
        # example: there every element that reaches a loss reaches example 0's, the only one, so "one
        # example's" and "every example's" are the same claim (and ``axis_of`` may place a batch of one
        # on any axis whose size fits: ``h - h.max(-1, keepdims=True)`` must not read as a broadcast
        # along the examples).
        every = old if isinstance(old, Every) else new if isinstance(new, Every) else Every(Reach.MIX, eqn)
        if every.kind is not Reach.UNKNOWN and self.mixing is None and self.batch > 1 and inexact(var) and self.dep.get((ctx, var), False):
            where = every.eqn if every.eqn is not None else eqn
            self.mixing = (
                f"losses[i] depends on example j != i through {_compat.construct(where)}: a value computed "
                "from several examples (a batch mean or variance, BatchNorm in training mode, an in-batch "
                "contrastive loss, attention across the batch) reaches each example's loss"
            )
        return every if every.kind is not Reach.UNKNOWN else Every(Reach.UNKNOWN, every.eqn)

    def equation(self, eqn, outs: list, ctx: tuple) -> list:
        every = next((s for s in outs if isinstance(s, Every)), None)
        if every is not None:
            return [every] * len(eqn.invars)
        steps = {s for s in outs if s is not None}
        if any(isinstance(s, Step) for s in steps):  # one loop step's example: so is every operand
            return [steps.pop() if len(steps) == 1 else Every(Reach.UNKNOWN, eqn)] * len(eqn.invars)
        rule = OWNERS.get(eqn.primitive.name)
        if rule is None or len(outs) != 1 and eqn.primitive.name not in MULTI:
            return [Every(Reach.UNKNOWN, eqn)] * len(eqn.invars)
        try:
            got = rule(self, eqn, outs, ctx)
        except Exception:  # a layout the rule does not read: reaches every loss, no claim made
            got = None
        return got if got is not None else [Every(Reach.UNKNOWN, eqn)] * len(eqn.invars)

    def tag(self, eqn, outs: list, ctx: tuple) -> list:
        key = (ctx, id(eqn))
        if key in self.forward_walk.by_eqn:  # a covered layer's call: its output's ownership, for ``Proof.occurrences``
            self.layer_outputs[key] = join_plain(self.layer_outputs.get(key), outs[0])
        return self.equation(eqn, outs, ctx)

    def custom(self, eqn, outs: list, ctx: tuple) -> list:
        """A custom derivative call: its primal body read, then its rule checked (``keeps_examples``)."""
        if any(isinstance(s, Every) for s in outs):
            return self.equation(eqn, outs, ctx)
        got = self.call(eqn, outs, ctx, "backward")
        if self.by_rules and not self.keeps_examples(eqn, outs, got):
            every = Every(Reach.UNKNOWN, eqn)  # JAX differentiates it by a rule that mixes examples (or may)
            self.call(eqn, [every] * len(outs), ctx, "backward")
            return [every] * len(eqn.invars)
        return got

    rules = {tag_p.name: tag, **dict.fromkeys(_compat.CUSTOM_DERIVATIVES, custom)}

    # a scan: its outputs into its body (``loop_ys``), its body's results out to its operands

    def loop_ys(self, eqn, outs: list, ctx: tuple) -> list:
        return self._scan_outputs(eqn, outs, loop_depth(ctx))[0]

    def loop_operands(self, eqn, outs: list, got: list, carry: list, ctx: tuple) -> list:
        level = loop_depth(ctx)
        ys, per_step = self._scan_outputs(eqn, outs, level)
        here = Step(level, per_step) if per_step else None
        _, carry_in, xs_in = scan_operands(eqn, eqn.invars)
        if here is not None and any(s == here and inexact(v) for v, s in zip(carry_in, carry)):
            # a float carried from one example's step to the next: not one example's values a step
            ys = [Every(Reach.UNKNOWN, eqn) if s == here else s for s in ys]
            got, carry = self.loop_body_backward(eqn, scan_results(eqn, outs)[0], ys, ctx)
            here = None
        consts, _, xs_got = scan_operands(eqn, got)
        xs = []
        for v, s in zip(xs_in, xs_got):
            if here is not None and s == here:  # the scanned axis holds the examples, ``inner`` steps each
                xs.append(unit(shape_of(v), 0, here.inner))
            elif s is None or isinstance(s, (Every, Step)):
                xs.append(s)
            else:
                where = axis_of(shape_of(v)[1:], s, self.batch)
                xs.append(unit(shape_of(v), where[0] + 1, where[1]) if where else Every(Reach.UNKNOWN, eqn))
        consts = [Every(Reach.SHARED, eqn) if here is not None and s == here else s for s in consts]  # read by every step
        carry = [Every(Reach.UNKNOWN, eqn) if here is not None and s == here else s for s in carry]  # (no float: no gradient)
        return consts + carry + xs

    def _scan_outputs(self, eqn, outs: list, level: int) -> tuple[list, int]:
        """``(the states of a scan body's ys, inner)``: ``inner`` > 0 where the scan's steps are the examples
        (``inner`` steps each, the same for every ys that reaches a loss, no carry out reaching one:
        ``lax.map`` over the batch), its body's values then ``Step``; else 0."""
        (carry, states), ys_vars = scan_results(eqn, outs), scan_results(eqn, eqn.outvars)[1]
        wheres = [axis_of(shape_of(v), s, self.batch) if isinstance(s, Axis) else None for v, s in zip(ys_vars, states)]
        inners = {w[1] for w in wheres if w is not None and w[0] == 0}
        stepped = len(inners) == 1 and all(s is None for s in carry) and all(
            w is not None and w[0] == 0 for w, s in zip(wheres, states) if isinstance(s, Axis)
        )
        inner = next(iter(inners)) if stepped else 0
        ys = []
        for v, s, where in zip(ys_vars, states, wheres):
            if s is None or isinstance(s, Step):  # (an outer scan's step: the same example at every step here)
                ys.append(s)
            elif where is not None and where[0] > 0:
                ys.append(unit(shape_of(v)[1:], where[0] - 1, where[1]))
            else:
                ys.append(Step(level, inner) if inner else Every(Reach.UNKNOWN, eqn))
        return ys, inner

    # a custom derivative call's rule

    def keeps_examples(self, eqn, outs: list, ins: list) -> bool:
        """Whether the derivative JAX takes of a ``custom_jvp``/``custom_vjp`` call (its rule, not its
        primal body) keeps the examples apart as ``ins`` (the operand states read from the body) say.

        The call's pullback ``(operands, cotangents) -> operand cotangents`` is traced (``jax.vjp``
        of the equation: the rule as reverse mode runs it) and read backward from the operand
        cotangents, each given its operand's state: each output cotangent must then reach only
        its own example's operand cotangents, as ``outs`` has it. A rule that reads other
        examples' cotangents (a backward pass centred over the batch), one that cannot be traced,
        or an operand the body gives to no loss whose cotangent the rule fills, fails. Inside
        ``jax.vmap`` over the examples JAX batches the rule itself, which then passes.
        """
        key = (id(eqn), tuple(outs), tuple(ins))
        if key not in self.rule_checks:
            self.rule_checks[key] = self._read_rule(eqn, outs, ins)
        return self.rule_checks[key]

    def _read_rule(self, eqn, outs: list, ins: list) -> bool:
        diff_out = [k for k, v in enumerate(eqn.outvars) if inexact(v)]
        try:
            pullback = _pullback_jaxpr(eqn, diff_out)
        except Exception:  # a rule that cannot be traced on its own: nothing is proven of it
            return False
        jaxpr, _ = _compat.jaxpr_and_consts(pullback)
        wanted = []
        for a, s in zip(eqn.invars, ins):
            if isinstance(s, Axis) and inexact(a):
                wanted.append(s)  # its cotangent must come from its own example's cotangents
            elif s is None and inexact(a):
                wanted.append(Every(Reach.UNKNOWN, eqn))  # the body gives it no loss: nor may the rule
            else:
                wanted.append(None)  # reaches every loss already (or no cotangent): no constraint
        forward = Forward({}, by_rules=False)
        forward.forward(jaxpr, [forward.bottom] * len(jaxpr.invars))
        got = Backward(self.batch, forward).backward(jaxpr, wanted)[len(jaxpr.constvars) + len(eqn.invars) :]
        for k, state in zip(diff_out, got):
            if outs[k] is not None and state is not None and state != outs[k]:
                return False
        return True


def _pullback_jaxpr(eqn, diff_out: list):
    """The jaxpr of ``(operands, cotangents of the outputs diff_out) -> operand cotangents`` of one
    equation: ``jax.vjp`` of it, so that a custom rule is what runs."""

    def spec(a):
        return jax.ShapeDtypeStruct(shape_of(a), a.aval.dtype)

    def pullback(operands, cts):
        outs, vjp = jax.vjp(lambda *xs: bind_equation(eqn, xs), *operands)
        full = [np.zeros(np.shape(o), jax.dtypes.float0) for o in outs]
        for k, ct in zip(diff_out, cts):
            full[k] = ct
        return vjp(full)

    return jax.make_jaxpr(pullback)([spec(a) for a in eqn.invars], [spec(eqn.outvars[k]) for k in diff_out])
