"""Property-based tests: random programs with tags at random places.

Hypothesis draws a program from a small grammar (elementwise ops, matmul,
reductions, ``lax.scan``, ``lax.cond``, ``jax.vmap``, ``jax.checkpoint``,
nested ``jax.jit``) with tags between its steps. One interpreter runs the
description two ways:

* tagged: ``jt.tag(v, name)`` at each tag, differentiated by
  ``jt.value_and_grad`` (eagerly or under ``jax.jit``);
* oracle: ``v + eps[name]`` at each tag, with ``eps`` explicit arguments
  threaded through every construct by hand (``xs`` of a scan, a mapped
  argument of a vmap, an operand of a cond/checkpoint/jit), differentiated by
  plain ``jax.grad``. It never touches jaxtrace.

The tag gradients must equal the oracle's ``eps`` gradients (moved to the
documented layout: loop axes, then vmap axes, then the value's shape) and the
leaf gradients must equal ``jax.grad``'s. Float64.

The default profile runs a couple of hundred examples; set
``JAXTRACE_HYPOTHESIS_PROFILE=large`` for a long run (``quick`` for a short one).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxtrace as jt

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

jax.config.update("jax_enable_x64", True)

PROFILES = {  # not registered globally: other test modules keep their own settings
    "ci": settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
    "quick": settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
    "large": settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]),
}
PROFILE = PROFILES[os.environ.get("JAXTRACE_HYPOTHESIS_PROFILE", "ci")]

D = 3  # the state is a vector of D numbers everywhere in a program

# --- the grammar ----------------------------------------------------------------------
# A program is a list of steps; each maps the state (a (D,) vector) to a new state.
#   ("unary", op)            elementwise sin / tanh / cos / x*tanh(x)
#   ("param", op, i)         x * b[i] or x + b[i]   (b: a leaf)
#   ("matmul", i)            W[i] @ x               (W: a leaf)
#   ("reduce", op)           x + 0.3 * sum(x), x - logsumexp(x), x * tanh(mean(x))
#   ("tag", name)            a tag on the state
#   ("tag2", name)           a tag on a pair (x, sin(x)[:2]); then x = first + 0.5 * sum(second)
#   ("scan", length, reverse, body)  carry through `body` `length` times, plus 0.5 * a weighted mean of
#                            the carries (weights 1..length, so the order of the iterations matters)
#   ("cond", a, b)           lax.cond(sum(x) > 0, a, b)
#   ("vmap", k, body)        body on k scaled copies of x, vmapped; then their mean
# The ops keep the state of moderate size, so that float64 rounding stays far
# below the tolerances (a state of 1e5 would make sin(state) ill-conditioned).
#   ("checkpoint", policy, body)
#   ("jit", body)

UNARY = {
    "sin": jnp.sin,
    "tanh": jnp.tanh,
    "cos": jnp.cos,
    "xtanh": lambda x: x * jnp.tanh(x),
}
REDUCE = {
    "sum": lambda x: x + 0.3 * jnp.sum(x),
    "lse": lambda x: x - jax.nn.logsumexp(x),
    "mean": lambda x: x * jnp.tanh(jnp.mean(x)),
}
POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_saveable, "nothing": jax.checkpoint_policies.nothing_saveable}
N_PARAMS = 2


def steps(depth):
    simple = [
        st.tuples(st.just("unary"), st.sampled_from(sorted(UNARY))),
        st.tuples(st.just("param"), st.sampled_from(["mul", "add"]), st.integers(0, N_PARAMS - 1)),
        st.tuples(st.just("matmul"), st.integers(0, N_PARAMS - 1)),
        st.tuples(st.just("reduce"), st.sampled_from(sorted(REDUCE))),
        st.just(("tag",)),
        st.just(("tag2",)),
    ]
    if depth >= 2:
        return st.one_of(simple)
    body = programs(depth + 1)
    nested = [
        st.tuples(st.just("scan"), st.integers(1, 3), st.booleans(), body),
        st.tuples(st.just("cond"), body, body),
        st.tuples(st.just("vmap"), st.integers(1, 3), body),
        st.tuples(st.just("checkpoint"), st.sampled_from(sorted(POLICIES)), body),
        st.tuples(st.just("jit"), body),
    ]
    return st.one_of(*simple, *nested)


def programs(depth=0):
    return st.lists(st.deferred(lambda: steps(depth)), min_size=1, max_size=4 if depth == 0 else 3)


def name_tags(program):
    """Give every tag a unique name, in program order."""
    counter = iter(range(10**6))

    def walk(prog):
        out = []
        for step in prog:
            kind = step[0]
            if kind in ("tag", "tag2"):
                out.append((kind, f"t{next(counter)}"))
            elif kind == "scan":
                out.append((kind, step[1], step[2], walk(step[3])))
            elif kind in ("vmap", "checkpoint"):
                out.append((kind, step[1], walk(step[2])))
            elif kind == "cond":
                out.append(("cond", walk(step[1]), walk(step[2])))
            elif kind == "jit":
                out.append(("jit", walk(step[1])))
            else:
                out.append(step)
        return out

    return walk(program)


def tag_names(program) -> list:
    names = []
    for step in program:
        if step[0] in ("tag", "tag2"):
            names.append(step[1])
        elif step[0] in ("scan", "vmap", "checkpoint"):
            names += tag_names(step[-1])
        elif step[0] == "cond":
            names += tag_names(step[1]) + tag_names(step[2])
        elif step[0] == "jit":
            names += tag_names(step[1])
    return names


# --- the interpreter ----------------------------------------------------------------------


def run(program, x, params, eps, mark, ctx=()):
    """Run ``program`` on the state ``x``.

    ``mark(value, name, eps, ctx)`` is called at each tag. ``eps`` holds the
    oracle's perturbations of the tags in ``program`` in their natural layout
    (one leading axis per enclosing scan or vmap, outermost first), and is
    sliced/mapped alongside the state; it is empty for the tagged run.
    ``ctx`` lists the enclosing loops and vmaps, outermost first.
    """
    for step in program:
        kind = step[0]
        if kind == "unary":
            x = UNARY[step[1]](x)
        elif kind == "param":
            b = params["b"][step[2]]
            x = x * b if step[1] == "mul" else x + b
        elif kind == "matmul":
            x = params["W"][step[1]] @ x
        elif kind == "reduce":
            x = REDUCE[step[1]](x)
        elif kind == "tag":
            x = mark(x, step[1], eps, ctx)
        elif kind == "tag2":
            first, second = mark((x, jnp.sin(x)[:2]), step[1], eps, ctx)
            x = first + 0.5 * jnp.sum(second)
        else:
            x = run_nested(step, x, params, eps, mark, ctx)
    return x


def own(eps, body):
    names = set(tag_names(body))
    return {k: v for k, v in eps.items() if k in names}


def run_nested(step, x, params, eps, mark, ctx):
    kind = step[0]
    if kind == "scan":
        _, length, reverse, body = step

        def scan_body(carry, e_t):
            new = run(body, carry, params, e_t, mark, (*ctx, ("loop", length)))
            return new, new

        carry, carries = lax.scan(scan_body, x, own(eps, body), length=length, reverse=reverse)
        weights = jnp.arange(1.0, length + 1) / length
        return carry + 0.5 * jnp.mean(weights[:, None] * carries, axis=0)
    if kind == "cond":
        _, a, b = step
        return lax.cond(
            jnp.sum(x) > 0,
            lambda x, e: run(a, x, params, e, mark, ctx),
            lambda x, e: run(b, x, params, e, mark, ctx),
            x,
            {**own(eps, a), **own(eps, b)},
        )
    if kind == "vmap":
        _, k, body = step
        copies = x[None, :] * (1.0 + 0.25 * jnp.arange(k))[:, None]
        out = jax.vmap(lambda x, e: run(body, x, params, e, mark, (*ctx, ("vmap", k))))(copies, own(eps, body))
        return jnp.mean(out, axis=0)
    if kind == "checkpoint":
        _, policy, body = step
        fn = jax.checkpoint(lambda x, e: run(body, x, params, e, mark, ctx), policy=POLICIES[policy])
        return fn(x, own(eps, body))
    if kind == "jit":
        _, body = step
        return jax.jit(lambda x, p, e: run(body, x, p, e, mark, ctx))(x, params, own(eps, body))
    raise AssertionError(step)


def loss(program, params, x, eps, mark):
    y = run(program, x, params, eps, mark)
    return jnp.sum(jnp.sin(y) * jnp.arange(1.0, D + 1))


def tag_mark(v, name, eps, ctx):
    return jt.tag(v, name)


def eps_mark(v, name, eps, ctx):
    return jax.tree_util.tree_map(jnp.add, v, eps[name])


def tag_contexts(program, params, x) -> dict:
    """``{name: (ctx, shapes)}`` for every tag, from a dry run of the interpreter."""
    found = {}

    def record(v, name, eps, ctx):
        found[name] = (ctx, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), v))
        return v

    jax.eval_shape(lambda p, x: loss(program, p, x, {}, record), params, x)
    return found


def documented_layout(ctx, grad):
    """From the oracle's nesting order to jaxtrace's: loop axes, then vmap axes, then the value's own."""
    loops = [i for i, (kind, _) in enumerate(ctx) if kind == "loop"]
    vmaps = [i for i, (kind, _) in enumerate(ctx) if kind == "vmap"]
    return jax.tree_util.tree_map(lambda g: jnp.transpose(g, (*loops, *vmaps, *range(len(ctx), g.ndim))), grad)


def oracle_eps(contexts):
    """Zeros for every tag in the oracle's layout: one leading axis per enclosing loop or vmap."""
    return {
        name: jax.tree_util.tree_map(lambda s: jnp.zeros((*(n for _, n in ctx), *s.shape), s.dtype), shapes)
        for name, (ctx, shapes) in contexts.items()
    }


# --- the property -------------------------------------------------------------------------


@st.composite
def cases(draw):
    return case(draw(programs()), draw(st.integers(0, 2**31 - 1)))


def case(program, seed):
    program = name_tags(program)
    rng = np.random.default_rng(seed)
    params = {
        "W": jnp.asarray(rng.normal(size=(N_PARAMS, D, D)) / np.sqrt(D)),
        "b": jnp.asarray(rng.uniform(-1, 1, size=(N_PARAMS, D))),
    }
    x = jnp.asarray(rng.normal(size=(D,)))
    return program, params, x


def check(program, params, x, jit):
    contexts = tag_contexts(program, params, x)
    eps = oracle_eps(contexts)
    tagged = lambda p, x: loss(program, p, x, {}, tag_mark)  # noqa: E731
    oracle = lambda p, e: loss(program, p, x, e, eps_mark)  # noqa: E731

    def results(params, x, eps):
        return (
            jt.value_and_grad(tagged)(params, x),
            jax.value_and_grad(oracle, argnums=(0, 1))(params, eps),
            jax.grad(tagged)(params, x),
        )

    # Under jit, one compilation for all three (the costly part of an example).
    (value, (grads, tag_grads)), (want_value, (want_grads, want_eps)), plain = (
        jax.jit(results) if jit else results
    )(params, x, eps)

    assert sorted(tag_grads) == sorted(contexts), (sorted(tag_grads), sorted(contexts))
    np.testing.assert_allclose(value, want_value, rtol=1e-10, atol=1e-12)  # XLA may fuse the two differently
    for name, (ctx, _) in contexts.items():
        want = documented_layout(ctx, want_eps[name])
        got = tag_grads[name]
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), (name, got, want)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert g.shape == w.shape, (name, ctx, g.shape, w.shape)
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{name} in {ctx}")
    for got, ref, ref2 in zip(*map(jax.tree_util.tree_leaves, (grads, plain, want_grads))):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12, err_msg="leaf gradient vs jax.grad")
        np.testing.assert_allclose(got, ref2, rtol=1e-10, atol=1e-12, err_msg="leaf gradient vs the oracle")


# Patterns worth running every time, whatever hypothesis draws: a vmap whose
# matmul moves the batch axis, a reverse scan, a cond in a vmap (a select), a
# scan in a vmap and a vmap in a scan (the axis order), remat with a policy in
# a jit, and a pair tag in a loop.
EXAMPLES = [
    [("vmap", 2, [("matmul", 0), ("tag",), ("unary", "sin")])],
    [("scan", 3, True, [("matmul", 1), ("tag",)]), ("tag",)],
    [("vmap", 3, [("cond", [("tag",), ("unary", "cos")], [("param", "mul", 0), ("tag",)])])],
    [("vmap", 2, [("scan", 3, False, [("matmul", 0), ("tag",)])]), ("reduce", "lse")],
    [("scan", 2, False, [("vmap", 3, [("tag2",), ("matmul", 1)])])],
    [("jit", [("checkpoint", "dots", [("matmul", 0), ("tag",), ("unary", "xtanh")])]), ("tag2",)],
]


def with_examples(test):
    for program in EXAMPLES:
        test = example(case(program, 0))(test)
    return test


@PROFILE
@with_examples
@given(cases())
def test_under_jit(case):
    check(*case, jit=True)


@settings(PROFILE, max_examples=max(PROFILE.max_examples // 20, 10))
@with_examples
@given(cases())
def test_eager(case):
    check(*case, jit=False)


def test_the_oracle_can_fail():
    """The oracle tells tags apart: a tag before ``sin`` and one after it get different gradients."""
    program = name_tags([("tag",), ("unary", "sin"), ("tag",)])
    params = {"W": jnp.zeros((N_PARAMS, D, D)), "b": jnp.zeros((N_PARAMS, D))}
    x = jnp.array([0.3, -1.2, 2.0])
    eps = oracle_eps(tag_contexts(program, params, x))
    want = jax.grad(lambda e: loss(program, params, x, e, eps_mark))(eps)
    _, (_, tag_grads) = jt.value_and_grad(lambda p, x: loss(program, p, x, {}, tag_mark))(params, x)
    np.testing.assert_allclose(tag_grads["t1"], want["t1"], rtol=1e-12)
    np.testing.assert_allclose(tag_grads["t0"], want["t1"] * np.cos(x), rtol=1e-12)
    assert not np.allclose(want["t0"], want["t1"])


# --- compositions: the same random programs with JAX transforms and jaxtrace around and inside

COMPOSITIONS = ["inner_grad", "inner_remat_grad", "inner_jvp", "inner_jt_grad", "outer_grad", "outer_vmap"]


def composed(mode, program):
    """``(tagged(p, x), oracle(p, x, eps))``: the program composed with ``mode``, written once with
    tags and once by hand with ``+ eps`` at every tag (the oracle of the whole composition). The
    tagged program runs once in each (a second call would be a second site)."""
    base = lambda p, x, e, mark: loss(program, p, x, e, mark)  # noqa: E731

    def penalized(fn, argnums):  # value + 0.1 * |gradient|^2, from one call of the program
        def wrapped(p, x, e, mark):
            value, g = jax.value_and_grad(fn, argnums=argnums)(p, x, e, mark)
            return value + 0.1 * jt_sum_sq(g)

        return wrapped

    if mode == "inner_grad":  # a gradient penalty: jax.grad of the tagged code inside
        inner = penalized(base, 1)
    elif mode == "inner_remat_grad":  # the same through jax.checkpoint (its forward pass is copied)
        inner = penalized(jax.checkpoint(base, static_argnums=(3,)), 1)
    elif mode == "inner_jvp":

        def inner(p, x, e, mark):
            value, tangent = jax.jvp(lambda x: base(p, x, e, mark), (x,), (jnp.ones_like(x),))
            return value + 0.1 * tangent**2

    elif mode == "inner_jt_grad":  # a penalty on the tag gradients themselves, from jt inside

        def tagged(p, x):
            value, (_, tag_grads) = jt.value_and_grad(lambda p: base(p, x, {}, tag_mark))(p)
            return value + 0.1 * jt_sum_sq(tag_grads)

        return tagged, lambda p, x, e: penalized(base, 2)(p, x, e, eps_mark)
    else:
        raise AssertionError(mode)
    return (lambda p, x: inner(p, x, {}, tag_mark)), (lambda p, x, e: inner(p, x, e, eps_mark))


def jt_sum_sq(tree):
    return sum((jnp.sum(leaf**2) for leaf in jax.tree_util.tree_leaves(tree)), jnp.zeros(()))


def check_composition(program, params, x, mode):
    contexts = tag_contexts(program, params, x)
    eps = oracle_eps(contexts)
    close = dict(rtol=1e-9, atol=1e-11)
    if mode == "outer_grad":  # jax.grad of a function of jt.grad's tag gradients
        tagged = lambda p: jt_sum_sq(jt.grad(lambda p: loss(program, p, x, {}, tag_mark))(p)[1])  # noqa: E731
        oracle = lambda p: jt_sum_sq(jax.grad(lambda e: loss(program, p, x, e, eps_mark))(eps))  # noqa: E731
        got, want = jax.jit(lambda p: (jax.grad(tagged)(p), jax.grad(oracle)(p)))(params)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(g, w, **close)
        return
    if mode == "outer_vmap":  # per-example tag gradients: the batch axis first
        xs = jnp.stack([x, -0.5 * x])
        tagged = jax.vmap(jt.grad(lambda x: loss(program, params, x, {}, tag_mark)))
        oracle = jax.vmap(lambda x: jax.grad(lambda e: loss(program, params, x, e, eps_mark))(eps))
        (_, got), want = jax.jit(lambda xs: (tagged(xs), oracle(xs)))(xs)
        for name, (ctx, _) in contexts.items():
            w = jax.vmap(lambda g: documented_layout(ctx, g))(want[name])
            for g, ww in zip(jax.tree_util.tree_leaves(got[name]), jax.tree_util.tree_leaves(w)):
                np.testing.assert_allclose(g, ww, **close, err_msg=f"{name} in {ctx}")
        return
    tagged, oracle = composed(mode, program)

    def results(params, x, eps):
        return jt.value_and_grad(tagged)(params, x), jax.value_and_grad(oracle, argnums=(0, 2))(params, x, eps)

    (value, (grads, tag_grads)), (want_value, (want_grads, want_eps)) = jax.jit(results)(params, x, eps)
    assert sorted(tag_grads) == sorted(contexts), (sorted(tag_grads), sorted(contexts))
    np.testing.assert_allclose(value, want_value, **close)
    for name, (ctx, _) in contexts.items():
        want = documented_layout(ctx, want_eps[name])
        for g, w in zip(jax.tree_util.tree_leaves(tag_grads[name]), jax.tree_util.tree_leaves(want)):
            assert g.shape == w.shape, (name, ctx, g.shape, w.shape)
            np.testing.assert_allclose(g, w, **close, err_msg=f"{mode}: {name} in {ctx}")
    for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(g, w, **close, err_msg=f"{mode}: leaf gradient")


@settings(PROFILE, max_examples=max(PROFILE.max_examples // 4, 10))
@given(cases(), st.sampled_from(COMPOSITIONS))
def test_compositions(case, mode):
    check_composition(*case, mode)


@pytest.mark.parametrize("mode", COMPOSITIONS)
def test_compositions_on_the_fixed_patterns(mode):
    for program in EXAMPLES:
        check_composition(*case(program, 1), mode)
