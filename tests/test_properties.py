"""Property-based tests: random programs with tags at random places, in random company.

Hypothesis draws a program from a small grammar (elementwise ops, matmul,
reductions, ``lax.scan``, ``lax.cond`` / ``lax.switch`` with per-example
predicates under ``jax.vmap``, ``jax.checkpoint``, nested ``jax.jit``,
``repeated=True`` calls, pytree tags with float32 / bfloat16 / size-0 leaves)
and a chain of transforms around it (every public jaxtrace transform and
``jax.grad`` / ``jvp`` / ``vmap`` / ``checkpoint`` / ``jit``, see
``test_properties_compositions.py``). One interpreter runs the description
two ways:

* tagged: ``jt.tag(v, name)`` at each tag, the chain made of the real
  transforms;
* oracle: ``h = v + eps`` at each tag, with ``eps`` explicit arguments threaded
  through every construct by hand (``xs`` of a scan, a mapped argument of a
  vmap, an operand of a cond/checkpoint/jit), and every jaxtrace transform of
  the chain written with plain JAX (``jax.grad``, ``jax.vjp``, ``jax.jacrev``,
  ``jax.jvp``) of its own ``eps``. It never touches jaxtrace.

What each layer does at a tag (the contract; docs/concepts.md) is one fold,
innermost layer first: a gradient transform adds its ``eps``, ``patch``
replaces the value (or applies its function), ``patch_grad`` puts an identity
``custom_vjp`` whose backward applies its function, and every reader (the
rest of the program, captured values, ``with_values``, tangents) sees the
result. Results are moved to the documented layout (loop and ``repeated``
axes, then vmap axes, then the value's shape) and compared leaf by leaf, with
a tolerance per dtype (float64 is exact to rounding).

The ``ci`` profile (the default) runs a hundred examples;
``JAXTRACE_HYPOTHESIS_PROFILE=quick`` a short run, ``large`` a long one.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxtrace as jt
from jaxtrace._errors import NoTags
from oracles import assert_close

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

jax.config.update("jax_enable_x64", True)

PROFILES = {  # not registered globally: other test modules keep their own settings
    # CI's profiles draw the same programs on every run (derandomize), so a landing does not hang on
    # a draw; "large" draws new ones each time, to find what they have not.
    "ci": settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True),
    "quick": settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True),
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
#   ("tagmix", name, dtype)  a tag on (x, sin(x)[:2] as float32 or bfloat16, x[:0]) (a size-0 leaf)
#   ("scan", length, reverse, body)  carry through `body` `length` times, plus 0.5 * a weighted mean of
#                            the carries (weights 1..length, so the order of the iterations matters)
#   ("cond", a, b)           lax.cond(sum(x) > 0, a, b)
#   ("switch", branches)     lax.switch(argmax(x[:len(branches)]), branches)
#   ("vmap", k, body)        body on k scaled copies of x (scales 1, -0.7, 1.6: so a cond or switch
#                            inside sees a per-example predicate), vmapped; then their mean
#   ("repeat", n, body)      body (simple steps) called n times in a Python loop; its tags say
#                            repeated=True (names "r..."), so they are stacked in call order
#   ("dup", body)            body called twice, its tags *without* repeated=True (names "d...");
#                            never drawn: the fixed examples expect the "used at 2 sites" TagError
#   ("checkpoint", policy, body)
#   ("jit", body)
# The ops keep the state of moderate size, so that float64 rounding stays far
# below the tolerances (a state of 1e5 would make sin(state) ill-conditioned).

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
SCALES = (1.0, -0.7, 1.6)  # the copies of a vmap: different signs, so per-example predicates differ
LOW = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def simple_steps():
    return [
        st.tuples(st.just("unary"), st.sampled_from(sorted(UNARY))),
        st.tuples(st.just("param"), st.sampled_from(["mul", "add"]), st.integers(0, N_PARAMS - 1)),
        st.tuples(st.just("matmul"), st.integers(0, N_PARAMS - 1)),
        st.tuples(st.just("reduce"), st.sampled_from(sorted(REDUCE))),
        st.just(("tag",)),
        st.just(("tag2",)),
        st.tuples(st.just("tagmix"), st.sampled_from(sorted(LOW))),
    ]


def steps(depth):
    simple = simple_steps()
    repeat_body = st.lists(st.one_of(st.just(("tag",)), st.just(("tag2",)), *simple), min_size=1, max_size=3)
    simple.append(st.tuples(st.just("repeat"), st.integers(2, 3), repeat_body))
    if depth >= 2:
        return st.one_of(simple)
    body = programs(depth + 1)
    nested = [
        st.tuples(st.just("scan"), st.integers(1, 3), st.booleans(), body),
        st.tuples(st.just("cond"), body, body),
        st.tuples(st.just("switch"), st.lists(body, min_size=2, max_size=3)),
        st.tuples(st.just("vmap"), st.integers(1, 3), body),
        st.tuples(st.just("checkpoint"), st.sampled_from(sorted(POLICIES)), body),
        st.tuples(st.just("jit"), body),
    ]
    return st.one_of(*simple, *nested)


def programs(depth=0):
    return st.lists(st.deferred(lambda: steps(depth)), min_size=1, max_size=4 if depth == 0 else 3)


TAGS = ("tag", "tag2", "tagmix")


def name_tags(program):
    """Give every tag a unique name, in program order: "t..." plain, "r..." repeated, "d..." duplicated."""
    counter = iter(range(10**6))

    def walk(prog, prefix="t"):
        out = []
        for step in prog:
            kind = step[0]
            if kind in TAGS:
                out.append((kind, f"{prefix}{next(counter)}", *step[1:]))
            elif kind == "scan":
                out.append((kind, step[1], step[2], walk(step[3], prefix)))
            elif kind in ("vmap", "checkpoint"):
                out.append((kind, step[1], walk(step[2], prefix)))
            elif kind == "repeat":
                out.append((kind, step[1], walk(step[2], "r")))
            elif kind == "dup":
                out.append((kind, walk(step[1], "d")))
            elif kind == "cond":
                out.append(("cond", walk(step[1], prefix), walk(step[2], prefix)))
            elif kind == "switch":
                out.append(("switch", [walk(b, prefix) for b in step[1]]))
            elif kind == "jit":
                out.append(("jit", walk(step[1], prefix)))
            else:
                out.append(step)
        return out

    return walk(program)


def bodies(step) -> list:
    kind = step[0]
    if kind in ("scan", "vmap", "checkpoint", "repeat"):
        return [step[-1]]
    if kind in ("dup", "jit"):
        return [step[1]]
    if kind == "cond":
        return [step[1], step[2]]
    if kind == "switch":
        return list(step[1])
    return []


def tag_names(program) -> list:
    names = []
    for step in program:
        if step[0] in TAGS:
            names.append(step[1])
        for body in bodies(step):
            names += tag_names(body)
    return names


# --- the interpreter ----------------------------------------------------------------------


def own(data, body):
    """The entries of ``data`` (keys ``"layer:name"``) for the tags in ``body``."""
    names = set(tag_names(body))
    return {k: v for k, v in data.items() if k.split(":", 1)[1] in names}


def stack(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


class Interp:
    """Runs a program on the state ``x``: ``run(...) -> (y, values)``.

    ``mark(value, name, data, ctx)`` is called at each tag and returns the value
    the program goes on with. ``data`` holds the oracle's per-tag inputs (eps,
    patch values; keys ``"layer:name"``) in their natural layout (one leading
    axis per enclosing scan, vmap or repeat, outermost first) and is
    sliced/mapped alongside the state; it is empty for the tagged run. ``ctx``
    lists the enclosing loops and vmaps, outermost first. With ``contexts``
    (``{name: (ctx, shapes)}``, from ``tag_contexts``), ``values`` are the
    marked values in the natural layout (zeros in a branch not taken);
    without, ``{}``. ``dry`` runs every branch of a cond in Python (to find
    the tags and their shapes).
    """

    def __init__(self, mark, contexts=None, dry=False):
        self.mark, self.contexts, self.dry = mark, contexts, dry

    def zeros(self, names, ctx):
        if self.contexts is None:
            return {}
        out = {}
        for name in names:
            tctx, shapes = self.contexts[name]
            lead = tuple(n for _, n in tctx[len(ctx):])
            out[name] = jax.tree_util.tree_map(lambda s: jnp.zeros((*lead, *s.shape), s.dtype), shapes)
        return out

    def run(self, program, x, params, data, ctx=()):
        values = {}
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
                x = self.mark(x, step[1], data, ctx)
                values[step[1]] = x
            elif kind == "tag2":
                h = self.mark((x, jnp.sin(x)[:2]), step[1], data, ctx)
                x = h[0] + 0.5 * jnp.sum(h[1])
                values[step[1]] = h
            elif kind == "tagmix":
                h = self.mark((x, jnp.sin(x)[:2].astype(LOW[step[2]]), 2.0 * x[:0]), step[1], data, ctx)
                x = h[0] + 0.5 * jnp.sum(h[1].astype(x.dtype)) + jnp.sum(h[2])
                values[step[1]] = h
            else:
                x, new = self.nested(step, x, params, data, ctx)
                values.update(new)
        return x, (values if self.contexts is not None else {})

    def nested(self, step, x, params, data, ctx):
        kind = step[0]
        if kind == "scan":
            _, length, reverse, body = step

            def scan_body(carry, d_t):
                new, values = self.run(body, carry, params, d_t, (*ctx, ("loop", length)))
                return new, (new, values)

            carry, (carries, values) = lax.scan(scan_body, x, own(data, body), length=length, reverse=reverse)
            weights = jnp.arange(1.0, length + 1) / length
            return carry + 0.5 * jnp.mean(weights[:, None] * carries, axis=0), values
        if kind == "repeat":
            _, n, body = step
            mine, values = own(data, body), []
            for i in range(n):
                x, v = self.run(body, x, params, jax.tree_util.tree_map(lambda d: d[i], mine), (*ctx, ("loop", n)))
                values.append(v)
            return x, stack(values)
        if kind == "dup":
            x, _ = self.run(step[1], x, params, data, ctx)
            return self.run(step[1], x, params, data, ctx)
        if kind in ("cond", "switch"):
            branches = [step[1], step[2]] if kind == "cond" else step[1]
            if self.dry:
                for branch in branches:
                    self.run(branch, x, params, data, ctx)
                return x, {}
            everything = [tag_names(b) for b in branches]

            def branch_fn(i):
                def fn(x, d):
                    y, values = self.run(branches[i], x, params, d, ctx)
                    others = [n for j, names in enumerate(everything) if j != i for n in names]
                    return y, {**values, **self.zeros(others, ctx)}

                return fn

            mine = {k: v for b in branches for k, v in own(data, b).items()}
            if kind == "cond":
                return lax.cond(jnp.sum(x) > 0, branch_fn(0), branch_fn(1), x, mine)
            index = jnp.argmax(x[: len(branches)])
            return lax.switch(index, [branch_fn(i) for i in range(len(branches))], x, mine)
        if kind == "vmap":
            _, k, body = step
            copies = x[None, :] * jnp.asarray(SCALES[:k])[:, None]
            run = lambda x, d: self.run(body, x, params, d, (*ctx, ("vmap", k)))  # noqa: E731
            out, values = jax.vmap(run)(copies, own(data, body))
            return jnp.mean(out, axis=0), values
        if kind == "checkpoint":
            _, policy, body = step
            fn = jax.checkpoint(lambda x, d: self.run(body, x, params, d, ctx), policy=POLICIES[policy])
            return fn(x, own(data, body))
        if kind == "jit":
            _, body = step
            return jax.jit(lambda x, p, d: self.run(body, x, p, d, ctx))(x, params, own(data, body))
        raise AssertionError(step)


def score(y):
    """The scalar loss of a program's output (of any leading shape)."""
    return jnp.sum(jnp.sin(y) * jnp.arange(1.0, D + 1))


def tag_mark(v, name, data, ctx):
    return jt.tag(v, name, repeated=name.startswith("r"))


def tag_contexts(program, params, x) -> dict:
    """``{name: (ctx, shapes)}`` for every tag, from a dry run of the interpreter."""
    found = {}

    def record(v, name, data, ctx):
        found[name] = (ctx, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), v))
        return v

    jax.eval_shape(lambda p, x: Interp(record, dry=True).run(program, x, p, {}), params, x)
    return found


def documented_layout(ctx, tree, lead=0):
    """From the oracle's nesting order to jaxtrace's: loop axes, then vmap axes, then the value's own
    (after ``lead`` axes left in front)."""
    loops = [lead + i for i, (kind, _) in enumerate(ctx) if kind == "loop"]
    vmaps = [lead + i for i, (kind, _) in enumerate(ctx) if kind == "vmap"]
    return jax.tree_util.tree_map(
        lambda g: jnp.transpose(g, (*range(lead), *loops, *vmaps, *range(lead + len(ctx), g.ndim))), tree
    )


def documented_shapes(contexts, lead=()):
    """``{name: tree of ShapeDtypeStruct}``: what a tag's result looks like in the documented layout."""
    out = {}
    for name, (ctx, shapes) in contexts.items():
        axes = [n for kind, n in ctx if kind == "loop"] + [n for kind, n in ctx if kind == "vmap"]
        out[name] = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((*lead, *axes, *s.shape), s.dtype), shapes)
    return out


def natural(contexts, name, fill):
    """A tree for tag ``name`` in the oracle's layout, each leaf ``fill(shape, dtype)``."""
    ctx, shapes = contexts[name]
    lead = tuple(n for _, n in ctx)
    return jax.tree_util.tree_map(lambda s: fill((*lead, *s.shape), s.dtype), shapes)


def zeros_for(contexts, layer):
    return {f"{layer}:{name}": natural(contexts, name, jnp.zeros) for name in contexts}


def by_name(layer, data):
    prefix = f"{layer}:"
    return {k[len(prefix):]: v for k, v in data.items() if k.startswith(prefix)}


def to_documented(contexts, tree_by_name, lead=0):
    return {name: documented_layout(contexts[name][0], tree, lead) for name, tree in tree_by_name.items()}


# --- comparing -----------------------------------------------------------------------------

TOLERANCES = {  # by the dtype of the leaf compared
    np.dtype(np.float64): dict(rtol=1e-8, atol=1e-10),
    np.dtype(np.float32): dict(rtol=2e-5, atol=2e-6),
    np.dtype(jnp.bfloat16): dict(rtol=3e-2, atol=3e-2),
}


def as_plain_dicts(tree):
    """``tree`` with each empty result of a transform that found no tags (``jaxtrace._errors.NoTags``,
    a ``{}`` whose reads explain that nothing is tagged) as the ``{}`` the oracles build."""
    return jax.tree_util.tree_map(
        lambda n: {} if isinstance(n, NoTags) else n, tree, is_leaf=lambda n: isinstance(n, NoTags)
    )


def assert_results_close(got, want, what="", floor=None):
    """Same structure, shapes and dtypes; values close by the leaf's dtype, or by ``floor``'s
    where that is looser (a value computed from lower-precision ones)."""
    floor = TOLERANCES[np.dtype(floor)] if floor is not None else {"rtol": 0.0, "atol": 0.0}
    tol = {k: {dtype: max(t[k], floor[k]) for dtype, t in TOLERANCES.items()} for k in ("rtol", "atol")}
    assert_close(as_plain_dicts(got), want, what, **tol)


def check_layout(results, contexts, what, lead=()):
    """At trace time: a jaxtrace transform's per-tag results have the documented names, shapes, dtypes."""
    want = documented_shapes(contexts, lead)
    assert sorted(results) == sorted(want), f"{what}: tags {sorted(results)}, want {sorted(want)}"
    for name in want:
        got = jax.tree_util.tree_map(lambda a: (jnp.shape(a), jnp.result_type(a)), results[name])
        exp = jax.tree_util.tree_map(lambda s: (s.shape, s.dtype), want[name])
        assert got == exp, f"{what}: tag {name!r} is {got}, want {exp} (loop axes, vmap axes, own shape)"


# --- the property: jt.value_and_grad of a random program (the composition tests add company) ---


@st.composite
def cases(draw, depth=0):
    """A program (``depth=1``: one level of nesting less, for the compositions), params and x."""
    return case(draw(programs(depth)), draw(st.integers(0, 2**31 - 1)))


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
    eps = zeros_for(contexts, "T")
    tagged = lambda p, x: score(Interp(tag_mark).run(program, x, p, {})[0])  # noqa: E731

    def eps_mark(v, name, data, ctx):
        return jax.tree_util.tree_map(jnp.add, v, data[f"T:{name}"])

    oracle = lambda p, e: score(Interp(eps_mark, contexts).run(program, x, p, e)[0])  # noqa: E731

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
    np.testing.assert_allclose(value, want_value, rtol=1e-10, atol=1e-12)  # XLA may fuse the two differently
    assert_results_close(tag_grads, to_documented(contexts, by_name("T", want_eps)), "tag gradients")
    assert_results_close(grads, plain, "leaf gradient vs jax.grad")
    assert_results_close(grads, want_grads, "leaf gradient vs the oracle")


# Patterns worth running every time, whatever hypothesis draws: a vmap whose
# matmul moves the batch axis, a reverse scan, a cond in a vmap (a select, with
# a per-example predicate), a scan in a vmap and a vmap in a scan (the axis
# order), remat with a policy in a jit, a pair tag in a loop, repeated calls in
# a scan and in one branch of a vmapped cond (issue 23), a switch in a vmap,
# leaves of three dtypes and size 0 in loops, repeated calls in a vmap whose
# batch axis moves between the calls, and reverse scans nested in scans.
EXAMPLES = [
    [("vmap", 2, [("matmul", 0), ("tag",), ("unary", "sin")])],
    [("scan", 3, True, [("matmul", 1), ("tag",)]), ("tag",)],
    [("vmap", 3, [("cond", [("tag",), ("unary", "cos")], [("param", "mul", 0), ("tag",)])])],
    [("vmap", 2, [("scan", 3, False, [("matmul", 0), ("tag",)])]), ("reduce", "lse")],
    [("scan", 2, False, [("vmap", 3, [("tag2",), ("matmul", 1)])])],
    [("jit", [("checkpoint", "dots", [("matmul", 0), ("tag",), ("unary", "xtanh")])]), ("tag2",)],
    [("scan", 2, False, [("repeat", 2, [("tag",), ("unary", "sin")])]), ("repeat", 3, [("tag2",)])],
    [("vmap", 2, [("cond", [("repeat", 2, [("tag",), ("unary", "sin")])], [("unary", "cos")])])],
    [("vmap", 3, [("switch", [[("tag",)], [("unary", "sin"), ("repeat", 2, [("tag",)])], [("tag2",)]])])],
    [("vmap", 2, [("tagmix", "bfloat16"), ("scan", 2, False, [("tagmix", "float32")])]), ("tagmix", "bfloat16")],
    # repeated calls in a vmap whose matmul moves the batch axis between the calls (found by the grammar)
    [("vmap", 2, [("repeat", 2, [("tag",), ("matmul", 0)])])],
    # a reversed scan in a forward one, and a reversed one around a vmap of a reversed one (issue 50):
    # index i of each loop axis is the step that reads xs[i], whichever way the loop runs
    [("scan", 2, False, [("scan", 3, True, [("tag",), ("matmul", 0)]), ("tag2",)])],
    [("scan", 3, True, [("tag",), ("vmap", 2, [("scan", 2, True, [("repeat", 2, [("tag",), ("unary", "sin")])])])])],
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


@settings(PROFILE, max_examples=max(PROFILE.max_examples // 20, 3))
@given(cases(depth=1))  # eager runs are slow: one nesting level less
def test_eager(case):
    check(*case, jit=False)


def test_the_oracle_can_fail():
    """The oracle tells tags apart: a tag before ``sin`` and one after it get different gradients."""
    program = name_tags([("tag",), ("unary", "sin"), ("tag",)])
    params = {"W": jnp.zeros((N_PARAMS, D, D)), "b": jnp.zeros((N_PARAMS, D))}
    x = jnp.array([0.3, -1.2, 2.0])
    contexts = tag_contexts(program, params, x)
    mark = lambda v, name, data, ctx: v + data[f"T:{name}"]  # noqa: E731
    want = jax.grad(lambda e: score(Interp(mark, contexts).run(program, x, params, e)[0]))(zeros_for(contexts, "T"))
    _, (_, tag_grads) = jt.value_and_grad(lambda p, x: score(Interp(tag_mark).run(program, x, p, {})[0]))(params, x)
    np.testing.assert_allclose(tag_grads["t1"], want["T:t1"], rtol=1e-12)
    np.testing.assert_allclose(tag_grads["t0"], want["T:t1"] * np.cos(x), rtol=1e-12)
    assert not np.allclose(want["T:t0"], want["T:t1"])
