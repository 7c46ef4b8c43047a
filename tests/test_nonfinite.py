"""jt.find_nonfinite: the tag, loop step and example where a NaN or an inf began, in real traps.

The eager variants of the heavier tests run with --long (op-by-op dispatch compiles every small
operation); their jit variants always run.

Each trap is checked against an oracle: the same program written with an explicit ``+ eps`` at
each tag and differentiated with plain ``jax.grad`` (the values and the cotangents at the tags), or
a closed form where the program says which entry breaks. Under ``jax.jit`` and without, in float64
and float32.
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import pytest

import jaxtrace as jt
from jaxtrace import _nonfinite_report

HERE = os.path.basename(__file__)


@pytest.fixture(params=["jit", "eager"])
def maybe_jit(request):
    return jax.jit if request.param == "jit" else (lambda f: f)


@pytest.fixture(params=[jnp.float64, jnp.float32])
def dtype(request):
    return request.param


def line_of(fun, text: str) -> int:
    """The line in this file of the first line of ``fun`` that holds ``text``."""
    import inspect

    lines, start = inspect.getsourcelines(fun)
    return start + next(i for i, line in enumerate(lines) if text in line)


def oracle(program, params, *args):
    """Values and cotangents at the tags of ``program(params, *args, t)``, where ``t(value, name)`` is
    the tag: here ``value + eps[name]``, differentiated with plain ``jax.grad`` at ``eps = 0``."""
    names = []

    def record(value, name):
        names.append(name)
        return value

    shapes = {}

    def shape_probe(value, name):
        shapes[name] = jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value))
        return value

    jax.eval_shape(lambda p: program(p, *args, shape_probe), params)
    eps = {n: jnp.zeros(s.shape, s.dtype) for n, s in shapes.items()}

    def with_eps(p, eps):
        values = {}

        def t(value, name):
            value = value + eps[name]
            values[name] = value
            return value

        return program(p, *args, t), values

    (_, values), (g_params, g_eps) = jax.value_and_grad(with_eps, argnums=(0, 1), has_aux=True)(params, eps)
    return values, g_eps, g_params


def tagged(program):
    return lambda params, *args: program(params, *args, jt.tag)


def assert_nonfinite_at(oracle_values, at, kind):
    entry = np.asarray(oracle_values[at.name])[at.index]
    assert not np.all(np.isfinite(entry))
    assert (np.any(np.isnan(entry)) if kind == "NaN" else np.any(np.isinf(entry)) and not np.any(np.isnan(entry)))


# --- the traps ------------------------------------------------------------------------------------


def where_trap(w, x, t):
    h = t(x * w["scale"], "h")
    y = t(jnp.where(h > 0, jnp.log(h), 0.0), "y")  # the FAQ's trap: log's derivative at 0 reaches h
    return jnp.sum(y)


def test_where_log_gradient_trap(maybe_jit, dtype):
    w, x = {"scale": jnp.asarray(1.0, dtype)}, jnp.asarray([1.0, 0.0, 2.0], dtype)
    report = maybe_jit(jt.find_nonfinite(tagged(where_trap)))(w, x)
    values, g_eps, g_w = oracle(where_trap, w, x)
    assert all(np.all(np.isfinite(v)) for v in values.values())  # finite forward values
    assert report.first_value is None
    at = report.first_gradient
    assert (at.name, at.index, at.kind) == ("h", (), "NaN")
    assert at.source == f"{__file__}:{line_of(where_trap, 'x * w')}"
    assert_nonfinite_at(g_eps, at, "NaN")
    assert np.all(np.isfinite(g_eps["y"]))
    assert report.params == ["scale"] and not np.isfinite(g_w["scale"])
    text = str(report)
    assert "Every tagged value is finite (2 tags)." in text
    assert (
        f"The gradients are finite down to 'y' and not at 'h' ({HERE}:{line_of(where_trap, 'x * w')}): "
        "the NaN begins in the backward pass of the code between them." in text
    )
    assert "Non-finite entries in the gradient of 'scale'." in text
    assert float(report.value) == pytest.approx(float(jnp.log(2.0)))


def self_distance(x, t):
    diff = x[:, None, :] - x[None, :, :]
    sq = t(jnp.sum(diff**2, axis=-1), "sq")  # zero on the diagonal: a point's distance to itself
    dist = t(jnp.sqrt(sq), "dist")
    return jnp.sum(dist)


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_sqrt_of_zero_distance_only_backward(maybe_jit, dtype):
    x = jnp.asarray([[0.0, 1.0], [2.0, 0.5], [1.0, 1.0]], dtype)
    report = maybe_jit(jt.find_nonfinite(tagged(self_distance)))(x)
    values, g_eps, g_x = oracle(self_distance, x)
    assert all(np.all(np.isfinite(v)) for v in values.values())
    assert report.first_value is None
    at = report.first_gradient
    assert (at.name, at.index, at.kind) == ("sq", (), "inf")  # 1 / (2 sqrt(0)), before 0 * inf = NaN at x
    assert_nonfinite_at(g_eps, at, "inf")
    assert np.all(np.isfinite(g_eps["dist"]))
    assert report.params == [""] and np.isnan(g_x).any()
    text = str(report)
    assert "The gradients are finite down to 'dist' and not at 'sq'" in text
    assert "the inf begins in the backward pass of the code between them" in text
    assert "Every tagged value is finite: it appears only in the backward pass." in text
    assert "Non-finite entries in the gradient of the argument itself." in text


def attention(w, q, k, v, mask, t):
    def one(q, k, v, mask):
        scores = t(q @ k.T * w, "scores")
        masked = jnp.where(mask, scores, -jnp.inf)
        probs = t(jax.nn.softmax(masked, axis=-1), "probs")  # a row masked everywhere: softmax of -inf
        return t(probs @ v, "out")

    return jnp.sum(jax.vmap(one)(q, k, v, mask))


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_fully_masked_attention_row(maybe_jit, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (3, 4, 2), dtype) for key in (kq, kk, kv))
    mask = jnp.tril(jnp.ones((4, 4), bool))[None].repeat(3, 0)
    mask = mask.at[1, 2].set(False)  # example 1, query 2 sees nothing
    w = jnp.asarray(0.5, dtype)
    report = maybe_jit(jt.find_nonfinite(tagged(attention)))(w, q, k, v, mask)
    at = report.first_value
    assert (at.name, at.index, at.kind, at.examples) == ("probs", (1,), "NaN", (1,))
    # Oracle: the same attention in plain JAX.
    scores = jnp.einsum("bqd,bkd->bqk", q, k) * w
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    assert np.all(np.isfinite(scores)) and list(np.all(np.isfinite(probs), axis=(1, 2))) == [True, False, True]
    line = line_of(attention, '"probs"')
    assert (
        f"The values are finite up to 'scores' and not at 'probs' ({HERE}:{line}), example 1: the NaN begins in the "
        "code between them." in str(report)
    )
    # The backward pass stays finite: jnp.where sends zeros to every masked score, NaN rows included.
    g_w = jax.grad(lambda w: attention(w, q, k, v, mask, lambda value, name: value))(w)
    assert report.first_gradient is None and report.params == [] and np.isfinite(g_w)


def cross_entropy(w, x, labels, t):
    def one(x, label):
        logits = t(x @ w, "logits")
        probs = t(jax.nn.softmax(logits), "probs")
        logp = t(jnp.log(probs), "logp")  # log(0): the label's probability underflowed
        return -logp[label]

    return jnp.mean(jax.vmap(one)(x, labels))


def cross_entropy_unrolled(w, x, labels, t):
    """The oracle's version: example by example, the tags named per example."""
    losses = []
    for b in range(x.shape[0]):
        logits = t(x[b] @ w, ("logits", b))
        probs = t(jax.nn.softmax(logits), ("probs", b))
        losses.append(-t(jnp.log(probs), ("logp", b))[labels[b]])
    return jnp.mean(jnp.stack(losses))


def per_example(values, name, n):
    return np.stack([np.asarray(values[(name, b)]) for b in range(n)])


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_log_of_zero_in_cross_entropy(maybe_jit, dtype):
    w = jnp.asarray([[1.0, -1.0, 0.0], [0.0, 0.0, 1.0]], dtype)
    x = jnp.asarray([[1.0, 0.0], [1000.0, 0.0], [0.0, 1.0]], dtype)  # example 1: logits 1000 apart
    labels = jnp.asarray([0, 1, 2])
    report = maybe_jit(jt.find_nonfinite(tagged(cross_entropy)))(w, x, labels)
    values, g_eps, _ = oracle(cross_entropy_unrolled, w, x, labels)
    values = {name: per_example(values, name, 3) for name in ("logits", "probs", "logp")}
    g_eps = {name: per_example(g_eps, name, 3) for name in ("logits", "probs", "logp")}
    at = report.first_value
    assert (at.name, at.index, at.kind) == ("logp", (1,), "inf")
    assert_nonfinite_at(values, at, "inf")
    assert np.all(np.isfinite(values["probs"])) and np.all(np.isfinite(values["logits"]))
    assert np.all(np.isfinite(np.delete(np.asarray(values["logp"]), 1, axis=0)))
    line = line_of(cross_entropy, '"logp"')
    assert (
        f"The values are finite up to 'probs' and not at 'logp' ({HERE}:{line}), "
        "example 1: the inf begins in the code between them." in str(report)
    )
    g = report.first_gradient  # the backward pass meets 1/0 at probs, then the softmax's 0 * inf
    assert g is not None and g.examples == (1,)
    assert_nonfinite_at(g_eps, g, g.kind)
    assert not np.isfinite(float(report.value))


def scanned_stack(scales, xs, t):
    """Micro-batches (an outer scan) through a scanned stack of 8 bfloat16 layers."""

    def micro_batch(total, x):
        def layer(h, scale):
            h = t(h, "in")
            z = t(h * scale.astype(jnp.bfloat16), "scaled")  # overflows bfloat16 (max 3.4e38)
            return jax.nn.leaky_relu(z), None

        h, _ = jax.lax.scan(layer, x.astype(jnp.bfloat16), scales)
        return total + jnp.sum(h.astype(scales.dtype)), None

    total, _ = jax.lax.scan(micro_batch, jnp.zeros((), scales.dtype), xs)
    return total


def scanned_stack_unrolled(scales, xs, t):
    """The oracle's version: the same program in Python loops, the tags named per step."""
    total = jnp.zeros((), scales.dtype)
    for i in range(xs.shape[0]):
        h = xs[i].astype(jnp.bfloat16)
        for l in range(scales.shape[0]):
            h = t(h, ("in", i, l))
            h = jax.nn.leaky_relu(t(h * scales[l].astype(jnp.bfloat16), ("scaled", i, l)))
        total = total + jnp.sum(h.astype(scales.dtype))
    return total


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_bfloat16_overflow_in_layer_5_of_a_scanned_stack(maybe_jit, dtype):
    scales = jnp.asarray([1.0, 1.0, 1.0, 1.0, 1.0, 1e38, 1.0, 1.0], dtype)
    xs = jnp.asarray([[0.5, 0.1], [0.2, 0.3], [0.9, 20.0]], dtype)  # only micro-batch 2 reaches 3.4e38 at layer 5
    report = maybe_jit(jt.find_nonfinite(tagged(scanned_stack)))(scales, xs)
    at = report.first_value
    assert (at.name, at.index, at.kind, at.loop_kinds) == ("scaled", (2, 5), "inf", ("scan step", "scan step"))
    values, g_eps, _ = oracle(scanned_stack_unrolled, scales, xs)
    bad = [key for key, v in values.items() if not np.all(np.isfinite(np.asarray(v, np.float32)))]
    assert min(bad, key=lambda k: (k[1], k[2], k[0] == "scaled")) == ("scaled", 2, 5)
    assert np.isinf(np.asarray(values[("scaled", 2, 5)], np.float32)).any()
    line = line_of(scanned_stack, '"scaled"')
    assert (
        f"The values are finite up to 'in' and not at 'scaled' ({HERE}:{line}), scan step 2, scan step 5: "
        "the inf begins in the code between them." in str(report)
    )
    grads_bad = [key for key, v in g_eps.items() if not np.all(np.isfinite(np.asarray(v, np.float32)))]
    assert (report.first_gradient is None) == (not grads_bad)


def per_example_recurrence(w, xs, t):
    """vmap outside a scan: a tag's index is (scan step, example)."""

    def one(x):
        def step(h, x_t):
            h = t(h * w + x_t, "pre")
            return t(jnp.log(h), "h"), None

        h, _ = jax.lax.scan(step, jnp.ones((), x.dtype), x)
        return h

    return jnp.sum(jax.vmap(one)(xs))


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_nan_at_one_vmapped_example_and_step(maybe_jit, dtype):
    xs = jnp.asarray([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, -9.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype)
    w = jnp.asarray(1.0, dtype)
    report = maybe_jit(jt.find_nonfinite(tagged(per_example_recurrence)))(w, xs)
    at = report.first_value
    assert (at.name, at.index, at.steps, at.examples, at.kind) == ("h", (2, 1), (2,), (1,), "NaN")
    # Closed form: example 1's pre-activation at step 2 is log(log(2)) - 9 < 0; every earlier one is > 0.
    h = 1.0
    for step, x_t in enumerate([1.0, 1.0, -9.0]):
        pre = h * 1.0 + x_t
        assert (pre > 0) == (step < 2)
        h = np.log(pre) if pre > 0 else np.nan
    assert "and not at 'h'" in str(report) and "scan step 2, example 1: the NaN begins" in str(report)
    g = report.first_gradient  # the backward pass computes the last step first
    assert g.examples == (1,) and g.steps == (3,)


class Sqrt(eqx.Module):
    def __call__(self, x, *, key=None):
        return jnp.sqrt(x)


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
@pytest.mark.parametrize("minor", [2**30, 8, 1])  # how many entries one key indexes: all, rows apart, every axis apart
@pytest.mark.parametrize("case", ["nan after an inf", "inf only", "nan in the second leaf"])
def test_the_entry_inside_the_value(case, minor, monkeypatch):
    """``entry`` and ``leaf``: where inside the tagged value the first non-finite entry is, at the
    reported step and example: a NaN if that example has one (even after an inf), in the first leaf
    of the tagged pytree that has one, row-major; the same when the device indexes the leading axes
    apart (values of 2**30 entries or more; here made small)."""
    monkeypatch.setattr(_nonfinite_report, "_MINOR", minor)

    def f(x, y):
        def one(xe, ye):
            def step(c, k):
                pair = jt.tag((xe * (k + 1.0), ye - k), "pair")
                return c + jnp.sum(pair[0]) + jnp.sum(pair[1]), None

            return lax.scan(step, 0.0, jnp.arange(3.0))[0]

        return jnp.sum(jax.vmap(one)(x, y))

    x, y = np.ones((2, 3, 5)), np.ones((2, 3, 5))
    x[1, 0, 1] = np.inf  # example 1, from scan step 0 on
    if case == "nan after an inf":
        x[1, 2, 3] = np.nan
    if case == "nan in the second leaf":
        y[1, 1, 0] = np.nan
    want = {"nan after an inf": ("NaN", 0, (2, 3)), "inf only": ("inf", 0, (0, 1)), "nan in the second leaf": ("NaN", 1, (1, 0))}
    at = jax.jit(jt.find_nonfinite(f))(x, y).first_value
    assert (at.name, at.steps, at.examples) == ("pair", (0,), (1,)), at
    assert (at.kind, at.leaf, at.entry) == want[case], at
    assert at.shard is None and at.replicated == () and not at.local  # one device


def test_equinox_model_tagged_with_tag_modules(maybe_jit, dtype):
    key = jax.random.key(0)
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(2, 2, key=key, dtype=dtype), eqx.nn.Lambda(jnp.tanh), eqx.nn.Linear(2, 1, key=key, dtype=dtype), Sqrt()]
    )
    model = eqx.tree_at(lambda m: (m.layers[0].weight, m.layers[0].bias), model, (jnp.eye(2, dtype=dtype), jnp.zeros(2, dtype)))
    model = eqx.tree_at(lambda m: (m.layers[2].weight, m.layers[2].bias), model, (jnp.ones((1, 2), dtype), jnp.zeros(1, dtype)))
    model = jt.tag_modules(model)
    xs = jnp.asarray([[1.0, 1.0], [-2.0, -1.0], [0.5, 0.0]], dtype)  # example 1: a negative sum into the sqrt

    def loss(model, xs):
        return jnp.sum(jax.vmap(model)(xs))

    jit = eqx.filter_jit if maybe_jit is jax.jit else maybe_jit  # the model holds a function (the Lambda)
    report = jit(jt.find_nonfinite(loss))(model, xs)
    at = report.first_value
    assert (at.name, at.index, at.source, at.kind) == ("3", (1,), "3", "NaN")
    assert report.names == ["0", "1", "2", "3", ""]
    assert (
        "The values are finite up to '2' and not at '3', example 1: the NaN begins in the code between them."
        in str(report)
    )
    # Oracle: the model's layers by hand.
    h = jnp.tanh(xs) @ jnp.ones((2, 1), dtype)
    assert np.all(np.isfinite(h)) and list(np.isnan(jnp.sqrt(h))[:, 0]) == [False, True, False]
    assert "layers.0.weight" in report.params and "layers.2.weight" in report.params
    assert all(p.startswith("layers.") for p in report.params)  # the Lambda's function is not a parameter


def test_a_finite_program_reports_none(maybe_jit, dtype):
    def loss(w, xs):
        def step(h, x):
            return jt.tag(jnp.tanh(h * w + x), "h"), None

        h, _ = jax.lax.scan(step, jnp.zeros(2, dtype), xs)
        return jnp.sum(jt.tag(h, "out") ** 2)

    report = maybe_jit(jt.find_nonfinite(loss))(jnp.asarray(0.5, dtype), jnp.ones((3, 2), dtype))
    assert report.first_value is None and report.first_gradient is None and report.params == []
    assert str(report) == (
        "Every tagged value is finite (2 tags). Every gradient at the tags is finite. Every parameter gradient is finite."
    )
    value, _ = jt.value_and_grad(loss)(jnp.asarray(0.5, dtype), jnp.ones((3, 2), dtype))
    assert float(report.value) == pytest.approx(float(value))


def test_the_first_tag_already_nonfinite_and_aux(maybe_jit):
    def loss(x):
        h = jt.tag(x * 2.0, "h")
        return jnp.sum(jt.tag(h + 1.0, "g")), {"n": jnp.sum(x)}

    report = maybe_jit(jt.find_nonfinite(loss, has_aux=True))(jnp.asarray([1.0, jnp.inf]))
    assert (report.first_value.name, report.first_value.kind) == ("h", "inf")
    assert "The value at 'h'" in str(report) and "it is the first tag the program computes" in str(report)
    assert report.nonfinite_params == {"": 1}  # the differentiated input itself, named as such
    assert "hold non-finite entries before this call: the argument itself (1 of 2)." in str(report)
    assert "comes from those arguments, the other inputs or from the code before that tag" in str(report)
    assert report.aux["n"] == jnp.inf


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_flax_nnx_model_tagged_with_tag_modules(maybe_jit, dtype):
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0), param_dtype=dtype), nnx.tanh, nnx.Linear(3, 1, rngs=nnx.Rngs(1), param_dtype=dtype))
    model.layers[2].kernel[...] = model.layers[2].kernel[...].at[1, 0].set(jnp.nan)  # a NaN weight in the last layer
    model = jt.tag_modules(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x))

    report = maybe_jit(jt.find_nonfinite(loss))(params, jnp.ones((4, 2), dtype))
    at = report.first_value
    assert (at.name, at.index, at.source, at.kind) == ("2", (), "2", "NaN")
    assert "The values are finite up to '0' and not at '2', the NaN begins" not in str(report)
    assert "The values are finite up to '0' and not at '2': the NaN begins in the code between them." in str(report)
    # Oracle: the layers by hand; the NaN weight's gradient is finite, the other kernel's is not.
    h = jnp.tanh(jnp.ones((4, 2), dtype) @ model.layers[0].kernel[...] + model.layers[0].bias[...])
    assert np.all(np.isfinite(h)) and np.all(np.isnan(h @ model.layers[2].kernel[...]))
    assert report.params == ["layers.0.bias", "layers.0.kernel"]  # the NaN kernel's own gradient is finite
    assert report.nonfinite_params == {"layers.2.kernel": 1}  # the weight itself: named, with its count
    assert "before this call: 'layers.2.kernel' (1 of 3). In parameters, an earlier update made them" in str(report)
    g = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(jnp.ones((4, 2), dtype))))(params)
    assert not np.all(np.isfinite(g["layers"][0]["kernel"][...])) and np.all(np.isfinite(g["layers"][2]["kernel"][...]))


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_checkpoint_cond_and_repeated_calls_keep_the_program_order(maybe_jit):
    """A checkpointed scan body, a tag in a cond branch, and repeated calls with another tag between them."""

    def loss(w, xs):
        def block(h):
            return jt.tag(h * w, "block", repeated=True)

        h = block(jnp.ones(2))
        h = jt.tag(jax.lax.cond(h[0] > 0, lambda h: jt.tag(h + 1.0, "branch"), lambda h: h, h), "cond")
        h = block(h)  # call 1 of "block", after "branch" and "cond"

        @jax.checkpoint
        def layer(h, x):
            h = jt.tag(h * x, "scaled")
            return jt.tag(jnp.log(h), "logged"), None

        h, _ = jax.lax.scan(layer, h, xs)
        return jnp.sum(h)

    xs = jnp.asarray([1.0, 2.0, -1.0, 1.0])  # log of a negative at step 2
    report = maybe_jit(jt.find_nonfinite(loss))(2.0, xs)
    assert report.names == ["block", "branch", "cond", "scaled", "logged"]
    at = report.first_value
    assert (at.name, at.index, at.kind) == ("logged", (2,), "NaN")
    assert "finite up to 'scaled' and not at 'logged'" in str(report)
    assert report.first_gradient.name == "scaled" and report.first_gradient.index == (3,)

    # The repeated calls sit at their own places: call 1 of "block" comes after "cond".
    report = maybe_jit(jt.find_nonfinite(loss))(jnp.inf, xs)
    assert (report.first_value.name, report.first_value.index) == ("block", (0,))
    text = str(report)
    assert "The value at 'block'" in text and ", call 0 is an inf" in text


def test_the_neighbour_across_loop_steps():
    """The entry before step 2's first tag is the last tag of step 1."""

    def loss(xs):
        def step(h, x):
            h = jt.tag(jnp.log(h * x), "a")
            return jt.tag(h + 1.0, "b"), None

        h, _ = jax.lax.scan(step, 3.0, xs)
        return h

    report = jax.jit(jt.find_nonfinite(loss))(jnp.asarray([1.0, 1.0, -1.0]))
    assert (report.first_value.name, report.first_value.index) == ("a", (2,))
    assert "The values are finite up to 'b' (scan step 1) and not at 'a'" in str(report)


def test_repeated_calls_are_ordered_each_at_its_place():
    def loss(c):
        h = jt.tag(jnp.ones(2), "block", repeated=True)
        h = jt.tag(h * c, "between")  # inf here, and so in call 1 of "block" below
        h = jt.tag(h * 2.0, "block", repeated=True)
        return jnp.sum(h)

    report = jax.jit(jt.find_nonfinite(loss))(jnp.inf)
    assert (report.first_value.name, report.first_value.index) == ("between", ())
    assert "finite up to 'block' (call 0) and not at 'between'" in str(report)
    report = jax.jit(jt.find_nonfinite(loss))(1.0)
    assert report.first_value is None and report.first_gradient is None


def test_a_vmap_around_it_is_an_error_not_a_mixed_up_report():
    def loss(x):
        return jnp.sum(jnp.log(jt.tag(x, "x")))

    report = jax.vmap(jt.find_nonfinite(loss))(jnp.asarray([[1.0, 2.0], [1.0, -1.0]]))
    with pytest.raises(ValueError, match="Put the jax.vmap inside"):
        report.first_value
    with pytest.raises(TypeError, match="read on the host"):
        jax.jit(lambda x: jt.find_nonfinite(loss)(x).first_value)(jnp.ones(2))


# --- reverse scans: reported in the order the program computes them (issue 50, item 3) -------------


def program_order(program, params, *args):
    """The names the (unrolled) ``program`` gives its marks, in the order it calls them."""
    names = []

    def record(value, name):
        names.append(name)
        return value

    jax.eval_shape(lambda p: program(p, *args, record), params)
    return names


def first_in_order(order, values, examples=0):
    """``(name, entry, example)`` of the first name in ``order`` whose value has a non-finite entry,
    and the first example (of the ``examples`` leading axes of its value) that has one."""
    for name in order:
        bad = ~np.isfinite(np.asarray(values[name], np.float64))
        if bad.any():
            per_example = bad.reshape(*bad.shape[:examples], -1).any(-1)
            return name, tuple(int(i) for i in np.argwhere(per_example)[0]) if examples else ()
    return None


S, OBS = 3, [0, 1, 0, 2, 1, 0, 1]  # symbol 2 is never emitted: the observation at position 3 is impossible


def hmm_params(dtype):
    A = jnp.asarray([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.3, 0.3, 0.4]], dtype)
    B = jnp.asarray([[0.6, 0.4, 0.0], [0.5, 0.5, 0.0], [0.1, 0.9, 0.0]], dtype)
    return {"A": A, "B": B, "pi": jnp.full((S,), 1.0 / S, dtype)}


def hmm_log_likelihood(params, obs, t):
    """The backward recursion of an HMM in log space: beta_k from beta_{k+1} and the observation at k+1."""
    log_A, log_B = jnp.log(params["A"]), jnp.log(params["B"])

    def backward(beta, o):
        emit = t(log_B[:, o] + beta, "emit")
        beta = t(jax.nn.logsumexp(log_A + emit[None, :], axis=1), "beta")
        return beta, None

    beta0, _ = jax.lax.scan(backward, jnp.zeros(S, log_A.dtype), obs[1:], reverse=True)
    return jax.nn.logsumexp(jnp.log(params["pi"]) + log_B[:, obs[0]] + beta0)


def hmm_unrolled(params, obs, t):
    """The oracle's version: a Python loop from the last step down, the tags named per step."""
    log_A, log_B = jnp.log(params["A"]), jnp.log(params["B"])
    beta = jnp.zeros(S, log_A.dtype)
    for k in reversed(range(len(OBS) - 1)):
        emit = t(log_B[:, obs[k + 1]] + beta, ("emit", k))
        beta = t(jax.nn.logsumexp(log_A + emit[None, :], axis=1), ("beta", k))
    return jax.nn.logsumexp(jnp.log(params["pi"]) + log_B[:, obs[0]] + beta)


def test_hmm_backward_recursion_in_a_reverse_scan(maybe_jit, dtype):
    params, obs = hmm_params(dtype), jnp.asarray(OBS)
    report = maybe_jit(jt.find_nonfinite(tagged(hmm_log_likelihood)))(params, obs)
    values, g_eps, _ = oracle(hmm_unrolled, params, obs)
    order = program_order(hmm_unrolled, params, obs)
    assert order[:4] == [("emit", 5), ("beta", 5), ("emit", 4), ("beta", 4)]  # the scan runs from its last index
    (name, k), _ = first_in_order(order, values)
    assert (name, k) == ("emit", 2)  # obs[3] is impossible: -inf from step 2 down to 0, finite above
    at = report.first_value
    assert (at.name, at.steps, at.kind, at.loop_kinds) == ("emit", (2,), "inf", ("reverse scan step",))
    assert_nonfinite_at({"emit": np.stack([values[("emit", i)] for i in range(6)])}, at, "inf")
    line = line_of(hmm_log_likelihood, '"emit"')
    assert (
        f"The values are finite up to 'beta' (reverse scan step 3) and not at 'emit' ({HERE}:{line}), "
        "reverse scan step 2: the inf begins in the code between them." in str(report)
    )
    (name, k), _ = first_in_order(order[::-1], g_eps)  # the backward pass runs the other way
    g = report.first_gradient
    assert (g.name, g.steps) == (name, (k,)) == ("beta", (0,))
    assert_nonfinite_at({"beta": np.stack([g_eps[("beta", i)] for i in range(6)])}, g, g.kind)
    assert not np.isfinite(float(report.value))


def returns_per_episode(params, rewards, t):
    """Outer scan over episodes, vmap over a batch, an inner reverse scan for the discounted returns."""

    def episode(total, batch):
        def one(r):
            def discount(g, r_k):
                g = t(r_k * params["scale"] + params["gamma"] * g, "return")
                return g, t(jnp.log(g), "log_return")  # log of a return <= 0

            _, logs = jax.lax.scan(discount, jnp.zeros((), r.dtype), r, reverse=True)
            return jnp.sum(logs)

        return total + jnp.sum(jax.vmap(one)(batch)), None

    total, _ = jax.lax.scan(episode, jnp.zeros((), rewards.dtype), rewards)
    return total


def returns_unrolled(params, rewards, t):
    """The oracle's version: episodes and steps in Python loops (steps from the last), the batch as a vector."""
    total = jnp.zeros((), rewards.dtype)
    for e in range(rewards.shape[0]):
        g = jnp.zeros(rewards.shape[1], rewards.dtype)
        for k in reversed(range(rewards.shape[2])):
            g = t(rewards[e, :, k] * params["scale"] + params["gamma"] * g, ("return", e, k))
            total = total + jnp.sum(t(jnp.log(g), ("log_return", e, k)))
    return total


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_nested_loop_with_an_inner_reverse_scan(maybe_jit, dtype):
    rewards = jnp.ones((3, 2, 6), dtype)
    rewards = rewards.at[1, 0, :2].set(jnp.asarray([5.0, -3.0], dtype))  # episode 1, example 0: negative at step 1
    rewards = rewards.at[1, 1, 3].set(-0.75)  # example 1: the return at step 3 is 0 exactly (-0.75 + 0.5 * 1.5)
    params = {"scale": jnp.asarray(1.0, dtype), "gamma": jnp.asarray(0.5, dtype)}
    report = maybe_jit(jt.find_nonfinite(tagged(returns_per_episode)))(params, rewards)
    values, g_eps, g_params = oracle(returns_unrolled, params, rewards)
    order = program_order(returns_unrolled, params, rewards)
    first = first_in_order(order, values, examples=1)
    assert first == (("log_return", 1, 3), (1,))  # step 3 runs before step 1: log(0) before log(-2.06)
    at = report.first_value
    assert (at.name, at.steps, at.examples, at.kind) == ("log_return", (1, 3), (1,), "inf")
    assert at.loop_kinds == ("scan step", "reverse scan step")
    line = line_of(returns_per_episode, '"log_return"')
    assert (
        f"The values are finite up to 'return' and not at 'log_return' ({HERE}:{line}), scan step 1, "
        "reverse scan step 3, example 1: the inf begins in the code between them." in str(report)
    )
    # The backward pass: episode 2, then episode 1 from step 0 up; 1/g is finite for g < 0, inf at g = 0.
    first = first_in_order(order[::-1], g_eps, examples=1)
    assert first == (("return", 1, 3), (1,))
    g = report.first_gradient
    assert (g.name, g.steps, g.examples, g.kind) == ("return", (1, 3), (1,), "inf")
    assert sorted(report.params) == sorted(n for n in params if not np.isfinite(g_params[n]))


def two_scans(w, xs, t):
    """One repeated tag in a forward scan, then in a reversed one: its call axis runs up, its step
    axis up in call 0 and down in call 1."""

    def step(h, x):
        h = t(jnp.log(h * x * w), "a")
        return h + 2.0, None

    h, _ = jax.lax.scan(step, jnp.ones((), xs.dtype), xs[0])
    h, _ = jax.lax.scan(step, h, xs[1], reverse=True)
    return h


def two_scans_unrolled(w, xs, t):
    h = jnp.ones((), xs.dtype)
    for call, steps in ((0, range(4)), (1, reversed(range(4)))):
        for k in steps:
            h = t(jnp.log(h * xs[call, k] * w), ("a", call, k)) + 2.0
    return h


def test_a_repeated_tag_in_a_forward_and_a_reversed_scan(maybe_jit):
    xs = jnp.ones((2, 4)).at[1, 0].set(-1.0).at[1, 2].set(-1.0)
    report = maybe_jit(jt.find_nonfinite(tagged(lambda w, xs, t: two_scans(w, xs, lambda v, n: t(v, n, repeated=True)))))(1.0, xs)
    values, g_eps, _ = oracle(two_scans_unrolled, 1.0, xs)
    order = program_order(two_scans_unrolled, 1.0, xs)
    assert first_in_order(order, values) == (("a", 1, 2), ())
    assert first_in_order(order[::-1], g_eps) == (("a", 1, 1), ())  # the last step's own gradient is 1
    at, g = report.first_value, report.first_gradient
    assert (at.steps, at.loop_kinds, g.steps) == ((1, 2), ("call", "reverse scan step"), (1, 1))
    assert "finite up to 'a' (call 1, reverse scan step 3) and not at 'a'" in str(report)


# --- a training loop: step k's update makes the NaN that step k+1's loss shows (issue 50, item 2) ---


def contrastive_loss(model, a, b, same, margin=1.0):
    """Pairs (a[i], b[i]) pulled together when ``same``, else pushed apart to ``margin``."""
    emb = jax.vmap(model)(jnp.concatenate([a, b]))
    ea, eb = jnp.split(emb, 2)
    d = jax.vmap(jnp.linalg.norm)(ea - eb)  # its gradient at d = 0 is NaN (sqrt at 0): a duplicated pair
    return jnp.mean(jnp.where(same, d**2, jnp.maximum(margin - d, 0.0) ** 2))


def contrastive_by_hand(w, a, b, same, t, margin=1.0):
    """The oracle's version: eqx.nn.MLP(4, 3, 8, 2) written out, ``t`` at each layer's output and the model's."""
    h = jnp.concatenate([a, b])
    for i in range(3):
        h = t(h @ w[f"W{i}"].T + w[f"b{i}"], f"layers.{i}")
        h = jax.nn.relu(h) if i < 2 else h
    ea, eb = jnp.split(t(h, ""), 2)
    d = jnp.sqrt(jnp.sum((ea - eb) ** 2, axis=1))
    return jnp.mean(jnp.where(same, d**2, jnp.maximum(margin - d, 0.0) ** 2))


def weights_of(model):
    pairs = (("W", "weight"), ("b", "bias"))
    return {f"{kind}{i}": getattr(layer, attr) for i, layer in enumerate(model.layers) for kind, attr in pairs}


def pair_batches(n=8, bad=5):
    """Random pairs; in batch ``bad`` the positive pair 2 is one input twice (a duplicate in the data)."""
    for step in range(n):
        ka, kb = jax.random.split(jax.random.key(step))
        a, b = jax.random.normal(ka, (6, 4)), jax.random.normal(kb, (6, 4))
        yield a, (b.at[2].set(a[2]) if step == bad else b), jnp.arange(6) % 2 == 0


def all_finite(*trees):
    """One flag: every floating entry of ``trees`` is finite (XLA fuses the checks into the step)."""
    leaves = jax.tree_util.tree_leaves(eqx.filter(trees, eqx.is_inexact_array))
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def train(guard: bool):
    """An equinox + optax loop, as users write it; with ``guard``, a step whose loss or gradients are
    not finite keeps the state it was given and the loop stops there."""
    import optax

    model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.key(0))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, a, b, same):
        loss, grads = eqx.filter_value_and_grad(contrastive_loss)(model, a, b, same)
        updates, new_opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        new_model = eqx.apply_updates(model, updates)
        if not guard:
            return new_model, new_opt_state, loss, jnp.isfinite(loss)
        finite = all_finite(loss, grads)
        keep = lambda new, old: jnp.where(finite, new, old) if eqx.is_array(new) else new  # noqa: E731
        model, opt_state = jax.tree_util.tree_map(keep, (new_model, new_opt_state), (model, opt_state))
        return model, opt_state, loss, finite

    states, losses = [model], []
    for step, batch in enumerate(pair_batches()):
        model, opt_state, loss, finite = train_step(model, opt_state, *batch)
        states.append(model)
        losses.append(float(loss))
        if not finite:
            return step, batch, states, losses
    raise AssertionError("the loop never met a non-finite step")


@pytest.mark.long_eager  # the jit variant always runs; eager (op by op) with --long
def test_a_training_loop_whose_first_bad_step_has_a_finite_loss(maybe_jit):
    pytest.importorskip("optax")
    jit = eqx.filter_jit if maybe_jit is jax.jit else maybe_jit
    batches = list(pair_batches())

    # Oracle: step 5's loss is finite and its gradients are not; its update breaks the weights.
    step, batch, states, losses = train(guard=False)
    assert step == 6 and np.isnan(losses[6]) and all(np.isfinite(losses[:6]))
    value, grads = jax.value_and_grad(lambda w: contrastive_by_hand(w, *batches[5], lambda v, n: v))(weights_of(states[5]))
    assert np.isfinite(value) and not all(np.all(np.isfinite(g)) for g in grads.values())

    # Without a guard: at step 6 the weights are already NaN; the report says so first.
    report = jit(jt.find_nonfinite(contrastive_loss))(jt.tag_modules(states[6]), *batch)
    broken = {
        f"layers.{i}.{attr}": int(np.sum(~np.isfinite(getattr(layer, attr))))
        for i, layer in enumerate(states[6].layers)
        for attr in ("weight", "bias")
    }
    assert report.nonfinite_params == {p: n for p, n in broken.items() if n}
    text = str(report)
    first = f"'layers.0.weight' ({broken['layers.0.weight']} of 32)"
    assert f"The differentiated arguments hold non-finite entries before this call: {first}" in text
    assert "In parameters, an earlier update made them" in text
    assert "the NaN comes from those arguments, the other inputs or from the code before that tag" in text

    # With the guard: the loop stops at step 5 (loss finite) and keeps the state before it.
    step, batch, states_guarded, losses_guarded = train(guard=True)
    assert step == 5 and np.isfinite(losses_guarded[5]) and losses_guarded == pytest.approx(losses[:6])
    kept = states_guarded[-1]
    for got, want in zip(jax.tree_util.tree_leaves(weights_of(kept)), jax.tree_util.tree_leaves(weights_of(states[5]))):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    report = jit(jt.find_nonfinite(contrastive_loss))(jt.tag_modules(kept), *batch)
    values, g_eps, g_w = oracle(contrastive_by_hand, weights_of(kept), *batch)
    order = program_order(contrastive_by_hand, weights_of(kept), *batch)
    assert order == report.names == ["layers.0", "layers.1", "layers.2", ""]
    assert first_in_order(order, values, examples=1) is None and report.first_value is None
    assert report.nonfinite_params == {}
    name, example = first_in_order(order[::-1], g_eps, examples=1)
    g = report.first_gradient
    assert (g.name, g.examples, g.kind) == (name, example, "NaN") == ("", (2,), "NaN")  # pair 2, the duplicate
    bad = {f"layers.{k[1]}.{'weight' if k[0] == 'W' else 'bias'}" for k, v in g_w.items() if not np.all(np.isfinite(v))}
    assert set(report.params) == bad


def test_tag_modules_tags_say_where_they_come_from_in_their_equations():
    """find_nonfinite tells jt.tag_modules' tags from the user's by the tag equation's ``origin``
    parameter (not by the source file that made it): the module's tags carry it, a user's tag does not."""
    from jaxtrace._tag import MODULE_TAGS, is_tag

    model = jt.tag_modules(eqx.nn.MLP(2, 2, 4, 1, key=jax.random.PRNGKey(0)))
    jaxpr = jax.make_jaxpr(lambda x: jt.tag(model(x), "user").sum())(jnp.ones(2))
    origins = {e.params["name"]: e.params.get("origin") for e in jaxpr.eqns if is_tag(e)}
    assert origins.pop("user") is None
    assert origins and set(origins.values()) == {MODULE_TAGS}, origins
