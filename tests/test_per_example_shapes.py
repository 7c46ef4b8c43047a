"""Per-example gradients of a layer called at several shapes or loop depths, and of ``lax.map`` over the examples (issue 51).

A layer's calls at different shapes (one CNN on two crop sizes, an embedding shared by an encoder and a
decoder of different lengths, a Linear on the tokens and on a pooled query, a layer before and inside a
``fori_loop``) are each one more use of its leaves: the per-example gradient is the sum over the calls,
cross terms in the norm. A scan whose step is one example (``jax.lax.map(lambda xi: loss(m, xi), x)``)
is a per-example layout: its layers are on factors. What cannot be told apart (``lax.map`` with a
remainder batch, calls of two shapes in two ``cond`` branches, a float carried from one example's step to
the next) takes the exact path, named under ``fallback="error"``, never a refusal under ``fallback="vmap"``.

The oracle is the definition (``tests/oracles.py``): row ``i`` of ``jax.jacrev`` of the
losses vector, in float64; each check runs eagerly and under ``jax.jit``, for ``per_example_norms``
(per leaf and ``total=True``) and ``clipped_grad``.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxtrace as jt
from oracles import assert_close, oracle_per_example

nnx = pytest.importorskip("flax.nnx")

jax.config.update("jax_enable_x64", True)
F64 = jnp.float64


def f64(model):
    return jax.tree.map(lambda a: a.astype(F64) if eqx.is_inexact_array(a) else a, model)


def normal(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape, F64)


def check(fun, model, *args, fallback="error", modes=("eager", "jit")):
    """``per_example_norms`` (per leaf and total) and ``clipped_grad`` (the bound biting for about half the
    examples) against ``jax.jacrev`` of the losses vector, eagerly and under jit (``modes``)."""
    ref = oracle_per_example(fun, model, *args)
    c = float(np.median(np.sqrt(np.asarray(ref.total)))) * 0.9

    def ours(m, *args):
        _, sq = jt.per_example_norms(fun, fallback=fallback)(m, *args)
        _, total = jt.per_example_norms(fun, fallback=fallback, total=True)(m, *args)
        _, clipped = jt.clipped_grad(fun, c, fallback=fallback)(m, *args)
        return sq, total, clipped

    wrap = nnx.jit if isinstance(model, nnx.Module) else eqx.filter_jit
    for mode, f in (("eager", ours), ("jit", wrap(ours))):
        if mode not in modes:
            continue
        sq, total, clipped = f(model, *args)
        assert_close(sq, ref.sq_norms, f"{mode}: per-leaf squared norms", rtol=1e-10)
        assert_close(total, ref.total, f"{mode}: total squared norms", rtol=1e-10)
        assert_close(clipped, ref.clipped(c), f"{mode}: clipped sum", rtol=1e-10)


def paths(fun, model, *args):
    """``{leaf: (path, why)}`` from the audit: which path each leaf took."""
    audit = jt.per_example_audit(fun)(model, *args)
    return {leaf.name: (leaf.path, leaf.why) for leaf in audit.leaves}


# --- one layer at several shapes ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_linear_at_two_shapes_is_on_factors(mode):
    """The issue's reproduction: one Linear on (B, 4) and on (B, 2, 4), refused before ("The repeated tag ':in'
    is called with different shapes")."""
    lin = f64(eqx.nn.Linear(4, 3, key=jax.random.key(0)))

    def multi(m, x, x2):
        a, b = jax.vmap(m)(x), jax.vmap(jax.vmap(m))(x2)
        return jnp.sum(a**2, -1) + jnp.sum(b**2, (-1, -2))

    check(multi, lin, normal(1, 5, 4), normal(2, 5, 2, 4), modes=(mode,))


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __call__(self, img):
        return self.head(jnp.mean(jnp.tanh(self.conv(img)), axis=(1, 2)))


def cnn():
    return f64(CNN(eqx.nn.Conv2d(2, 3, 3, padding=1, key=jax.random.key(0)), eqx.nn.Linear(3, 2, key=jax.random.key(1))))


def test_a_cnn_on_two_crop_sizes_is_on_factors():
    """A multi-crop consistency loss: the same CNN on 8x8 and 5x5 crops (the conv at two shapes, the head at one)."""

    def crops(m, a, b):
        ya, yb = jax.vmap(m)(a), jax.vmap(m)(b)
        return jnp.sum((ya - yb) ** 2, -1) + jnp.sum(ya**2, -1)

    check(crops, cnn(), normal(3, 4, 2, 8, 8), normal(4, 4, 2, 5, 5))


def test_an_nnx_conv_at_two_scales_is_on_factors():
    """Multi-scale convolution: one nnx.Conv on the image and on its 2x2 average pool."""
    conv = nnx.Conv(2, 3, (3, 3), padding="SAME", rngs=nnx.Rngs(0), param_dtype=F64, dtype=F64)

    def multiscale(m, img):
        coarse = nnx.avg_pool(img, (2, 2), strides=(2, 2))
        return jnp.sum(jnp.tanh(m(img)) ** 2, (1, 2, 3)) + jnp.sum(m(coarse) ** 2, (1, 2, 3))

    check(multiscale, conv, normal(5, 3, 6, 6, 2))


class Seq2Seq(eqx.Module):
    emb: eqx.nn.Embedding
    out: eqx.nn.Linear

    def __call__(self, src, tgt):
        memory = jnp.mean(jax.vmap(self.emb)(src), axis=0)
        h = jnp.tanh(jax.vmap(self.emb)(tgt) + memory)
        return jnp.sum(jax.vmap(self.out)(h) ** 2)


def test_an_embedding_shared_at_two_lengths_is_on_factors():
    """An encoder and a decoder sharing one embedding over sources of length 5 and targets of length 3."""
    model = f64(Seq2Seq(eqx.nn.Embedding(7, 3, key=jax.random.key(0)), eqx.nn.Linear(3, 3, key=jax.random.key(1))))
    src = jax.random.randint(jax.random.key(2), (4, 5), 0, 7)
    tgt = jax.random.randint(jax.random.key(3), (4, 3), 0, 7)
    check(lambda m, s, t: jax.vmap(m)(s, t), model, src, tgt)


def test_a_layer_before_and_inside_a_fori_loop_is_on_factors():
    """The same Linear once outside and at each step of a fori_loop (a scan): a loop axis on one call only."""
    lin = f64(eqx.nn.Linear(4, 4, key=jax.random.key(0)))

    def fun(m, x):
        h = jnp.tanh(jax.vmap(m)(x))
        h = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(jax.vmap(m)(h)), h)
        return jnp.sum(h**2, -1)

    check(fun, lin, normal(1, 5, 4))


def test_calls_twice_a_step_in_one_scan_and_once_a_step_in_another_are_on_factors():
    """Two scans of one length, the layer called twice a step in one and once in the other: their loop
    layouts differ ((L, 2) and (L,)), so the calls are told apart by the scan that holds them."""
    lin = f64(eqx.nn.Linear(2, 2, key=jax.random.key(0)))

    def fun(m, x):
        steps = lambda xi: xi.reshape(2, 2)  # noqa: E731
        h = jax.vmap(lambda xi: lax.scan(lambda c, t: (c, m(jnp.tanh(m(t)))), 0.0, steps(xi))[1])(x)
        g = jax.vmap(lambda xi: lax.scan(lambda c, t: (c, m(t)), 0.0, steps(xi))[1])(x)
        return jnp.sum(h**2, (1, 2)) + jnp.sum(jnp.sin(g), (1, 2))

    check(fun, lin, normal(1, 4, 4))


def test_a_pooled_query_through_the_same_nnx_linear_is_on_factors():
    lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0), param_dtype=F64, dtype=F64)

    def fun(m, x):
        h = jnp.tanh(m(x))  # (B, T, d)
        q = m(jnp.mean(h, axis=1))  # (B, d)
        return jnp.sum(h * q[:, None, :], (1, 2))

    check(fun, lin, normal(1, 4, 5, 3))


def test_shapes_in_two_cond_branches_take_the_exact_path_and_are_named():
    """Calls of two layouts, each inside a cond the pass cannot run again with a name of its own: the
    exact path (the definition's numbers) under fallback="vmap"; named, with why, under "error"."""
    lin = f64(eqx.nn.Linear(4, 4, key=jax.random.key(0)))

    def fun(m, x):
        b = lax.cond(x[0, 0] < 10.0, lambda x: jax.vmap(jax.vmap(m))(x[:, None]).sum(1), lambda x: x, x)
        c = lax.cond(x[0, 0] < 10.0, lambda x: jax.vmap(m)(x), lambda x: x, x)
        return jnp.sum(c**2 + b**2, -1)

    x = normal(1, 5, 4)
    check(fun, lin, x, fallback="vmap")
    with pytest.raises(jt.TagError, match=r"'weight' \(in module '', Linear\): its layer '' is called at different shapes.*`cond`"):
        jt.per_example_norms(fun, fallback="error")(lin, x)


# --- lax.map over the examples ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_lax_map_over_the_examples_is_on_factors(mode):
    lin = f64(eqx.nn.Linear(4, 3, key=jax.random.key(0)))
    fun = lambda m, x: lax.map(lambda xi: jnp.sum(jnp.tanh(m(xi)) ** 2), x)  # noqa: E731
    check(fun, lin, normal(1, 5, 4), modes=(mode,))


def test_lax_map_over_a_cnn_and_a_seq2seq_is_on_factors():
    check(lambda m, a: lax.map(lambda ai: jnp.sum(m(ai) ** 2), a), cnn(), normal(3, 4, 2, 6, 6))
    model = f64(Seq2Seq(eqx.nn.Embedding(7, 3, key=jax.random.key(0)), eqx.nn.Linear(3, 3, key=jax.random.key(1))))
    src = jax.random.randint(jax.random.key(2), (4, 5), 0, 7)
    tgt = jax.random.randint(jax.random.key(3), (4, 3), 0, 7)
    check(lambda m, s, t: lax.map(lambda st: m(*st), (s, t)), model, src, tgt)


def test_lax_map_with_the_layer_twice_a_step_in_two_maps_and_outside_is_on_factors():
    lin = f64(eqx.nn.Linear(4, 4, key=jax.random.key(0)))

    def fun(m, x):
        twice = lax.map(lambda xi: jnp.sum(m(jnp.tanh(m(xi))) ** 2), x)
        again = lax.map(lambda xi: jnp.sum(jnp.sin(m(xi))), x)
        return twice + again + jnp.sum(jax.vmap(m)(x) ** 3, -1)

    check(fun, lin, normal(1, 5, 4))


def test_lax_map_over_an_nnx_model_on_batches_of_one_is_on_factors():
    model = nnx.Sequential(
        nnx.Linear(3, 4, rngs=nnx.Rngs(0), param_dtype=F64, dtype=F64),
        nnx.LayerNorm(4, rngs=nnx.Rngs(1), param_dtype=F64, dtype=F64),
    )
    fun = lambda m, x: lax.map(lambda xi: jnp.sum(jnp.tanh(m(xi[None])) ** 2), x)  # noqa: E731
    check(fun, model, normal(1, 4, 3))


def test_lax_map_in_chunks_with_a_remainder_takes_the_exact_path_and_is_named():
    """lax.map(..., batch_size=2) over 5 examples: a scan of a vmap over 4, and a remainder of 1 at
    another shape (refused before, "called with different shapes"). The examples span the scan's steps
    and the rows of each, and the remainder is concatenated after them: the exact path, named."""
    lin = f64(eqx.nn.Linear(4, 3, key=jax.random.key(0)))
    fun = lambda m, x: lax.map(lambda xi: jnp.sum(jnp.tanh(m(xi)) ** 2), x, batch_size=2)  # noqa: E731
    x = normal(1, 5, 4)
    check(fun, lin, x, fallback="vmap")
    with pytest.raises(jt.TagError, match=r"'weight' \(in module '', Linear\): at its layer '': its output reaches several examples' losses"):
        jt.clipped_grad(fun, 1.0, fallback="error")(lin, x)


def test_a_float_carried_between_example_steps_takes_the_exact_path():
    """A scan over the examples whose carry (a running sum of the outputs) reaches the next example's loss:
    not one example's values a step. The definition's numbers (row i reads examples j < i too)."""
    lin = f64(eqx.nn.Linear(4, 4, key=jax.random.key(0)))

    def fun(m, x):
        def step(c, xi):
            h = jnp.tanh(m(xi)) + 0.5 * c
            return h, jnp.sum(h**2)

        return lax.scan(step, jnp.zeros(4, F64), x)[1]

    x = normal(1, 5, 4)
    check(fun, lin, x, fallback="vmap")
    assert {p for p, _ in paths(fun, lin, x).values()} == {"exact"}
