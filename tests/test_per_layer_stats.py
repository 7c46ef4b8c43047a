"""Statistics and values per layer and per step: layer stacks run by ``lax.scan`` / ``nnx.scan``
(equinox, Flax NNX), a cell stepped in a scan, and the checks of statistic names.

Oracles: the hand-written ``+ eps`` program (``oracles.eps_oracle``), its tag gradients
reduced by hand per layer, and the plain forward values, in float64, eager and under jit.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxtrace as jt

from conftest import assert_trees_close
from oracles import eps_oracle, nnx_stack_by_hand

F64 = jnp.float64
X = jnp.linspace(-1.0, 1.0, 12, dtype=F64).reshape(4, 3)


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


@pytest.mark.long_eager
def test_equinox_scanned_stack_stats_per_layer(maybe_jit):
    model = ScannedMLP(4, jax.random.key(1))
    x = X[0]
    loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    value, (grads, tag_stats) = maybe_jit(jt.filter_value_and_grad(loss, stats=True))(model, x)
    expected = eps_oracle(lambda e: scanned_oracle(model, e, x), jnp.zeros((4, 3), F64))
    assert sorted(tag_stats["layer"]) == sorted(jt.stats.STATS)
    assert tag_stats["layer"]["norm"].shape == (4,)  # one per layer, no loop_axes passed
    assert_trees_close(tag_stats["layer"]["norm"], _per_layer_norms(expected))
    assert_trees_close(tag_stats["layer"]["max_abs"], jnp.max(jnp.abs(expected), axis=1))
    # stats= names; with_values: the activations' statistics, per layer too
    (_, (_, g_stats), v_stats) = jt.filter_value_and_grad(loss, stats="norm", with_values=True)(model, x)
    assert list(g_stats["layer"]) == ["norm"] and v_stats["layer"]["norm"].shape == (4,)
    grads2, g_stats2 = jt.filter_grad(loss, stats=["norm", "nonfinite"])(model, x)
    assert_trees_close(g_stats2["layer"]["norm"], _per_layer_norms(expected))


@pytest.mark.long_eager
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
from oracles import NnxStack  # noqa: E402


def nnx_oracle(model, eps, x):
    """``nnx_loss`` with ``+ eps`` at each block's output, by hand: (loss, the blocks' outputs)."""
    out, values = nnx_stack_by_hand(model, x, eps)
    return jnp.sum(jnp.sin(out) ** 2), values


def nnx_loss(model, x):
    return jnp.sum(jnp.sin(model(x)) ** 2)


def test_nnx_stack_with_values_and_stats_against_eps():
    model = jt.tag_modules(NnxStack(nnx.Rngs(0)), ["blocks"])
    eps = jnp.zeros((4, 4, 3), F64)
    (expected_value, expected_values), expected = eps_oracle(
        lambda e: nnx_oracle(model, e, X), eps, value=True, has_aux=True
    )
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
