"""The one walk over a traced program (``jaxtrace._walker``): forward and backward, calls, branches,
loops to a fixed point over their carries, nested and reversed scans, and a walk over arrays.

Each expectation is worked out by hand from the program (which input each output depends on), or is
the program's own value (a walk that evaluates must give what the function gives).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrace import _compat, _higher_order
from jaxtrace._fused_runs import bind_equation
from jaxtrace._walker import (
    Walker, bodies_along, body_of, into_bodies, into_body, loop_depth, operand_role, results_of, scan_positions, uses_of,
)


class Deps(Walker):
    """Forward: bit masks of the inputs each value depends on."""

    bottom = 0

    def __init__(self):
        self.contexts = set()

    def join(self, a, b):
        return a | b

    def record(self, ctx, var, value):
        self.contexts.add(tuple(_higher_order.kind(e) if hasattr(e, "primitive") else "branch" for e in ctx))

    def equation(self, eqn, ins, ctx):
        return [functools.reduce(operator.or_, ins, 0)] * len(eqn.outvars)


class Reaches(Walker):
    """Backward: bit masks of the outputs each value reaches."""

    bottom = 0

    def join(self, a, b):
        return a | b

    def equation(self, eqn, outs, ctx):
        return [functools.reduce(operator.or_, outs, 0)] * len(eqn.invars)


def masks(walker, fun, *args):
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    return walker.forward(jaxpr, [1 << i for i in range(len(jaxpr.invars))])


def test_carries_run_to_a_fixed_point():
    """``(a, b) -> (b, x)``: x reaches b at the first step and a only at the second."""

    def f(a, b, xs):
        def step(carry, x):
            a, b = carry
            return (b, x), a

        return jax.lax.scan(step, (a, b), xs)

    assert masks(Deps(), f, 1.0, 2.0, jnp.ones(3)) == [0b111, 0b110, 0b111]


def test_a_loop_that_runs_no_step_keeps_its_carries():
    """The body drops its carry, but a scan of length 0 (or a while loop that never runs) returns it."""

    def scan(c, xs):
        return jax.lax.scan(lambda c, x: (x, x), c, xs)[0]

    def while_loop(c, x):
        return jax.lax.while_loop(lambda c: c < 0.0, lambda c: x, c)

    assert masks(Deps(), scan, 1.0, jnp.ones(0)) == [0b11]
    assert masks(Deps(), while_loop, 1.0, 2.0) == [0b11]


def test_branches_are_joined_and_calls_are_inline_with_one_context():
    def f(p, x, y):
        inner = jax.jit(lambda x: jnp.sin(x))
        return jax.lax.cond(p > 0, lambda x, y: inner(x), lambda x, y: y, x, y), inner(y)

    walker = Deps()
    assert masks(walker, f, 1.0, 2.0, 3.0) == [0b110, 0b100]  # (the predicate's value does not flow into a branch)
    assert {("cond", "branch", "call"), ("call",), ("cond", "branch"), ()} <= walker.contexts


def test_nested_scans_are_walked_with_their_depth():
    depths = []

    class Depths(Deps):
        def record(self, ctx, var, value):
            depths.append(loop_depth(ctx))

    def f(xs):
        inner = lambda c, x: (c + x, c)  # noqa: E731
        return jax.lax.scan(lambda c, row: (c + jax.lax.scan(inner, 0.0, row)[0], c), 0.0, xs)

    assert masks(Depths(), f, jnp.ones((2, 3))) == [1, 1]
    assert max(depths) == 2


def test_scan_positions_skip_calls_and_branches_in_a_context():
    contexts = set()

    class Contexts(Deps):
        def record(self, ctx, var, value):
            contexts.add(ctx)

    def f(p, xs):
        inner = jax.jit(lambda row: jax.lax.scan(lambda c, x: (c + x, c), 0.0, row)[0])
        branch = lambda row: jax.lax.cond(p > 0, inner, jnp.sum, row)  # noqa: E731
        return jax.lax.scan(lambda c, row: (c + branch(row), c), 0.0, xs)

    masks(Contexts(), f, 1.0, jnp.ones((2, 3)))
    deepest = max(contexts, key=len)
    kinds = [_higher_order.kind(e) if hasattr(e, "primitive") else "branch" for e in deepest]
    assert kinds == ["scan", "cond", "branch", "call", "scan"]
    assert scan_positions(deepest) == [0, 4] and loop_depth(deepest) == 2
    assert scan_positions(()) == [] and scan_positions(deepest[:4]) == [0]


def test_backward_through_a_scan_a_branch_and_a_call():
    """Which outputs each input reaches, read from the outputs back."""

    def f(p, x, y, zs):
        carry, ys = jax.lax.scan(lambda c, z: (c * z, c), x, zs)
        return jax.lax.cond(p > 0, lambda a, b: a, lambda a, b: jax.jit(jnp.cos)(b), carry, y), ys

    jaxpr = jax.make_jaxpr(f)(1.0, 2.0, 3.0, jnp.ones(4)).jaxpr
    got = Reaches().backward(jaxpr, [0b01, 0b10])
    assert got[len(jaxpr.constvars) :] == [0, 0b11, 0b01, 0b11]


class Again(Walker):
    """A walk over arrays: every equation bound as it is, scans run again over their bodies' walk."""

    evaluates = True

    def __init__(self):
        self.scans = 0

    def enter(self, eqn, values, ctx):
        self.scans += _higher_order.kind(eqn) == _higher_order.SCAN
        return super().enter(eqn, values, ctx)

    def equation(self, eqn, ins, ctx):
        return bind_equation(eqn, ins)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_walk_over_arrays_runs_reversed_and_nested_scans_again(reverse):
    def f(xs):
        def row(c, r):
            c2, ys = jax.lax.scan(lambda a, x: (a * 0.5 + x, a), c, r, reverse=not reverse)
            return c2 + jax.jit(jnp.sin)(c), ys

        return jax.lax.scan(row, 1.0, xs, reverse=reverse)

    xs = jnp.arange(12.0).reshape(3, 4) / 7
    closed = jax.make_jaxpr(f)(xs)
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    walker = Again()
    got = walker.forward(jaxpr, [xs], (), consts)
    want = f(xs)
    assert walker.scans == 2
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_a_leaf_in_a_carry_that_a_scan_of_no_step_returns_is_used():
    """``_uses`` on the walk: the body drops its carry, but with no step the scan returns the leaf."""
    from jaxtrace._per_example._uses import used_outside

    jaxpr = jax.make_jaxpr(lambda w, xs: jax.lax.scan(lambda c, x: (x, x), w, xs)[0])(1.0, jnp.ones(0)).jaxpr
    assert used_outside(jaxpr, 1, {}) == {0}



def test_into_bodies_follows_one_use_into_scans_and_calls():
    """A var's one use followed down by role (``xs`` of a scan, ``xs`` of the scan in its body, an
    operand of a ``jit`` in that body; a scan's const; a carry), and no further than a var with two
    uses or one that is an output."""

    def roles(f, *args, i=0):
        jaxpr = jax.make_jaxpr(f)(*args).jaxpr
        return [(_higher_order.kind(eqn), role, inner.aval.shape) for eqn, role, inner in into_bodies(jaxpr, jaxpr.invars[i])]

    def nested(xs):
        return jax.lax.scan(lambda c, x: (c, jax.lax.scan(lambda d, r: (d, jax.jit(jnp.sin)(r)), 0.0, x)[1]), 0.0, xs)[1]

    scan, call = _higher_order.SCAN, _higher_order.CALL
    assert roles(nested, jnp.ones((4, 3))) == [(scan, "xs", (3,)), (scan, "xs", ()), (call, "call", ())]
    assert roles(lambda w, xs: jax.lax.scan(lambda c, x: (c + w * x, None), 0.0, xs)[0], 2.0, jnp.ones(3)) == [(scan, "const", ())]
    assert roles(lambda v: jax.lax.scan(lambda c, _: (c * 2.0, None), v, None, length=2)[0], 1.0) == [(scan, "carry", ())]
    assert roles(lambda w, xs: jax.lax.scan(lambda c, x: (c + x, None), w, xs)[0] + w, 0.0, jnp.ones(3)) == []  # two uses
    assert roles(lambda w: (w, jax.jit(jnp.sin)(w)), 1.0) == []  # also an output


def test_uses_of_and_operand_role():
    """Where a body's equations read each var (an output as ``(None, k)``, literals left out), and what each
    operand is to the body it enters: a scan's const, carry and xs, a call's, none for a ``cond``'s."""

    def f(w, h, xs):
        h, ys = jax.lax.scan(lambda c, x: (jnp.tanh(c * w + x), c), h, xs)
        return jax.lax.cond(h > 0, jnp.sin, jnp.cos, h) + jax.jit(jnp.sin)(h), ys, h

    jaxpr = jax.make_jaxpr(f)(2.0, 1.0, jnp.ones(3)).jaxpr
    scan = jaxpr.eqns[0]
    assert [operand_role(scan, k) for k in range(3)] == ["const", "carry", "xs"]
    uses = uses_of(jaxpr)
    h = scan.outvars[0]
    assert [(e.primitive.name if e is not None else None, k) for e, k in uses[id(h)]] == [
        (e.primitive.name, k) for e in jaxpr.eqns for k, a in enumerate(e.invars) if a is h
    ] + [(None, 2)]
    assert {operand_role(e, k) for e, k in uses[id(h)] if e is not None and e.primitive.name != "gt"} == {None, "call"}  # cond, jit
    assert uses[id(scan.outvars[1])] == [(None, 1)] and uses[id(jaxpr.invars[2])] == [(scan, 2)]


def test_into_body_results_of_and_bodies_along_map_vars_across_a_call_and_a_scan():
    """A var into a ``jit`` body (once per operand position it holds) and a body output back out to the
    call's results; a context of a scan and the ``jit`` in its body followed down to the innermost body."""
    def f(x, xs):
        g = jax.jit(lambda a, b: ((ab := a * b), ab, b))  # one var, two outputs
        return g(x, x), jax.lax.scan(lambda c, r: (c, g(r, c)[0]), x, xs)[1]

    jaxpr = jax.make_jaxpr(f)(1.0, jnp.ones(3)).jaxpr
    call, scan = jaxpr.eqns[0], jaxpr.eqns[1]
    body, inners = into_body(call, jaxpr.invars[0])
    assert inners == list(body.invars)  # x is both operands
    product = body.eqns[0].outvars[0]
    assert results_of(call, body, product) == call.outvars[:2] and results_of(call, body, body.invars[1]) == [call.outvars[2]]
    assert into_body(scan, jaxpr.invars[1])[1] == [body_of(scan).invars[-1]]  # xs: the body's one step
    inner_call = next(e for e in body_of(scan).eqns if _higher_order.kind(e) == _higher_order.CALL)
    innermost, outer = bodies_along(jaxpr, (scan, inner_call))
    assert outer == (jaxpr, body_of(scan)) and innermost is body_of(inner_call)
    assert bodies_along(jaxpr, ()) == (jaxpr, ())
    with pytest.raises(ValueError, match="only a call's or a scan's"):
        body_of(jax.make_jaxpr(jnp.sin)(1.0).jaxpr.eqns[0])
