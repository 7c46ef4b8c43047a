"""Models with leaves that are not arrays (an ``eqx.nn.Lambda``, strings, Python numbers): what
``jt.grad`` says, and what the filter transforms give, ``with_values`` too.

Oracles: the hand-written ``+ eps`` program (``oracles.eps_oracle``) and the plain forward
values, in float64, eager and under jit; ``jax.vmap`` around.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import jaxtrace as jt

from oracles import assert_close, eps_oracle, zeros_like

F64 = jnp.float64
X = jnp.linspace(-1.0, 1.0, 12, dtype=F64).reshape(4, 3)


# --- an equinox model with an eqx.nn.Lambda ------------------------------------------------


def lambda_model():
    k1, k2 = jax.random.split(jax.random.key(0))
    return eqx.nn.Sequential(
        [eqx.nn.Linear(3, 5, key=k1, dtype=F64), eqx.nn.Lambda(jnp.tanh), eqx.nn.Linear(5, 2, key=k2, dtype=F64)]
    )


def lambda_loss(model, x):
    return jnp.sum(jnp.sin(jax.vmap(model)(x)) ** 2)


def lambda_oracle(model, eps, x):
    """The same model written with + eps at each layer's output: (loss, values at the layers)."""
    l0, l2 = model.layers[0], model.layers[2]
    h0 = jax.vmap(l0)(x) + eps["0"]
    h1 = jnp.tanh(h0) + eps["1"]
    h2 = jax.vmap(l2)(h1) + eps["2"]
    return jnp.sum(jnp.sin(h2) ** 2), {"0": h0, "1": h1, "2": h2}


def _eps(model):
    _, values = lambda_oracle(model, {"0": 0.0, "1": 0.0, "2": 0.0}, X)
    return zeros_like(values)


def test_jt_grad_on_a_model_with_a_lambda_says_what_to_use():
    model = lambda_model()
    with pytest.raises(TypeError) as info:
        jt.grad(lambda_loss)(model, X)
    message = str(info.value)
    assert "argument 0 at .layers[1].fn" in message  # where the non-array leaf is
    assert "jt.filter_grad / jt.filter_value_and_grad" in message and "jaxtrace.flax" in message
    with pytest.raises(TypeError, match="filter_value_and_grad"):
        jt.value_and_grad(lambda_loss)(model, X)


def test_jt_grad_on_a_string_leaf():
    with pytest.raises(TypeError, match=r"argument 1 at \['name'\]: a str"):
        jt.grad(lambda w, cfg: jnp.sum(w), argnums=(0, 1))(jnp.ones(2), {"name": "fc"})


def test_python_numbers_are_still_arrays_to_jt_grad():
    grads, _ = jt.grad(lambda w: jt.tag(3.0 * w, "h") ** 2)(1.0)
    assert float(grads) == 18.0


@pytest.mark.parametrize("wrap", [lambda f: f, eqx.filter_jit], ids=["eager", "filter_jit"])
def test_filter_value_and_grad_with_values_against_eps(wrap):
    model = jt.tag_modules(lambda_model(), ["0", "1", "2"])
    value, (grads, tag_grads), tag_values = wrap(jt.filter_value_and_grad(lambda_loss, with_values=True))(model, X)
    eps = _eps(model)
    (expected_value, expected_values), expected = eps_oracle(
        lambda e: lambda_oracle(model, e, X), eps, value=True, has_aux=True
    )
    assert_close(value, expected_value)
    assert_close(tag_grads, expected)
    assert_close(tag_values, expected_values)
    assert grads.layers[1].fn is None  # a Lambda has no gradient, as eqx.filter_grad gives it
    # filter_grad: (grads, tag_grads, tag_values); has_aux: ((grads, tag_grads), aux, tag_values)
    g, tg, tv = jt.filter_grad(lambda_loss, with_values=True)(model, X)
    assert_close(tg, expected)
    assert_close(tv, expected_values)
    (g2, tg2), aux, tv2 = jt.filter_grad(lambda m, x: (lambda_loss(m, x), "aux"), has_aux=True, with_values=True)(model, X)
    assert aux == "aux"
    assert_close(tg2, expected)
    assert_close(tv2, expected_values)
    # without with_values nothing changes
    assert len(jt.filter_grad(lambda_loss)(model, X)) == 2
    value_only = jt.filter_value_and_grad(lambda_loss)(model, X)
    assert len(value_only) == 2 and len(value_only[1]) == 2


def test_filter_value_and_grad_with_values_under_vmap():
    model = jt.tag_modules(lambda_model(), ["1"])

    def one(x):
        return jt.filter_value_and_grad(lambda m, x: jnp.sum(jnp.sin(m(x)) ** 2), with_values=True)(model, x)

    value, (_, tag_grads), tag_values = jax.vmap(one)(X)
    eps = _eps(model)
    expected = eps_oracle(lambda e: lambda_oracle(model, e, X)[0], eps)
    assert_close(tag_grads["1"], expected["1"])
    assert_close(tag_values["1"], jnp.tanh(jax.vmap(model.layers[0])(X)))


# --- a Python number in a model stays a Python number (eqx.nn.Dropout(0.0), as in eqx.nn.MultiheadAttention) ---


def dropout_model():
    return eqx.nn.Sequential([eqx.nn.Linear(3, 2, key=jax.random.key(1), dtype=F64), eqx.nn.Dropout(0.0)])


def dropout_loss(model, x):
    return jnp.sum(jnp.sin(jax.vmap(model)(x)) ** 2)


def dropout_losses(model, x):
    return jnp.sum(jnp.sin(jax.vmap(model)(x)) ** 2, axis=-1)


def dropout_oracle(model, eps, x):
    """By hand: the Linear, + eps at each module's output (Dropout(0.0) is the identity)."""
    h0 = jax.vmap(model.layers[0])(x) + eps["0"]
    h1 = h0 + eps["1"]
    return jnp.sum(jnp.sin(h1) ** 2), {"0": h0, "1": h1}


@pytest.mark.parametrize("wrap", [lambda f: f, eqx.filter_jit], ids=["eager", "filter_jit"])
def test_a_python_number_in_a_model_stays_one_in_every_entry_point(wrap):
    """eqx.nn.Dropout(0.0) shortcuts on ``p == 0`` only while ``p`` is a Python float: a traced ``p``
    asks for a key. Every jaxtrace entry point that takes a model must hand it over as it is."""
    plain = dropout_model()
    model = jt.tag_modules(plain)
    eps = {"0": jnp.zeros((4, 2), F64), "1": jnp.zeros((4, 2), F64)}
    (loss, values), tag_grads = eps_oracle(lambda e: dropout_oracle(plain, e, X), eps, value=True, has_aux=True)
    grads = eqx.filter_grad(dropout_loss)(plain, X)

    report = wrap(jt.find_nonfinite(dropout_loss))(model, X)
    assert float(report.value) == pytest.approx(float(loss), rel=1e-12)
    assert report.first_value is None and report.first_gradient is None and report.params == []
    assert report.names == ["0", "1", ""]
    assert_close({k: v for k, v in wrap(jt.capture(dropout_loss))(model, X)[1].items() if k != ""}, values)
    assert_close(wrap(jt.patch(dropout_loss, {"1": lambda v: v}))(model, X), loss)
    assert_close(wrap(jt.patch_grad(dropout_loss, {"1": lambda g: g}))(model, X), loss)
    value, (g, tg) = wrap(jt.filter_value_and_grad(dropout_loss, tags=["0", "1"]))(model, X)
    linear, want = g.layers[0], grads.layers[0]
    assert_close((value, linear.weight, linear.bias, tg), (loss, want.weight, want.bias, tag_grads))
    assert g.layers[1].p is None  # the Python float is not differentiated, as eqx.filter_grad gives it
    _, (_, stats) = wrap(jt.filter_value_and_grad(dropout_loss, tags=["0", "1"], stats=True))(model, X)
    assert_close(stats["1"]["norm"], jnp.linalg.norm(tag_grads["1"]))
    jac, _ = wrap(jt.filter_jacrev(dropout_losses, tags=["1"]))(model, X)
    with_weight = lambda w: dropout_losses(eqx.tree_at(lambda m: m.layers[0].weight, plain, w), X)  # noqa: E731
    assert_close(jac.layers[0].weight, jax.jacrev(with_weight)(plain.layers[0].weight))
    per_example_losses, sq_norms = wrap(jt.per_example_norms(dropout_losses, total=True))(plain, X)
    by_example = jax.vmap(lambda x: eqx.filter_grad(lambda m: dropout_losses(m, x[None])[0])(plain))(X)
    leaves = jax.tree_util.tree_leaves(eqx.filter(by_example, eqx.is_inexact_array))
    expected = sum(jnp.sum(leaf.reshape(4, -1) ** 2, axis=1) for leaf in leaves)
    assert_close((jnp.sum(per_example_losses), sq_norms), (loss, expected))


def test_find_nonfinite_on_multihead_attention_under_filter_jit():
    """The issue's case: eqx.nn.MultiheadAttention holds a default Dropout(0.0), as a ViT's blocks do."""
    attention = jt.tag_modules(eqx.nn.MultiheadAttention(2, 4, key=jax.random.key(0), dtype=F64))
    x = jnp.linspace(-1.0, 1.0, 12, dtype=F64).reshape(3, 4)

    def loss(model, x):
        return jnp.sum(model(x, x, x) ** 2)

    report = eqx.filter_jit(jt.find_nonfinite(loss))(attention, x)
    assert float(report.value) == pytest.approx(float(loss(attention, x)), rel=1e-12)
    assert report.first_value is None and report.params == []
