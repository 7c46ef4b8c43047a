"""Property-based tests of ``jt.find_nonfinite``: the random programs of ``test_properties.py``
(forward and reversed scans, scans in scans, repeated calls, vmaps, checkpoints, jits) with a
*poison* at a random place: at one loop step and vmapped example it makes the state a NaN or an
inf (the forward pass), or leaves the state as it is and makes its gradient a NaN (the backward
pass only: ``0 * sqrt(0)``).

The oracle never touches jaxtrace: the values and the cotangents at the tags come from the
``+ eps`` program differentiated with plain ``jax.grad``, and the order of the entries from the
program's description, walked as the program runs (a reversed scan from its last index down;
the backward pass the other way). The first entry with a non-finite value, in that order, and the
first example (row-major) that has one there, is what the report must name; the same for the
gradients; and the parameters whose gradient is not finite.

A ``lax.cond`` or ``lax.switch`` under ``jax.vmap`` runs its branches side by side (a select):
which branch's tags come first is a convention, not an order of computation, so the programs
here take the first branch of those (``plain_alternatives``); a ``cond`` outside a vmap runs one
branch (the other's values are zeros) and stays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax import lax
from test_properties import (
    PROFILE,
    SCALES,
    TAGS,
    Interp,
    by_name,
    case,
    cases,
    own,
    score,
    stack,
    tag_mark,
    to_documented,
    zeros_for,
)

import jaxtrace as jt

# --- the poison, and an interpreter that knows each loop step and example -------------------------
#   ("poison", mode, target)  mode "nan" / "inf": state + (nan or inf) at the target; "gradient":
#                             state + 0 * sqrt(|state| * 0) at the target (the value unchanged, its
#                             gradient 0 * inf = nan); target: the index of each enclosing loop
#                             (scan, repeat) and vmap, outermost first


class Indexed(Interp):
    """``Interp`` that runs the poison: it keeps the index of each enclosing loop step and vmapped
    example (``self.where``, outermost first) while it traces their bodies."""

    def __init__(self, mark, contexts=None, dry=False):
        super().__init__(mark, contexts, dry)
        self.where: list = []

    def _inside(self, index, fn, *args):
        self.where.append(index)
        try:
            return fn(*args)
        finally:
            self.where.pop()

    def nested(self, step, x, params, data, ctx):
        kind = step[0]
        if kind == "poison":
            _, mode, target = step
            hit = jnp.asarray(True)
            for index, t in zip(self.where, target):
                hit = hit & (index == t)
            if mode == "gradient":
                return x + 0.0 * jnp.sqrt(jnp.abs(x) * jnp.where(hit, 0.0, 1.0)), {}
            return x + jnp.where(hit, jnp.nan if mode == "nan" else jnp.inf, 0.0), {}
        if kind == "scan":
            _, length, reverse, body = step

            def scan_body(carry, step_t):
                t, d_t = step_t
                new, values = self._inside(t, self.run, body, carry, params, d_t, (*ctx, ("loop", length)))
                return new, (new, values)

            xs = (jnp.arange(length), own(data, body))
            carry, (carries, values) = lax.scan(scan_body, x, xs, length=length, reverse=reverse)
            weights = jnp.arange(1.0, length + 1) / length
            return carry + 0.5 * jnp.mean(weights[:, None] * carries, axis=0), values
        if kind == "repeat":
            _, n, body = step
            mine, values = own(data, body), []
            for i in range(n):
                d_i = jax.tree_util.tree_map(lambda d: d[i], mine)  # noqa: B023
                x, v = self._inside(i, self.run, body, x, params, d_i, (*ctx, ("loop", n)))
                values.append(v)
            return x, stack(values)
        if kind == "vmap":
            _, k, body = step
            copies = x[None, :] * jnp.asarray(SCALES[:k])[:, None]

            def one(e, x, d):
                return self._inside(e, self.run, body, x, params, d, (*ctx, ("vmap", k)))

            out, values = jax.vmap(one)(jnp.arange(k), copies, own(data, body))
            return jnp.mean(out, axis=0), values
        return super().nested(step, x, params, data, ctx)


# --- programs: rebuilt, walked in the order they run -------------------------------------------


def rebuild(step, f):
    """``step`` with ``f(body, inner context)`` in place of each of its bodies."""
    kind = step[0]
    if kind == "scan":
        return (kind, step[1], step[2], f(step[3], ("loop", step[1])))
    if kind in ("repeat", "vmap"):
        return (kind, step[1], f(step[2], ("loop" if kind == "repeat" else "vmap", step[1])))
    if kind == "checkpoint":
        return (kind, step[1], f(step[2], None))
    if kind == "jit":
        return (kind, f(step[1], None))
    if kind == "cond":
        return (kind, f(step[1], None), f(step[2], None))
    if kind == "switch":
        return (kind, [f(b, None) for b in step[1]])
    return step


def plain_alternatives(program, vmapped=False):
    """``program`` with each ``cond`` / ``switch`` under a vmap replaced by its first branch (in a jit)."""
    out = []
    for step in program:
        if vmapped and step[0] in ("cond", "switch"):
            step = ("jit", step[1] if step[0] == "cond" else step[1][0])
        out.append(rebuild(step, lambda body, c: plain_alternatives(body, vmapped or (c is not None and c[0] == "vmap"))))
    return out


def bodies_of(step) -> list:
    """``(body, context it adds)`` for each body of ``step``."""
    found: list = []
    rebuild(step, lambda body, c: found.append((body, c)) or body)
    return found


def insert_points(program, ctx=()) -> list:
    """``(path, ctx)`` of every place a step can go: ``path`` the (step, body) indices down to a body,
    then the position in it; ``ctx`` the enclosing loops and vmaps there, as ``(kind, size)``."""
    points = [([i], ctx) for i in range(len(program) + 1)]
    for i, step in enumerate(program):
        for j, (body, c) in enumerate(bodies_of(step)):
            inner = (*ctx, c) if c else ctx
            points += [([(i, j), *path], where) for path, where in insert_points(body, inner)]
    return points


def insert(program, path, new):
    if len(path) == 1:
        return [*program[: path[0]], new, *program[path[0] :]]
    (i, j), rest = path[0], path[1:]
    count = iter(range(10**6))
    step = rebuild(program[i], lambda body, c: insert(body, rest, new) if next(count) == j else body)
    return [*program[:i], step, *program[i + 1 :]]


def entries(program, steps=()):
    """``(name, loop steps)`` of every tag entry, in the order the program computes them: a scan
    step by step (a reversed one from its last index), repeated calls in call order; both branches
    of a cond (outside a vmap only one runs, the other's values are zeros)."""
    for step in program:
        kind = step[0]
        if kind in TAGS:
            yield step[1], steps
        elif kind == "scan":
            _, length, reverse, body = step
            for t in (reversed(range(length)) if reverse else range(length)):
                yield from entries(body, (*steps, t))
        elif kind == "repeat":
            for i in range(step[1]):
                yield from entries(step[2], (*steps, i))
        else:
            for body, _ in bodies_of(step):
                yield from entries(body, steps)


def first_nonfinite(order, doc, contexts):
    """``(name, steps, examples, kind, leaf, entry)`` of the first entry in ``order`` with a
    non-finite value in ``doc`` (the documented layout), its first example (row-major) with one,
    and there the first leaf with an entry of that kind and that entry (row-major, inside the
    value); None if all are finite."""
    for name, steps in order:
        vmaps = sum(kind == "vmap" for kind, _ in contexts[name][0])
        nan = inf = None
        leaves = jax.tree_util.tree_leaves(doc[name])
        for leaf in leaves:
            entry = np.asarray(np.asarray(leaf)[steps], np.float64)
            entry = entry.reshape(*entry.shape[:vmaps], -1)
            n, i = np.isnan(entry).any(-1), np.isinf(entry).any(-1)
            nan, inf = (n, i) if nan is None else (nan | n, inf | i)
        bad = nan | inf
        if np.any(bad):
            example = tuple(int(e) for e in np.argwhere(bad)[0]) if vmaps else ()
            kind = "NaN" if np.asarray(nan)[example] else "inf"
            for index, leaf in enumerate(leaves):
                part = np.asarray(np.asarray(leaf)[steps][example], np.float64)
                hit = np.isnan(part) if kind == "NaN" else np.isinf(part)
                if hit.any():
                    return name, steps, example, kind, index, tuple(int(i) for i in np.argwhere(hit)[0])
    return None


def tag_contexts(program, params, x) -> dict:
    """``test_properties.tag_contexts``, by an interpreter that runs the poison."""
    found = {}

    def record(v, name, data, ctx):
        found[name] = (ctx, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), v))
        return v

    jax.eval_shape(lambda p, x: Indexed(record, dry=True).run(program, x, p, {}), params, x)
    return found


def reported(at):
    return None if at is None else (at.name, at.steps, at.examples, at.kind, at.leaf, at.entry)


# --- the property -----------------------------------------------------------------------------


def check(program, params, x, jit):
    contexts = tag_contexts(program, params, x)
    eps = zeros_for(contexts, "T")
    tagged = lambda p, x: score(Indexed(tag_mark).run(program, x, p, {})[0])  # noqa: E731

    def eps_mark(v, name, data, ctx):
        return jax.tree_util.tree_map(jnp.add, v, data[f"T:{name}"])

    def oracle(p, e):
        y, values = Indexed(eps_mark, contexts).run(program, x, p, e)
        return score(y), values

    def results(params, x, eps):
        return jt.find_nonfinite(tagged)(params, x), jax.value_and_grad(oracle, argnums=(0, 1), has_aux=True)(params, eps)

    report, ((value, values), (g_params, g_eps)) = (jax.jit(results) if jit else results)(params, x, eps)
    values = to_documented(contexts, values)
    g_eps = to_documented(contexts, by_name("T", g_eps))
    order = list(entries(program))
    np.testing.assert_allclose(report.value, value, rtol=1e-10, atol=1e-12, equal_nan=True)
    assert reported(report.first_value) == first_nonfinite(order, values, contexts), str(report)
    assert reported(report.first_gradient) == first_nonfinite(order[::-1], g_eps, contexts), str(report)
    bad = [name for name, g in g_params.items() if not np.all(np.isfinite(g))]
    assert sorted(report.params) == sorted(bad), str(report)


@st.composite
def poisoned(draw, depth=0):
    """A program of the grammar; half of them run in a scan (forward or reversed, so the scans the
    grammar draws inside are nested), and the poison goes into a loop three times in four."""
    program, params, x = draw(cases(depth))
    program = plain_alternatives(program)
    if draw(st.booleans()):
        program = [("scan", draw(st.integers(2, 3)), draw(st.booleans()), program), ("tag", "t_after")]
    points = insert_points(program)
    in_loops = [(path, ctx) for path, ctx in points if any(kind == "loop" for kind, _ in ctx)]
    path, ctx = draw(st.sampled_from(in_loops if in_loops and draw(st.integers(0, 3)) else points))
    target = tuple(draw(st.integers(0, n - 1)) for _, n in ctx)
    program = insert(program, path, ("poison", draw(st.sampled_from(["nan", "inf", "gradient"])), target))
    return program, params, x


# Run every time: the reverse scans (issue 50, item 3). A reversed scan with the NaN at a
# middle step, in the forward and in the backward pass; a forward scan around a reversed one, and a
# reversed one around a forward one, with a vmap between; repeated calls in a reversed scan.
NONFINITE_EXAMPLES = [
    [("scan", 4, True, [("tag",), ("poison", "nan", (2,)), ("unary", "sin"), ("tag",)])],
    [("scan", 4, True, [("tag",), ("poison", "gradient", (1,)), ("unary", "sin"), ("tag",)]), ("tag",)],
    [("scan", 2, False, [("vmap", 2, [("scan", 3, True, [("tag",), ("poison", "inf", (1, 1, 1)), ("tag2",)])])])],
    [("scan", 3, True, [("tag",), ("vmap", 2, [("scan", 2, False, [("poison", "gradient", (1, 0, 1)), ("tag",)])])])],
    [("scan", 3, True, [("repeat", 2, [("tag",), ("poison", "nan", (1, 1)), ("unary", "cos")])])],
]


def with_examples(test):
    for program in NONFINITE_EXAMPLES:
        test = example(case(program, 0))(test)
    return test


@settings(PROFILE, max_examples=PROFILE.max_examples // 2)
@with_examples
@given(poisoned())
def test_find_nonfinite_under_jit(case):
    check(*case, jit=True)


@settings(PROFILE, max_examples=max(PROFILE.max_examples // 20, 3))
@given(poisoned(depth=1))  # eager runs are slow: one nesting level less
def test_find_nonfinite_eager(case):
    check(*case, jit=False)


def test_the_oracle_order_runs_a_reversed_scan_from_its_last_step():
    program = [("tag", "a"), ("scan", 3, True, [("tag", "b"), ("scan", 2, False, [("tag", "c")])])]
    assert list(entries(program)) == [
        ("a", ()), ("b", (2,)), ("c", (2, 0)), ("c", (2, 1)), ("b", (1,)), ("c", (1, 0)), ("c", (1, 1)),
        ("b", (0,)), ("c", (0, 0)), ("c", (0, 1)),
    ]  # fmt: skip
