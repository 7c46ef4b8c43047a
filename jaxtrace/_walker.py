"""One walk over a traced program: every analysis of a jaxpr is a table of rules on it.

The per-example proof, the leaves used outside their layers, the leaves read by one primitive,
the replay with a tag where a shared value meets the examples, and the order in which
``find_nonfinite`` reports all ask the same questions: which equations, in which order
(forward, or the backward pass's), inside which loop and which branch. ``Walker`` answers them
once. It visits a jaxpr's equations forward (``forward``) or backward (``backward``), each with
its *context*: the equations that hold its body, outermost first, and right after a ``cond``
the branch (its jaxpr) it is in. It recurses through the one ``_higher_order`` table: calls
(``jit``, ``closed_call``, ``checkpoint``, custom derivatives' primal bodies) as if inline,
``cond`` branch by branch (their results joined), ``scan`` and ``while`` bodies run until their
carries stop changing (``fixed_point``), and, for an analysis whose values are arrays
(``evaluates``), a ``scan`` run again as ``lax.scan`` over its body's walk.

An analysis subclasses ``Walker`` and gives ``rules`` (primitive name -> ``rule(walker, eqn,
values, ctx)``: the outputs' values forward, the operands' backward) and ``equation``, the
default for a primitive with no rule (and for a higher-order equation it does not enter); it
never matches ``scan`` or ``cond`` itself. JAX's ``pe.dce_rules`` are the model.

Example (which inputs each output depends on, as bit masks)::

    class Deps(Walker):
        bottom = 0
        def join(self, a, b): return a | b
        def equation(self, eqn, ins, ctx): return [functools.reduce(operator.or_, ins, 0)] * len(eqn.outvars)

    Deps().forward(jaxpr, [1, 2])  # [3] for the jaxpr of lambda x, y: x * y
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

import jax

from . import _compat, _equation_params, _higher_order

__all__ = [
    "Walker",
    "bodies_along",
    "body_of",
    "into_bodies",
    "into_body",
    "loop_depth",
    "nesting",
    "operand_role",
    "results_of",
    "scan_operands",
    "scan_positions",
    "scan_results",
    "uses_of",
]

# The kinds a walk enters by default; an analysis lists fewer where it treats the others as a whole.
_ENTERED = frozenset({_higher_order.CALL, _higher_order.REMAT, _higher_order.CUSTOM, _higher_order.COND, _higher_order.SCAN, _higher_order.WHILE})
_EVALUATED = frozenset({*_higher_order.CALL_LIKE, _higher_order.SCAN})  # what a walk over arrays can run again


def loop_depth(ctx: tuple) -> int:
    """How many ``lax.scan`` bodies hold a body of context ``ctx``."""
    return len(scan_positions(ctx))


def scan_positions(ctx: tuple) -> list[int]:
    """Where the ``lax.scan`` equations sit in context ``ctx``, outermost first (a ``cond`` branch in a
    context is a jaxpr, not an equation): ``ctx[: scan_positions(ctx)[level] + 1]`` is the context down
    to the scan of loop level ``level``."""
    return [i for i, e in enumerate(ctx) if hasattr(e, "primitive") and _higher_order.kind(e) == _higher_order.SCAN]


def nesting(eqn) -> tuple:
    """How the bodies of a higher-order equation run inside it: ``("loop", reverse)`` for a scan's
    body (once per step, from the last step where ``reverse``), ``("shards", mesh axes)`` for a
    ``shard_map``'s (once per shard, side by side), ``("in",)`` for any other (once, or once per branch
    taken)."""
    kind = _higher_order.kind(eqn)
    if kind == _higher_order.SCAN:
        return ("loop", bool(_equation_params.scan_params(eqn).reverse))
    if kind == _higher_order.SHARD_MAP:
        return ("shards", _equation_params.shard_map_params(eqn).axes)
    return ("in",)


def scan_operands(eqn, seq: Sequence) -> tuple[list, list, list]:
    """``seq``, laid out as scan ``eqn``'s operands (or its body's invars), by role: ``(consts, carry, xs)``."""
    k, c = _counts(eqn)
    return list(seq[:k]), list(seq[k : k + c]), list(seq[k + c :])


def scan_results(eqn, seq: Sequence) -> tuple[list, list]:
    """``seq``, laid out as scan ``eqn``'s results (or its body's outvars), by role: ``(carry, ys)``."""
    c = _counts(eqn)[1]
    return list(seq[:c]), list(seq[c:])


def uses_of(jaxpr) -> dict:
    """``{id(var): [(equation, operand index), ...]}``: where ``jaxpr``'s equations read each var, in order,
    a use as its ``k``-th output ``(None, k)``; literals left out. Build it once per body and look up."""
    found: dict = {}
    for eqn in jaxpr.eqns:
        for k, a in enumerate(eqn.invars):
            if not isinstance(a, _compat.Literal):
                found.setdefault(id(a), []).append((eqn, k))
    for k, a in enumerate(jaxpr.outvars):
        if not isinstance(a, _compat.Literal):
            found.setdefault(id(a), []).append((None, k))
    return found


def operand_role(eqn, k: int) -> str | None:
    """What operand ``k`` of ``eqn`` is to the body it enters: "const", "carry" or "xs" for a scan's, "call"
    for a call's (``jit``, ``checkpoint``, a custom derivative's primal body); ``None`` for any other
    equation's (a ``cond``'s, a ``while``'s: no one body it enters as it is)."""
    kind = _higher_order.kind(eqn)
    if kind == _higher_order.SCAN:
        consts, carry = _counts(eqn)
        return "const" if k < consts else "carry" if k < consts + carry else "xs"
    return "call" if kind in _higher_order.CALL_LIKE else None


def into_bodies(jaxpr, var):
    """``var``'s one use in ``jaxpr`` followed into the body of the call or scan it is an operand of, and
    that body's var's one use likewise, while each has exactly one (as one operand of one equation, and
    no output): ``(equation, role, the body's var)`` per body entered, outermost first; ``role`` is
    ``operand_role``'s. Stops at a use of any other kind."""
    jaxpr = _compat.jaxpr_and_consts(jaxpr)[0]
    while True:
        uses = uses_of(jaxpr).get(id(var), [])
        if len(uses) != 1 or uses[0][0] is None:
            return
        ((eqn, k),) = uses
        role = operand_role(eqn, k)
        if role is None:
            return
        jaxpr = body_of(eqn)
        var = jaxpr.invars[k]
        yield eqn, role, var


def body_of(eqn):
    """The jaxpr of the one body of a call (``jit``, ``checkpoint``, a custom derivative's primal body) or
    a scan, opened: the body a walk enters with context ``(*ctx, eqn)``."""
    kind = _higher_order.kind(eqn)
    if kind == _higher_order.SCAN:
        return _compat.jaxpr_and_consts(_equation_params.scan_params(eqn).body)[0]
    if kind in _higher_order.CALL_LIKE:
        return _compat.jaxpr_and_consts(_higher_order.body(eqn))[0]
    raise ValueError(f"`{eqn.primitive.name}` has no one body a value enters as it is: only a call's or a scan's.")


def into_body(eqn, var) -> tuple[Any, list]:
    """``(the body of call or scan eqn (body_of), the invars of it that operand var becomes)``: one per
    operand position ``var`` holds (a scan's body sees an ``xs`` operand's one step)."""
    body = body_of(eqn)
    return body, [body.invars[k] for k, a in enumerate(eqn.invars) if a is var]


def results_of(eqn, body, var) -> list:
    """The results of call or scan ``eqn`` that ``var`` of its body ``body`` (body_of) becomes: one per
    output position ``var`` holds (a scan's carry out of its last step, or its stacked ``ys``)."""
    return [eqn.outvars[k] for k, a in enumerate(body.outvars) if a is var]


def bodies_along(jaxpr, ctx: tuple) -> tuple[Any, tuple]:
    """A context of calls and scans (``ctx``, outermost first) followed down from ``jaxpr``, its top
    level: ``(the body its innermost equation runs, (the jaxprs that hold each equation of ctx))``."""
    outer = []
    for eqn in ctx:
        outer.append(jaxpr)
        jaxpr = body_of(eqn)
    return jaxpr, tuple(outer)


class Walker:
    """A walk over a jaxpr with per-primitive rules (see the module docstring).

    Hooks (each with a default): ``join`` (two values of one var: branches, loop steps),
    ``combine`` (backward: two uses of one var), ``literal`` and ``constant`` (a literal's value,
    a closed-over constant's), ``before`` (a result for an equation ahead of every rule), ``enter``
    (whether to walk a higher-order equation's bodies), ``into_loop``, ``out_of_loop`` and
    ``out_of_body`` (a value as it enters a loop body, leaves a loop's, or leaves any body),
    ``loop_ys`` and ``loop_operands`` (backward: a scan's outputs into its body, and its body's
    results out to its operands), ``record`` (every var's value, with its context). A rule reads
    a scan's operands and results by role with ``scan_operands`` and ``scan_results``; an analysis
    that follows one value reads bodies with ``body_of``, ``into_body``, ``results_of`` and
    ``bodies_along``.
    """

    rules: ClassVar[dict[str, Callable]] = {}
    enters: ClassVar[frozenset] = _ENTERED
    fixed_point: ClassVar[bool] = True  # loop bodies walked until their carries stop changing (else once)
    evaluates: ClassVar[bool] = False  # values are arrays: literals and consts are theirs, scans run again
    bottom: Any = None  # the value of what nothing reaches (and of a closed-over constant)

    # --- hooks ---------------------------------------------------------------------

    def join(self, a, b):
        """One value of two (of a var in two branches, or before and after a loop step); an analysis
        whose values can differ there says how they join."""
        if a == self.bottom or a == b:
            return b
        if b == self.bottom:
            return a
        raise NotImplementedError(f"{type(self).__name__} has no join for two different values of one var.")

    def combine(self, old, new, var, ctx: tuple, eqn):
        return self.join(old, new)

    def literal(self, atom):
        return atom.val if self.evaluates else self.bottom

    def before(self, eqn, values: list, ctx: tuple):
        return None

    def enter(self, eqn, values: list, ctx: tuple) -> bool:
        kind = _higher_order.kind(eqn)
        return kind in self.enters and (not self.evaluates or kind in _EVALUATED)

    def equation(self, eqn, values: list, ctx: tuple) -> list:
        raise NotImplementedError(f"{type(self).__name__} has no default rule (for `{eqn.primitive.name}`).")

    def into_loop(self, eqn, role: str, value, ctx: tuple):
        """``value`` as the body of loop ``eqn`` sees it; ``role``: "const", "carry" or "xs"."""
        return value

    def out_of_body(self, eqn, value, ctx: tuple):
        return value

    def out_of_loop(self, eqn, role: str, value, ctx: tuple):
        """A loop's result from its body's; ``role``: "carry" or "ys" (a scan's stacked outputs)."""
        return self.out_of_body(eqn, value, ctx)

    def constant(self, var):
        """The value of a closed-over constant (``var``) where the walk does not evaluate."""
        return self.bottom

    def loop_ys(self, eqn, outs: list, ctx: tuple) -> list:
        return scan_results(eqn, outs)[1]

    def loop_operands(self, eqn, outs: list, got: list, carry: list, ctx: tuple) -> list:
        consts, _, xs = scan_operands(eqn, got)
        return [*consts, *carry, *xs]

    def record(self, ctx: tuple, var, value) -> None:
        pass

    # --- the walk ------------------------------------------------------------------

    def forward(self, jaxpr, values: Sequence, ctx: tuple = (), consts: Sequence | None = None) -> list:
        """The values of ``jaxpr``'s outputs from those of its invars (``values``) and constvars
        (``consts``; default: a closed jaxpr's own where the walk evaluates, else ``constant``'s)."""
        jaxpr, own = _compat.jaxpr_and_consts(jaxpr)
        if consts is None:
            consts = own if self.evaluates else [self.constant(v) for v in jaxpr.constvars]
        env: dict = {}
        for v, x in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *values)):
            self._write(env, ctx, v, x)
        for eqn in jaxpr.eqns:
            ins = [self._read(env, a) for a in eqn.invars]
            outs = self.before(eqn, ins, ctx)
            if outs is None:
                outs = self._dispatch(eqn, ins, ctx, _FORWARD)
            for v, x in zip(eqn.outvars, outs):
                self._write(env, ctx, v, x)
        return [self._read(env, a) for a in jaxpr.outvars]

    def backward(self, jaxpr, values: Sequence, ctx: tuple = ()) -> list:
        """The values of ``jaxpr``'s constvars and invars (in that order) from those of its outputs:
        the equations in reverse, each var's uses combined (``combine``)."""
        jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
        env: dict = {}
        for v, x in zip(jaxpr.outvars, values):
            if not isinstance(v, _compat.Literal):
                env[v] = self.combine(env.get(v, self.bottom), x, v, ctx, None)
        for eqn in reversed(jaxpr.eqns):
            outs = [env.get(v, self.bottom) for v in eqn.outvars]
            for v, x in zip(eqn.outvars, outs):
                self.record(ctx, v, x)
            if all(x == self.bottom for x in outs):  # reaches nothing: nor do its operands
                continue
            ins = self.before(eqn, outs, ctx)
            if ins is None:
                ins = self._dispatch(eqn, outs, ctx, _BACKWARD)
            for a, x in zip(eqn.invars, ins):
                if not isinstance(a, _compat.Literal) and x != self.bottom:
                    env[a] = self.combine(env.get(a, self.bottom), x, a, ctx, eqn)
        found = [env.get(v, self.bottom) for v in (*jaxpr.constvars, *jaxpr.invars)]
        for v, x in zip((*jaxpr.constvars, *jaxpr.invars), found):
            self.record(ctx, v, x)
        return found

    def call(self, eqn, values: list, ctx: tuple, direction: str) -> list:
        """A call-like equation (``jit``, ``checkpoint``, a custom derivative's primal body) walked as if
        inline: forward, its outputs' values; backward, its operands'."""
        body = _higher_order.body(eqn)
        if direction == _FORWARD:
            return [self.out_of_body(eqn, x, ctx) for x in self.forward(body, values, (*ctx, eqn))]
        n = len(_compat.jaxpr_and_consts(body)[0].constvars)
        return self.backward(body, values, (*ctx, eqn))[n:]

    def loop_body_backward(self, eqn, carry: list, ys: list, ctx: tuple) -> tuple[list, list]:
        """A scan's body read backward from its carries' and ``ys``'s values, the carries fed back until
        they stop changing: ``(the values of its consts, carries and xs, the carries')``."""
        body = _equation_params.scan_params(eqn).body
        k, c = _counts(eqn)
        n = len(_compat.jaxpr_and_consts(body)[0].constvars)
        return self._until_stable(lambda cs: (got := self.backward(body, [*cs, *ys], (*ctx, eqn))[n:], got[k : k + c]), carry)

    # --- the higher-order kinds ----------------------------------------------------

    def _dispatch(self, eqn, values: list, ctx: tuple, direction: str) -> list:
        rule = self.rules.get(eqn.primitive.name)
        if rule is not None:
            return rule(self, eqn, values, ctx)
        kind = _higher_order.kind(eqn)
        if kind is not None and self.enter(eqn, values, ctx):
            return _KINDS[kind, direction](self, eqn, values, ctx)
        return self.equation(eqn, values, ctx)

    def _cond(self, eqn, values: list, ctx: tuple, direction: str) -> list:
        n = len(eqn.outvars) if direction == _FORWARD else len(eqn.invars) - 1
        joined = None
        for branch in _equation_params.cond_branches(eqn):
            inner = (*ctx, eqn, branch)
            if direction == _FORWARD:
                got = [self.out_of_body(eqn, x, ctx) for x in self.forward(branch, values[1:], inner)]
            else:
                got = self.backward(branch, values, inner)[len(_compat.jaxpr_and_consts(branch)[0].constvars) :]
            joined = got if joined is None else [self.join(a, b) for a, b in zip(joined, got)]
        joined = joined if joined is not None else [self.bottom] * n
        return joined if direction == _FORWARD else [self.bottom, *joined]

    def _scan_forward(self, eqn, values: list, ctx: tuple) -> list:
        p = _equation_params.scan_params(eqn)
        if self.evaluates:
            return self._scan_again(eqn, p, values, ctx)
        consts, carry, xs = ([self.into_loop(eqn, role, x, ctx) for x in part] for role, part in zip(_ROLES, scan_operands(eqn, values)))
        carry, ys = scan_results(eqn, self._fixed_point(eqn, p.body, consts, carry, xs, ctx))
        return [*(self.out_of_loop(eqn, "carry", x, ctx) for x in carry), *(self.out_of_loop(eqn, "ys", y, ctx) for y in ys)]

    def _scan_again(self, eqn, p, values: list, ctx: tuple) -> list:
        """``eqn`` run again as ``lax.scan`` over its body's walk (values that are arrays)."""
        k, c = p.num_consts, p.num_carry

        def step(carry, xs):
            outs = self.forward(p.body, [*values[:k], *carry, *xs], (*ctx, eqn))
            return outs[:c], outs[c:]

        carry, ys = jax.lax.scan(step, values[k : k + c], values[k + c :], length=p.length, reverse=p.reverse, unroll=p.unroll)
        return [*carry, *ys]

    def _while_forward(self, eqn, values: list, ctx: tuple) -> list:
        """The body of a ``while`` (its predicate's value flows nowhere: it only says when to stop)."""
        p = _equation_params.while_params(eqn)
        consts = [self.into_loop(eqn, "const", x, ctx) for x in values[p.cond_nconsts : p.cond_nconsts + p.body_nconsts]]
        carry = [self.into_loop(eqn, "carry", x, ctx) for x in values[p.cond_nconsts + p.body_nconsts :]]
        return [self.out_of_loop(eqn, "carry", x, ctx) for x in self._fixed_point(eqn, p.body, consts, carry, [], ctx)]

    def _fixed_point(self, eqn, body, consts: list, carry: list, xs: list, ctx: tuple) -> list:
        """The body's outputs, its carries fed back until they stop changing; the carries out are the
        join of every step's (and of the carries in: a loop may run no step)."""
        c = len(carry)
        outs, carry = self._until_stable(
            lambda cs: (outs := self.forward(body, [*consts, *cs, *xs], (*ctx, eqn)), outs[:c]), carry
        )
        return [*carry, *outs[c:]]

    def _until_stable(self, step: Callable, carry: list) -> tuple[Any, list]:
        """The one fixed point over loop carries: ``step(carry)`` gives ``(result, carry after a step)``,
        joined with the carry before it (a loop may run no step) and fed back until it stops changing
        (once, without ``fixed_point``); ``(the last result, the carries)``."""
        carry = list(carry)
        while True:
            result, after = step(carry)
            new = [self.join(a, b) for a, b in zip(carry, after)]
            if new == carry or not self.fixed_point:
                return result, new
            carry = new

    def _scan_backward(self, eqn, outs: list, ctx: tuple) -> list:
        got, carry = self.loop_body_backward(eqn, scan_results(eqn, outs)[0], self.loop_ys(eqn, outs, ctx), ctx)
        return self.loop_operands(eqn, outs, got, carry, ctx)

    def _while_backward(self, eqn, outs: list, ctx: tuple) -> list:
        p = _equation_params.while_params(eqn)
        n = len(_compat.jaxpr_and_consts(p.body)[0].constvars)
        got, carry = self._until_stable(lambda cs: (got := self.backward(p.body, cs, (*ctx, eqn))[n:], got[p.body_nconsts :]), outs)
        return [*[self.bottom] * p.cond_nconsts, *got[: p.body_nconsts], *carry]

    def _read(self, env: dict, atom):
        if isinstance(atom, _compat.Literal):
            return self.literal(atom)
        return env[atom] if self.evaluates else env.get(atom, self.bottom)  # (arrays: every var is written)

    def _write(self, env: dict, ctx: tuple, var, value) -> None:
        if not isinstance(var, _compat.DropVar):
            env[var] = value
            self.record(ctx, var, value)


def _counts(eqn) -> tuple[int, int]:
    p = _equation_params.scan_params(eqn)
    return p.num_consts, p.num_carry


_FORWARD, _BACKWARD = "forward", "backward"
_ROLES = ("const", "carry", "xs")  # a scan's operands, in order
_KINDS: dict = {
    **{(kind, direction): lambda w, e, v, c, d=direction: w.call(e, v, c, d) for kind in _higher_order.CALL_LIKE for direction in (_FORWARD, _BACKWARD)},
    (_higher_order.COND, _FORWARD): lambda w, e, v, c: w._cond(e, v, c, _FORWARD),
    (_higher_order.COND, _BACKWARD): lambda w, e, v, c: w._cond(e, v, c, _BACKWARD),
    (_higher_order.SCAN, _FORWARD): Walker._scan_forward,
    (_higher_order.SCAN, _BACKWARD): Walker._scan_backward,
    (_higher_order.WHILE, _FORWARD): Walker._while_forward,
    (_higher_order.WHILE, _BACKWARD): Walker._while_backward,
}
