"""Framework models at jaxtrace's seams (issue 24): non-array leaves, with_values, per-layer statistics.

Oracles: the hand-written ``+ eps`` program (an explicit eps argument
differentiated with plain ``jax.grad``) and the plain forward values, in
float64, eager and under jit; ``jax.vmap`` around where it applies.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxtrace as jt

from conftest import assert_trees_close

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
    return jax.tree_util.tree_map(jnp.zeros_like, values)


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
    (expected_value, expected_values), expected = jax.value_and_grad(
        lambda e: lambda_oracle(model, e, X), has_aux=True
    )(eps)
    assert_trees_close(value, expected_value)
    assert_trees_close(tag_grads, expected)
    assert_trees_close(tag_values, expected_values)
    assert grads.layers[1].fn is None  # a Lambda has no gradient, as eqx.filter_grad gives it
    # filter_grad: (grads, tag_grads, tag_values); has_aux: ((grads, tag_grads), aux, tag_values)
    g, tg, tv = jt.filter_grad(lambda_loss, with_values=True)(model, X)
    assert_trees_close(tg, expected) and assert_trees_close(tv, expected_values)
    (g2, tg2), aux, tv2 = jt.filter_grad(lambda m, x: (lambda_loss(m, x), "aux"), has_aux=True, with_values=True)(model, X)
    assert aux == "aux"
    assert_trees_close(tg2, expected) and assert_trees_close(tv2, expected_values)
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
    expected = jax.grad(lambda e: lambda_oracle(model, e, X)[0])(eps)
    assert_trees_close(tag_grads["1"], expected["1"])
    assert_trees_close(tag_values["1"], jnp.tanh(jax.vmap(model.layers[0])(X)))


# --- per-layer and per-step statistics ---------------------------------------------------------


class ScannedMLP(eqx.Module):
    """An equinox stack of layers run by lax.scan (weights stacked by eqx.filter_vmap)."""

    layers: eqx.nn.Linear

    def __init__(self, depth, key):
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k, dtype=F64))(jax.random.split(key, depth))

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, layer):
            return jt.tag(jnp.tanh(eqx.combine(layer, static)(h)), "layer"), None

        return lax.scan(body, x, dynamic)[0]


def scanned_oracle(model, eps, x):
    def body(h, layer_and_eps):
        (w, b), e = layer_and_eps
        return jnp.tanh(w @ h + b) + e, None

    return jnp.sum(lax.scan(body, x, ((model.layers.weight, model.layers.bias), eps))[0] ** 2)


def _per_layer_norms(grads):  # the oracle's statistic: one L2 norm per layer
    return jnp.sqrt(jnp.sum(grads**2, axis=tuple(range(1, grads.ndim))))


def test_equinox_scanned_stack_stats_per_layer(maybe_jit):
    model = ScannedMLP(4, jax.random.key(1))
    x = X[0]
    loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    value, (grads, tag_stats) = maybe_jit(jt.filter_value_and_grad(loss, stats=True))(model, x)
    expected = jax.grad(lambda e: scanned_oracle(model, e, x))(jnp.zeros((4, 3), F64))
    assert sorted(tag_stats["layer"]) == sorted(jt.stats.STATS)
    assert tag_stats["layer"]["norm"].shape == (4,)  # one per layer, no loop_axes passed
    assert_trees_close(tag_stats["layer"]["norm"], _per_layer_norms(expected))
    assert_trees_close(tag_stats["layer"]["max_abs"], jnp.max(jnp.abs(expected), axis=1))
    # stats= names; with_values: the activations' statistics, per layer too
    (_, (_, g_stats), v_stats) = jt.filter_value_and_grad(loss, stats="norm", with_values=True)(model, x)
    assert list(g_stats["layer"]) == ["norm"] and v_stats["layer"]["norm"].shape == (4,)
    grads2, g_stats2 = jt.filter_grad(loss, stats=["norm", "nonfinite"])(model, x)
    assert_trees_close(g_stats2["layer"]["norm"], _per_layer_norms(expected))


def test_equinox_lstm_cell_in_scan_stats_per_step(maybe_jit):
    cell = jt.tag_modules(eqx.nn.LSTMCell(3, 2, key=jax.random.key(2), dtype=F64))
    xs = jnp.linspace(-1.0, 1.0, 15, dtype=F64).reshape(5, 3)

    def loss(cell, xs):
        def step(carry, x):
            carry = cell(x, carry)
            return carry, carry[0]

        init = (jnp.zeros(2, F64), jnp.zeros(2, F64))
        return jnp.sum(lax.scan(step, init, xs)[1] ** 2)

    _, (_, tag_stats) = maybe_jit(jt.filter_value_and_grad(loss, stats=True))(cell, xs)
    _, (_, tag_grads) = jt.filter_value_and_grad(loss)(cell, xs)
    assert tag_stats[""]["norm"].shape == (5,)  # per step
    h, c = tag_grads[""]
    assert_trees_close(tag_stats[""]["norm"], jnp.sqrt(jnp.sum(h**2, axis=1) + jnp.sum(c**2, axis=1)))


def test_bad_stats_names_fail_when_wrapping():
    with pytest.raises(ValueError, match="unknown statistic"):
        jt.filter_value_and_grad(lambda m: 0.0, stats="l2")


def test_plain_stats_with_values():
    def loss(w, xs):
        def step(h, x):
            h = jt.tag(jnp.tanh(w * h + x), "h")
            return h, None

        return jnp.sum(lax.scan(step, jnp.zeros(2, F64), xs)[0])

    xs = jnp.ones((5, 2), F64)
    _, (_, g_stats), v_stats = jax.jit(jt.stats.value_and_grad(loss, with_values=True))(0.5, xs)
    _, _, values = jt.value_and_grad(loss, with_values=True)(0.5, xs)
    assert_trees_close(v_stats["h"]["max_abs"], jnp.max(jnp.abs(values["h"]), axis=1))
    assert g_stats["h"]["norm"].shape == (5,)


# --- an NNX scan-over-layers stack ---------------------------------------------------------------

nnx = pytest.importorskip("flax.nnx")
import jaxtrace.flax  # noqa: E402


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs, param_dtype=F64)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class Stack(nnx.Module):  # a scanned layer stack, as the Flax docs build one
    def __init__(self, rngs, depth=4):
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


def nnx_oracle(model, eps, x):
    w, b = model.blocks.lin.kernel[...], model.blocks.lin.bias[...]

    def body(x, layer):
        w, b, e = layer
        out = jnp.tanh(x @ w + b) + e
        return out, out

    out, values = lax.scan(body, x, (w, b, eps))
    return jnp.sum(jnp.sin(out) ** 2), values


def nnx_loss(model, x):
    return jnp.sum(jnp.sin(model(x)) ** 2)


def test_nnx_stack_with_values_and_stats_against_eps():
    model = jt.tag_modules(Stack(nnx.Rngs(0)), ["blocks"])
    eps = jnp.zeros((4, 4, 3), F64)
    (expected_value, expected_values), expected = jax.value_and_grad(
        lambda e: nnx_oracle(model, e, X), has_aux=True
    )(eps)
    for wrap in (lambda f: f, nnx.jit):
        value, (grads, tag_grads), tag_values = wrap(jaxtrace.flax.value_and_grad(nnx_loss, with_values=True))(model, X)
        assert_trees_close(value, expected_value)
        assert_trees_close(tag_grads["blocks"], expected)
        assert_trees_close(tag_values["blocks"], expected_values)
        _, (_, tag_stats) = wrap(jaxtrace.flax.value_and_grad(nnx_loss, stats=True))(model, X)
        assert tag_stats["blocks"]["norm"].shape == (4,)  # one per layer
        assert_trees_close(tag_stats["blocks"]["norm"], _per_layer_norms(expected))
    grads, tag_grads, tag_values = jaxtrace.flax.grad(nnx_loss, with_values=True)(model, X)
    assert_trees_close(tag_values["blocks"], expected_values)
    (grads, tag_grads), aux, tag_values = jaxtrace.flax.grad(
        lambda m, x: (nnx_loss(m, x), 7), has_aux=True, with_values=True
    )(model, X)
    assert aux == 7
    assert_trees_close(tag_grads["blocks"], expected)
    # without with_values: as before
    assert len(jaxtrace.flax.grad(nnx_loss)(model, X)) == 2
