"""jt.per_example_norms and jt.clipped_grad against the definition (row i of jax.jacrev of the losses vector), float64, 1e-10.

Models: an MLP, a transformer block (attention + MLP + LayerNorm + Embedding), a CNN, on
equinox and on Flax NNX; tied weights (eqx.nn.Shared, a shared NNX Variable, a module
called twice); under jit, under vmap, bfloat16; fallback="error"; a traced max_norm;
jax.grad around clipped_grad.
"""

import functools
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrace as jt
from oracles import assert_close, oracle_per_example

nnx = pytest.importorskip("flax.nnx")

F64 = jnp.float64
# larger cases: marked slow, run with --long (tests/conftest.py; .ci/run passes it)
SLOW = [pytest.mark.slow]
KEY = jax.random.key(0)


# --- the checks (the oracle is the definition: tests/oracles.py) --------------------------


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


def to_dtype(model, dtype=F64):
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, _cast(state, dtype))
        for _, node in nnx.iter_graph(model):  # nnx.Embed computes in the dtype it was built with
            if isinstance(node, nnx.Module) and getattr(node, "dtype", None) is not None:
                node.dtype = dtype
        return model
    return _cast(model, dtype)


def jit(f):
    """nnx.jit for NNX models (it keeps shared modules shared), eqx.filter_jit otherwise."""
    eqx_jit, nnx_jit = eqx.filter_jit(f), nnx.jit(f)
    return lambda *args: (nnx_jit if any(isinstance(a, nnx.Module) for a in args) else eqx_jit)(*args)


def check(fun, model, *batch, fallback="vmap"):
    """Norms, and the clipped sum with max_norm the median norm (it bites for half the examples), in one jit."""

    def ours(model, *batch):
        losses, sq = jt.per_example_norms(fun, fallback=fallback)(model, *batch)
        max_norm = jnp.median(jnp.sqrt(sum(jax.tree.leaves(sq))))
        return losses, sq, max_norm, jt.clipped_grad(fun, max_norm, fallback=fallback)(model, *batch)[1]

    losses, sq, max_norm, grads = jit(ours)(model, *batch)
    np.testing.assert_allclose(losses, fun(model, *batch), rtol=1e-12)
    assert_close(sq, jit(lambda m, *b: oracle_per_example(fun, m, *b).sq_norms)(model, *batch), rtol=1e-10)
    assert_close(grads, jit(lambda m, c, *b: oracle_per_example(fun, m, *b).clipped(c))(model, max_norm, *batch), rtol=1e-10)



def check_on_factors(fun, model, *args, under_jit=None):
    """Norms and the clipped sum (max_norm the median norm) with ``fallback="error"``, eager and under
    jit (``under_jit=True``: only under jit; ``False``: only eagerly), against the definition: row
    ``i`` of ``jax.jacrev`` of the losses vector."""
    ref = oracle_per_example(fun, model, *args)
    c = float(jnp.median(jnp.sqrt(ref.total)))

    def ours(m, *args):
        return jt.per_example_norms(fun, fallback="error")(m, *args)[1], jt.clipped_grad(fun, c, fallback="error")(m, *args)[1]

    for f in {None: (ours, jit(ours)), True: (jit(ours),), False: (ours,)}[under_jit]:
        sq, clipped = f(model, *args)
        assert_close(jax.tree.leaves(sq), jax.tree.leaves(ref.sq_norms), rtol=1e-10)
        assert_close(jax.tree.leaves(clipped), jax.tree.leaves(ref.clipped(c)), rtol=1e-10)

# --- models ----------------------------------------------------------------------------


def mse(model, x, y):
    out = jax.vmap(model)(x) if isinstance(model, eqx.Module) else model(x)
    return jnp.sum((out - y) ** 2, axis=-1)


B = 6


def data(*shape, key=1):
    return jax.random.normal(jax.random.key(key), shape, F64)


class EqxBlock(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, vocab, d, t, key):
        k = jax.random.split(key, 6)
        self.embed = eqx.nn.Embedding(vocab, d, key=k[0])
        self.pos = jax.random.normal(k[1], (t, d)) * 0.1
        self.ln1 = eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(2, d, use_query_bias=True, use_output_bias=True, key=k[2])
        self.ln2 = eqx.nn.RMSNorm(d)
        self.up = eqx.nn.Linear(d, 2 * d, key=k[3])
        self.down = eqx.nn.Linear(2 * d, d, key=k[4])
        self.head = eqx.nn.Linear(d, vocab, key=k[5])

    def __call__(self, ids):
        h = jax.vmap(self.embed)(ids) + self.pos
        a = jax.vmap(self.ln1)(h)
        h = h + self.attn(a, a, a)
        m = jax.vmap(self.ln2)(h)
        h = h + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(m)))
        return jax.vmap(self.head)(h)


class NnxBlock(nnx.Module):
    def __init__(self, vocab, d, t, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(t, d, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, rngs=rngs) for _ in range(4))
        self.ln2 = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)
        self.heads = 2

    def __call__(self, ids, positions):
        h = self.embed(ids) + self.pos(positions)
        a = self.ln1(h)
        split = lambda z: z.reshape(*z.shape[:-1], self.heads, -1)  # noqa: E731
        q, k, v = split(self.q(a)), split(self.k(a)), split(self.v(a))
        w = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1]), axis=-1)
        h = h + self.o(jnp.einsum("bhts,bshd->bthd", w, v).reshape(h.shape))
        h = h + self.down(jax.nn.gelu(self.up(self.ln2(h))))
        return self.head(h)


def xent(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=-1)


def eqx_lm(model, ids, targets):
    return xent(jax.vmap(model)(ids), targets)


def nnx_lm(model, ids, positions, targets):
    return xent(model(ids, positions), targets)


class EqxCNN(eqx.Module):
    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.c1 = eqx.nn.Conv2d(2, 3, 3, stride=2, padding=1, key=k[0])
        self.c2 = eqx.nn.Conv2d(3, 4, 2, dilation=2, key=k[1])
        self.fc = eqx.nn.Linear(4 * 2 * 2, 3, key=k[2])

    def __call__(self, x):
        h = jnp.tanh(self.c2(jnp.tanh(self.c1(x))))
        return self.fc(h.reshape(-1))


class NnxCNN(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(2, 3, (3, 3), strides=2, padding=1, rngs=rngs)
        self.c2 = nnx.Conv(3, 4, (2, 2), kernel_dilation=2, padding="VALID", rngs=rngs)
        self.fc = nnx.Linear(4 * 2 * 2, 3, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.c2(jnp.tanh(self.c1(x))))
        return self.fc(h.reshape(h.shape[0], -1))


# --- the oracle tests ------------------------------------------------------------------


def test_mlp_equinox():
    model = to_dtype(eqx.nn.MLP(3, 2, 8, 2, key=KEY))
    check(mse, model, data(B, 3), data(B, 2, key=2))


def test_mlp_nnx():
    rngs = nnx.Rngs(0)
    model = to_dtype(nnx.Sequential(nnx.Linear(3, 8, rngs=rngs), nnx.tanh, nnx.Linear(8, 2, rngs=rngs)))
    check(mse, model, data(B, 3), data(B, 2, key=2))


@pytest.mark.slow  # ~15-35 s each: with --long
def test_transformer_block_equinox():
    """Embedding, LayerNorm, RMSNorm, attention projections and MLP by rule; the raw `pos` by vmap."""
    model = to_dtype(EqxBlock(11, 8, 5, KEY))
    ids = jax.random.randint(jax.random.key(3), (B, 5), 0, 11)
    check(eqx_lm, model, ids, jnp.roll(ids, 1, axis=1))


@pytest.mark.slow  # ~15-35 s each: with --long
def test_transformer_block_nnx():
    model = to_dtype(NnxBlock(11, 8, 5, nnx.Rngs(0)))
    ids = jax.random.randint(jax.random.key(3), (B, 5), 0, 11)
    positions = jnp.broadcast_to(jnp.arange(5), (B, 5))
    check(nnx_lm, model, ids, positions, jnp.roll(ids, 1, axis=1), fallback="error")


@pytest.mark.slow  # ~15-35 s each: with --long
def test_cnn_equinox():
    check(mse, to_dtype(EqxCNN(KEY)), data(B, 2, 7, 7), data(B, 3, key=2), fallback="error")


@pytest.mark.slow  # ~15-35 s each: with --long
def test_cnn_nnx():
    check(mse, to_dtype(NnxCNN(nnx.Rngs(0))), data(B, 7, 7, 2), data(B, 3, key=2), fallback="error")


class PooledCNN(eqx.Module):
    """The classic DP-SGD CNN as equinox users write it: convolutions, each followed by a pooling layer."""

    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.c1, self.c2 = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[0]), eqx.nn.Conv2d(3, 4, 3, padding=1, key=k[1])
        self.fc = eqx.nn.Linear(4 * 2 * 2, 3, key=k[2])

    def __call__(self, x):  # (2, 8, 8)
        h = eqx.nn.MaxPool2d(2, 2)(jax.nn.relu(self.c1(x)))  # lax.reduce_window_max
        h = eqx.nn.AvgPool2d(2, 2)(jnp.tanh(self.c2(h)))  # lax.reduce_window_sum
        return self.fc(h.reshape(-1))


class NnxPooledCNN(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(2, 3, (3, 3), padding="SAME", rngs=rngs)
        self.c2 = nnx.Conv(3, 4, (3, 3), padding="SAME", rngs=rngs)
        self.fc = nnx.Linear(4 * 2 * 2, 3, rngs=rngs)

    def __call__(self, x):  # (B, 8, 8, 2)
        h = nnx.max_pool(nnx.relu(self.c1(x)), (2, 2), strides=(2, 2))
        h = nnx.avg_pool(jnp.tanh(self.c2(h)), (2, 2), strides=(2, 2))
        return self.fc(h.reshape(h.shape[0], -1))


@pytest.mark.parametrize("framework", ["equinox", "nnx"])
def test_layers_before_a_pooling_layer_are_on_factors(framework):
    """A pooling layer (``lax.reduce_window_*``) pools within each example: the layers before it keep
    their factors."""
    if framework == "equinox":
        check(mse, to_dtype(PooledCNN(KEY)), data(B, 2, 8, 8), data(B, 3, key=2), fallback="error")
    else:
        check(mse, to_dtype(NnxPooledCNN(nnx.Rngs(0))), data(B, 8, 8, 2), data(B, 3, key=2), fallback="error")


@pytest.mark.parametrize("dims", [1, pytest.param(3, marks=SLOW)])
def test_conv_1d_3d(dims):
    eq = to_dtype(eqx.nn.Conv(dims, 2, 3, 2, stride=2, padding=1, key=KEY))
    fun = lambda m, x: jnp.sum(jnp.tanh(jax.vmap(m)(x)).reshape(x.shape[0], -1) ** 2, 1)  # noqa: E731
    check(fun, eq, data(B, 2, *[5] * dims), fallback="error")
    nx = to_dtype(nnx.Conv(2, 3, (2,) * dims, strides=2, padding="SAME", rngs=nnx.Rngs(0)))
    fun = lambda m, x: jnp.sum(jnp.tanh(m(x)).reshape(x.shape[0], -1) ** 2, 1)  # noqa: E731
    check(fun, nx, data(B, *[5] * dims, 2), fallback="error")


# Each conv geometry against the definition (jax.jacrev of the losses vector), eager and jitted, on
# both routes of _conv.py: the Gram form (few output positions T against the channels,
# T * (C * K + O) < C * K * O) and the per-example gradient from shifted input slices (larger T).
# (framework, dims, layer kwargs, input side for each route); all but the first ~10-30 s each: with --long,
# and under jit only (eagerly, op by op, each took 5-15 s: the first geometry's eager runs cover that path).
CONV_GEOMETRIES = [
    ("eqx", 2, dict(stride=2, padding=((1, 2), (0, 1)), dilation=(1, 2)), (4, 10)),
    pytest.param("eqx", 2, dict(stride=(1, 2), padding="SAME_LOWER"), (2, 10), marks=SLOW),
    pytest.param("eqx", 1, dict(padding="VALID", dilation=2), (7, 24), marks=SLOW),
    pytest.param("eqx", 3, dict(stride=2, padding=1), (2, 5), marks=SLOW),
    pytest.param("nnx", 2, dict(strides=2, padding=((1, 1), (2, 1)), input_dilation=2, kernel_dilation=(2, 1)), (2, 10), marks=SLOW),
    pytest.param("nnx", 1, dict(padding=[(2, 0)], kernel_dilation=2, use_bias=False), (5, 24), marks=SLOW),
    pytest.param("nnx", 3, dict(strides=(1, 2, 1), padding=1), (2, 5), marks=SLOW),
]


def _conv_model(framework, dims, kw):
    if framework == "eqx":
        return to_dtype(eqx.nn.Conv(dims, 4, 5, 3, key=KEY, **kw)), 1
    return to_dtype(nnx.Conv(4, 5, (3,) * dims, rngs=nnx.Rngs(0), **kw)), -1


def _eager_for_the_first(geometries):
    """Each geometry's ``pytest.param`` on both routes, under jit and eagerly (the eager pass, op by op,
    with --long), but the geometries after the first under jit alone."""
    cases = []
    for k, geometry in enumerate(geometries):
        values, marks, name = (geometry.values, geometry.marks, geometry.id) if hasattr(geometry, "values") else (geometry, (), None)
        for jit in (False, True) if k == 0 else (True,):
            for route in ("gram", "slices"):
                ids = "-".join(str(part) for part in (jit, name or f"{values[0]}-{values[1]}d-{k}", route))
                eager = [pytest.mark.long_eager] if not jit else []
                cases.append(pytest.param(*values, route, jit, marks=[*marks, *eager], id=ids))
    return cases


@pytest.mark.parametrize("framework, dims, kw, sides, route, jit", _eager_for_the_first(CONV_GEOMETRIES))
def test_conv_geometry_against_jacrev(framework, dims, kw, sides, route, jit):
    model, channel = _conv_model(framework, dims, kw)
    side = sides[route == "slices"]
    shape = (B, 4, *[side] * dims) if channel == 1 else (B, *[side] * dims, 4)
    x = data(*shape)
    call = (lambda m, x: jax.vmap(m)(x)) if framework == "eqx" else (lambda m, x: m(x))  # noqa: E731
    out = call(model, x)
    positions = int(np.prod(out.shape[2:] if channel == 1 else out.shape[1:-1]))
    ck, o = 4 * 3**dims, 5
    assert (positions * (ck + o) < ck * o) == (route == "gram"), positions  # the case takes that route (_conv.py)
    scale = jnp.linspace(0.5, 2.0, B)

    def fun(m, x):
        return scale * jnp.sum(jnp.tanh(call(m, x)).reshape(x.shape[0], -1) ** 2, axis=1)

    check_on_factors(fun, model, x, under_jit=jit)


@pytest.mark.slow  # ~10-30 s: with --long
def test_conv_called_twice_against_jacrev():
    """One Conv called twice per example (on the image and on its square): the two calls' G_i summed."""
    conv = to_dtype(eqx.nn.Conv2d(2, 3, 3, padding=1, key=KEY))

    def fun(m, x):
        return jax.vmap(lambda xi: jnp.sum(jnp.tanh(m(xi)) ** 2) + jnp.sum(jnp.sin(m(xi * xi))))(x)

    check_on_factors(fun, conv, data(B, 2, 6, 6))


@pytest.mark.parametrize("framework", ["eqx", "nnx"])
@pytest.mark.parametrize("cin, blocks", [(3, 1), (8, 9)])
def test_conv_blocks_one_per_offset_or_one_for_all_against_jacrev(framework, cin, blocks):
    """Below ``FEW_CHANNELS`` input channels a call's G_i is one contraction over every kernel offset's
    view side by side, from 8 one per offset (``ConvUse.per_offset``); both in the leaf's layout, OIHW
    and NNX's HWIO, against the definition (the norms and the clipped sum, jit and eager)."""
    from jaxtrace._per_example._conv import FEW_CHANNELS, ConvUse

    if framework == "eqx":
        model, call, x = to_dtype(eqx.nn.Conv2d(cin, 4, 3, stride=2, padding=1, key=KEY)), lambda m, x: jax.vmap(m)(x), data(B, cin, 7, 7)
    else:
        model, call, x = to_dtype(nnx.Conv(cin, 4, (3, 3), strides=2, padding="SAME", rngs=nnx.Rngs(0))), lambda m, x: m(x), data(B, 7, 7, cin)
    use = ConvUse(jnp.zeros((B, 1, cin, 4, 4)), jnp.zeros((B, 1, 4, 2, 2)), (3, 3), (1, 1), ((0, 0), (0, 0)), (1, 1), (1, 1), False)
    assert (cin < FEW_CHANNELS) == (blocks == 1) and len(use.per_offset(jnp.float64)) == blocks

    def fun(m, x):
        return jnp.sum(jnp.tanh(call(m, x)).reshape(x.shape[0], -1) ** 2, axis=1)

    check_on_factors(fun, model, x)


@pytest.mark.parametrize("cin", [3, 8])
def test_conv_block_forms_under_vmap_grad_and_jvp(cin):
    """Both block forms of ``ConvUse.per_offset`` (one contraction below ``FEW_CHANNELS``, one per offset
    from it) with ``jax.vmap`` over two parameter sets, ``jax.grad`` of the summed norms and ``jax.jvp``
    around ``per_example_norms``, against the same transforms of the definition (float64)."""
    conv = to_dtype(eqx.nn.Conv2d(cin, 4, 3, stride=2, padding=1, key=KEY))
    x = data(B, cin, 5, 5)
    diff, static = eqx.partition(conv, eqx.is_inexact_array)

    def losses(m, x):
        return jnp.sum(jnp.tanh(jax.vmap(m)(x)).reshape(x.shape[0], -1) ** 2, axis=1)

    norms = lambda d: jt.per_example_norms(losses, total=True, fallback="error")(eqx.combine(d, static), x)[1]  # noqa: E731
    reference = lambda d: oracle_per_example(losses, eqx.combine(d, static), x).total  # noqa: E731
    two = jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.7 * a]), diff)
    assert_close(jax.jit(jax.vmap(norms))(two), jax.vmap(reference)(two), "under jax.vmap", rtol=1e-10, atol=0)
    assert_close(jax.grad(lambda d: jnp.sum(norms(d)))(diff), jax.grad(lambda d: jnp.sum(reference(d)))(diff), "under jax.grad", rtol=1e-9, atol=1e-12)
    tangent = jax.tree_util.tree_map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), diff)
    ours, expected = jax.jvp(norms, (diff,), (tangent,)), jax.jvp(reference, (diff,), (tangent,))
    assert_close(ours, expected, "under jax.jvp", rtol=1e-9, atol=1e-12)


class EqxConvStack(eqx.Module):
    convs: eqx.nn.Conv2d  # three Conv2d stacked by eqx.filter_vmap, run with lax.scan
    calls: int = eqx.field(static=True, default=1)  # each step's conv applied once or twice

    def __call__(self, x):
        params, static = eqx.partition(self.convs, eqx.is_array)

        def step(h, p):
            for _ in range(self.calls):
                h = jnp.tanh(eqx.combine(p, static)(h))
            return h, None

        return jax.lax.scan(step, x, params)[0]


@pytest.mark.slow  # ~10-30 s: with --long
@pytest.mark.parametrize("calls", [1, 2])
def test_conv_stacked_in_scan_against_jacrev(calls):
    """Convolutions stacked in lax.scan: each step's slice of the weight is its own parameter (called
    twice a step: the two calls' positions side by side)."""
    stack = eqx.filter_vmap(lambda k: eqx.nn.Conv2d(2, 2, 3, padding=1, key=k))(jax.random.split(KEY, 3))
    model = to_dtype(EqxConvStack(stack, calls))

    def fun(m, x):
        return jnp.sum(jax.vmap(m)(x).reshape(x.shape[0], -1) ** 2, axis=1)

    check_on_factors(fun, model, data(B, 2, 6, 6))



def test_a_stacked_conv_called_in_a_scan_nested_in_its_scan_takes_the_exact_path():
    """A convolution stacked in a scan and run over positions by a scan in its body: the rule's factors keep
    their own layout (no positions to lay the inner steps beside), so its weight takes the exact path, named
    under ``fallback="error"``; the numbers are the definition's."""
    convs = eqx.filter_vmap(lambda k: eqx.nn.Conv1d(2, 2, 3, padding=1, key=k))(jax.random.split(KEY, 2))

    def fun(convs, x):  # x: (B, T, C, W)
        params, static = eqx.partition(convs, eqx.is_array)

        def layer(xs, p):
            conv = eqx.combine(p, static)
            return jax.lax.scan(lambda h, x_t: (jnp.tanh(conv(x_t) + 0.5 * h),) * 2, jnp.zeros((2, 6), F64), xs)[1], None

        return jnp.sum(jnp.sin(jax.vmap(lambda x: jax.lax.scan(layer, x, params)[0])(x)), axis=(1, 2, 3))

    model, x = to_dtype(convs), data(B, 3, 2, 6)
    with pytest.raises(jt.TagError, match=r"'weight'.*stacked in a scan and called in a loop nested in it"):
        jt.per_example_norms(fun, fallback="error")(model, x)
    ref = oracle_per_example(fun, model, x)
    sq = jit(jt.per_example_norms(fun))(model, x)[1]
    assert_close(jax.tree.leaves(sq), jax.tree.leaves(ref.sq_norms), rtol=1e-10)

# Grouped and depthwise convolutions (feature_group_count = G: each group's output channels read that
# group's input channels alone; depthwise is G = C_in, here with a channel multiplier of 2), on both
# routes of _conv.py, with fallback="error" so that the exact path cannot stand in for the factors.
# (framework, dims, in, out, groups, layer kwargs, input side for each route); all but the first with --long,
# under jit only.
GROUPED_GEOMETRIES = [
    pytest.param("eqx", 2, 8, 16, 2, dict(stride=2, padding=1), (4, 8), id="eqx-2d-groups"),
    pytest.param("nnx", 2, 3, 6, 3, dict(strides=2, padding="SAME"), (2, 8), marks=SLOW, id="nnx-2d-depthwise"),
    pytest.param("eqx", 2, 3, 6, 3, dict(padding="SAME", dilation=(1, 2)), (1, 6), marks=SLOW, id="eqx-2d-depthwise"),
    pytest.param("eqx", 1, 16, 16, 2, dict(stride=2, padding=((2, 1),)), (9, 14), marks=SLOW, id="eqx-1d-groups"),
    pytest.param("nnx", 1, 3, 6, 3, dict(padding="VALID", kernel_dilation=2, use_bias=False), (5, 12), marks=SLOW, id="nnx-1d-depthwise"),
    pytest.param("nnx", 2, 8, 16, 2, dict(strides=(1, 2), padding=((1, 0), (2, 1)), input_dilation=(2, 1)), (2, 5), marks=SLOW, id="nnx-2d-groups"),
]


@pytest.mark.parametrize("framework, dims, cin, cout, groups, kw, sides, route, jit", _eager_for_the_first(GROUPED_GEOMETRIES))
def test_grouped_conv_against_jacrev(framework, dims, cin, cout, groups, kw, sides, route, jit):
    if framework == "eqx":
        model, call = eqx.nn.Conv(dims, cin, cout, 3, groups=groups, key=KEY, **kw), lambda m, x: jax.vmap(m)(x)
        shape = (B, cin, *[sides[route == "slices"]] * dims)
    else:
        model, call = nnx.Conv(cin, cout, (3,) * dims, feature_group_count=groups, rngs=nnx.Rngs(0), **kw), lambda m, x: m(x)
        shape = (B, *[sides[route == "slices"]] * dims, cin)
    model, x = to_dtype(model), data(*shape)
    out = call(model, x)
    positions = int(np.prod(out.shape[2:] if framework == "eqx" else out.shape[1:-1]))
    ck, o = cin // groups * 3**dims, cout // groups
    assert (positions * (ck + o) < ck * o) == (route == "gram"), positions  # the case takes that route (_conv.py)
    scale = jnp.linspace(0.5, 2.0, B)

    def fun(m, x):
        return scale * jnp.sum(jnp.tanh(call(m, x)).reshape(x.shape[0], -1) ** 2, axis=1)

    check_on_factors(fun, model, x, under_jit=jit)


def test_grouped_conv_patch_factors():
    """A grouped call as patch factors (``ConvUse.expand``, for a weight shared with a use of another
    kind): one row per position and group, so that the norm and the weighted sum are those of G_i."""
    from jaxtrace._per_example._conv import ConvUse
    from jaxtrace._per_example._factors import sq_norm, weighted_sum

    @functools.partial(jax.jit, static_argnums=0)  # one program per layout (eagerly: seconds of op-by-op compiles)
    def both_ways(out_last):
        use = ConvUse(data(B, 1, 6, 5), data(B, 1, 9, 3, key=2), (3,), (1,), ((0, 0),), (1,), (1,), out_last, 3)
        per = use.per_example(F64)  # (B, 9, 2, 3), or (B, 3, 2, 9)
        w = jnp.linspace(0.5, 2.0, B)
        ours = sq_norm([use.expand(F64)], F64), weighted_sum([use.expand(F64)], w, per.shape[1:], F64)
        return per, ours, (jnp.sum(per.reshape(B, -1) ** 2, axis=1), jnp.tensordot(w, per, 1))

    for out_last in (False, True):
        per, ours, direct = both_ways(out_last)
        assert per.shape == ((B, 3, 2, 9) if out_last else (B, 9, 2, 3))
        assert_close(ours, direct, rtol=1e-10)


# --- tied and shared weights -------------------------------------------------------------


class EqxTied(eqx.Module):
    shared: eqx.nn.Shared
    mix: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        embed = eqx.nn.Embedding(7, 4, key=k1)
        head = eqx.nn.Linear(4, 7, key=k2)
        self.shared = eqx.nn.Shared((embed, head), lambda p: p[1].weight, lambda p: p[0].weight)
        self.mix = eqx.nn.Linear(4, 4, key=k3)

    def __call__(self, ids):
        embed, head = self.shared()
        h = jax.vmap(embed)(ids)
        h = jax.vmap(self.mix)(jnp.tanh(jax.vmap(self.mix)(h)))  # one module called twice
        return jax.vmap(head)(h)


@pytest.mark.slow  # 6-20 s on 2 cores: with --long (CI's newest-3.11 cell)
def test_tied_equinox():
    """eqx.nn.Shared ties the head to the embedding; `mix` runs twice: the cross terms count."""
    model = to_dtype(EqxTied(KEY))
    ids = jax.random.randint(jax.random.key(3), (B, 3), 0, 7)
    check(eqx_lm, model, ids, jnp.roll(ids, 1, axis=1), fallback="error")


class NnxTied(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 4, rngs=rngs)
        self.b.kernel = self.a.kernel  # one Variable in two layers
        self.again = self.a  # one module at two paths

    def __call__(self, x):
        return self.again(jnp.tanh(self.b(jnp.tanh(self.a(x)))))


def test_tied_nnx():
    check(mse, to_dtype(NnxTied(nnx.Rngs(0))), data(B, 4), data(B, 4, key=2), fallback="error")


class EqxTiedHead(eqx.Module):
    """GPT-2's tied head: the embedding matrix read directly, `h @ embed.weight.T`, beside its Embedding call."""

    embed: eqx.nn.Embedding
    mix: eqx.nn.Linear
    through: object = eqx.field(static=True)  # what the head applies to the matrix first (None: nothing)

    def __init__(self, key, through=None):
        k1, k2 = jax.random.split(key)
        self.embed, self.mix = eqx.nn.Embedding(7, 4, key=k1), eqx.nn.Linear(4, 4, key=k2)
        self.through = through

    def __call__(self, ids):
        h = jnp.tanh(jax.vmap(self.mix)(jax.vmap(self.embed)(ids)))
        w = self.embed.weight if self.through is None else self.through(self.embed.weight)
        return h @ w.T


class NnxTiedHead(nnx.Module):
    def __init__(self, rngs, through=None):
        self.embed, self.mix = nnx.Embed(7, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)
        self.through = through

    def __call__(self, ids):
        h = jnp.tanh(self.mix(self.embed(ids)))
        if self.through is None:
            return self.embed.attend(h)
        return h @ self.through(self.embed.embedding[...]).T


def nnx_lm_plain(model, ids, targets):
    return xent(model(ids), targets)


@pytest.mark.parametrize("framework", ["equinox", "nnx"])
def test_tied_head_reading_the_matrix_is_on_factors(framework):
    """GPT-2's tied head, the embedding matrix read by a matrix product (``h @ embed.weight.T``,
    NNX's ``attend``) beside its Embedding call: both uses on factors, with their cross terms."""
    if framework == "equinox":
        model, fun = to_dtype(EqxTiedHead(KEY)), eqx_lm
    else:
        model, fun = to_dtype(NnxTiedHead(nnx.Rngs(0))), nnx_lm_plain
    ids = jax.random.randint(jax.random.key(3), (B, 3), 0, 7)
    check(fun, model, ids, jnp.roll(ids, 1, axis=1))
    jt.per_example_norms(fun, fallback="error")(model, ids, ids)


@pytest.mark.parametrize("framework", ["equinox", "nnx"])
def test_leaf_also_used_outside_its_layers(framework):
    """A weight used outside its covered layer other than by a read the rules cover (here the head
    reads ``tanh(embed.weight)``) has more gradient than the layer's factors: it goes to the
    fallback (exact), or fallback="error" names it; never a norm too small."""
    if framework == "equinox":
        model, fun, name = to_dtype(EqxTiedHead(KEY, jnp.tanh)), eqx_lm, r"'embed\.weight' \(in module 'embed', Embedding\)"
    else:
        model, fun, name = to_dtype(NnxTiedHead(nnx.Rngs(0), jnp.tanh)), nnx_lm_plain, r"'embed\.embedding' \(in module 'embed', Embed\)"
    ids = jax.random.randint(jax.random.key(3), (B, 3), 0, 7)
    check(fun, model, ids, jnp.roll(ids, 1, axis=1))
    with pytest.raises(jt.TagError, match=name) as info:
        jt.per_example_norms(fun, fallback="error")(model, ids, ids)
    assert "mix" not in str(info.value)  # the Linear is used by its call only: by its factors


class EqxWrapped(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear
    unused: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.a, self.b, self.unused = (eqx.nn.Linear(3, 3, key=kk) for kk in k)

    def __call__(self, x):
        h = jax.checkpoint(lambda x: jnp.tanh(self.a(x)))(x)
        return eqx.filter_jit(lambda h: self.b(h))(h)


def test_layers_in_checkpoint_jit_and_scan_by_factors():
    """Layers called inside jax.checkpoint, a jit and a lax.scan body are still by factors (fallback="error"
    passes), and a leaf the losses never use has zero norms rather than an error."""
    model = to_dtype(EqxWrapped(KEY))
    x, y = data(B, 3), data(B, 3, key=2)
    check(mse, model, x, y, fallback="error")

    def scanned(m, x, y):
        h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(jax.vmap(m.a)(h)), None), x, None, length=2)
        return jnp.sum((jax.vmap(m.b)(h) - y) ** 2, -1)

    check(scanned, model, x, y, fallback="error")
    _, sq = jit(jt.per_example_norms(scanned, fallback="error"))(model, x, y)
    assert not np.any(sq.unused.weight) and sq.a.weight.shape == (B,)


@pytest.mark.slow  # 6-20 s on 2 cores: with --long (CI's newest-3.11 cell)
def test_batch_size_equal_to_other_axes():
    """B equals the number of calls and the sequence length: the batch axis is found by a probe."""
    model = to_dtype(EqxTied(KEY))
    ids = jax.random.randint(jax.random.key(3), (2, 2), 0, 7)
    losses, sq = jit(jt.per_example_norms(eqx_lm, fallback="error"))(model, ids, ids[:, ::-1])
    assert_close(sq, oracle_per_example(eqx_lm, model, ids, ids[:, ::-1]).sq_norms, rtol=1e-10)


def test_batch_of_one_and_total():
    model = to_dtype(eqx.nn.MLP(3, 2, 8, 2, key=KEY))
    x, y = data(1, 3), data(1, 2, key=2)
    _, sq = jit(jt.per_example_norms(mse))(model, x, y)
    assert_close(sq, oracle_per_example(mse, model, x, y).sq_norms, rtol=1e-10)
    _, total = jit(jt.per_example_norms(mse, total=True))(model, x, y)
    np.testing.assert_allclose(total, sum(jax.tree.leaves(sq)), rtol=1e-12)


# --- transforms around, dtypes, errors -------------------------------------------------------


def test_eager_and_nnx_jit():
    model = to_dtype(nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1))))
    x, y = data(B, 3), data(B, 2, key=2)
    ref = oracle_per_example(mse, model, x, y).sq_norms
    assert_close(jt.per_example_norms(mse)(model, x, y)[1], ref, rtol=1e-10)
    assert_close(nnx.jit(jt.per_example_norms(mse))(model, x, y)[1], ref, rtol=1e-10)


def test_vmap_around():
    """A vmap over something else (here: three sets of targets) maps the whole computation (under
    jit: eager, the passes run op by op in the vmap, ~20 s on 2 cores)."""
    model = to_dtype(eqx.nn.MLP(3, 2, 8, 2, key=KEY))
    x, ys = data(B, 3), data(3, B, 2, key=2)
    sq = eqx.filter_jit(eqx.filter_vmap(lambda y: jt.per_example_norms(mse)(model, x, y)[1]))(ys)
    grads = eqx.filter_jit(eqx.filter_vmap(lambda y: jt.clipped_grad(mse, 0.3)(model, x, y)[1]))(ys)
    for j in range(3):
        assert_close(jax.tree.map(lambda s: s[j], sq), oracle_per_example(mse, model, x, ys[j]).sq_norms, rtol=1e-10)
        assert_close(jax.tree.map(lambda s: s[j], grads), oracle_per_example(mse, model, x, ys[j]).clipped(0.3), rtol=1e-10)


@pytest.mark.slow  # disable_jit runs jaxtrace's passes op by op: with --long
def test_transforms_and_jaxtrace_around():
    """disable_jit, checkpoint, jvp and jit(grad) around the norms, and jt.grad around the clipped
    sum with a tag on the input (its cotangent against an explicit + eps), against the oracle."""
    model = to_dtype(eqx.nn.MLP(3, 2, 8, 2, key=KEY))
    x, y, t = data(B, 3), data(B, 2, key=2), data(B, 3, key=5)
    with jax.disable_jit():
        assert_close(jt.per_example_norms(mse)(model, x, y)[1], oracle_per_example(mse, model, x, y).sq_norms, rtol=1e-10)
    ours = lambda x: jt.per_example_norms(mse, total=True)(model, x, y)[1]  # noqa: E731
    ref = lambda x: sum(jax.tree.leaves(oracle_per_example(mse, model, x, y).sq_norms))  # noqa: E731
    assert_close(jax.checkpoint(ours)(x), ref(x), rtol=1e-10)
    assert_close(jax.jvp(ours, (x,), (t,)), jax.jvp(ref, (x,), (t,)), rtol=1e-9)
    assert_close(jax.jit(jax.grad(lambda x: jnp.sum(ours(x))))(x), jax.grad(lambda x: jnp.sum(ref(x)))(x), rtol=1e-9)

    def outer(x):
        grads = jt.clipped_grad(mse, 0.3)(model, jt.tag(x, "x"), y)[1]
        return sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))

    def outer_ref(x, eps):
        return sum(jnp.sum(g**2) for g in jax.tree.leaves(oracle_per_example(mse, model, x + eps, y).clipped(0.3)))

    gx, tag_grads = jt.grad(outer)(x)
    assert_close(tag_grads["x"], jax.grad(outer_ref, argnums=1)(x, jnp.zeros_like(x)), rtol=1e-9)
    assert_close(gx, jax.grad(outer_ref)(x, jnp.zeros_like(x)), rtol=1e-9)


@pytest.mark.slow  # 6-20 s on 2 cores: with --long (CI's newest-3.11 cell)
def test_traced_max_norm_and_grad_around():
    model = to_dtype(eqx.nn.MLP(3, 2, 8, 2, key=KEY))
    x, y = data(B, 3), data(B, 2, key=2)

    @jit
    def clipped(model, x, y, c):
        return jt.clipped_grad(mse, c)(model, x, y)[1]

    for c in (0.1, 0.5):
        assert_close(clipped(model, x, y, c), oracle_per_example(mse, model, x, y).clipped(c), rtol=1e-10)

    def summed(f):
        return lambda c, x: sum(jnp.sum(g) for g in jax.tree.leaves(f(c, x)))

    ours = jax.grad(summed(lambda c, x: clipped(model, x, y, c)), argnums=(0, 1))(0.3, x)
    ref = jax.grad(summed(lambda c, x: oracle_per_example(mse, model, x, y).clipped(c)), argnums=(0, 1))(0.3, x)
    assert_close(ours, ref, rtol=1e-9)


def test_clipped_sum_costs_one_backward_pass():
    """XLA's flop count: the clipped sum costs about one ordinary gradient (no second backward pass)."""
    model = eqx.nn.MLP(64, 10, 64, 3, key=KEY)
    x, y = jnp.ones((32, 64)), jnp.zeros((32, 10))
    arrays, static = eqx.partition(model, eqx.is_array)

    def flops(f):
        compiled = jax.jit(lambda a, x, y: f(eqx.combine(a, static), x, y)).lower(arrays, x, y).compile()
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]

    plain = flops(eqx.filter_grad(lambda m, x, y: jnp.sum(mse(m, x, y))))
    clipped = flops(lambda m, x, y: jt.clipped_grad(mse, 1.0)(m, x, y)[1])
    assert clipped <= 1.1 * plain, (clipped, plain)  # a second backward pass: 1.28x here


# --- clipping guard rails (issue 51, item 7) ----------------------------------------------------------


class Mixed(eqx.Module):
    """An Embedding (its factor is the ids), a Conv1d, a Linear and a raw scale: all on factors; with
    ``through=jnp.sin`` the scale takes the exact path."""

    emb: eqx.nn.Embedding
    conv: eqx.nn.Conv1d
    lin: eqx.nn.Linear
    scale: jax.Array
    through: object = eqx.field(static=True, default=None)

    def __call__(self, ids, x):  # ids (T,), x (T, 4)
        h = jnp.tanh(self.conv((jax.vmap(self.emb)(ids) + x).T).T)
        return jax.vmap(self.lin)(h) * (self.scale if self.through is None else self.through(self.scale))


def mixed_losses(model, ids, x, y):
    return jnp.sum((jax.vmap(model)(ids, x) - y) ** 2, axis=(1, 2))


def mixed_model(through=None):
    k = jax.random.split(KEY, 3)
    conv = eqx.nn.Conv1d(4, 4, 3, padding=1, key=k[1])
    return to_dtype(Mixed(eqx.nn.Embedding(7, 4, key=k[0]), conv, eqx.nn.Linear(4, 2, key=k[2]), jnp.ones(2), through))


class Stacked(eqx.Module):
    """Linear layers stacked with eqx.filter_vmap and run by lax.scan (one slice per step), on ``Mixed``'s inputs."""

    layers: eqx.nn.Linear
    out: eqx.nn.Linear

    def __call__(self, ids, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        h, _ = jax.lax.scan(lambda h, d: (jnp.tanh(jax.vmap(eqx.combine(d, static))(h)), None), x + ids[:, None], dynamic)
        return jax.vmap(self.out)(h)


def stacked_model():
    k = jax.random.split(KEY, 4)
    return to_dtype(Stacked(eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(k[:3]), eqx.nn.Linear(4, 2, key=k[3])))


def bad_batch(n, bad):
    """``(ids, x, y)`` of ``n`` examples, a NaN in the inputs of example ``bad[0]``, an infinity in ``bad[1]``'s."""
    ids = jax.random.randint(jax.random.key(1), (n, 5), 0, 7)
    x, y = data(n, 5, 4), data(n, 5, 2, key=2)
    x = x.at[bad[0], 2].set(jnp.nan)
    return ids, (x.at[bad[1], 0, 1].set(jnp.inf) if len(bad) > 1 else x), y


@pytest.mark.parametrize("under_jit", [False, True])
@pytest.mark.parametrize("bad", [(1,), (0, 2), (0,)], ids=["one", "two", "batch_of_one"])
@pytest.mark.parametrize("make", [mixed_model, stacked_model], ids=["mixed", "stacked"])
def test_a_non_finite_example_is_left_out_and_counted(under_jit, bad, make):
    """An example whose gradient norm is NaN or infinite gets weight 0 and none of its NaN reaches the
    others' sum (its factors are zeroed, not only weighted by zero): the clipped sum is the definition's
    over the other examples; ``count_nonfinite=True`` says how many were left out."""
    model = make()
    n = 1 if bad == (0,) else 4
    ids, x, y = bad_batch(n, bad)
    good = jnp.asarray([i for i in range(n) if i not in bad], jnp.int32)
    c = 0.5

    def ours(m, *batch):
        return jt.clipped_grad(mixed_losses, c, fallback="error", count_nonfinite=True)(m, *batch)

    losses, grads, left_out = (jit(ours) if under_jit else ours)(model, ids, x, y)
    assert int(left_out) == len(bad)
    assert not np.all(np.isfinite(np.asarray(losses)))  # the losses are as they are
    if len(good):
        expected = oracle_per_example(mixed_losses, model, ids[good], x[good], y[good]).clipped(c)
    else:
        expected = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))
    assert_close(jax.tree.leaves(grads), jax.tree.leaves(expected), rtol=1e-10)
    # without the option: the same sum, two results as documented
    _, plain = (jit(jt.clipped_grad(mixed_losses, c)) if under_jit else jt.clipped_grad(mixed_losses, c))(model, ids, x, y)
    assert_close(jax.tree.leaves(plain), jax.tree.leaves(expected), rtol=1e-10)


@pytest.mark.parametrize("under_jit", [False, True])
def test_a_non_finite_example_leaves_out_every_example_where_a_leaf_takes_the_exact_path(under_jit):
    """The exact path pulls each example's basis vector back through the whole batch: the bad example's NaN
    reaches every row there (``0 * nan``), so no example's norm is finite: all are left out, and counted."""
    model = mixed_model(through=jnp.sin)
    ids, x, y = bad_batch(4, (1,))
    clipped = jt.clipped_grad(mixed_losses, 0.5, count_nonfinite=True)
    _, grads, left_out = (jit(clipped) if under_jit else clipped)(model, ids, x, y)
    assert int(left_out) == 4
    assert_close(jax.tree.leaves(grads), [jnp.zeros_like(g) for g in jax.tree.leaves(grads)], rtol=1e-10)


@pytest.mark.parametrize("under_jit", [False, True])
def test_nan_safe_false_gives_the_same_sum_on_a_finite_batch(under_jit):
    model, (ids, x, y) = mixed_model(), (jax.random.randint(jax.random.key(1), (4, 5), 0, 7), data(4, 5, 4), data(4, 5, 2, key=2))
    clipped = jt.clipped_grad(mixed_losses, 0.5, nan_safe=False, fallback="error")
    _, grads = (jit(clipped) if under_jit else clipped)(model, ids, x, y)
    assert_close(jax.tree.leaves(grads), jax.tree.leaves(oracle_per_example(mixed_losses, model, ids, x, y).clipped(0.5)), rtol=1e-10)


def test_clip_weights_leave_out_non_finite_norms():
    from jaxtrace._per_example import clip_weights

    sq = jnp.array([0.0, 1.0, 16.0, jnp.nan, jnp.inf, -jnp.inf])
    assert clip_weights(sq, 2.0).tolist() == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
    grad = jax.grad(lambda s: jnp.sum(clip_weights(s, 2.0)))(sq)
    assert np.all(np.isfinite(np.asarray(grad)))  # no NaN derivative from a left-out example


@pytest.mark.parametrize("max_norm", [-1.0, -1, float("inf"), float("nan"), np.float32(-0.5)])
def test_a_negative_or_non_finite_bound_is_an_error(max_norm):
    from jaxtrace._per_example import clip_weights

    with pytest.raises(ValueError, match="max_norm must be a finite number >= 0"):
        jt.clipped_grad(mixed_losses, max_norm)
    with pytest.raises(ValueError, match="max_norm must be a finite number >= 0"):
        clip_weights(jnp.ones(3), max_norm)


def test_a_traced_negative_bound_gives_nan():
    """Under jit the bound is known on device only: a negative one cannot raise there, so it shows in the sum."""
    model = mixed_model()
    ids, x, y = jax.random.randint(jax.random.key(1), (3, 5), 0, 7), data(3, 5, 4), data(3, 5, 2, key=2)
    clipped = jax.jit(lambda c: jt.clipped_grad(mixed_losses, c)(model, ids, x, y)[1])
    assert all(np.all(np.isnan(np.asarray(g))) for g in jax.tree.leaves(clipped(-1.0)))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(clipped(0.0)))


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=SLOW), pytest.param(jnp.bfloat16, marks=SLOW)])
def test_low_precision(dtype):
    """The norms accumulate in float32 at least; compared with the float64 oracle on the same weights."""
    model = to_dtype(EqxBlock(11, 8, 5, KEY), dtype)
    ids = jax.random.randint(jax.random.key(3), (B, 5), 0, 11)
    targets = jnp.roll(ids, 1, axis=1)
    losses, sq = jit(jt.per_example_norms(eqx_lm))(model, ids, targets)
    assert losses.dtype == dtype
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(sq))
    ref = jit(lambda m, i, t: oracle_per_example(eqx_lm, m, i, t).sq_norms)(to_dtype(model, F64), ids, targets)
    tol = 2e-4 if dtype == jnp.float32 else 1e-1
    for a, e in zip(jax.tree.leaves(sq), jax.tree.leaves(ref), strict=True):  # atol: each leaf's own scale
        assert_close(a, e, "per-leaf squared norms", rtol=tol, atol=tol * float(jnp.max(e)), dtype=False)
    _, grads = jit(jt.clipped_grad(eqx_lm, 1.0))(model, ids, targets)
    assert all(g.dtype == dtype for g in jax.tree.leaves(grads))


class WithRaw(eqx.Module):
    lin: eqx.nn.Linear
    scale: jax.Array
    through: object = eqx.field(static=True, default=None)  # applied to `scale` first (None: nothing)

    def __call__(self, x):
        return self.lin(x) * (self.scale if self.through is None else self.through(self.scale))


def test_fallback_error_names_leaf_and_module():
    """A raw array transformed before it meets the examples (``sin(scale)``) has no factors."""
    model = WithRaw(eqx.nn.Linear(3, 2, key=KEY), jnp.ones(2), jnp.sin)
    with pytest.raises(jt.TagError, match=r"'scale' \(in module '', WithRaw\)"):
        jt.per_example_norms(mse, fallback="error")(model, jnp.ones((B, 3)), jnp.ones((B, 2)))
    x, y = data(B, 3), data(B, 2, key=2)  # and fallback="vmap" computes `scale` alone by vmap(grad)
    assert_close(jit(jt.per_example_norms(mse))(to_dtype(model), x, y)[1], oracle_per_example(mse, to_dtype(model), x, y).sq_norms, rtol=1e-10)


def test_a_raw_array_meeting_the_examples_as_it_is_is_on_factors():
    """``lin(x) * scale``: each example's gradient of ``scale`` is its cotangent where ``scale`` is broadcast
    against the examples (no exact path)."""
    model = to_dtype(WithRaw(eqx.nn.Linear(3, 2, key=KEY), 1.0 + jnp.arange(2.0)))
    x, y = data(B, 3), data(B, 2, key=2)
    assert_close(jit(jt.per_example_norms(mse, fallback="error"))(model, x, y)[1], oracle_per_example(mse, model, x, y).sq_norms, rtol=1e-10)


def test_errors():
    model = eqx.nn.MLP(3, 2, 8, 2, key=KEY)
    x, y = jnp.ones((B, 3)), jnp.ones((B, 2))
    with pytest.raises(ValueError, match="one loss per example"):
        jt.per_example_norms(lambda m, x, y: jnp.sum(mse(m, x, y)))(model, x, y)
    with pytest.raises(ValueError, match="fallback"):
        jt.per_example_norms(mse, fallback="loop")(model, x, y)
    with pytest.raises(TypeError, match="equinox or Flax NNX"):
        jt.per_example_norms(mse)({"w": jnp.ones(3)}, x, y)


SHARDED = r"""
import jax, jax.numpy as jnp, numpy as np, equinox as eqx
jax.config.update("jax_enable_x64", True)
import jaxtrace as jt
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from oracles import assert_close, oracle_per_example
assert len(jax.devices()) == 4
model = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a,
                     eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0)))
x = jax.random.normal(jax.random.key(1), (8, 3), jnp.float64)
y = jax.random.normal(jax.random.key(2), (8, 2), jnp.float64)
mesh = Mesh(np.array(jax.devices()), ("batch",))
xs, ys = (jax.device_put(a, NamedSharding(mesh, P("batch"))) for a in (x, y))
def losses(m, x, y):
    return jnp.sum((jax.vmap(m)(x) - y) ** 2, axis=-1)
_, total = eqx.filter_jit(jt.per_example_norms(losses, total=True))(model, xs, ys)
_, grads = eqx.filter_jit(jt.clipped_grad(losses, 0.5))(model, xs, ys)
ref = oracle_per_example(losses, model, x, y)
assert_close(total, ref.total, "total", rtol=1e-10)
assert_close(grads, ref.clipped(0.5), "clipped", rtol=1e-10)
print("sharded ok", total.sharding)
"""


@pytest.mark.slow  # 6-20 s on 2 cores: with --long (CI's newest-3.11 cell)
def test_sharded_batch():
    """A batch sharded over 4 CPU devices (XLA_FLAGS fixes the device count at start-up: a subprocess)."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.path.join(root, "tests"), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sharded ok" in out.stdout
