"""Seams of the core split (issue 34): a tag called under jax.vmap and also unbatched, one tag
vmapped over a different axis in each branch of a cond, and literal constants in the runs of
equations that are spliced as one cached call. Every number against the hand-written ``+ eps``
program (float64), eager and under jit."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import assert_close
from jax import lax

import jaxtrace as jt
from jaxtrace import _fused_runs

XS = jnp.arange(12.0).reshape(4, 3) / 7 - 0.5

# --- a tag called under vmap and once unbatched: the documented TagError, in either order ------


def vmapped_and_plain(order, repeated):
    def g(v):
        return jnp.sum(jnp.sin(jt.tag(v * 2.0, "h", repeated=repeated)))

    def f(x):
        batched = lambda: jnp.sum(jax.vmap(g)(x))  # noqa: E731
        plain = lambda: g(x[0])  # noqa: E731
        return batched() + plain() if order == "vmap_first" else plain() + batched()

    return f


TRANSFORMS = {
    "grad": lambda f: jt.grad(f),
    "grad_with_values": lambda f: jt.grad(f, with_values=True),
    "value_and_grad_with_values": lambda f: jt.value_and_grad(f, with_values=True),
    "capture": lambda f: jt.capture(f),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("order", ["vmap_first", "plain_first"])
@pytest.mark.parametrize("repeated", [False, True])
def test_a_tag_called_under_vmap_and_unbatched_is_a_tag_error(maybe_jit, transform, order, repeated):
    f = vmapped_and_plain(order, repeated)
    message = "different shapes" if repeated else "used at 2 sites"
    with pytest.raises(jt.TagError, match=message):
        maybe_jit(TRANSFORMS[transform](f))(XS)


def test_a_tag_called_under_vmap_and_unbatched_does_not_stop_other_tags(maybe_jit):
    def f(x, e=None):
        y = jt.tag(jnp.cos(x), "other") if e is None else jnp.cos(x) + e
        return vmapped_and_plain("vmap_first", False)(y)

    _, tag_grads = maybe_jit(jt.grad(f, tags="other"))(XS)
    assert_close(tag_grads["other"], jax.grad(f, argnums=1)(XS, jnp.zeros_like(XS)))


# --- one tag in both branches of a cond, vmapped over a different axis in each -----------------


def per_row(v, e=None):
    h = v * 2.0
    h = jt.tag(h, "h") if e is None else h + e
    return jnp.sum(jnp.sin(h)) * v[0]


def two_axes(x, p, e=None):
    """Branch ``True`` vmaps over the rows of ``x`` (in_axes=0), branch ``False`` over the columns
    of ``x.T`` (in_axes=1): the tag is ``(3,)`` per example in both, ``(4, 3)`` documented."""
    if e is None:
        rows = lambda x: jnp.sum(jax.vmap(per_row)(x) ** 2)  # noqa: E731
        cols = lambda x: jnp.sum(jax.vmap(per_row, in_axes=1)(x.T) ** 2)  # noqa: E731
        return lax.cond(p, rows, cols, x)
    rows = lambda x, e: jnp.sum(jax.vmap(per_row)(x, e) ** 2)  # noqa: E731
    cols = lambda x, e: jnp.sum(jax.vmap(per_row, in_axes=(1, 0))(x.T, e) ** 2)  # noqa: E731
    return lax.cond(p, rows, cols, x, e)


@pytest.mark.parametrize("p", [True, False])
def test_cond_branches_vmapping_a_tag_over_different_axes(maybe_jit, p):
    p = jnp.asarray(p)
    e0 = jnp.zeros((4, 3))
    g, tag_grads, values = maybe_jit(jt.grad(two_axes, with_values=True))(XS, p)
    assert tag_grads["h"].shape == (4, 3)
    assert_close(tag_grads["h"], jax.jit(jax.grad(two_axes, argnums=2))(XS, p, e0))
    assert_close(g, jax.jit(jax.grad(two_axes))(XS, p, e0))
    assert_close(values["h"], 2 * XS)
    _, captured = maybe_jit(jt.capture(two_axes))(XS, p)
    assert_close(captured["h"], 2 * XS)
    # A replacement goes back into each branch's own layout.
    new = jnp.cos(XS)
    patched = maybe_jit(jt.patch(two_axes, {"h": new}))(XS, p)
    assert_close(patched, jax.jit(two_axes)(XS, p, new - 2 * XS))
    _, out_tangent, tangents = jt.jvp(lambda x: two_axes(x, p), (XS,), (jnp.ones_like(XS),))
    assert_close(tangents["h"], 2 * jnp.ones_like(XS))
    oracle = jax.jit(lambda x, t: jax.jvp(lambda x: two_axes(x, p, e0), (x,), (t,))[1])
    assert_close(out_tangent, oracle(XS, jnp.ones_like(XS)))


@pytest.mark.long_eager
def test_vmapped_cond_branches_vmapping_a_tag_over_different_axes(maybe_jit):
    """The same under an outer jax.vmap with a per-example predicate (JAX batches the cond)."""

    def one(x, e=None):
        return two_axes(x, jnp.sum(x) > 0, e)

    f = lambda xs: jnp.sum(jax.vmap(one)(xs) ** 2)  # noqa: E731
    f_eps = lambda xs, e: jnp.sum(jax.vmap(one)(xs, e) ** 2)  # noqa: E731
    xs = jnp.stack([XS + 1, XS - 1])  # one example per branch
    g, tag_grads, values = maybe_jit(jt.grad(f, with_values=True))(xs)
    e0 = jnp.zeros((2, 4, 3))
    assert tag_grads["h"].shape == (2, 4, 3)
    assert_close(tag_grads["h"], jax.jit(jax.grad(f_eps, argnums=1))(xs, e0))
    assert_close(g, jax.jit(jax.grad(f_eps))(xs, e0))
    assert_close(values["h"], 2 * xs)  # both branches tag it: no example is masked
    patched = maybe_jit(jt.patch(f, {"h": jnp.cos(xs)}))(xs)
    assert_close(patched, jax.jit(f_eps)(xs, jnp.cos(xs) - 2 * xs))


@pytest.mark.long_eager
def test_a_vmapped_cond_around_branches_of_different_ranks(maybe_jit):
    """A cond whose branches tag values of different ranks, in a branch of a vmapped cond: the
    documented TagError when asked for, and the other tags as without it."""

    def inner(x):
        whole = lambda x: jnp.sum(jt.tag(x, "h"))  # noqa: E731
        lifted = lambda x: jnp.sum(jt.tag(x[None], "h"))  # noqa: E731
        return lax.cond(x[0] > 0.5, whole, lifted, x)

    def one(x, e=None):
        other = lambda x: jnp.sum(jt.tag(jnp.sin(x), "o") if e is None else jnp.sin(x) + e)  # noqa: E731
        return lax.cond(jnp.sum(x) > 0, inner, other, x)

    xs = jnp.arange(6.0).reshape(2, 3) - 2
    f = lambda xs: jnp.sum(jax.vmap(one)(xs))  # noqa: E731
    f_eps = lambda xs, e: jnp.sum(jax.vmap(one)(xs, e))  # noqa: E731
    _, tag_grads = maybe_jit(jt.grad(f, tags="o"))(xs)
    assert_close(tag_grads["o"], jax.grad(f_eps, argnums=1)(xs, jnp.zeros_like(xs)))
    with pytest.raises(jt.TagError, match="different shapes in the branches"):
        maybe_jit(jt.grad(f))(xs)


# --- literal constants in spliced runs ----------------------------------------------------------


def layers(w, x, c, e=None):
    """Four layers; each has a literal ``c`` and a mean's division in runs of untagged equations."""
    for i in range(4):
        h = jnp.tanh(x @ w) * c
        h = jt.tag(h, f"h{i}") if e is None else h + e[i]
        x = h - jnp.mean(h) / 3.0
    return jnp.sum(x**2)


W = jax.random.normal(jax.random.PRNGKey(1), (3, 3)) / 2
X = jnp.arange(3.0) - 0.5


@pytest.mark.parametrize("c", [2.0, 3.0])
def test_runs_with_literal_constants_are_spliced_and_cached(c):
    _fused_runs.run_function.cache_clear()
    traces = []

    def f(w, x):
        traces.append(None)
        return layers(w, x, c)

    e0 = jnp.zeros((4, 3))
    oracle = {f"h{i}": g for i, g in enumerate(jax.grad(layers, argnums=3)(W, X, c, e0))}
    g, tag_grads = jt.grad(f)(W, X)
    assert_close(tag_grads, oracle)
    assert_close(g, jax.grad(layers)(W, X, c, e0))
    first = _fused_runs.run_function.cache_info()
    # The layers' runs hold literals (c, the mean's count, 3.0) and are spliced: the repeated
    # layers share their functions.
    assert first.hits >= 6, first
    jt.grad(f)(W, X)
    second = _fused_runs.run_function.cache_info()
    assert second.misses == first.misses and second.hits > first.hits, (first, second)
    # Under jax.jit the second call does not trace the function again.
    jitted = jax.jit(jt.grad(f))
    traces.clear()
    assert_close(jitted(W, X)[1], oracle)
    assert_close(jitted(W, X)[1], oracle)
    assert len(traces) == 1


def test_runs_that_differ_only_in_a_constant_do_not_share_a_splice(maybe_jit):
    _fused_runs.run_function.cache_clear()
    e0 = jnp.zeros((4, 3))
    for c in (2.0, 3.0, 2.0, -0.5):
        _, tag_grads = maybe_jit(jt.grad(lambda w, x: layers(w, x, c)))(W, X)
        oracle = jax.grad(layers, argnums=3)(W, X, c, e0)
        assert_close(tag_grads, {f"h{i}": g for i, g in enumerate(oracle)})


def test_constants_are_keyed_by_their_bits():
    def key(val, aval=None):
        found = _fused_runs.constant(types.SimpleNamespace(val=val, aval=aval))
        assert found is not None
        return found

    assert key(2.0) == key(2.0) and hash(key(2.0)) == hash(key(2.0))
    assert key(0.0) != key(-0.0)
    assert key(2) != key(2.0) and key(True) != key(1)
    assert key(np.float32(2.0)) != key(np.float64(2.0))
    assert key(np.array([1.0, 2.0])) != key(np.array([[1.0, 2.0]]))
    assert key(float("nan")) == key(float("nan"))  # the same bits: one function is right for both
    assert key(np.array(2.0), "weak") != key(np.array(2.0), "strong")
    # Too large to key cheaply, or not readable as bits: the run is left unspliced.
    assert _fused_runs.constant(types.SimpleNamespace(val=np.zeros(1000), aval=None)) is None
    assert _fused_runs.constant(types.SimpleNamespace(val=np.array([object()]), aval=None)) is None
