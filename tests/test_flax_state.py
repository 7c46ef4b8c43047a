"""Flax NNX state across jaxtrace's transforms: it ends as one plain call leaves it.

Programs written as Flax's examples write them: the MNIST CNN's ``train_step`` with an
``nnx.Rngs`` argument and dropout, BatchNorm and Dropout in training mode read with
``jt.capture``, a layer stack run by ``nnx.scan`` checked with ``jt.find_nonfinite``, dropout
drawing from an ``nnx.Rngs`` argument under the per-example transforms. Each against an oracle
without jaxtrace: ``nnx.value_and_grad`` / ``nnx.grad`` for values and gradients, and a plain
call of the same function for the state (batch statistics, RNG counts), eagerly and under
``nnx.jit``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from flax import nnx  # noqa: E402

import jaxtrace as jt  # noqa: E402
import jaxtrace.flax  # noqa: E402

from oracles import assert_close  # noqa: E402

F64 = jnp.float64

# nnx.BatchNorm keeps float32 statistics updates beside float64 ones: JAX warns on the scatter.
pytestmark = pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types")


def _plain(tree):  # PRNG keys as their bits, so that states compare as arrays
    def bits(a):
        return jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a

    return jax.tree_util.tree_map(bits, tree)


def _same_state(ours, theirs):
    assert_close(_plain(nnx.state(ours)), _plain(nnx.state(theirs)))


def _jit(jit: bool):
    return nnx.jit if jit else (lambda f: f)


# --- the MNIST example's train_step (flax/examples, the NNX MNIST tutorial) ---------------------


class CNN(nnx.Module):
    """The tutorial's CNN, smaller: conv, batch norm, dropout drawing from the ``rngs`` argument."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs, param_dtype=F64)
        self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs, dtype=F64, param_dtype=F64)
        self.dropout1 = nnx.Dropout(rate=0.25)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs, param_dtype=F64)
        self.batch_norm2 = nnx.BatchNorm(8, rngs=rngs, dtype=F64, param_dtype=F64)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * 2 * 8, 16, rngs=rngs, param_dtype=F64)
        self.dropout2 = nnx.Dropout(rate=0.25)
        self.linear2 = nnx.Linear(16, 10, rngs=rngs, param_dtype=F64)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def _batch(seed: int):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"image": jax.random.normal(k1, (6, 8, 8, 1), F64), "label": jax.random.randint(k2, (6,), 0, 10)}


def _training(model):
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return optimizer, metrics, nnx.Rngs(1)


@pytest.mark.parametrize("jit", [False, True])
def test_mnist_train_step_with_an_rngs_argument_equals_nnx(jit):
    """The tutorial's loop with jaxtrace.flax.value_and_grad in its train_step: nnx's loss, logits,
    gradients, updated model, metrics and Rngs count, and the tag gradient at the logits in closed form."""

    def nnx_train_step(model, optimizer, metrics, rngs, batch):
        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, rngs)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)
        return loss, logits, grads

    def train_step(model, optimizer, metrics, rngs, batch):
        (loss, logits), (grads, tag_grads) = jaxtrace.flax.value_and_grad(loss_fn, has_aux=True)(model, batch, rngs)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)
        return loss, logits, grads, tag_grads

    model, tagged = CNN(rngs=nnx.Rngs(0)), jt.tag_modules(CNN(rngs=nnx.Rngs(0)))
    theirs, ours = _training(model), _training(tagged)
    nnx_step, our_step = _jit(jit)(nnx_train_step), _jit(jit)(train_step)
    for step in range(3):  # each step starts from the state the last one left
        batch = _batch(step)
        loss, logits, grads = nnx_step(model, *theirs, batch)
        our_loss, our_logits, our_grads, tag_grads = our_step(tagged, *ours, batch)
        assert_close((our_loss, our_logits, our_grads), (loss, logits, grads))
        # parameters after the update, batch statistics; a bias before BatchNorm has a zero gradient up to
        # rounding, which Adam scales up to its step size: 1e-11 apart
        assert_close(_plain(nnx.state(tagged)), _plain(nnx.state(model)), rtol=1e-9, atol=1e-9)
        _same_state(ours[2], theirs[2])  # the Rngs count, advanced once per dropout call
        assert_close(ours[1].compute(), theirs[1].compute())
        # d loss / d logits of a mean cross-entropy: (softmax - one_hot) / batch
        expected = (jax.nn.softmax(logits) - jax.nn.one_hot(batch["label"], 10, dtype=F64)) / 6
        assert_close(tag_grads["linear2"], expected)
    assert int(ours[2].default.count[...]) == 6  # two dropout calls a step


# --- BatchNorm and Dropout in training mode, read with capture --------------------------------


class Stateful(nnx.Module):  # RNG counts and batch statistics change on every call
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs, param_dtype=F64)
        self.norm = nnx.BatchNorm(4, rngs=rngs, dtype=F64, param_dtype=F64)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.norm(self.dense(x)))


X = jnp.linspace(-1.0, 1.0, 15, dtype=F64).reshape(5, 3)


@pytest.mark.parametrize("jit", [False, True])
def test_capture_in_training_mode_leaves_the_state_of_a_plain_call(jit):
    """jt.capture(model)(x), and jt.capture of a function taking the model: the plain call's output,
    the layer's value, and its batch statistics and RNG count after the call."""
    model, tagged = Stateful(nnx.Rngs(0)), jt.tag_modules(Stateful(nnx.Rngs(0)), ["dense"])
    captures = [
        _jit(jit)(lambda m, x: jt.capture(m)(x)),  # the model as the function
        _jit(jit)(jt.capture(lambda m, x: m(x))),  # the model as an argument
    ]
    for capture in captures * 2 if jit else captures:
        expected_h = model.dense(X)
        expected = model(X)
        out, values = capture(tagged, X)
        assert_close(out, expected)
        assert_close(values["dense"], expected_h)
        _same_state(tagged, model)
    # A model the function closes over cannot change inside jaxtrace's trace: Flax's error, and the fix.
    with pytest.raises(Exception, match="Cannot mutate") as error:
        jt.capture(lambda x: tagged(x))(X)
    assert "pass the model (or nnx.Rngs) as an argument" in "".join(getattr(error.value, "__notes__", []))


def _terms(out, h):
    return {"main": jnp.sum(jnp.sin(out) ** 2), "aux": 0.1 * jnp.mean(h**2)}


@pytest.mark.parametrize("jit", [False, True])
def test_capture_inside_flax_jacrev_and_grad_in_training_mode(jit):
    """The loss-paths guide's recipe on BatchNorm and Dropout in training mode: the Jacobian against
    nnx.grad of each term, the state after one plain call."""
    model, tagged = Stateful(nnx.Rngs(0)), jt.tag_modules(Stateful(nnx.Rngs(0)), ["dense", "norm"])

    def losses(m, x):
        out, acts = jt.capture(m)(x)
        return _terms(out, acts["dense"])

    def plain_losses(m, x):
        h = m.dense(x)
        return _terms(m.drop(m.norm(h)), h)

    jacrev = _jit(jit)(jaxtrace.flax.jacrev(losses))
    grad = _jit(jit)(jaxtrace.flax.grad(lambda m, x: losses(m, x)["main"]))
    for _ in range(2):
        expected = {t: nnx.grad(lambda m, x: plain_losses(m, x)[t])(nnx.clone(model), X) for t in ("main", "aux")}
        jac, tag_jacs = jacrev(tagged, X)
        plain_losses(model, X)  # the state one plain call leaves
        assert_close(jac, expected)
        assert_close(tag_jacs["dense"]["aux"], 0.2 * model.dense(X) / 20)  # d mean(h**2)/dh, before the call
        _same_state(tagged, model)
        expected_main = nnx.grad(lambda m, x: plain_losses(m, x)["main"])(nnx.clone(model), X)
        grads, _ = grad(tagged, X)
        plain_losses(model, X)
        assert_close(grads, expected_main)
        _same_state(tagged, model)


# --- a layer stack run by nnx.scan, checked with find_nonfinite (the finding-nans guide) ----------


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs, param_dtype=F64)
        self.norm = nnx.LayerNorm(3, rngs=rngs, param_dtype=F64)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.tanh(self.norm(self.lin(x))))


class Stack(nnx.Module):
    """Layers made by nnx.vmap, run by nnx.scan, each with its own dropout stream, as Flax's guides build it."""

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


def mean_square(model, x):
    return jnp.mean(model(x) ** 2)


@pytest.mark.parametrize("jit", [False, True])
def test_find_nonfinite_on_a_scanned_stack_as_the_guide_shows(jit):
    """The tagged module itself passed to jt.find_nonfinite (under nnx.jit): the report names the
    first layer at step 0, and the dropout streams advance as a plain call advances them."""
    model, tagged = Stack(nnx.Rngs(0)), jt.tag_modules(Stack(nnx.Rngs(0)))
    x = jnp.array([[1.0, jnp.nan, 0.0], [1.0, 2.0, 3.0]], F64)
    check = _jit(jit)(jt.find_nonfinite(mean_square))
    for _ in range(2):
        report = check(tagged, x)
        value = mean_square(model, x)
        _same_state(tagged, model)
        assert np.isnan(report.value) and np.isnan(value)
        assert (report.first_value.name, report.first_value.kind) == ("blocks.lin", "NaN")
        assert report.first_value.steps == (0,)  # the first layer of the scan
    finite = _jit(jit)(jt.find_nonfinite(mean_square))(tagged, x.at[0, 1].set(0.5))
    assert finite.first_value is None and finite.first_gradient is None
    mean_square(model, x)
    _same_state(tagged, model)


# --- every transform, with an nnx.Rngs argument --------------------------------------------------


class Net(nnx.Module):  # dropout draws from the Rngs it is given, as in the MNIST example
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 8, rngs=rngs, param_dtype=F64)
        self.drop = nnx.Dropout(0.5)
        self.l2 = nnx.Linear(8, 2, rngs=rngs, param_dtype=F64)

    def __call__(self, x, rngs):
        return self.l2(self.drop(jnp.tanh(self.l1(x)), rngs=rngs))


def losses(model, x, rngs):  # one loss per example
    return jnp.sum(jnp.sin(model(x, rngs)) ** 2, axis=-1)


def loss(model, x, rngs):
    return jnp.sum(losses(model, x, rngs))


TRANSFORMS = {
    "jt.grad": lambda m, x, r: jt.grad(loss)(m, x, r)[0],
    "jt.value_and_grad, rngs as a keyword": lambda m, x, r: jt.value_and_grad(loss)(m, x, rngs=r)[1][0],
    "jt.vjp": lambda m, x, r: jt.vjp(loss, m, x, r)[1](1.0)[0][0],
    "jt.jacrev": lambda m, x, r: jt.jacrev(loss)(m, x, r)[0],
    "jt.stats.value_and_grad": lambda m, x, r: jt.stats.value_and_grad(loss)(m, x, r)[1][0],
    "jaxtrace.flax.grad": lambda m, x, r: jaxtrace.flax.grad(loss)(m, x, r)[0],
    "jt.capture": lambda m, x, r: jt.capture(loss)(m, x, r)[0],
    "jt.patch": lambda m, x, r: jt.patch(loss, {"l1": lambda v: v})(m, x, r),
    "jt.find_nonfinite": lambda m, x, r: jt.find_nonfinite(loss)(m, x, r).value,
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_every_transform_advances_an_rngs_argument_as_a_plain_call(name, jit):
    """The value or the gradient of nnx (on copies of the state before the call), and the Rngs after it."""
    model, tagged, rngs, ours = Net(nnx.Rngs(0)), jt.tag_modules(Net(nnx.Rngs(0))), nnx.Rngs(5), nnx.Rngs(5)
    transform = _jit(jit)(TRANSFORMS[name])
    for _ in range(2):
        before = nnx.clone(rngs)
        got = transform(tagged, X, ours)
        if "grad" in name or name in ("jt.vjp", "jt.jacrev"):
            expected = nnx.grad(loss)(model, X, before)
            got = got if isinstance(got, nnx.State) else nnx.state(got, nnx.Param)
        else:
            expected = loss(model, X, before)
        loss(model, X, rngs)  # the plain call
        assert_close(got, expected)
        _same_state(ours, rngs)
        _same_state(tagged, model)


@pytest.mark.parametrize("jit", [False, True])
def test_per_example_transforms_with_an_rngs_argument(jit):
    """jt.per_example_norms and jt.clipped_grad: each example's nnx.grad (the same dropout mask, from a
    copy of the Rngs), and the Rngs after one plain call."""
    model, rngs, ours = Net(nnx.Rngs(0)), nnx.Rngs(5), nnx.Rngs(5)
    norms = _jit(jit)(jt.per_example_norms(losses))
    clipped = _jit(jit)(jt.clipped_grad(losses, 1.0))
    for transform in (norms, clipped):
        per_example = [
            nnx.grad(lambda m, x, r, i=i: losses(m, x, r)[i])(model, X, nnx.clone(rngs)) for i in range(len(X))
        ]
        sq = [sum(jnp.sum(g**2) for g in jax.tree_util.tree_leaves(gi)) for gi in per_example]
        value, got = transform(model, X, ours)
        expected_losses = losses(model, X, rngs)
        assert_close(value, expected_losses)
        if transform is norms:
            expected = jax.tree_util.tree_map(lambda *g: jnp.stack([jnp.sum(gi**2) for gi in g]), *per_example)
        else:
            weights = [jnp.minimum(1.0, 1.0 / jnp.sqrt(s)) for s in sq]
            expected = jax.tree_util.tree_map(lambda *g: sum(w * gi for w, gi in zip(weights, g)), *per_example)
        assert_close(got, expected, rtol=1e-10, atol=1e-12)
        _same_state(ours, rngs)


def test_a_variable_reached_from_a_differentiated_model_and_an_argument_is_refused():
    """jt.find_nonfinite takes the model as a pytree (as jax.grad); an Rngs it holds passed again would be two."""
    rngs = nnx.Rngs(5)

    class Holder(nnx.Module):
        def __init__(self):
            self.l1 = nnx.Linear(3, 2, rngs=nnx.Rngs(0), param_dtype=F64)
            self.rngs = rngs

    with pytest.raises(TypeError, match="reachable both from the model or an argument that is differentiated"):
        jt.find_nonfinite(lambda m, x, r: jnp.sum(m.l1(x)) + jax.random.uniform(r()))(Holder(), X, rngs)


def test_a_call_that_adds_variables_is_refused():
    """Variables made during the call cannot leave jaxtrace's trace: a sentence that says where to make them."""

    class Lazy(nnx.Module):
        def __init__(self):
            self.l1 = nnx.Linear(3, 2, rngs=nnx.Rngs(0), param_dtype=F64)

        def __call__(self, x):
            self.seen = nnx.BatchStat(jnp.mean(x))  # state created by the call
            return self.l1(x)

    with pytest.raises(TypeError, match="added or removed nnx.Variables.*Create that state before"):
        jt.capture(Lazy())(X)


def test_jt_grad_of_a_module_with_rng_state_names_jaxtrace_flax():
    """jt.grad differentiates every leaf, as jax.grad: an owned RNG count has no gradient, and the error says
    which leaf and what to use instead."""
    tagged = jt.tag_modules(Stateful(nnx.Rngs(0)))
    for transform in (jt.grad, jt.stats.value_and_grad, jt.jacrev):
        with pytest.raises(TypeError, match=r"at \.drop\.rngs\.count.*Use jaxtrace\.flax\.grad"):
            transform(lambda m, x: jnp.sum(m(x)))(tagged, X)
    grads, _ = jaxtrace.flax.grad(lambda m, x: jnp.sum(m(x)))(tagged, X)  # the way the message names
    assert sorted(grads) == ["dense", "norm"]
