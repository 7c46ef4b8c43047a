"""jaxtrace.stats: in-graph summaries against NumPy on the full cotangents, the compiled
program's outputs, and the host-side History."""

import doctest
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax

import jaxtrace as jt
from jaxtrace import stats
from oracles import assert_close

jax.config.update("jax_enable_x64", True)


def numpy_stats(value, keep):
    """The oracle: float64 NumPy over all leaves of one tag, keeping the first ``keep`` axes."""
    leaves = [np.asarray(leaf, np.float64) for leaf in jax.tree_util.tree_leaves(value)]
    kept = leaves[0].shape[:keep]
    flat = np.concatenate([leaf.reshape(*kept, -1) for leaf in leaves], axis=-1)
    mags = np.abs(flat)
    return {
        "norm": np.sqrt(np.sum(flat**2, axis=-1)),
        "mean_abs": np.mean(mags, axis=-1),
        "max_abs": np.max(mags, axis=-1),
        "nonfinite": np.mean(~np.isfinite(flat), axis=-1),
        "rms": np.sqrt(np.mean(flat**2, axis=-1)),
    }


def assert_stats_match(tag_stats, tag_grads, keep, rtol=1e-12, names=stats.STATS):
    assert set(tag_stats) == set(tag_grads)
    for name, value in tag_grads.items():
        expected = numpy_stats(value, keep.get(name, 0))
        assert set(tag_stats[name]) == set(names)
        got = {stat: np.asarray(tag_stats[name][stat]) for stat in names}
        assert_close(got, {stat: expected[stat] for stat in names}, name, rtol=rtol, atol=0, dtype=False)


def model(params, xs):
    """Tags in plain code (a pytree), in a scan, in a vmap inside the scan, and repeated calls."""
    w, u = params["w"], params["u"]
    pair = jt.tag({"a": jnp.sin(xs[0] @ w), "b": jnp.cos(xs[0])}, "pair")

    def step(h, x):
        h = jt.tag(jnp.tanh(h @ u + x @ w), "rnn.h")
        rows = jax.vmap(lambda r: jt.tag(r * jnp.sum(r), "rows"))(jnp.stack([h, 2 * h]))
        return h, jnp.sum(rows)

    h, ys = lax.scan(step, pair["a"], xs)
    for _ in range(3):
        h = jt.tag(jnp.tanh(h @ u), "shared", repeated=True)
    return jnp.sum(h**2) + jnp.sum(ys) + jnp.sum(pair["b"] ** 3)


LOOP_AXES = {"pair": 0, "rnn.h": 1, "rows": 1, "shared": 1}


@pytest.fixture
def problem():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w": jax.random.normal(k1, (3, 4)), "u": jax.random.normal(k2, (4, 4)) / 2}
    xs = jax.random.normal(k3, (6, 3))
    return params, xs


@pytest.mark.long_eager
def test_value_and_grad_stats_match_numpy_on_full_cotangents(problem, maybe_jit):
    params, xs = problem
    value, (grads, tag_grads) = maybe_jit(jt.value_and_grad(model))(params, xs)
    s_value, (s_grads, tag_stats) = maybe_jit(stats.value_and_grad(model))(params, xs)
    np.testing.assert_allclose(s_value, value, rtol=1e-13)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-13), s_grads, grads)
    assert tag_grads["rows"].shape == (6, 2, 4)  # loop, vmap, value
    assert tag_stats["rnn.h"]["norm"].shape == (6,)  # one per scan step
    assert tag_stats["rows"]["norm"].shape == (6,)  # the vmap axis is reduced
    assert tag_stats["shared"]["norm"].shape == (3,)  # one per repeated call
    assert tag_stats["pair"]["norm"].shape == ()
    assert_stats_match(tag_stats, tag_grads, LOOP_AXES)


@pytest.mark.long_eager
def test_per_example_keeps_vmap_axes(problem, maybe_jit):
    params, xs = problem
    _, (_, tag_grads) = jt.value_and_grad(model)(params, xs)
    _, (_, tag_stats) = maybe_jit(stats.value_and_grad(model, tags=["rows", "rnn.h"], per_example=True))(params, xs)
    assert set(tag_stats) == {"rows", "rnn.h"}
    assert tag_stats["rows"]["max_abs"].shape == (6, 2)
    assert_stats_match(tag_stats, {n: tag_grads[n] for n in tag_stats}, {"rows": 2, "rnn.h": 1})


def test_argnums_has_aux_and_stat_selection(problem):
    params, xs = problem

    def f(xs, params):
        return model(params, xs), {"first": xs[0]}

    fun = stats.value_and_grad(f, argnums=1, has_aux=True, tags="rnn.h", stats=["max_abs", "norm"])
    (value, aux), (g, tag_stats) = fun(xs, params)
    np.testing.assert_allclose(value, model(params, xs), rtol=1e-13)
    np.testing.assert_array_equal(aux["first"], xs[0])
    assert set(g) == {"w", "u"}
    assert set(tag_stats["rnn.h"]) == {"max_abs", "norm"}


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_summarize_loop_axes_forms(keep):
    g = {"a": jnp.arange(24.0).reshape(2, 3, 4) - 7.0, "b": {"x": jnp.ones((2, 3)), "y": -jnp.ones((2, 3, 5))}}
    for loop_axes in (keep, {"a": keep, "b": keep}, lambda name: keep):
        out = jax.jit(lambda g: stats.summarize(g, loop_axes=loop_axes))(g)
        assert_stats_match(out, g, {"a": keep, "b": keep})


def test_summarize_nonfinite_and_large_values():
    g = np.array(
        [[1.0, -2.0, 2.0, 0.0], [np.inf, 1.0, -1.0, 0.0], [np.nan, 1.0, np.inf, 0.0], [0.0, 0.0, 0.0, 0.0]]
    )
    out = jax.jit(lambda g: stats.summarize({"g": g}, loop_axes=1))(jnp.asarray(g))
    expected = numpy_stats(g, 1)
    for stat in stats.STATS:
        np.testing.assert_array_equal(np.asarray(out["g"][stat]), expected[stat], err_msg=stat)
    rms = jax.jit(lambda g: stats.summarize({"g": g}, loop_axes=1, stats="rms"))(jnp.asarray(g))["g"]["rms"]
    np.testing.assert_array_equal(np.asarray(rms), expected["rms"])
    # float32: finite gradients whose squares overflow still give a finite norm
    big = np.array([3e30, -4e30, 1e25], np.float32)
    out = stats.summarize({"big": jnp.asarray(big)})["big"]
    assert out["norm"].dtype == jnp.float32
    np.testing.assert_allclose(out["norm"], np.linalg.norm(big.astype(np.float64)), rtol=1e-6)
    np.testing.assert_allclose(out["mean_abs"], np.mean(np.abs(big.astype(np.float64))), rtol=1e-6)


ALL = (*stats.STATS, "rms")

FLOAT32_CASES = {
    "ordinary": [1.5, -2.0, 0.25, 0.0],
    "huge (squares overflow)": [3e30, -4e30, 1e25],
    "tiny (squares underflow)": [3e-30, -4e-30, 1e-35],
    "huge and tiny": [3e30, 1e-30, 0.0],
    "near the float32 max": [3e38, -3e38],  # the norm itself overflows; mean and rms do not
    "zeros": [0.0, 0.0],
}


@pytest.mark.parametrize("case", list(FLOAT32_CASES))
def test_float32_sums_of_squares_out_of_range(case, maybe_jit):
    """Accumulated in float32, squares of |g| > 1e19 overflow and of |g| < 1e-19 underflow: the sums at
    fixed power-of-two scales, in the same pass, give the float64 numbers rounded to float32 (what the
    max-scaling gave, with a second reduction round)."""
    g = np.array(FLOAT32_CASES[case], np.float32)
    out = maybe_jit(lambda g: stats.summarize({"g": g}, stats=ALL))(jnp.asarray(g))["g"]
    want = numpy_stats(g.astype(np.float64), 0)
    for stat in ALL:
        assert out[stat].dtype == jnp.float32, stat
        with np.errstate(over="ignore"):
            expected = np.float32(want[stat])
        np.testing.assert_allclose(np.asarray(out[stat]), expected, rtol=2e-6, atol=0, err_msg=f"{case}: {stat}")


def test_float32_out_of_range_per_step_and_per_example(maybe_jit):
    """Each kept step (each row) gets its own scale: an ordinary or all-zero step beside a huge or a
    tiny one keeps its plain numbers; the same under jax.vmap."""
    rows = [[3e30, -4e30, 1e25], [3e-30, -4e-30, 1e-35], [1.5, -2.0, 0.25], [0.0, 0.0, 0.0], [3e38, -3e38, 0.0]]
    g = np.array(rows, np.float32)
    want = numpy_stats(g.astype(np.float64), 1)
    per_step = maybe_jit(lambda g: stats.summarize({"g": g}, stats=ALL, loop_axes=1))(jnp.asarray(g))["g"]
    one = lambda row: stats.summarize({"g": row}, stats=ALL)["g"]  # noqa: E731
    per_row = maybe_jit(jax.vmap(one))(jnp.asarray(g))
    for out in (per_step, per_row):
        for stat in ALL:
            with np.errstate(over="ignore"):
                expected = want[stat].astype(np.float32)
            np.testing.assert_allclose(np.asarray(out[stat]), expected, rtol=2e-6, atol=0, err_msg=stat)
    # ordinary steps alone: the plain sums, bit for bit what sqrt(sum(g**2)) gives
    ordinary = jnp.asarray(g[2:4])
    norm = maybe_jit(lambda g: stats.summarize({"g": g}, stats="norm", loop_axes=1))(ordinary)["g"]["norm"]
    np.testing.assert_array_equal(np.asarray(norm), np.asarray(jnp.sqrt(jnp.sum(ordinary**2, axis=1))))


@pytest.mark.parametrize("lam", [0.0, 1e-25, 1e25, 3e37], ids=["zero", "tiny", "huge", "sum of |g| overflows"])
def test_float32_broadcast_gradient_of_a_weighted_term(lam, maybe_jit):
    """Issue 50.4: loss = main + lam * aux with lam a step argument and the terms tagged, so the
    gradient at aux is lam broadcast. Under jit on JAX 0.10.2, XLA rewrote square(g * 2**k) into
    square(g) * 2**(2k), 0 * inf in float32, and norm and rms were nan; each scaled entry is now
    capped after its multiply (min(|g * 2**k|, cap)), and no rewrite moves the constant through
    the min (without it these fail on JAX 0.10.2). 3e37 broadcast to 32 entries: the sum of |g|
    overflows, mean_abs comes from the scaled sum."""

    def loss(w, x, lam):
        main = jt.tag(jnp.sum((x @ w) ** 2), "main")
        aux = jt.tag(jnp.sum(jnp.abs(w)), "aux")  # a scalar term: its gradient is lam
        entries = jt.tag(jnp.abs(w), "aux.entries")  # its gradient is lam broadcast to (8, 4)
        return main + lam * aux + lam * jnp.sum(entries)

    w, x = jnp.ones((8, 4), jnp.float32), jnp.ones((3, 8), jnp.float32)
    step = maybe_jit(stats.value_and_grad(loss, stats=ALL))
    _, (_, tag_stats) = step(w, x, jnp.float32(lam))
    lam32 = np.float64(np.float32(lam))
    for name, grad in (("aux", np.full((), lam32)), ("aux.entries", np.full((8, 4), lam32))):
        want = numpy_stats(grad, 0)  # by hand in float64
        for stat in ALL:
            got = tag_stats[name][stat]
            assert got.dtype == jnp.float32, (name, stat)
            np.testing.assert_allclose(np.asarray(got, np.float64), want[stat], rtol=2e-6, atol=0, err_msg=f"{name} {stat}")


@pytest.mark.parametrize("case", ["huge (squares overflow)", "tiny (squares underflow)"])
def test_float32_range_guards_differentiate(case, maybe_jit):
    """The scaled entries are made from g's bits, with their own derivative (|g| * 2**k's): the
    norm's gradient is still g / |g| where the guards pick the scaled sums."""
    g = jnp.asarray(np.array(FLOAT32_CASES[case], np.float32))
    grad = maybe_jit(jax.grad(lambda g: stats.summarize({"g": g}, stats="norm")["g"]["norm"]))(g)
    g64 = np.asarray(g, np.float64)
    np.testing.assert_allclose(np.asarray(grad, np.float64), g64 / np.linalg.norm(g64), rtol=2e-6, atol=1e-12)


@pytest.mark.long_eager
def test_empty_values_and_rms_in_loops(maybe_jit):
    """No entries: norm 0, mean and rms nan, no non-finite entries; rms keeps loop axes like the rest."""
    out = maybe_jit(lambda g: stats.summarize({"e": g}, stats=ALL, loop_axes=1))(jnp.zeros((3, 0)))["e"]
    np.testing.assert_array_equal(out["norm"], np.zeros(3))
    np.testing.assert_array_equal(out["max_abs"], np.zeros(3))
    np.testing.assert_array_equal(out["nonfinite"], np.zeros(3))
    assert np.all(np.isnan(out["mean_abs"])) and np.all(np.isnan(out["rms"]))
    g = {"a": jnp.arange(24.0).reshape(2, 3, 4) - 7.0, "e": jnp.zeros((2, 0)), "b": jnp.ones((2, 5))}
    out = maybe_jit(lambda g: stats.summarize({"t": g}, stats=ALL, loop_axes=1))(g)
    assert_stats_match(out, {"t": g}, {"t": 1}, names=ALL)


@pytest.mark.parametrize("jit", [False, True])
def test_summaries_differentiate_as_their_closed_forms(jit):
    """The max only scales the sums (no derivative goes through it), and an empty leaf adds
    nothing: the tangents of norm and mean_abs are those of sqrt(sum g**2) and mean |g|, finite
    (found by the property tests: a size-0 leaf made them nan)."""
    g = {"a": jnp.array([1.5, -2.0, 0.5]), "b": jnp.array([[0.25, -3.0]]), "e": jnp.zeros((0,))}
    dg = {"a": jnp.array([0.3, 0.1, -1.0]), "b": jnp.array([[2.0, 0.5]]), "e": jnp.zeros((0,))}
    fun = lambda g: stats.summarize({"t": g}, stats=("norm", "mean_abs", "rms"))["t"]  # noqa: E731
    jvp = lambda g, dg: jax.jvp(fun, (g,), (dg,))  # noqa: E731
    _, tangents = (jax.jit(jvp) if jit else jvp)(g, dg)
    flat, dflat = (jnp.concatenate([jnp.ravel(t[k]) for k in "abe"]) for t in (g, dg))
    np.testing.assert_allclose(tangents["norm"], jnp.sum(flat * dflat) / jnp.linalg.norm(flat), rtol=1e-12)
    np.testing.assert_allclose(tangents["mean_abs"], jnp.mean(jnp.sign(flat) * dflat), rtol=1e-12)
    rms = jnp.sqrt(jnp.mean(flat**2))
    np.testing.assert_allclose(tangents["rms"], jnp.mean(flat * dflat) / rms, rtol=1e-12)
    # an all-zero gradient: finite tangents (sqrt's derivative at 0 is not taken)
    _, at_zero = jax.jvp(fun, (jax.tree_util.tree_map(jnp.zeros_like, g),), (dg,))
    assert all(np.isfinite(v) for k, v in at_zero.items() if k != "mean_abs")


@pytest.mark.parametrize("jit", [False, True])
def test_reverse_mode_and_max_ties_through_the_one_pass_reduction(jit):
    """jax.grad through the statistics (the one-pass reduction has its own derivative rule): the
    norm's gradient is g / |g|, and max_abs's splits evenly between tied entries, as jnp.max's."""
    g = {"a": jnp.array([[1.5, -3.0, 3.0], [3.0, 1.0, -2.0]]), "e": jnp.zeros((2, 0))}

    def fun(g):
        s = stats.summarize({"t": g}, stats=stats.STATS + ("rms",), loop_axes=1)["t"]
        return jnp.sum(s["norm"] + s["max_abs"] + s["mean_abs"] + s["rms"])

    grad = (jax.jit(jax.grad(fun)) if jit else jax.grad(fun))(g)
    a = g["a"]
    norm = jnp.linalg.norm(a, axis=1, keepdims=True)
    ties = jnp.abs(a) == jnp.max(jnp.abs(a), axis=1, keepdims=True)
    want = a / norm + jnp.sign(a) * ties / jnp.sum(ties, axis=1, keepdims=True) + jnp.sign(a) / 3 + a / (3 * norm / jnp.sqrt(3.0))
    np.testing.assert_allclose(grad["a"], want, rtol=1e-12)
    assert grad["e"].shape == (2, 0)


def test_one_operand_reductions_and_float32_accuracy():
    """Each statistic is a one-operand reduction of an elementwise function of g (the form XLA's SPMD
    partitioner reduces where each shard lies; it gathers a variadic reduction's operands first),
    and a large float32 leaf's sums are as accurate as jnp.sum's."""
    g = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2**15)), jnp.float32)
    for names, count in ((("norm",), 3), (stats.STATS + ("rms",), 7)):
        step = jax.jit(lambda g: stats.summarize({"t": g}, stats=names)["t"])  # noqa: B023
        text = step.lower(g).compile().as_text()
        reads = [line for line in text.splitlines() if re.search(r"\sreduce\(", line)]
        # the squares at three scales; with all five also |g| at two, the non-finite count and the max
        assert len(reads) == count and all(re.search(r"\sreduce\(%[^,]+, %[^,]+\)", r) for r in reads), reads
        for leaf in (g, g.reshape(-1)[: 2**17 - 1]):  # a prime count: no block size divides it, padded
            got, want = step(leaf), numpy_stats(leaf, 0)
            for name in names:
                np.testing.assert_allclose(np.asarray(got[name], np.float64), want[name], rtol=1e-6, err_msg=name)


def test_dtypes_float0_and_complex():
    half = stats.summarize({"h": jnp.ones(4, jnp.bfloat16)})["h"]
    assert half["norm"].dtype == jnp.float32 and float(half["norm"]) == 2.0
    z = stats.summarize({"z": jnp.array([3 + 4j, 0j])})["z"]
    np.testing.assert_allclose(z["norm"], 5.0)
    np.testing.assert_allclose(z["mean_abs"], 2.5)

    def f(x, n):
        return jnp.sum(x * jt.tag(n, "count"))

    _, (_, s) = stats.value_and_grad(f)(jnp.ones(3), jnp.arange(3))
    assert {k: float(v) for k, v in s["count"].items()} == {"norm": 0, "mean_abs": 0, "max_abs": 0, "nonfinite": 0}


def test_errors():
    with pytest.raises(ValueError, match="unknown statistic.*'median'"):
        stats.summarize({"a": jnp.ones(2)}, stats=["norm", "median"])
    with pytest.raises(ValueError, match="unknown statistic.*'median'"):
        stats.value_and_grad(jnp.sum, stats="median")  # one name alone is checked as a name
    with pytest.raises(ValueError, match="at most as many axes"):
        stats.summarize({"a": jnp.ones(2)}, loop_axes=2)
    with pytest.raises(ValueError, match="different leading axes"):
        stats.summarize({"a": {"x": jnp.ones((2, 3)), "y": jnp.ones((3, 3))}}, loop_axes=1)
    with pytest.raises(TypeError, match="int >= 0"):
        stats.summarize({"a": jnp.ones(2)}, loop_axes={"a": -1})
    with pytest.raises(TypeError, match="takes a dict"):
        stats.summarize(jnp.ones(2))
    with pytest.raises(jt.TagError, match="No tag named 'nope'"):
        stats.value_and_grad(model, tags="nope")(
            {"w": jnp.ones((3, 4)), "u": jnp.ones((4, 4))}, jnp.ones((2, 3))
        )


def test_only_the_summaries_leave_the_compiled_step():
    """Under jit the full cotangents are not outputs: check the lowered outputs and compiled memory."""
    n, width, depth = 256, 512, 3

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            h = jt.tag(jnp.tanh(h @ w), f"layer{i}")
        return jnp.mean(h**2)

    ws = [jnp.ones((width, width), jnp.float32) / width for _ in range(depth)]
    x = jnp.ones((n, width), jnp.float32)

    def with_stats(ws, x):
        value, (grads, tag_stats) = stats.value_and_grad(loss)(ws, x)
        return value, tag_stats

    def with_cotangents(ws, x):
        value, (grads, tag_grads) = jt.value_and_grad(loss)(ws, x)
        return value, tag_grads

    lowered = jax.jit(with_stats).lower(ws, x)
    out_shapes = [leaf.shape for leaf in jax.tree_util.tree_leaves(lowered.out_info)]
    assert out_shapes == [()] * (1 + depth * len(stats.STATS))
    full = jax.jit(with_cotangents).lower(ws, x)
    assert [leaf.shape for leaf in jax.tree_util.tree_leaves(full.out_info)][1:] == [(n, width)] * depth

    summary_mem = lowered.compile().memory_analysis()
    full_mem = full.compile().memory_analysis()
    if summary_mem is None or full_mem is None:
        pytest.skip("this backend reports no memory analysis")
    one_cotangent = n * width * 4
    assert full_mem.output_size_in_bytes >= depth * one_cotangent
    assert summary_mem.output_size_in_bytes < 1024


def test_history():
    h = stats.History()
    assert len(h) == 0 and h.format() == "(empty History)"
    h.append(0, {"a": {"norm": jnp.float32(1.0), "max_abs": jnp.float32(2.0)}, "loop": {"norm": jnp.arange(3.0)}}, loss=3.0)
    h.append(5, {"a": {"norm": jnp.float32(0.5), "max_abs": jnp.float32(1.5)}}, loss=jnp.float32(2.0), acc=0.5)
    h.append(9, {"loop": {"norm": jnp.ones(3)}, "late": {"norm": 7.0}})
    assert len(h) == 3 and h.steps.tolist() == [0, 5, 9]
    assert h.names == ["a", "loop", "late"] and "a" in h and "b" not in h
    np.testing.assert_array_equal(h["a"]["norm"], [1.0, 0.5, np.nan])
    assert h["a"]["norm"].dtype == np.float32
    np.testing.assert_array_equal(h.array("loop", "norm"), [[0, 1, 2], [np.nan] * 3, [1, 1, 1]])
    np.testing.assert_array_equal(h.array("late"), [np.nan, np.nan, 7.0])
    np.testing.assert_array_equal(h.scalar("loss"), [3.0, 2.0, np.nan])
    np.testing.assert_array_equal(h.scalar("acc"), [np.nan, 0.5, np.nan])
    assert h.format(row=1) == "step 5  loss 2  acc 0.5  | norm: a 0.5"
    assert h.format(stat="max_abs", names=["a"], row=0) == "step 0  loss 3  | max_abs: a 2"
    assert h.format() == "step 9  | norm: loop[0] 1  loop[1] 1  loop[2] 1  late 7"  # one entry per layer
    with pytest.raises(KeyError, match="has \\['a', 'loop', 'late'\\]"):
        h["b"]
    with pytest.raises(KeyError, match="No statistic 'mean_abs'"):
        h.array("a", "mean_abs")
    with pytest.raises(KeyError, match="No scalar 'lr'"):
        h.scalar("lr")
    with pytest.raises(TypeError, match="should be a dict"):
        h.append(10, {"a": jnp.ones(3)})


def test_history_from_a_jitted_training_loop(problem):
    params, xs = problem
    step = jax.jit(stats.value_and_grad(model))
    full = jax.jit(jt.grad(model, tags="rnn.h"))
    history = stats.History()
    expected = []
    for i in range(3):
        value, (grads, tag_stats) = step(params, xs)
        history.append(i, tag_stats, loss=value)
        expected.append(numpy_stats(full(params, xs)[1]["rnn.h"], 1)["norm"])
        params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    assert history.array("rnn.h", "norm").shape == (3, 6)
    np.testing.assert_allclose(history.array("rnn.h", "norm"), np.stack(expected), rtol=1e-12)


def test_guide_statistics_example_runs():
    page = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "training-statistics.md"
    code = re.search(r"```python\n(.*?)```", page.read_text(), re.S).group(1)
    namespace = {}
    exec(compile(code, str(page), "exec"), namespace)
    history = namespace["history"]
    assert history.steps.tolist() == [0, 5, 10, 15]
    assert history["layers.0"]["norm"].shape == (4,)
    assert history.format(row=0).startswith("step 0  loss 0.01278  | norm: layers.0 0.00935")


def test_docstring_examples():
    # The namespace re-exports; doctest reads each function where it is defined.
    import importlib

    modules = {stats, *(importlib.import_module(getattr(stats, n).__module__) for n in stats.__all__ if hasattr(getattr(stats, n), "__module__"))}
    for module in modules:
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, module.__name__


def _terms_model(w, xs, detach=False):
    """A scan-tagged state and a plain tag; three terms, one cut by stop_gradient when detach."""

    def step(c, x):
        c = jt.tag(jnp.tanh(w * c + x), "c")
        return c, c

    c, cs = lax.scan(step, jnp.zeros(2), xs)
    h = jt.tag(jnp.sin(c), "h")
    aux_in = lax.stop_gradient(cs) if detach else cs
    return {"main": jnp.sum(h**2), "aux": jnp.mean(aux_in**2), "vec": h * 2.0}


@pytest.mark.long_eager
@pytest.mark.parametrize("detach", [False, True])
def test_summarize_tag_jacobians_per_term(maybe_jit, detach):
    xs = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)
    fun = lambda w: _terms_model(w, xs, detach)  # noqa: E731

    def table_of(w):
        _, tag_jacs = jt.jacrev(fun)(w)
        return stats.summarize(tag_jacs, terms=jax.eval_shape(fun, w), loop_axes={"c": 1}), tag_jacs

    table, tag_jacs = maybe_jit(table_of)(0.7)
    # Each entry is the statistic of that term's Jacobian block, its own axes reduced, loop axes kept.
    for name, per_term in table.items():
        for term, jac in tag_jacs[name].items():
            out_ndim = {"main": 0, "aux": 0, "vec": 1}[term]
            keep = 1 if name == "c" else 0
            moved = np.moveaxis(np.asarray(jac), tuple(range(out_ndim)), tuple(range(-out_ndim, 0)))
            flat = moved.reshape(moved.shape[:keep] + (-1,))
            np.testing.assert_allclose(per_term[term]["norm"], np.linalg.norm(flat, axis=-1), rtol=1e-12)
    assert table["c"]["aux"]["norm"].shape == (4,)
    assert bool(np.all(table["c"]["aux"]["norm"] == 0)) == detach  # the cut path is exactly zero
    text = stats.format_paths(table, tags=["c", "h"])
    assert text.splitlines()[0].split() == ["tag", "aux", "main", "vec"]
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["c[0]", "c[1]", "c[2]", "c[3]", "h"]  # a row per loop step
    assert all(("0 (none)" in c_row) == detach for c_row in lines[1:5])
    assert "0 (none)" in lines[5]  # aux never reaches h


def test_stats_jacrev_is_the_per_term_summary_in_the_loss_own_order(maybe_jit):
    """jt.stats.jacrev: no terms= idiom; tags in forward order, terms as the loss built them, under jit too."""
    xs = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)

    def fun(w, xs):  # the dict built in non-alphabetical order
        out = _terms_model(w, xs)
        return {"vec": out["vec"], "main": out["main"], "aux": out["aux"]}

    jac, table = maybe_jit(jt.stats.jacrev(fun, stats=("norm", "max_abs"), loop_axes={"c": 1}))(0.7, xs)
    _, tag_jacs = jt.jacrev(fun)(0.7, xs)
    expected = stats.summarize(tag_jacs, terms=jax.eval_shape(fun, 0.7, xs), stats=("norm", "max_abs"), loop_axes={"c": 1})
    assert list(table) == ["c", "h"] and all(list(per_term) == ["vec", "main", "aux"] for per_term in table.values())
    for name in expected:
        for term in expected[name]:
            for stat in ("norm", "max_abs"):
                np.testing.assert_allclose(table[name][term][stat], expected[name][term][stat], rtol=1e-12)
    np.testing.assert_allclose(jac["main"], jax.jacrev(lambda w: fun(w, xs)["main"])(0.7), rtol=1e-12)
    assert stats.format_paths(table).splitlines()[0].split() == ["tag", "vec", "main", "aux"]
    (_, with_aux), aux = jt.stats.jacrev(lambda w: (fun(w, xs), 1.0), has_aux=True)(0.7)
    assert aux == 1.0 and list(with_aux["h"]) == ["vec", "main", "aux"]


def test_stats_jacrev_param_stats_is_the_parameters_table(maybe_jit):
    """param_stats=True: each parameter's Jacobian reduced per term, named by its path, zeros where no path."""
    xs = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)
    params = {"w": jnp.array([[0.5, -1.0], [2.0, 0.3]]), "head": {"b": jnp.array([0.1, 0.2])}, "unused": jnp.ones(3)}

    def fun(p, xs):  # terms built in non-alphabetical order
        h = jt.tag(jnp.tanh(xs @ p["w"]), "h")
        return {"main": jnp.sum((h + p["head"]["b"]) ** 2), "aux": jnp.mean(h**2)}

    jac, _ = maybe_jit(jt.stats.jacrev(fun, stats=("norm", "max_abs"), param_stats=True))(params, xs)
    full = jax.jacrev(fun)(params, xs)
    assert list(jac) == ["head.b", "unused", "w"]  # the parameters' leaves in their order (dict keys sorted)
    for name, get in (("head.b", lambda t: t["head"]["b"]), ("unused", lambda t: t["unused"]), ("w", lambda t: t["w"])):
        assert list(jac[name]) == ["main", "aux"]
        for term in ("main", "aux"):
            np.testing.assert_allclose(jac[name][term]["norm"], np.linalg.norm(np.ravel(get(full[term]))), rtol=1e-12)
            np.testing.assert_allclose(jac[name][term]["max_abs"], np.max(np.abs(get(full[term]))), rtol=1e-12)
    text = stats.format_paths(jac, header="parameter").splitlines()
    assert text[0].split() == ["parameter", "main", "aux"]
    assert text[1].endswith("0 (none)") and text[2].split()[1:] == ["0", "(none)", "0", "(none)"]  # aux misses head.b; nothing reaches unused


def test_summarize_terms_structure_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="structure of terms="):
        stats.summarize({"h": {"a": jnp.ones(2)}}, terms={"b": 1.0, "c": 2.0})


def test_value_and_grad_exports_with_a_symbolic_batch():
    def loss(w, xs):
        def step(h, x):
            return jt.tag(jnp.tanh(w * h + x), "h"), None

        return jnp.sum(lax.scan(step, jnp.zeros(xs.shape[1:]), xs)[0])

    (b,) = export.symbolic_shape("b")
    for per_example in (False, True):
        step = jax.jit(stats.value_and_grad(loss, per_example=per_example))
        exported = export.export(step)(jax.ShapeDtypeStruct((), jnp.float64), jax.ShapeDtypeStruct((5, b), jnp.float64))
        xs = jnp.linspace(-1, 1, 15).reshape(5, 3)
        got, want = exported.call(0.5, xs), step(0.5, xs)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-12)


def test_history_format_names_the_root_module():
    """tag_modules names the root module "": the log line shows it as "" rather than a blank."""
    h = jt.stats.History()
    h.append(3, {"": {"norm": np.float32(1.0)}, "fc": {"norm": np.float32(2.0)}})
    assert h.format() == 'step 3  | norm: "" 1  fc 2'


@pytest.mark.long_eager
def test_value_stats_match_numpy_on_captured_values(problem, maybe_jit):
    """with_values=True: the statistics of the values at the tags (jt.capture, reduced by NumPy), with the
    keys and loop axes of the gradient statistics (jt.grad's cotangents, reduced by NumPy)."""
    params, xs = problem
    _, values = jt.capture(model)(params, xs)
    _, (_, tag_grads) = jt.value_and_grad(model)(params, xs)
    value, (grads, tag_stats), value_stats = maybe_jit(stats.value_and_grad(model, stats=ALL, with_values=True))(params, xs)
    np.testing.assert_allclose(value, model(params, xs), rtol=1e-13)
    assert_stats_match(value_stats, values, LOOP_AXES, names=ALL)
    assert_stats_match(tag_stats, tag_grads, LOOP_AXES, names=ALL)
    assert value_stats["rnn.h"]["rms"].shape == (6,) and value_stats["shared"]["norm"].shape == (3,)
    _, _, per_example = maybe_jit(stats.value_and_grad(model, tags="rows", per_example=True, with_values=True))(params, xs)
    assert_stats_match(per_example, {"rows": values["rows"]}, {"rows": 2})


def scanned_stack(ws, x):
    """A stack of layers run by lax.scan over their stacked weights: one tag, one entry per layer."""

    def layer(h, w):
        return jt.tag(jnp.tanh(h @ w), "layer"), None

    h, _ = lax.scan(layer, x, ws)
    return jnp.mean((h - 0.5) ** 2)


def test_history_keeps_value_stats_and_layer_flow_draws_each_scanned_layer():
    ws = jax.random.normal(jax.random.PRNGKey(1), (4, 3, 3)) * jnp.array([0.5, 1.0, 2.0, 4.0])[:, None, None]
    x = jax.random.normal(jax.random.PRNGKey(2), (5, 3))
    step = jax.jit(stats.value_and_grad(scanned_stack, stats=("norm", "rms"), with_values=True))
    history = stats.History()
    want_values, want_grads = [], []
    for i in range(3):
        loss, (grads, tag_stats), value_stats = step(ws, x)
        history.append(10 * i, tag_stats, value_stats, loss=loss)
        want_values.append(numpy_stats(jt.capture(scanned_stack)(ws, x)[1]["layer"], 1))
        want_grads.append(numpy_stats(jt.grad(scanned_stack)(ws, x)[1]["layer"], 1))
        ws = ws - 0.5 * grads
    for got, want in ((history.values, want_values), (history, want_grads)):
        for stat in ("norm", "rms"):
            assert got.array("layer", stat).shape == (3, 4)  # (appends, layers)
            np.testing.assert_allclose(got.array("layer", stat), np.stack([w[stat] for w in want]), rtol=1e-12)
    assert history.values.steps.tolist() == [0, 10, 20] and history.values.names == ["layer"]
    np.testing.assert_array_equal(history.values.scalar("loss"), history.scalar("loss"))
    history.append(30, tag_stats)  # no value statistics at this step: nan there
    assert np.all(np.isnan(history.values.array("layer")[-1])) and np.all(np.isfinite(history.array("layer")))
    with pytest.raises(TypeError, match="append to the History itself"):
        history.values.append(40, value_stats)
    with pytest.raises(TypeError, match=r"value_stats\['layer'\] should be a dict"):
        history.append(40, tag_stats, {"layer": jnp.ones(4)})
    assert len(history) == 4  # the refused append added no step

    pytest.importorskip("matplotlib")
    from jaxtrace import plot

    fig = plot.layer_flow(history, "norm")
    assert [ax.get_title() for ax in fig.axes] == ["activation norm per layer", "gradient norm per layer"]
    for ax, table in zip(fig.axes, (history.values, history)):
        assert [line.get_label() for line in ax.lines] == [f"layer[{i}]" for i in range(4)]  # one per layer
        for i, line in enumerate(ax.lines):
            np.testing.assert_array_equal(line.get_xdata(), history.steps)
            np.testing.assert_allclose(line.get_ydata(), table.array("layer")[:, i], rtol=1e-12)
    only_grads = stats.History()
    only_grads.append(0, tag_stats)
    assert [ax.get_title() for ax in plot.layer_flow(only_grads).axes] == ["gradient norm per layer"]
    with pytest.raises(ValueError, match="no statistics of these tags"):
        plot.layer_flow(stats.History())


def spike_recipe():
    """Run the guide's "Debugging a loss spike" block (30 steps, an outlier at step 25); its namespace."""
    page = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "training-statistics.md"
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S) if "def forensics" in b]
    namespace: dict = {}
    exec(compile(code, str(page), "exec"), namespace)
    return namespace


@pytest.mark.long  # compiles the forensics (per_example_norms and per-layer statistics): ~20 s here
def test_spike_recipe_names_the_outlier_example_and_layer():
    """The spike recipe of the guide: its step flags a loss above 5x its running mean, and the forensics
    on that step name the example with the largest gradient norm and the first layer where its
    activation is 10x the batch median's, checked against per-example jax.grad and jt.capture reduced by
    NumPy; the compiled step does the plain step's work and no more."""
    pytest.importorskip("equinox")
    pytest.importorskip("optax")
    import equinox as eqx

    ns = spike_recipe()
    assert ns["found"] == [(25, 17, "layers.0")]  # the guide's own injection, found on that step alone
    step, forensics, batch, layers = ns["step"], ns["forensics"], ns["batch"], ns["LAYERS"]
    model, opt_state, average = ns["model"], ns["opt_state"], ns["average"]

    x, y = batch(jax.random.key(100))
    _, _, new_average, _, spike = step(model, opt_state, average, x, y)
    assert not spike and float(new_average) != float(average)

    def oracle(x, y):
        """Per-example gradient norms, one jax.grad per example, and per-layer activation norms per example."""
        norms = []
        for i in range(len(x)):
            g = eqx.filter_grad(lambda m: ns["per_example_losses"](m, x[i : i + 1], y[i : i + 1])[0])(model)
            norms.append(np.sqrt(sum(np.sum(np.asarray(leaf, np.float64) ** 2) for leaf in jax.tree_util.tree_leaves(g))))
        _, values = jt.capture(lambda m, x: jax.vmap(m)(x))(jt.tag_modules(model, layers), x)
        per_layer = [np.linalg.norm(np.asarray(values[n], np.float64).reshape(len(x), -1), axis=1) for n in layers]
        return np.array(norms), per_layer

    for outlier, label, want_layer in ((3, None, 0), (40, 30.0, -1)):  # an input 300x too large; a wrong label
        x, y = batch(jax.random.key(101), outlier=None if label else outlier)
        if label is not None:
            y = y.at[outlier].set(label)
        _, _, new_average, loss, spike = step(model, opt_state, average, x, y)
        assert bool(spike) and float(new_average) == float(average)  # a spike does not move the threshold
        report = forensics(model, x, y)
        assert int(report["example"]) == outlier and int(report["layer"]) == want_layer
        norms, per_layer = oracle(x, y)
        np.testing.assert_allclose(report["example_norms"], norms, rtol=1e-4)
        ratios = [v[outlier] / np.median(v) for v in per_layer]
        np.testing.assert_allclose(report["layer_ratios"], ratios, rtol=1e-4)
        assert int(np.argmax(norms)) == outlier

    # The step is the plain step and a comparison: no conditional, the plain step's matrix products,
    # no sort (the medians) and no per-example work; those are in the forensics' own program.
    optimizer, mean_loss = ns["optimizer"], ns["mean_loss"]

    def plain_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(mean_loss)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    spike_hlo = step.lower(model, opt_state, average, x, y).compile().compiled.as_text()
    plain_hlo = eqx.filter_jit(plain_step).lower(model, opt_state, x, y).compile().compiled.as_text()
    normal, branch = hlo_work(spike_hlo)
    assert not branch and " conditional(" not in spike_hlo
    assert normal == hlo_work(plain_hlo)[0] and not any(op == "sort" for op, _ in normal)
    apart = hlo_work(forensics.lower(model, x, y).compile().compiled.as_text())[0]
    assert sum(n for (op, _), n in apart.items() if op == "sort") >= 1  # the medians
    # a forward and a backward pass over the batch (products whose results have its rows), and more; not the
    # batch's weight gradients, which the norms do not need (JAX 0.12.1's XLA leaves them out)
    over_batch = lambda work: sum(n for (op, shape), n in work.items() if op != "sort" and shape.startswith(f"f64[{len(x)},"))  # noqa: E731
    assert over_batch(apart) >= over_batch(normal) > 0, (apart, normal)


def hlo_work(text: str):
    """Matrix products (dots, library-call fusions) and sorts, by result shape, of a compiled program:
    outside and inside the branch of its one ``conditional`` that holds the most (``Counter()`` without one)."""
    import collections

    comps, entry, name = {}, None, None
    for line in text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith((" ", "HloModule")):
            head = line.split()
            name = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
            comps[name] = []
            entry = name if head[0] == "ENTRY" else entry
        elif line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line)

    def called(line):
        names = re.findall(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)", line)
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        return names + ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else [])

    def work(start, skip=()):
        seen, todo, found = set(), [start], collections.Counter()
        while todo:
            comp = todo.pop()
            if comp in seen or comp in skip:
                continue
            seen.add(comp)
            for line in comps[comp]:
                m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\(.*?\)|[^\s(]+)\s+(dot|convolution|sort|fusion)\(", line)
                if m and (m.group(2) != "fusion" or "kind=kCustom" in line):  # a kCustom fusion: a library matmul
                    found[(m.group(2), re.sub(r"\{[^}]*\}", "", m.group(1)))] += 1
                todo.extend(called(line))
        return found

    conds = [line for lines in comps.values() for line in lines if " conditional(" in line]
    if not conds:
        return work(entry), collections.Counter()
    assert len(conds) == 1, conds
    heavy = max(called(conds[0]), key=lambda b: sum(work(b).values()))
    return work(entry, {heavy}), work(heavy)
