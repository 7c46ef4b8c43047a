"""jt.jacrev: Jacobians at tags (which output reaches which tag), against jax.jacrev of the
hand-written ``+ eps`` program, float64, eager and under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import assert_close
from jax import export, lax

import jaxtrace as jt

W = jax.random.normal(jax.random.PRNGKey(0), (3, 3)) / 2
X = jnp.arange(3.0) - 0.5
XS = jax.random.normal(jax.random.PRNGKey(1), (4, 3))


def losses(w, x, eps=None):
    """Three terms: one reaches 'h' directly, one through a slice, one is cut by stop_gradient."""
    h = jnp.tanh(w @ x)
    h = jt.tag(h, "h") if eps is None else h + eps
    return {"ce": jnp.sum(h**2), "aux": jnp.sin(h[:2]) * w[0, :2], "cut": jnp.sum(lax.stop_gradient(h))}


def test_matches_the_oracle_and_jax_jacrev(maybe_jit):
    jac, tag_jacs = maybe_jit(jt.jacrev(losses))(W, X)
    assert_close(jac, jax.jacrev(losses)(W, X))
    want = jax.jacrev(losses, argnums=2)(W, X, jnp.zeros(3))
    assert_close(tag_jacs["h"], want)
    assert tag_jacs["h"]["aux"].shape == (2, 3)
    assert not np.any(tag_jacs["h"]["cut"])  # the stop_gradient term never reaches h


def test_argnums_tuple_has_aux_and_with_values(maybe_jit):
    def f(w, x):
        out = losses(w, x)
        return out, {"mean": jnp.mean(x)}

    (jac, tag_jacs), aux, values = maybe_jit(jt.jacrev(f, argnums=(0, 1), has_aux=True, with_values=True))(W, X)
    assert_close(aux, {"mean": jnp.mean(X)})
    assert_close(jac, jax.jacrev(losses, argnums=(0, 1))(W, X))
    assert_close(values["h"], jnp.tanh(W @ X))
    assert_close(tag_jacs["h"]["ce"], 2 * jnp.tanh(W @ X))


def test_loops_and_vmap_inside_keep_the_layout(maybe_jit):
    def f(w, xs, eps=None):
        def step(c, inp):
            x, e = inp
            c = jnp.tanh(w @ c + x)
            c = jt.tag(c, "c") if e is None else c + e
            return c, None

        if eps is None:
            c, _ = lax.scan(lambda c, x: step(c, (x, None)), jnp.zeros(3), xs)
        else:
            c, _ = lax.scan(step, jnp.zeros(3), (xs, eps))
        per = jax.vmap(lambda r: jt.tag(jnp.sin(r), "v") if eps is None else jnp.sin(r))(xs)
        return jnp.stack([jnp.sum(c), jnp.sum(per**2)])

    _, tag_jacs = maybe_jit(jt.jacrev(f))(W, XS)
    assert tag_jacs["c"].shape == (2, 4, 3) and tag_jacs["v"].shape == (2, 4, 3)
    assert_close(tag_jacs["c"], jax.jacrev(f, argnums=2)(W, XS, jnp.zeros((4, 3))))
    assert_close(tag_jacs["v"][1], 2 * jnp.sin(XS))
    assert not np.any(tag_jacs["v"][0])


def test_vmap_around_gives_per_example_jacobians():
    _, tag_jacs = jax.vmap(jt.jacrev(losses), in_axes=(None, 0))(W, XS)
    want = jax.vmap(jax.jacrev(losses, argnums=2), in_axes=(None, 0, None))(W, XS, jnp.zeros(3))
    assert_close(tag_jacs["h"], want)


def test_pytree_and_integer_tags():
    def f(x):
        pair = jt.tag({"a": jnp.sin(x), "b": x[:2] * 2}, "pair")
        k = jt.tag(jnp.arange(2), "int")
        return jnp.stack([jnp.sum(pair["a"]), jnp.sum(pair["b"] * k)])

    _, tag_jacs = jt.jacrev(f)(X)
    assert_close(tag_jacs["pair"]["a"], jnp.stack([jnp.ones(3), jnp.zeros(3)]))
    assert_close(tag_jacs["pair"]["b"], jnp.stack([jnp.zeros(2), jnp.arange(2.0)]))
    assert tag_jacs["int"].shape == (2, 2) and tag_jacs["int"].dtype == jax.dtypes.float0


def test_errors():
    with pytest.raises(TypeError, match="callable"):
        jt.jacrev(3.0)
    with pytest.raises(jt.TagError, match="No tag named 'nope'"):
        jt.jacrev(losses, tags="nope")(W, X)
    with pytest.raises(TypeError, match="floating-point outputs"):
        jt.jacrev(lambda x: jnp.round(jt.tag(x, "h")).astype(int))(X)


def test_matrix_output_cond_not_taken_and_checkpoint(maybe_jit):
    def f(w, x, eps=None):
        def mark(v, name, i):
            return jt.tag(v, name) if eps is None else v + eps[i]

        h = jax.checkpoint(lambda x: mark(jnp.tanh(w @ x), "remat", 0))(x)
        taken = lax.cond(jnp.sum(x) > 100.0, lambda h: mark(h * 3, "never", 1), lambda h: h, h)
        return jnp.outer(taken, h)  # a matrix output

    e0 = jnp.zeros((2, 3))
    _, tag_jacs = maybe_jit(jt.jacrev(f))(W, X)
    want = jax.jacrev(f, argnums=2)(W, X, e0)
    assert tag_jacs["remat"].shape == (3, 3, 3)
    assert_close(tag_jacs["remat"], want[..., 0, :])
    assert_close(tag_jacs["never"], jnp.zeros((3, 3, 3)))  # the branch not taken: zeros


@pytest.mark.long_eager
def test_transforms_around_jacrev(maybe_jit):
    # jax.grad of a penalty on the tag Jacobians, against jax.grad of the oracle's jax.jacrev.
    penalty = lambda w: sum(jnp.sum(v**2) for v in jax.tree_util.tree_leaves(jt.jacrev(losses)(w, X)[1]))  # noqa: E731
    oracle = lambda w: sum(  # noqa: E731
        jnp.sum(v**2) for v in jax.tree_util.tree_leaves(jax.jacrev(losses, argnums=2)(w, X, jnp.zeros(3)))
    )
    assert_close(maybe_jit(jax.grad(penalty))(W), jax.grad(oracle)(W), rtol=1e-10)
    # capture around it still sees the tag (a split leaves its tags in place).
    _, values = maybe_jit(jt.capture(lambda w: jt.jacrev(losses)(w, X)))(W)
    assert_close(values["h"], jnp.tanh(W @ X))


def mixed_outputs(x, eps=None):
    """Outputs of three precisions and one of size 0, as jax.jacrev takes them."""
    t = x * 2 if eps is None else x * 2 + eps
    t = jt.tag(t, "t") if eps is None else t
    return {
        "f32": (t * 3).astype(jnp.float32),
        "bf16": jnp.sin(t).astype(jnp.bfloat16),
        "f64": t**2,
        "empty": jnp.zeros((0, 2)) * t[0],
    }


def test_mixed_precision_and_empty_outputs_as_jax_jacrev(maybe_jit):
    x = jnp.array([0.5, -1.0])
    jac, tag_jacs = maybe_jit(jt.jacrev(mixed_outputs))(x)
    want = jax.jacrev(mixed_outputs)(x)
    assert_close(jac, want, rtol=1e-2, atol=1e-2)  # bf16 rows
    assert jax.tree.map(lambda a: (a.shape, a.dtype), jac) == jax.tree.map(lambda a: (a.shape, a.dtype), want)
    want_tag = jax.jacrev(mixed_outputs, argnums=1)(x, jnp.zeros(2))
    assert_close(tag_jacs["t"], want_tag, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(tag_jacs["t"]["f64"], want_tag["f64"], rtol=1e-14)
    assert tag_jacs["t"]["empty"].shape == (0, 2, 2)


def test_jacrev_exports_with_a_symbolic_output_size():
    def f(x):
        return 2 * jt.tag(jnp.tanh(x), "h")

    (b,) = export.symbolic_shape("b")
    exported = export.export(jax.jit(jt.jacrev(f)))(jax.ShapeDtypeStruct((b, 3), jnp.float64))
    xs = jnp.arange(6.0).reshape(2, 3) / 5
    assert_close(exported.call(xs), jt.jacrev(f)(xs))
