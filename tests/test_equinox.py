"""Equinox integration: filter_grad / filter_value_and_grad and tag_modules.

Oracles: the same equinox model run by hand with an explicit ``+ eps`` after
each module (and before it, for input tags), differentiated with plain
``jax.grad`` in float64; leaf gradients against ``eqx.filter_grad`` of the
untagged model; and, when torch is installed, PyTorch backward hooks on the
same network with the same weights.
"""

import copy
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxtrace as jt

from oracles import assert_close, eps_oracle, hlo, zeros_like

jax.config.update("jax_enable_x64", True)

KEYS = jax.random.split(jax.random.key(0), 16)


@pytest.fixture(params=["eager", "filter_jit"])
def maybe_jit(request):
    return (lambda f: f) if request.param == "eager" else eqx.filter_jit


def params(model):
    return jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))


class NoEps:
    """``eps = 0`` in the by-hand models below: ``x + NoEps()`` is ``x``, and so is indexing it."""

    def __getitem__(self, index):
        return self

    def __radd__(self, other):
        return other

    __add__ = __radd__


def mlp():
    return eqx.nn.MLP(3, 2, 5, 2, activation=jnp.tanh, key=KEYS[0])


# --- names ------------------------------------------------------------------


class Block(eqx.Module):
    attn: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __call__(self, x):
        return self.norm(x + self.attn(x))


class Net(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list
    heads: dict
    seq: eqx.nn.Sequential
    scale: jax.Array

    def __init__(self, key):
        k = jax.random.split(key, 6)
        self.embed = eqx.nn.Linear(3, 4, key=k[0])
        self.blocks = [Block(eqx.nn.Linear(4, 4, key=k[i + 1]), eqx.nn.LayerNorm(4)) for i in range(2)]
        self.heads = {"a": eqx.nn.Linear(4, 2, key=k[3]), "b": eqx.nn.Linear(4, 2, key=k[4])}
        self.seq = eqx.nn.Sequential([eqx.nn.Linear(2, 2, key=k[5]), eqx.nn.Lambda(jnp.tanh)])
        self.scale = jnp.array(2.0)

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.scale * self.seq(self.heads["a"](h) + self.heads["b"](h))


def test_names_follow_named_modules():
    model = jt.tag_modules(Net(KEYS[1]))
    grads, tag_grads = jt.filter_grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones(3))
    assert list(tag_grads) == [
        "embed",
        "blocks.0.attn",
        "blocks.0.norm",
        "blocks.0",
        "blocks.1.attn",
        "blocks.1.norm",
        "blocks.1",
        "heads.a",
        "heads.b",
        "seq.0",
        "seq.1",
        "seq",
        "",
    ]


def test_where_paths_predicate_and_inputs():
    net = Net(KEYS[1])
    loss = lambda m, x: jnp.sum(m(x))
    x = jnp.ones(3)
    _, tags = jt.filter_grad(loss)(jt.tag_modules(net, ["blocks.1.norm", "seq.0"], inputs=True), x)
    assert list(tags) == ["blocks.1.norm:in", "blocks.1.norm", "seq.0:in", "seq.0"]
    _, tags = jt.filter_grad(loss)(jt.tag_modules(net, lambda path, m: isinstance(m, eqx.nn.LayerNorm)), x)
    assert list(tags) == ["blocks.0.norm", "blocks.1.norm"]
    _, tags = jt.filter_grad(loss)(jt.tag_modules(net, "embed"), x)
    assert list(tags) == ["embed"]
    with pytest.raises(ValueError, match=r"no callable submodule at 'blocks\.2'.*'blocks\.0\.attn'"):
        jt.tag_modules(net, ["blocks.2"])
    with pytest.raises(TypeError, match=r"^jaxtrace\.tag_modules: where= must be None \(every module\), a path, .*; got 3 of type int\."):
        jt.tag_modules(net, 3)  # issue 23: was "'int' object is not iterable"
    with pytest.raises(TypeError, match="needs an equinox.Module"):
        jt.tag_modules({"w": jnp.ones(2)})


def test_tags_filter_is_passed_through():
    model = jt.tag_modules(Net(KEYS[1]))
    _, tags = jt.filter_grad(lambda m, x: jnp.sum(m(x)), tags=lambda n: n.startswith("heads"))(model, jnp.ones(3))
    assert list(tags) == ["heads.a", "heads.b"]
    with pytest.raises(jt.TagError, match="'nope'.*'embed'"):
        jt.filter_grad(lambda m, x: jnp.sum(m(x)), tags=["nope"])(model, jnp.ones(3))


# --- oracles: MLP -------------------------------------------------------------


def mlp_loss(model, x, y):
    return jnp.sum((model(x) - y) ** 2)


def mlp_by_hand(model, x, eps, inputs=True):
    """An ``eqx.nn.MLP`` run layer by layer with ``+ eps[name]`` at each layer's output and the MLP's
    (``"layers.i"``, ``""``) and, with ``inputs``, at their inputs (``"layers.i:in"``, ``":in"``):
    ``(output, the layers' outputs)``."""
    h, outs = (x + eps[":in"] if inputs else x), []
    for i, layer in enumerate(model.layers):
        h = layer(h + eps[f"layers.{i}:in"] if inputs else h) + eps[f"layers.{i}"]
        outs.append(h)
        h = model.activation(h) if i < len(model.layers) - 1 else model.final_activation(h)
    return h + eps[""], outs


def mlp_oracle(model, eps, x, y):
    """``mlp_loss`` with ``+ eps`` at every module input and output, by hand."""
    return jnp.sum((mlp_by_hand(model, x, eps)[0] - y) ** 2)


def test_mlp_against_oracle(maybe_jit):
    model, x, y = mlp(), jnp.array([0.3, -1.0, 2.0]), jnp.array([1.0, -0.5])
    tagged = jt.tag_modules(model, inputs=True)
    value, (grads, tag_grads) = maybe_jit(jt.filter_value_and_grad(mlp_loss))(tagged, x, y)
    value0, grads0 = maybe_jit(eqx.filter_value_and_grad(mlp_loss))(model, x, y)
    assert np.isclose(value, value0, rtol=1e-14)
    assert_close(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads0))
    expected = eps_oracle(mlp_oracle, model, zeros_like(tag_grads), x, y, argnums=1, wrap=maybe_jit)
    assert set(tag_grads) == {":in", "", *(f"layers.{i}{s}" for i in range(3) for s in ("", ":in"))}
    assert_close(tag_grads, expected)


def test_grads_are_those_of_filter_grad():
    """None at non-inexact leaves, same structure as eqx.filter_grad, has_aux."""

    class WithInt(eqx.Module):
        lin: eqx.nn.Linear
        steps: jax.Array
        fn: object

        def __call__(self, x):
            return self.fn(self.lin(x)) * self.steps

    model = jt.tag_modules(WithInt(eqx.nn.Linear(2, 2, key=KEYS[2]), jnp.array(3), jnp.sin))

    def loss(m, x):
        out = m(x)
        return jnp.sum(out), out

    (grads, tag_grads), aux = jt.filter_grad(loss, has_aux=True)(model, jnp.ones(2))
    grads0, aux0 = eqx.filter_grad(loss, has_aux=True)(model, jnp.ones(2))
    assert grads.steps is None and grads.fn is None
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(grads0)
    assert_close((grads, aux), (grads0, aux0))
    assert_close(tag_grads["lin"], 3.0 * jnp.cos(model.lin(jnp.ones(2))))
    (value, aux), (grads, _) = jt.filter_value_and_grad(loss, has_aux=True)(model, jnp.ones(2))
    assert np.isclose(value, jnp.sum(aux))
    with pytest.raises(TypeError, match="by position"):
        jt.filter_grad(loss)(m=model, x=jnp.ones(2))


# --- oracles: Conv2d, LayerNorm, MultiheadAttention, GRUCell -------------------


class Zoo(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    cell: eqx.nn.GRUCell

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv2d(1, 2, 3, key=k[0])  # (1, 5, 5) -> (2, 3, 3)
        self.norm = eqx.nn.LayerNorm((2, 3, 3))
        self.attn = eqx.nn.MultiheadAttention(2, 6, key=k[1])  # on (3, 6)
        self.cell = eqx.nn.GRUCell(6, 4, key=k[2])

    def __call__(self, x, eps=None):
        e = (lambda name: NoEps()) if eps is None else (lambda name: eps[name])
        h = self.norm(self.conv(x + e("conv:in")) + e("conv") + e("norm:in")) + e("norm")
        q = h.reshape(3, 6) + e("attn:in")[0]
        kv = h.reshape(3, 6)[::-1]
        a = self.attn(q, kv + e("attn:in")[1], kv + e("attn:in")[2]) + e("attn")
        s = jnp.zeros(4)
        for t in range(3):  # a cell in a Python loop: its calls are stacked
            s = self.cell(a[t] + e("cell:in")[0][t], s + e("cell:in")[1][t]) + e("cell")[t]
        return s


def zoo_loss(model, x):
    return jnp.sum(jnp.sin(model(x)))


@pytest.mark.long_eager
def test_builtin_layers_against_oracle(maybe_jit):
    model, x = Zoo(KEYS[3]), jax.random.normal(KEYS[4], (1, 5, 5))
    tagged = jt.tag_modules(model, ["conv", "norm", "attn", "cell"], inputs=True)
    grads, tag_grads = maybe_jit(jt.filter_grad(zoo_loss))(tagged, x)
    assert tag_grads["cell"].shape == (3, 4)
    assert [g.shape for g in tag_grads["cell:in"]] == [(3, 6), (3, 4)]
    assert [g.shape for g in tag_grads["attn:in"]] == [(3, 6)] * 3

    oracle = lambda eps, model, x: jnp.sum(jnp.sin(model(x, eps)))
    expected = eps_oracle(oracle, zeros_like(tag_grads), model, x, wrap=maybe_jit)
    assert_close(tag_grads, expected)
    assert_close(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(eqx.filter_grad(zoo_loss)(model, x)))


def test_all_submodules_of_builtin_layers():
    """Tagging every module (MultiheadAttention's projections too) changes no result."""
    model, x = Zoo(KEYS[3]), jax.random.normal(KEYS[4], (1, 5, 5))
    few = jt.filter_grad(zoo_loss)(jt.tag_modules(model, ["conv", "cell"]), x)
    grads, tag_grads = jt.filter_grad(zoo_loss)(jt.tag_modules(model), x)
    assert_close(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(few[0]))
    assert_close({k: tag_grads[k] for k in few[1]}, few[1])
    for proj in ("query_proj", "key_proj", "value_proj", "output_proj"):
        assert tag_grads[f"attn.{proj}"].shape == (3, 6)
    # The output projection is the attention module's last step.
    assert_close(tag_grads["attn.output_proj"], tag_grads["attn"])


# --- BatchNorm with State, vmap inside the loss ---------------------------------


def bn_model():
    return eqx.nn.Sequential(
        [
            eqx.nn.Linear(3, 4, key=KEYS[5]),
            eqx.nn.BatchNorm(4, "batch", mode="batch"),
            eqx.nn.Lambda(jnp.tanh),
            eqx.nn.Linear(4, 2, key=KEYS[6]),
        ]
    )


def bn_loss(model, state, x):
    y, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.sum(jnp.cos(y)), state


def bn_oracle(eps, model, state, x):
    def one(x, e):
        h = model.layers[0](x + e["0:in"]) + e["0"]
        h, new_state = model.layers[1](h + e["1:in"], state)
        h = model.layers[2](h + e["1"] + e["2:in"]) + e["2"]
        h = model.layers[3](h + e["3:in"]) + e["3"]
        return h + e[""], new_state

    y, new_state = jax.vmap(one, axis_name="batch", in_axes=(0, 0), out_axes=(0, None))(x + eps[":in"], eps)
    return jnp.sum(jnp.cos(y)), new_state


def clone(state):
    """A copy of an ``eqx.nn.State`` (each one may be used only once)."""
    leaves, tree = jax.tree_util.tree_flatten(state)
    return jax.tree_util.tree_unflatten(tree, leaves)


@pytest.mark.long_eager
def test_batchnorm_state_against_oracle(maybe_jit):
    model = bn_model()
    state = eqx.nn.State(model)
    x = jax.random.normal(KEYS[7], (5, 3))
    tagged = jt.tag_modules(model, inputs=True)
    (value, new_state), (grads, tag_grads) = maybe_jit(jt.filter_value_and_grad(bn_loss, has_aux=True))(
        tagged, clone(state), x
    )
    # Per-example gradients: the vmap axis comes first; State is never tagged.
    assert tag_grads["1"].shape == (5, 4) and tag_grads[":in"].shape == (5, 3)
    eps = {k: v for k, v in zeros_like(tag_grads).items() if k != ":in"}
    eps[":in"] = jnp.zeros_like(x)
    expected, expected_state = eps_oracle(bn_oracle, eps, model, clone(state), x, has_aux=True, wrap=maybe_jit)
    assert_close(tag_grads, expected)
    (value0, state0), grads0 = eqx.filter_value_and_grad(bn_loss, has_aux=True)(model, clone(state), x)
    assert np.isclose(value, value0, rtol=1e-14)
    assert_close(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads0))
    assert_close(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(state0))
    assert_close(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(expected_state))


# --- repeated calls: weight sharing, Python loops, scan --------------------------


class Shared(eqx.Module):
    lin: eqx.nn.Linear
    cell: eqx.nn.GRUCell

    def __call__(self, xs, eps=None):
        e = (lambda name, i: NoEps()) if eps is None else (lambda name, i: eps[name][i])
        h = self.lin(self.lin(xs[0]) + e("lin", 0)) + e("lin", 1)  # one Linear, two calls
        for t in range(1, xs.shape[0]):
            h = self.cell(xs[t], h) + e("cell", t - 1)
        return h


@pytest.mark.long_eager
def test_weight_sharing_and_python_loop_are_stacked(maybe_jit):
    model = Shared(eqx.nn.Linear(3, 3, key=KEYS[8]), eqx.nn.GRUCell(3, 3, key=KEYS[9]))
    xs = jax.random.normal(KEYS[10], (4, 3))
    loss = lambda m, xs: jnp.sum(m(xs) ** 3)
    grads, tag_grads = maybe_jit(jt.filter_grad(loss))(jt.tag_modules(model, ["lin", "cell"]), xs)
    assert tag_grads["lin"].shape == (2, 3) and tag_grads["cell"].shape == (3, 3)
    oracle = lambda eps, m, xs: jnp.sum(m(xs, eps) ** 3)
    assert_close(tag_grads, eps_oracle(oracle, zeros_like(tag_grads), model, xs, wrap=maybe_jit))


def test_cell_in_scan_is_stacked_per_step():
    cell = eqx.nn.GRUCell(2, 3, key=KEYS[11])
    xs = jax.random.normal(KEYS[12], (5, 2))

    def loss(cell, xs):
        h, _ = lax.scan(lambda h, x: (cell(x, h), None), jnp.zeros(3), xs)
        return jnp.sum(h**2)

    def oracle(eps, cell, xs):
        h, _ = lax.scan(lambda h, xe: (cell(xe[0], h) + xe[1], None), jnp.zeros(3), (xs, eps[""]))
        return jnp.sum(h**2)

    grads, tag_grads = jax.jit(jt.filter_grad(loss))(jt.tag_modules(cell), xs)
    assert tag_grads[""].shape == (5, 3)
    assert_close(tag_grads, eps_oracle(oracle, zeros_like(tag_grads), cell, xs))


# --- per-example gradients: vmap over jt.filter_grad ------------------------------


def test_filter_vmap_per_example(maybe_jit):
    model = mlp()
    xs, ys = jax.random.normal(KEYS[13], (4, 3)), jax.random.normal(KEYS[14], (4, 2))
    per_example = eqx.filter_vmap(jt.filter_grad(mlp_loss), in_axes=(None, 0, 0))
    grads, tag_grads = maybe_jit(per_example)(jt.tag_modules(model, inputs=True), xs, ys)
    assert tag_grads["layers.1"].shape == (4, 5)
    assert grads.layers[0].weight.shape == (4, 5, 3)
    eps = jax.tree_util.tree_map(lambda g: jnp.zeros(g.shape[1:]), tag_grads)

    def oracle(model, eps, x, y):
        return eqx.filter_grad(lambda both: mlp_oracle(*both, x, y))((model, eps))

    expected_grads, expected_tags = eqx.filter_vmap(oracle, in_axes=(None, None, 0, 0))(model, eps, xs, ys)
    assert_close(tag_grads, expected_tags)
    assert_close(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected_grads))


# --- training with optax -------------------------------------------------------


def test_optax_training_step():
    optax = pytest.importorskip("optax")
    model = mlp()
    xs, ys = jax.random.normal(KEYS[13], (4, 3)), jax.random.normal(KEYS[14], (4, 2))
    opt = optax.adam(1e-2)
    traces = []

    def batch_loss(model, xs, ys):
        return jnp.mean(jax.vmap(mlp_loss, in_axes=(None, 0, 0))(model, xs, ys))

    @eqx.filter_jit
    def step(model, opt_state, xs, ys):
        traces.append(1)
        loss, (grads, tag_grads) = jt.filter_value_and_grad(batch_loss, tags=["layers.0", "layers.1"])(model, xs, ys)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss, tag_grads

    @eqx.filter_jit
    def plain_step(model, opt_state, xs, ys):
        loss, grads = eqx.filter_value_and_grad(batch_loss)(model, xs, ys)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    tagged = jt.tag_modules(model)
    opt_state = opt.init(eqx.filter(tagged, eqx.is_array))
    plain, plain_state = model, opt.init(eqx.filter(model, eqx.is_array))
    for _ in range(3):
        before = tagged
        tagged, opt_state, loss, tag_grads = step(tagged, opt_state, xs, ys)
        plain, plain_state = plain_step(plain, plain_state, xs, ys)
    assert len(traces) == 1  # the tagged model keeps its structure across steps: no retrace
    assert type(tagged.layers[0]) is not eqx.nn.Linear and isinstance(tagged.layers[0], eqx.nn.Linear)
    assert_close(params(tagged), params(plain))
    # The last step's tag gradients are those at the model before that step.
    shapes = {":in": (3,), "": (2,), **{f"layers.{i}": (5,) for i in range(2)}, "layers.2": (2,)}
    shapes.update({f"layers.{i}:in": (3 if i == 0 else 5,) for i in range(3)})
    eps = {k: jnp.zeros((4, *s)) for k, s in shapes.items()}
    oracle = lambda eps, m: jnp.mean(jax.vmap(mlp_oracle, in_axes=(None, 0, 0, 0))(m, eps, xs, ys))
    expected = eps_oracle(oracle, eps, before)
    assert set(tag_grads) == {"layers.0", "layers.1"}
    assert_close(tag_grads, {k: expected[k] for k in tag_grads})


def test_optax_loop_that_ran_before_jaxtrace_keeps_its_state(maybe_jit):
    """Issue 50.1: jaxtrace added to a loop that already runs. The optimiser state was made from the
    untagged model before jaxtrace entered; with tag_modules=True the step changes in one line and
    its updates are the plain loop's, step by step, its tag gradients the + eps oracle's."""
    optax = pytest.importorskip("optax")
    model = mlp()
    xs, ys = jax.random.normal(KEYS[13], (4, 3)), jax.random.normal(KEYS[14], (4, 2))
    opt = optax.adam(1e-2)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))  # the loop's own, made before jaxtrace
    traces = []

    def batch_loss(model, xs, ys):
        return jnp.mean(jax.vmap(mlp_loss, in_axes=(None, 0, 0))(model, xs, ys))

    def plain_step(model, opt_state, xs, ys):
        loss, grads = eqx.filter_value_and_grad(batch_loss)(model, xs, ys)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, updates

    def step(model, opt_state, xs, ys):  # the same step, jaxtrace in its first line
        traces.append(1)
        loss, (grads, tag_grads) = jt.filter_value_and_grad(batch_loss, tag_modules=True, module_inputs=True)(model, xs, ys)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, updates, tag_grads

    plain_step, step = maybe_jit(plain_step), maybe_jit(step)
    oracle = lambda eps, m: jnp.mean(jax.vmap(mlp_oracle, in_axes=(None, 0, 0, 0))(m, eps, xs, ys))
    plain, plain_state, traced, traced_state = model, opt_state, model, opt_state
    for _ in range(3):
        before = traced
        plain, plain_state, plain_updates = plain_step(plain, plain_state, xs, ys)
        traced, traced_state, updates, tag_grads = step(traced, traced_state, xs, ys)
        assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(plain_updates)
        assert_close(updates, plain_updates)
        assert_close(tag_grads, eps_oracle(oracle, zeros_like(tag_grads), before))
    assert len(tag_grads) == 8  # every module's output and input: ":in", "", "layers.i", "layers.i:in"
    assert jax.tree_util.tree_structure(traced) == jax.tree_util.tree_structure(model)  # still untagged
    assert jax.tree_util.tree_structure(traced_state) == jax.tree_util.tree_structure(opt_state)
    assert_close((params(traced), traced_state), (params(plain), plain_state))
    if maybe_jit is eqx.filter_jit:
        assert len(traces) == 1  # the structures the loop carries never change: no retrace
    # A plain step continues from the jaxtrace steps' state, and back: the two are interchangeable.
    mixed, mixed_state, _ = plain_step(*step(model, opt_state, xs, ys)[:2], xs, ys)
    again, again_state, _ = plain_step(*plain_step(model, opt_state, xs, ys)[:2], xs, ys)
    assert_close((params(mixed), mixed_state), (params(again), again_state))


def test_tag_modules_keyword_selects_and_keeps_the_structure_passed():
    net, x = Net(KEYS[1]), jnp.ones(3)
    loss = lambda m, x: jnp.sum(m(x))
    grads, tags = jt.filter_grad(loss, tag_modules=["blocks.1.norm", "seq.0"], module_inputs=True)(net, x)
    assert list(tags) == ["blocks.1.norm:in", "blocks.1.norm", "seq.0:in", "seq.0"]
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(eqx.filter_grad(loss)(net, x))
    _, tags = jt.filter_grad(loss, tag_modules=eqx.nn.LayerNorm)(net, x)
    assert list(tags) == ["blocks.0.norm", "blocks.1.norm"]
    _, (_, tags) = jt.filter_value_and_grad(loss, tag_modules=lambda path, m: path == "embed")(net, x)
    assert list(tags) == ["embed"]
    # The model passed keeps its structure in filter_jacrev's jac too, and capture sees the tags in fun.
    def terms(m, x):
        out, acts = jt.capture(m)(x)
        return {"out": jnp.sum(out), "aux": jnp.sum(acts["embed"] ** 2)}

    jac, table = jt.filter_jacrev(terms, tag_modules=True, stats="norm")(net, x)
    assert jax.tree_util.tree_structure(jac["aux"]) == jax.tree_util.tree_structure(eqx.filter(net, eqx.is_inexact_array))
    assert list(table)[0] == "embed" and float(table["heads.a"]["aux"]["norm"]) == 0.0
    # A model tagged beforehand keeps working, and its gradients keep its (tagged) structure.
    tagged = jt.tag_modules(net)
    grads, tags = jt.filter_grad(loss)(tagged, x)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(eqx.filter_grad(loss)(tagged, x))
    assert len(tags) == 13
    with pytest.raises(TypeError, match=r"^jaxtrace\.filter_grad: tag_modules= must be False .*; got 3 of type int\.$"):
        jt.filter_grad(loss, tag_modules=3)
    with pytest.raises(TypeError, match=r"module_inputs=True .* tag_modules= selects none\. Pass tag_modules=True"):
        jt.filter_jacrev(terms, module_inputs=True)
    with pytest.raises(ValueError, match=r"^jaxtrace\.filter_grad\(tag_modules=\.\.\.\): no callable submodule at 'nope'"):
        jt.filter_grad(loss, tag_modules="nope")(net, x)
    with pytest.raises(TypeError, match=r"filter_value_and_grad\(tag_modules=\.\.\.\) needs an equinox\.Module"):
        jt.filter_value_and_grad(lambda p, x: jnp.sum(p["w"] * x), tag_modules=True)({"w": x}, x)


def test_no_tags_found_says_how_to_tag():
    """Issue 50.8: an untagged model gave {} and the next line a bare KeyError; reading a name now says why."""
    model, x = mlp(), jnp.ones(3)
    _, tag_grads = eqx.filter_jit(jt.filter_grad(mlp_loss))(model, x, jnp.zeros(2))
    assert tag_grads == {}
    with pytest.raises(KeyError, match=r"^jaxtrace\.filter_grad found no tags .* nothing named 'layers\.0'\. Pass tag_modules=True"):
        tag_grads["layers.0"]
    (_, (_, tag_grads), tag_values) = jt.filter_value_and_grad(mlp_loss, with_values=True)(model, x, jnp.zeros(2))
    with pytest.raises(jt.TagError, match=r"^jaxtrace\.filter_value_and_grad found no tags"):
        tag_values["layers.0"]
    (_, tag_jacs), _ = jt.filter_jacrev(lambda m, x: ({"a": jnp.sum(m(x))}, None), has_aux=True, stats="norm")(model, x)
    with pytest.raises(KeyError, match=r"^jaxtrace\.filter_jacrev found no tags"):
        tag_jacs["layers.0"]
    with pytest.raises(KeyError, match=r"found no tags .* tag_modules= selected no module that the function calls"):
        jt.filter_grad(lambda m, x: jnp.sum(m.layers[0].weight @ x), tag_modules="layers.1")(model, x)[1]["layers.1"]
    _, none_selected = jt.filter_grad(mlp_loss, tag_modules=True, tags=lambda name: False)(model, x, jnp.zeros(2))
    assert type(none_selected) is dict and none_selected == {}  # tags exist, none asked for: a plain dict


# --- the model around the tags ----------------------------------------------------


def test_original_untouched_and_attribute_access():
    model = mlp()
    before = jax.tree_util.tree_structure(model)
    tagged = jt.tag_modules(model, inputs=True)
    assert jax.tree_util.tree_structure(model) == before
    assert all(type(layer) is eqx.nn.Linear for layer in model.layers)
    assert tagged.layers[0].weight is model.layers[0].weight
    assert tagged.layers[1].in_features == 5 and tagged.activation is model.activation
    assert isinstance(tagged, eqx.nn.MLP) and isinstance(tagged.layers[2], eqx.nn.Linear)
    assert [id(x) for x in jax.tree_util.tree_leaves(tagged)] == [id(x) for x in jax.tree_util.tree_leaves(model)]
    assert repr(tagged) == repr(model)
    assert "jaxtrace" in repr(type(tagged.layers[0]))
    # Calling it outside jaxtrace is the original computation.
    x = jnp.array([0.1, 0.2, 0.3])
    np.testing.assert_array_equal(tagged(x), model(x))
    # Tagging twice: the other tags stay, the re-selected one is updated.
    twice = jt.tag_modules(jt.tag_modules(model, ["layers.0"]), ["layers.1"], inputs=True)
    _, tags = jt.filter_grad(mlp_loss)(twice, x, jnp.zeros(2))
    assert list(tags) == ["layers.0", "layers.1:in", "layers.1"]
    assert type(twice.layers[0]) is type(twice.layers[1])  # one subclass per class


def filter_grad_hlo(model, loss, *args):
    """The compiled program of ``eqx.filter_grad(loss)(model, *args)``, as ``oracles.hlo`` reads it."""
    dynamic, static = eqx.partition(model, eqx.is_array)
    return hlo(lambda dynamic, *args: eqx.filter_grad(loss)(eqx.combine(dynamic, static), *args), dynamic, *args)


def test_tagged_model_compiles_to_the_same_program():
    """Outside jaxtrace the tags are free: eqx.filter_grad gives the same HLO as untagged."""
    model = bn_model()
    loss = lambda m, state, x: bn_loss(m, state, x)[0]
    args = (eqx.nn.State(model), jnp.ones((5, 3)))
    assert filter_grad_hlo(jt.tag_modules(model, inputs=True), loss, *args) == filter_grad_hlo(model, loss, *args)


def test_serialisation_round_trip(tmp_path):
    tagged = jt.tag_modules(mlp())
    other = eqx.nn.MLP(3, 2, 5, 2, activation=jnp.tanh, key=KEYS[15])
    eqx.tree_serialise_leaves(tmp_path / "tagged.eqx", tagged)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "tagged.eqx", jt.tag_modules(other))
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(tagged)
    assert_close(params(loaded), params(tagged))
    # The files are interchangeable with the untagged model's.
    plain = eqx.tree_deserialise_leaves(tmp_path / "tagged.eqx", other)
    assert type(plain.layers[0]) is eqx.nn.Linear
    assert_close(params(plain), params(tagged))


def test_pickle_and_deepcopy_keep_the_tags():
    model = eqx.nn.Sequential([eqx.nn.Linear(3, 2, key=KEYS[0]), eqx.nn.Linear(2, 1, key=KEYS[1])])
    tagged = jt.tag_modules(model)
    loss = lambda m, x: jnp.sum(m(x))
    for clone in (pickle.loads(pickle.dumps(tagged)), copy.deepcopy(tagged)):
        assert type(clone[0]) is type(tagged[0])
        assert_close(params(clone), params(tagged))
        assert_close(jt.filter_grad(loss)(clone, jnp.ones(3)), jt.filter_grad(loss)(tagged, jnp.ones(3)))


def test_pickles_that_name_the_old_module_paths_still_load():
    """The tag spec moved to jaxtrace._module_tags (issue 26); a pickle made before names
    jaxtrace._equinox._ModuleTag, which still resolves, and _restore stays where it was."""
    import jaxtrace._equinox
    import jaxtrace._module_tags

    assert jaxtrace._equinox._ModuleTag is jaxtrace._module_tags.ModuleTag
    tagged = jt.tag_modules(eqx.nn.Linear(3, 2, key=KEYS[0]), inputs=True)
    new = pickle.dumps(tagged, protocol=3)  # protocols 0-3 name classes as text lines
    assert b"cjaxtrace._equinox\n_restore\n" in new and b"cjaxtrace._module_tags\nModuleTag\n" in new
    old = new.replace(b"cjaxtrace._module_tags\nModuleTag\n", b"cjaxtrace._equinox\n_ModuleTag\n")
    loss = lambda m, x: jnp.sum(m(x))
    for clone in (pickle.loads(new), pickle.loads(old)):
        assert sorted(jt.filter_grad(loss)(clone, jnp.ones(3))[1]) == ["", ":in"]


# --- PyTorch parity: the same network, module-output gradients by name -------------


class EqxNet(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    norm: eqx.nn.LayerNorm
    layers: list
    cell: eqx.nn.GRUCell
    head: eqx.nn.Sequential

    def __init__(self, key):
        k = jax.random.split(key, 6)
        self.conv = eqx.nn.Conv2d(1, 2, 3, padding=1, key=k[0])
        self.bn = eqx.nn.BatchNorm(2, "batch", mode="batch")
        self.norm = eqx.nn.LayerNorm((2, 4, 4))
        self.layers = [eqx.nn.Linear(32, 6, key=k[1]), eqx.nn.Linear(6, 6, key=k[2])]
        self.cell = eqx.nn.GRUCell(3, 4, key=k[3])
        self.head = eqx.nn.Sequential(
            [eqx.nn.Linear(4, 4, key=k[4]), eqx.nn.Lambda(jnp.tanh), eqx.nn.Linear(4, 2, key=k[5])]
        )

    def __call__(self, x, h, state):
        x, state = self.bn(self.conv(x), state)
        x = self.norm(x).reshape(-1)
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        for t in range(2):
            h = self.cell(x[3 * t : 3 * t + 3], h)
        return self.head(h), state


def torch_net(model):
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class TorchNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3, padding=1)
            self.bn = nn.BatchNorm2d(2)
            self.norm = nn.LayerNorm((2, 4, 4))
            self.layers = nn.ModuleList([nn.Linear(32, 6), nn.Linear(6, 6)])
            self.cell = nn.GRUCell(3, 4)
            self.head = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))

        def forward(self, x, h):
            x = self.norm(self.bn(self.conv(x))).flatten(1)
            for layer in self.layers:
                x = torch.tanh(layer(x))
            for t in range(2):
                h = self.cell(x[:, 3 * t : 3 * t + 3], h)
            return self.head(h)

    net = TorchNet().double()
    t = lambda a: torch.tensor(np.asarray(a))
    with torch.no_grad():
        net.conv.weight.copy_(t(model.conv.weight))
        net.conv.bias.copy_(t(model.conv.bias).reshape(-1))
        net.bn.weight.copy_(t(model.bn.weight))
        net.bn.bias.copy_(t(model.bn.bias))
        net.norm.weight.copy_(t(model.norm.weight))
        net.norm.bias.copy_(t(model.norm.bias))
        pairs = [*zip(model.layers, net.layers), (model.head[0], net.head[0]), (model.head[2], net.head[2])]
        for mine, theirs in pairs:
            theirs.weight.copy_(t(mine.weight))
            theirs.bias.copy_(t(mine.bias))
        net.cell.weight_ih.copy_(t(model.cell.weight_ih))
        net.cell.weight_hh.copy_(t(model.cell.weight_hh))
        net.cell.bias_ih.copy_(t(model.cell.bias))  # equinox adds the r and z hidden biases here
        net.cell.bias_hh.copy_(torch.cat([torch.zeros(8, dtype=torch.float64), t(model.cell.bias_n)]))
    return torch, net.train()


def test_module_gradients_match_pytorch_hooks():
    model = EqxNet(KEYS[0])
    torch, net = torch_net(model)
    x = np.asarray(jax.random.normal(KEYS[1], (3, 1, 4, 4)))
    h0 = np.asarray(jax.random.normal(KEYS[2], (3, 4)))
    c = np.asarray(jax.random.normal(KEYS[3], (3, 2)))

    # PyTorch: full backward hooks on every module, per call (they fire last call first).
    outputs, inputs = {}, {}

    def hook(name):
        def record(module, grad_input, grad_output):
            outputs.setdefault(name, []).insert(0, grad_output[0].numpy().copy())
            inputs.setdefault(name, []).insert(0, [None if g is None else g.numpy().copy() for g in grad_input])

        return record

    for name, module in net.named_modules():
        module.register_full_backward_hook(hook(name))
    tx, th = torch.tensor(x, requires_grad=True), torch.tensor(h0, requires_grad=True)
    (torch.sin(net(tx, th)) * torch.tensor(c)).sum().backward()

    # jaxtrace: the same weights, all modules tagged, per-example calls under vmap.
    def loss(model, state, x, h0):
        run = jax.vmap(model, axis_name="batch", in_axes=(0, 0, None), out_axes=(0, None))
        out, _ = run(x, h0, state)
        return jnp.sum(jnp.sin(out) * c)

    tagged = jt.tag_modules(model, inputs=True)
    grads, tag_grads = eqx.filter_jit(jt.filter_grad(loss))(tagged, eqx.nn.State(model), x, h0)

    assert set(outputs) == {n for n in tag_grads if not n.endswith(":in")}  # names match one to one
    # The two cell calls: stacked first in jaxtrace, per-example (batch) axis next.
    stack = lambda name, values: np.stack(values) if name == "cell" else values[0]
    for name, calls in outputs.items():
        np.testing.assert_allclose(tag_grads[name], stack(name, calls), rtol=1e-10, atol=1e-10, err_msg=name)
    for name, calls in inputs.items():
        mine = tag_grads[name + ":in"]
        theirs = [stack(name, [call[i] for call in calls]) for i in range(len(calls[0]))]
        if name in ("", "cell"):  # several positional inputs: a tuple
            assert len(mine) == len(theirs) == 2
        else:
            mine = (mine,)
        for m, t in zip(mine, theirs):
            np.testing.assert_allclose(m, t, rtol=1e-10, atol=1e-10, err_msg=name + ":in")
    # Parameter gradients agree as well.
    np.testing.assert_allclose(grads.layers[0].weight, net.layers[0].weight.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(grads.cell.weight_hh, net.cell.weight_hh.grad.numpy(), rtol=1e-10, atol=1e-10)


# --- HookPoint: TransformerLens-style named points -----------------------------


class _Attn(eqx.Module):
    proj: eqx.nn.Linear
    hook_q: jt.HookPoint
    hook_z: jt.HookPoint

    def __init__(self, key):
        self.proj, self.hook_q, self.hook_z = eqx.nn.Linear(3, 3, key=key), jt.HookPoint(), jt.HookPoint()

    def __call__(self, x):
        return self.hook_z(jnp.tanh(self.hook_q(self.proj(x))))


class _Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: _Attn
    hook_normalized: jt.HookPoint
    hook_resid_post: jt.HookPoint

    def __init__(self, key):
        self.ln1, self.attn = eqx.nn.LayerNorm(3), _Attn(key)
        self.hook_normalized, self.hook_resid_post = jt.HookPoint(), jt.HookPoint()

    def __call__(self, x):
        # The hook point fires twice (as TransformerLens's ln1 does, once per q/k/v input).
        a = self.hook_normalized(self.ln1(x))
        b = self.hook_normalized(self.ln1(2.0 * x))
        return self.hook_resid_post(x + self.attn(a) * b)


class _Stack(eqx.Module):
    blocks: list

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def block_by_hand(m, e, x):
    """A ``_Block`` run by hand with ``+ eps`` at each call of each hook point: ``e["n"]`` at the two
    calls of ``hook_normalized``, ``e["q"]``, ``e["z"]`` at the attention's, ``e["r"]`` at the residual."""
    a = m.ln1(x) + e["n"][0]
    b = m.ln1(2.0 * x) + e["n"][1]
    z = jnp.tanh(m.attn.proj(a) + e["q"]) + e["z"]
    return jnp.sum((x + z * b + e["r"]) ** 2)


def block_eps():
    """Zeros for each of ``block_by_hand``'s perturbations."""
    return {"n": jnp.zeros((2, 3)), "q": jnp.zeros(3), "z": jnp.zeros(3), "r": jnp.zeros(3)}


def test_hook_points_are_tagged_by_path_and_repeated_calls_stack(maybe_jit):
    blocks = [_Block(KEYS[0]), _Block(KEYS[1])]
    model = jt.tag_modules(blocks[0], jt.HookPoint)
    x = jnp.array([0.3, -1.0, 2.0])

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    grads, tag_grads = maybe_jit(jt.filter_grad(loss))(model, x)
    assert sorted(tag_grads) == ["attn.hook_q", "attn.hook_z", "hook_normalized", "hook_resid_post"]
    assert tag_grads["hook_normalized"].shape == (2, 3)  # two calls, stacked in call order
    acts = jt.capture(lambda x: model(x))(x)[1]
    np.testing.assert_allclose(acts["hook_normalized"][-1], blocks[0].ln1(2.0 * x), rtol=1e-12)  # TL's "last call"
    # Oracle: + eps at each call of each hook point.
    m = blocks[0]
    want = eps_oracle(lambda e, x: block_by_hand(m, e, x), block_eps(), x)
    assert_close(
        [tag_grads[k] for k in ["hook_normalized", "attn.hook_q", "attn.hook_z", "hook_resid_post"]],
        [want["n"], want["q"], want["z"], want["r"]],
    )
    assert_close(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(eqx.filter_grad(loss)(blocks[0], x)))
    # In a list, the paths carry the index; a tuple of classes selects as isinstance does.
    tagged = jt.tag_modules(_Stack(blocks), (jt.HookPoint, eqx.nn.LayerNorm))
    names = jt.capture(tagged)(x)[1]
    assert "blocks.1.attn.hook_z" in names and "blocks.0.ln1" in names and "blocks.0.attn.proj" not in names


def test_hook_points_compose_with_vmap_checkpoint_and_grad():
    """vmap around, jax.checkpoint inside, jax.grad around jt.filter_grad: against + eps by hand."""
    m = _Block(KEYS[0])
    model = jt.tag_modules(m, jt.HookPoint)
    xs = jnp.array([[0.3, -1.0, 2.0], [1.0, 0.5, -0.2]])

    names = {"hook_normalized": "n", "attn.hook_q": "q", "attn.hook_z": "z", "hook_resid_post": "r"}
    by_hand = lambda e, x: block_by_hand(m, e, x)  # noqa: E731

    def loss(m, x):
        return jnp.sum(jax.checkpoint(lambda x: m(x))(x) ** 2)

    per_example = jax.vmap(lambda x: jt.filter_grad(loss)(model, x)[1])(xs)
    want = jax.vmap(lambda x: eps_oracle(by_hand, block_eps(), x))(xs)
    assert_close([per_example[k] for k in names], [want[v] for v in names.values()])

    def through(x):  # a function of the gradient at a hook point, differentiated in x
        return jnp.sum(jt.filter_grad(loss)(model, x)[1]["attn.hook_z"] ** 2)

    assert_close(jax.grad(through)(xs[0]), jax.grad(lambda x: jnp.sum(eps_oracle(by_hand, block_eps(), x)["z"] ** 2))(xs[0]))


def test_hook_point_is_an_identity_on_pytrees():
    hp = jt.HookPoint()
    value = (jnp.ones(2), {"a": jnp.zeros(1)})
    assert hp(value) is value
    assert jax.tree_util.tree_leaves(hp) == []


# --- filter_jacrev: which loss term reaches which layer, on a model nobody edited --------------


def _mlp_terms(out, h0, y):
    """The issue's scenario: a main loss, and an auxiliary loss read from an intermediate (layers.0)."""
    return {"mse": jnp.mean((out - y) ** 2), "aux": 0.1 * jnp.mean(jnp.tanh(h0) ** 2)}


@pytest.mark.long_eager
def test_filter_jacrev_on_an_mlp_against_eps(maybe_jit):
    model = eqx.nn.MLP(3, 2, 5, 2, key=KEYS[3])
    tagged = jt.tag_modules(model)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    y = jnp.linspace(0.5, -0.5, 8).reshape(4, 2)

    def losses(model, x, y):
        out, acts = jt.capture(jax.vmap(model))(x)
        return _mlp_terms(out, acts["layers.0"], y)

    jac, tag_jacs = maybe_jit(jt.filter_jacrev(losses))(tagged, x, y)

    eps0 = {name: jnp.zeros((4, 5)) for name in ("layers.0", "layers.1")}
    eps0.update({"layers.2": jnp.zeros((4, 2)), "": jnp.zeros((4, 2))})

    def by_hand(eps):
        out, outs = jax.vmap(lambda x, e: mlp_by_hand(model, x, e, inputs=False))(x, eps)
        return _mlp_terms(out, outs[0], y)

    expected = jax.jacrev(by_hand)(eps0)  # {term: {tag: array}}
    assert sorted(tag_jacs) == sorted(eps0)  # a plain dict: jax.jit hands it back sorted
    assert_close(tag_jacs, {name: {term: expected[term][name] for term in expected} for name in eps0})
    assert float(jnp.max(jnp.abs(tag_jacs["layers.0"]["aux"]))) > 0  # the new path exists
    assert not np.any(tag_jacs["layers.1"]["aux"]) and not np.any(tag_jacs[""]["aux"])
    # jac is eqx.filter_jacrev's: the model's floating arrays, None at the activation functions.
    def plain(model, x, y):
        out, outs = jax.vmap(lambda x: mlp_by_hand(model, x, NoEps(), inputs=False))(x)
        return _mlp_terms(out, outs[0], y)

    assert_close(jac, eqx.filter_jacrev(plain)(tagged, x, y))  # tags are identities to jax.jacrev

    # stats=: the table of jt.stats.jacrev, the norms of those Jacobians, terms in the loss's order.
    _, table = maybe_jit(jt.filter_jacrev(losses, stats="norm"))(tagged, x, y)
    assert list(table) == ["layers.0", "layers.1", "layers.2", ""] and all(list(per_term) == ["mse", "aux"] for per_term in table.values())
    for name in table:
        for term in ("mse", "aux"):
            np.testing.assert_allclose(table[name][term]["norm"], np.linalg.norm(np.ravel(expected[term][name])), rtol=1e-12)
    assert "0 (none)" in jt.stats.format_paths(table).splitlines()[2]  # aux does not reach layers.1
    # param_stats=True: jac reduced the same way, one row per parameter in the model's order, from the
    # untagged model (tag_modules=True): the norms of eqx.filter_jacrev's Jacobian, exact zeros as none.
    params_table, _ = maybe_jit(jt.filter_jacrev(losses, stats="norm", param_stats=True, tag_modules=True))(model, x, y)
    expected_jac = eqx.filter_jacrev(plain)(model, x, y)
    names = [f"layers.{i}.{p}" for i in range(3) for p in ("weight", "bias")]
    assert list(params_table) == names and all(list(per_term) == ["mse", "aux"] for per_term in params_table.values())
    for i in range(3):
        for p in ("weight", "bias"):
            for term in ("mse", "aux"):
                leaf = getattr(expected_jac[term].layers[i], p)
                np.testing.assert_allclose(params_table[f"layers.{i}.{p}"][term]["norm"], np.linalg.norm(np.ravel(leaf)), rtol=1e-12)
    lines = jt.stats.format_paths(params_table, header="parameter").splitlines()
    assert lines[0].split() == ["parameter", "mse", "aux"]
    assert [line.split()[0] for line in lines if line.endswith("0 (none)")] == names[2:]  # aux reaches layers.0's only
    with pytest.raises(TypeError, match=r"^jaxtrace\.filter_jacrev: param_stats=True .* stats= is None"):
        jt.filter_jacrev(losses, param_stats=True)


def test_filter_jacrev_has_aux_tags_and_errors():
    model = jt.tag_modules(eqx.nn.MLP(2, 1, 3, 1, key=KEYS[4]))

    def losses(model, x):
        out = model(x)
        return {"a": jnp.sum(out), "b": jnp.sum(out**2)}, "aux"

    (jac, tag_jacs), aux = jt.filter_jacrev(losses, has_aux=True, tags="layers.0")(model, jnp.ones(2))
    assert aux == "aux" and list(tag_jacs) == ["layers.0"] and tag_jacs["layers.0"]["b"].shape == (3,)
    assert jac["a"].activation is None
    (_, table), _ = jt.filter_jacrev(losses, has_aux=True, stats=True)(model, jnp.ones(2))
    assert sorted(table["layers.0"]["a"]) == sorted(jt.stats.STATS)
    with pytest.raises(TypeError, match="by position"):
        jt.filter_jacrev(losses)(model=model, x=jnp.ones(2))
    with pytest.raises(ValueError, match="unknown statistic"):
        jt.filter_jacrev(losses, stats="nrom")
    # jt.stats.jacrev on such a model points to filter_jacrev.
    with pytest.raises(TypeError, match="jt.filter_jacrev"):
        jt.stats.jacrev(lambda m, x: losses(m, x)[0])(model, jnp.ones(2))


def test_tag_modules_keyword_composes_with_jax_and_jaxtrace_transforms():
    """jt.filter_grad(loss, tag_modules=True) inside jax.vmap, jax.grad and jit, around a checkpoint, and inside an
    outer jt.grad, each against the + eps oracle composed with the same JAX transform."""
    model = mlp()
    xs, ys = jax.random.normal(KEYS[13], (4, 3)), jax.random.normal(KEYS[14], (4, 2))
    names = [":in", "", "layers.0:in", "layers.0", "layers.1:in", "layers.1", "layers.2:in", "layers.2"]
    eps = {n: jnp.zeros(2 if n in ("", "layers.2") else 3 if n in (":in", "layers.0:in") else 5) for n in names}

    def tag_grads(model, x, y):  # the transform under test
        return jt.filter_grad(mlp_loss, tag_modules=True, module_inputs=True)(model, x, y)[1]

    def oracle(model, x, y):
        return eps_oracle(lambda e: mlp_oracle(model, e, x, y), eps)

    # jax.vmap over examples around it
    assert_close(jax.vmap(tag_grads, in_axes=(None, 0, 0))(model, xs, ys), jax.vmap(oracle, in_axes=(None, 0, 0))(model, xs, ys))
    # jax.grad around it: a second derivative, by the input and by the parameters
    square = lambda g: sum(jnp.sum(v**2) for v in jax.tree_util.tree_leaves(g))  # noqa: E731
    assert_close(
        jax.grad(lambda x: square(tag_grads(model, x, ys[0])))(xs[0]),
        jax.grad(lambda x: square(oracle(model, x, ys[0])))(xs[0]),
    )
    assert_close(
        eqx.filter_grad(lambda m: square(tag_grads(m, xs[0], ys[0])))(model),
        eqx.filter_grad(lambda m: square(oracle(m, xs[0], ys[0])))(model),
    )
    # eqx.filter_checkpoint (jax.checkpoint) inside the loss, and eqx.filter_jit around everything
    remat_loss = eqx.filter_checkpoint(mlp_loss)
    got = eqx.filter_jit(jt.filter_grad(remat_loss, tag_modules=True, module_inputs=True))(model, xs[1], ys[1])[1]
    assert_close(got, oracle(model, xs[1], ys[1]))
    # an outer jt.grad: the input's tag sees the path through the inner transform's tag gradients
    def outer(x):
        x = jt.tag(x, "x")
        return square(tag_grads(model, x, ys[2]))

    gx, outer_tags = jt.grad(outer)(xs[2])
    want = jax.grad(lambda x: square(oracle(model, x, ys[2])))(xs[2])
    assert_close((gx, outer_tags["x"]), (want, want))
