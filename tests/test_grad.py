"""grad / value_and_grad / vjp on plain code, against explicit-perturbation oracles."""

import jax
import jax.numpy as jnp
import pytest
from oracles import assert_close, eps_oracle, plus_eps

import jaxtrace as jt

KEY = jax.random.PRNGKey(0)
W1 = jax.random.normal(KEY, (3, 4))
W2 = jax.random.normal(jax.random.PRNGKey(1), (4, 2))
X = jax.random.normal(jax.random.PRNGKey(2), (5, 3))
PARAMS = {"w1": W1, "w2": W2}


def mlp(params, x, mark):
    """A two-layer MLP; ``mark(value, name)`` is jt.tag or an explicit ``+ eps``."""
    h = mark(x @ params["w1"], "pre")
    a = mark(jnp.tanh(h), "act")
    y = a @ params["w2"]
    return jnp.sum(jnp.sin(y) * y) + 0.1 * jnp.sum(a**2)  # "act" is used twice


def tagged(params, x):
    return mlp(params, x, jt.tag)


def mlp_oracle():
    """The ``+ eps`` oracle of ``mlp``: its parameter gradients and its tag gradients."""
    eps = {"pre": jnp.zeros((5, 4)), "act": jnp.zeros((5, 4))}
    return eps_oracle(lambda params, x, eps: mlp(params, x, plus_eps(eps)), PARAMS, X, eps, argnums=(0, 2))


def test_grad_matches_oracle(maybe_jit):
    grads, tag_grads = maybe_jit(jt.grad(tagged))(PARAMS, X)
    expected_grads, expected_tags = mlp_oracle()
    assert_close(grads, expected_grads)
    assert_close(tag_grads, expected_tags)
    assert_close(grads, jax.grad(tagged)(PARAMS, X))


def test_value_and_grad(maybe_jit):
    value, (grads, tag_grads) = maybe_jit(jt.value_and_grad(tagged))(PARAMS, X)
    assert_close(value, tagged(PARAMS, X))
    _, expected_tags = mlp_oracle()
    assert_close(tag_grads, expected_tags)


def test_tag_gradient_closed_form(maybe_jit):
    def f(x):
        h = jt.tag(x**2, "h")
        return jnp.sum(jnp.sin(h))

    x = jnp.linspace(0.1, 1.0, 4)
    _, tag_grads = maybe_jit(jt.grad(f))(x)
    assert_close(tag_grads["h"], jnp.cos(x**2))


def test_argnums_tuple_and_has_aux(maybe_jit):
    def f(params, x):
        loss = tagged(params, x)
        return loss, {"loss": loss}

    (grads, tag_grads), aux = maybe_jit(jt.grad(f, argnums=(0, 1), has_aux=True))(PARAMS, X)
    expected = jax.grad(f, argnums=(0, 1), has_aux=True)(PARAMS, X)[0]
    assert isinstance(grads, tuple) and len(grads) == 2
    assert_close(grads, expected)
    assert_close(aux["loss"], tagged(PARAMS, X))
    (value, aux2), (_, tag_grads2) = maybe_jit(jt.value_and_grad(f, has_aux=True))(PARAMS, X)
    assert_close(tag_grads2, tag_grads)
    assert_close(value, aux2["loss"])


def test_argnums_nondiff_args_stay_static():
    def f(x, n, *, scale):
        for _ in range(n):  # n must stay a Python int, as with jax.grad
            x = jt.tag(jnp.sin(x), "s", repeated=True) * scale
        return jnp.sum(x)

    grads, tag_grads = jt.grad(f)(jnp.ones(3), 2, scale=2.0)
    assert_close(grads, jax.grad(f)(jnp.ones(3), 2, scale=2.0))
    assert tag_grads["s"].shape == (2, 3)


def test_pytree_tag_keeps_structure_and_dtype(maybe_jit):
    def f(x, mark):
        pair = mark({"a": x, "b": (x * 2).astype(jnp.float32)}, "pair")
        return jnp.sum(pair["a"] ** 2) + jnp.sum(pair["b"].astype(jnp.float64) ** 3)

    x = jnp.linspace(0.0, 1.0, 3)
    _, tag_grads = maybe_jit(jt.grad(lambda x: f(x, jt.tag)))(x)
    eps = {"a": jnp.zeros(3), "b": jnp.zeros(3, jnp.float32)}
    expected = eps_oracle(lambda e: f(x, lambda v, n: jax.tree.map(jnp.add, v, e)), eps)  # a pytree tag: + eps leaf by leaf
    assert_close(tag_grads["pair"], expected, rtol=1e-6)
    assert tag_grads["pair"]["b"].dtype == jnp.float32


def test_unused_tag_gives_zeros(maybe_jit):
    def f(x):
        jt.tag(x * 3.0, "unused")
        return jnp.sum(x)

    _, tag_grads = maybe_jit(jt.grad(f))(jnp.ones(2))
    assert_close(tag_grads["unused"], jnp.zeros(2))


def test_tags_selection(maybe_jit):
    f = maybe_jit(jt.grad(tagged, tags="act"))
    assert set(f(PARAMS, X)[1]) == {"act"}
    assert set(maybe_jit(jt.grad(tagged, tags=["pre"]))(PARAMS, X)[1]) == {"pre"}
    assert set(maybe_jit(jt.grad(tagged, tags=lambda n: n.startswith("p")))(PARAMS, X)[1]) == {"pre"}
    assert set(maybe_jit(jt.grad(tagged, tags=()))(PARAMS, X)[1]) == set()
    _, expected_tags = mlp_oracle()
    assert_close(f(PARAMS, X)[1]["act"], expected_tags["act"])


def test_unknown_tag_name_lists_existing():
    with pytest.raises(jt.TagError, match=r"No tag named 'nope'.*Tags found: 'pre', 'act'"):
        jt.grad(tagged, tags="nope")(PARAMS, X)


def test_vjp_non_scalar_and_vmapped_pullback(maybe_jit):
    def f(x):
        h = jt.tag(jnp.sin(x) * 2.0, "h")
        return jnp.stack([jnp.sum(h**2), jnp.sum(h)])

    x = jnp.linspace(0.1, 0.5, 3)
    out, vjp_fn = jt.vjp(f, x)
    assert_close(out, f(x))
    (x_ct,), tag_cts = maybe_jit(vjp_fn)(jnp.array([1.0, 0.0]))
    h = jnp.sin(x) * 2.0
    assert_close(tag_cts["h"], 2 * h)
    assert_close(x_ct, 2 * h * 2 * jnp.cos(x))
    # Rows of the Jacobian at the tag, one per output.
    (x_rows,), tag_rows = jax.vmap(vjp_fn)(jnp.eye(2))
    assert_close(tag_rows["h"], jnp.stack([2 * h, jnp.ones(3)]))
    assert_close(x_rows, jax.jacrev(f)(x))


def test_vjp_has_aux_and_multiple_primals():
    def f(a, b):
        h = jt.tag(a * b, "h")
        return jnp.sum(h**2), {"h": h}

    out, vjp_fn, aux = jt.vjp(f, 2.0, 3.0, has_aux=True)
    (ga, gb), tag_cts = vjp_fn(1.0)
    assert_close((ga, gb, tag_cts["h"], aux["h"]), (36.0, 24.0, 12.0, 6.0))


def test_vjp_fn_crosses_jit_boundary():
    def f(x):
        return jnp.sum(jt.tag(x * x, "h") ** 2)

    _, vjp_fn = jt.vjp(f, jnp.ones(2))
    (x_ct,), tag_cts = jax.jit(lambda fn, ct: fn(ct))(vjp_fn, 1.0)
    assert_close(tag_cts["h"], 2 * jnp.ones(2))


def test_integer_tag_gives_float0_zeros(maybe_jit):
    def f(x):
        n = jt.tag(jnp.arange(3), "index")
        return jnp.sum(x * n)

    grads, tag_grads = maybe_jit(jt.grad(f))(jnp.ones(3))
    assert tag_grads["index"].dtype == jax.dtypes.float0
    assert tag_grads["index"].shape == (3,)
    assert_close(grads, jnp.arange(3.0))


def test_stop_gradient_gives_zeros(maybe_jit):
    def f(x):
        h = jt.tag(x * 2.0, "h")
        return jnp.sum(jax.lax.stop_gradient(h) * x)

    _, tag_grads = maybe_jit(jt.grad(f))(jnp.ones(2))
    assert_close(tag_grads["h"], jnp.zeros(2))


def test_non_scalar_output_errors_like_jax_grad():
    with pytest.raises(TypeError, match="scalar"):
        jt.grad(lambda x: jt.tag(x, "h") * 2)(jnp.ones(3))


def test_python_scalar_arguments():
    grads, tag_grads = jt.grad(lambda w: jt.tag(3.0 * w, "h") ** 2)(1.0)
    assert float(grads) == 18.0 and float(tag_grads["h"]) == 6.0
