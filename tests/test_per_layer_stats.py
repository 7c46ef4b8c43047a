"""Statistics and values per layer and per step: layer stacks run by ``lax.scan`` / ``nnx.scan``
(equinox, Flax NNX), a cell stepped in a scan, and the checks of statistic names.

Oracles: the hand-written ``+ eps`` program (``oracles.eps_oracle``), its tag gradients
reduced by hand per layer, and the plain forward values, in float64, eager and under jit.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxtrace as jt

from oracles import assert_close, eps_oracle, nnx_stack_by_hand

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
    assert_close(tag_stats["layer"]["norm"], _per_layer_norms(expected))
    assert_close(tag_stats["layer"]["max_abs"], jnp.max(jnp.abs(expected), axis=1))
    # stats= names; with_values: the activations' statistics, per layer too
    (_, (_, g_stats), v_stats) = jt.filter_value_and_grad(loss, stats="norm", with_values=True)(model, x)
    assert list(g_stats["layer"]) == ["norm"] and v_stats["layer"]["norm"].shape == (4,)
    grads2, g_stats2 = jt.filter_grad(loss, stats=["norm", "nonfinite"])(model, x)
    assert_close(g_stats2["layer"]["norm"], _per_layer_norms(expected))


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
    assert_close(tag_stats[""]["norm"], jnp.sqrt(jnp.sum(h**2, axis=1) + jnp.sum(c**2, axis=1)))


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
    assert_close(v_stats["h"]["max_abs"], jnp.max(jnp.abs(values["h"]), axis=1))
    assert g_stats["h"]["norm"].shape == (5,)


# --- one rule for a stack's statistics: one labelled entry per layer ------------------------------

EXPLODING = jnp.array([4.5, 0.25, 0.25], F64)  # d loss / d layer i's output is c_i * ones(4): norms 9, 0.5, 0.5


def exploding_stack(cs, xs):
    """Three layers run by lax.scan, one tag in the body; layer 0's gradient explodes (norm 9)."""

    def body(total, layer):
        c, x = layer
        h = jt.tag(jnp.tanh(x), "layers")
        return total + c * jnp.sum(h), None

    total, _ = lax.scan(body, jnp.zeros((), F64), (cs, xs))
    head = jt.tag(total, "head")
    return {"main": head, "aux": jnp.sum(lax.stop_gradient(xs))}


def exploding_history(maybe_jit):
    step = maybe_jit(jt.stats.value_and_grad(lambda cs, xs: exploding_stack(cs, xs)["main"]))
    history = jt.stats.History()
    for i in range(2):
        loss, (_, tag_stats) = step(EXPLODING, jnp.ones((3, 4), F64))
        history.append(i, tag_stats, loss=loss)
    return history


def test_a_stack_reads_per_layer_in_the_text(maybe_jit):
    """Issue 50.7: an exploding layer 0 (norm 9) in a stack whose other layers have norm 0.5 was
    logged as "norm: 0.5" (History.format showed the last layer) and as 9 alone by format_paths
    (the max). Both now show one labelled entry per layer."""
    history = exploding_history(maybe_jit)
    np.testing.assert_allclose(history["layers"]["norm"][-1], [9.0, 0.5, 0.5], rtol=1e-12)
    line = history.format()
    assert line.endswith("| norm: head 1  layers[0] 9  layers[1] 0.5  layers[2] 0.5"), line
    assert history.format(stat="max_abs", names=["layers"]).endswith("max_abs: layers[0] 4.5  layers[1] 0.25  layers[2] 0.25")

    _, table = maybe_jit(jt.stats.jacrev(exploding_stack, stats="norm", loop_axes={"layers": 1}))(EXPLODING, jnp.ones((3, 4), F64))
    rows = [r.split() for r in jt.stats.format_paths(table).splitlines()]
    assert rows[0] == ["tag", "main", "aux"]
    assert rows[1:] == [
        ["layers[0]", "9", "0", "(none)"],
        ["layers[1]", "0.5", "0", "(none)"],
        ["layers[2]", "0.5", "0", "(none)"],
        ["head", "1", "0", "(none)"],
    ]


def test_a_stack_draws_a_line_per_layer():
    """The plots follow the same rule: grad_flow a line and a bar per layer (not one root-sum-of-
    squares line for the stack), plot.paths a row per layer (not the max)."""
    pytest.importorskip("matplotlib")
    from jaxtrace import plot

    history = exploding_history(jax.jit)
    fig = plot.grad_flow(history, stat="norm")
    lines, bars = fig.axes
    labels = ["head", "layers[0]", "layers[1]", "layers[2]"]
    assert [line.get_label() for line in lines.lines] == labels
    np.testing.assert_allclose([line.get_ydata()[-1] for line in lines.lines], [1.0, 9.0, 0.5, 0.5], rtol=1e-12)
    assert [t.get_text() for t in bars.get_xticklabels()] == labels
    maxes = [1.0, 4.5, 0.25, 0.25]  # the bars: max |g| per entry, then mean |g| (the same here)
    np.testing.assert_allclose([p.get_height() for p in bars.patches], maxes + maxes, rtol=1e-12)
    _, table = jt.stats.jacrev(exploding_stack, stats="norm", loop_axes={"layers": 1})(EXPLODING, jnp.ones((3, 4), F64))
    fig = plot.paths(table)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [*labels[1:], "head"]  # the program's order
    np.testing.assert_allclose(fig.axes[0].images[0].get_array()[:, 0], np.log10([9.0, 0.5, 0.5, 1.0]), rtol=1e-12)


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
        assert_close(value, expected_value)
        assert_close(tag_grads["blocks"], expected)
        assert_close(tag_values["blocks"], expected_values)
        _, (_, tag_stats) = wrap(jaxtrace.flax.value_and_grad(nnx_loss, stats=True))(model, X)
        assert tag_stats["blocks"]["norm"].shape == (4,)  # one per layer
        assert_close(tag_stats["blocks"]["norm"], _per_layer_norms(expected))
    grads, tag_grads, tag_values = jaxtrace.flax.grad(nnx_loss, with_values=True)(model, X)
    assert_close(tag_values["blocks"], expected_values)
    (grads, tag_grads), aux, tag_values = jaxtrace.flax.grad(
        lambda m, x: (nnx_loss(m, x), 7), has_aux=True, with_values=True
    )(model, X)
    assert aux == 7
    assert_close(tag_grads["blocks"], expected)
    # without with_values: as before
    assert len(jaxtrace.flax.grad(nnx_loss)(model, X)) == 2
