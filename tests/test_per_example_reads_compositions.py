"""The reads' placement (``_per_example/_read_tags``) composed: in a ``lax.scan`` cell, matrix-product reads whose
outputs add up share one tag on their sum, and a read of the scan's ``xs`` slice records ``xs`` itself. Here under
``jax.jvp``, inside ``jt.value_and_grad`` and ``jt.grad`` with the user's own tag in the cell, in reversed scans (one
step and several), a cell under ``jax.checkpoint``, one cell in three scans and under ``jax.disable_jit``: each against
the definition, row i of ``jax.jacrev`` of the losses vector, float64."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxtrace as jt
from oracles import assert_close, oracle_per_example

B, D = 3, 4
KEYS = jax.random.split(jax.random.key(7), 6)
C = 0.3  # the clipping bound: below most examples' norms here, above some


class Cell(eqx.Module):
    """``h = tanh(x_t @ a + h @ b + h @ b.T + x_t @ c.T + bias)`` scanned over the positions (four reads adding up,
    two of them of the ``xs`` slice), forwards or in reverse, the cell under ``jax.checkpoint`` or not. ``mark``: where
    the user's tag ``"z"`` sits (``"sum"``: on the whole pre-activation; ``"part"``: on ``x_t @ a + h @ b``, inside the
    chain of adds); called with ``eps`` (``(T, D)``), the oracle's ``+ eps`` there instead."""

    a: jax.Array
    b: jax.Array
    c: jax.Array
    bias: jax.Array
    reverse: bool = eqx.field(static=True, default=False)
    remat: bool = eqx.field(static=True, default=False)
    mark: str = eqx.field(static=True, default="")

    def __call__(self, x, eps=None):
        def at_mark(v, e):
            return jt.tag(v, "z") if eps is None else v + e

        def cell(h, xe):
            x_t, e = xe if eps is not None else (xe, None)
            first = x_t @ self.a + h @ self.b
            first = at_mark(first, e) if self.mark == "part" else first
            z = first + h @ self.b.T + x_t @ self.c.T + self.bias
            h = jnp.tanh(at_mark(z, e) if self.mark == "sum" else z)
            return h, h

        _, hs = lax.scan(jax.checkpoint(cell) if self.remat else cell, jnp.zeros(D), x if eps is None else (x, eps), reverse=self.reverse)
        return hs


def make(steps=4, **kw):
    k = jax.random.split(KEYS[0], 4)
    model = Cell(*(0.5 * jax.random.normal(kk, (D, D)) for kk in k[:3]), 0.1 * jax.random.normal(k[3], (D,)), **kw)
    return model, jax.random.normal(KEYS[1], (B, steps, D))


def losses(model, x, eps=None):
    hs = jax.vmap(model)(x) if eps is None else jax.vmap(model)(x, eps)
    return jnp.mean(hs**2, axis=(1, 2))


def placement(model, x, fun=losses):
    """``(tags, moved)``: the tags the four reads' output gradients are read at, and the reads whose input is
    recorded on the scan's ``xs``, as the pass places them."""
    from jaxtrace._per_example._pass import Call

    found = []
    jax.make_jaxpr(lambda m, x: found.append(Call(fun, 0, "error", False, (m, x), {}).contributions))(model, x)
    reads = found[0].reads
    return {r.grad_tag for r in reads}, len(found[0].read_tags.moved_inputs), len(reads)


def check(model, x, *, jit, fun=losses):
    """Norms, clipped sum and ``value_grad_and_norms``' mean gradient (``fallback="error"``: every leaf on factors)
    against the definition."""
    ref = oracle_per_example(fun, model, x)

    def ours(model, x):
        sq = jt.per_example_norms(fun, fallback="error")(model, x)[1]
        clipped = jt.clipped_grad(fun, C, fallback="error")(model, x)[1]
        return sq, clipped, jt.value_grad_and_norms(fun, fallback="error")(model, x)[1]

    sq, clipped, (mean_grad, sq_again) = (eqx.filter_jit(ours) if jit else ours)(model, x)
    tol = dict(rtol=1e-10, atol=1e-12)
    assert_close(sq, ref.sq_norms, "per-leaf squared norms", **tol)
    assert_close(sq_again, ref.sq_norms, "value_grad_and_norms: squared norms", **tol)
    assert_close(clipped, ref.clipped(C), "clipped sum", **tol)
    assert_close(mean_grad, jax.tree.map(lambda g: jnp.mean(g, axis=0), ref.grads), "value_grad_and_norms: mean gradient", **tol)


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("jit", [False, True])
def test_reads_adding_up_in_a_reversed_scan(jit, steps):
    """A reversed scan: the tag on the sum stacks its cotangents in the order of ``xs``, as ``xs`` itself (where the
    reads of its slice record their input) is laid out; one step too."""
    model, x = make(steps, reverse=True)
    tags, moved, n = placement(model, x)
    assert len(tags) == 1 and None not in tags and n == 4 and moved == 2, (tags, moved, n)
    check(model, x, jit=jit)


@pytest.mark.parametrize("reverse", [False, True])
def test_reads_adding_up_in_a_cell_under_checkpoint(reverse):
    """``lax.scan(jax.checkpoint(cell), ...)``: the reads sit in the remat body, not in the scan's own, so their input
    stays theirs (no ``xs`` move), their sum still shares one tag."""
    model, x = make(3, reverse=reverse, remat=True)
    tags, moved, n = placement(model, x)
    assert len(tags) == 1 and None not in tags and n == 4, (tags, moved, n)
    check(model, x, jit=True)


class Bidirectional(eqx.Module):
    """One cell (three reads adding up, two of the ``xs`` slice) scanned forwards, in reverse, and again over the
    product of the two: JAX traces the three scans to one body (the same jaxpr object), so each read's tags are
    told apart by the scan that holds it, not by the body."""

    a: jax.Array
    b: jax.Array
    c: jax.Array
    unroll: int = eqx.field(static=True, default=1)

    def __call__(self, x):
        def cell(h, x_t):
            h = jnp.tanh(x_t @ self.a + h @ self.b + x_t @ self.c.T)
            return h, h

        _, forwards = lax.scan(cell, jnp.zeros(D), x, unroll=self.unroll)
        _, backwards = lax.scan(cell, jnp.zeros(D), x, reverse=True, unroll=self.unroll)
        return forwards + lax.scan(cell, jnp.zeros(D), forwards * backwards)[1]


@pytest.mark.parametrize("unroll", [1, 2])
def test_one_cell_scanned_forwards_in_reverse_and_again(unroll):
    model, x = make(4)
    model = Bidirectional(model.a, model.b, model.c, unroll)
    tags, moved, n = placement(model, x)
    assert len(tags) == 3 and None not in tags and n == 9 and moved == 6, (tags, moved, n)  # one tag per scan
    check(model, x, jit=True)


EAGER_LONG = pytest.param(False, marks=pytest.mark.long_eager)  # the eager variant with --long


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("jit", [EAGER_LONG, True])
def test_jvp_of_the_norms(jit, reverse):
    """``jax.jvp`` of the per-leaf norms in the parameters and the inputs at once (the tangent of ``x`` reaches the
    input tags put on the scan's ``xs``) against ``jax.jvp`` of the definition's."""
    model, x = make(3, reverse=reverse)
    diff, static = eqx.partition(model, eqx.is_inexact_array)
    tangents = (jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), diff), jnp.sin(x))
    ours = lambda d, x: jt.per_example_norms(losses, fallback="error")(eqx.combine(d, static), x)[1]  # noqa: E731
    reference = lambda d, x: oracle_per_example(losses, eqx.combine(d, static), x).sq_norms  # noqa: E731
    got = (jax.jit(lambda p, t: jax.jvp(ours, p, t)) if jit else lambda p, t: jax.jvp(ours, p, t))((diff, x), tangents)
    expected = jax.jvp(reference, (diff, x), tangents)
    assert_close(got[0], expected[0], "the norms", rtol=1e-10, atol=1e-12)
    assert_close(got[1], expected[1], "their tangent", rtol=1e-9, atol=1e-12)


def _eps_oracle_total(model, x, diff, static):
    """``value, (d / d params, d / d eps)`` of the summed total norms, the user's tag written ``+ eps``: eps is
    ``(B, T, D)``, given back as ``(T, B, D)`` (jaxtrace's layout: the loop's axis, then the vmap's)."""

    def total(d, eps):
        return jnp.sum(oracle_per_example(lambda m, x: losses(m, x, eps), eqx.combine(d, static), x).total)

    value, (g, g_eps) = jax.value_and_grad(total, argnums=(0, 1))(diff, jnp.zeros_like(x))
    return value, (g, jnp.swapaxes(g_eps, 0, 1))


@pytest.mark.parametrize("mark", ["sum", "part"])
@pytest.mark.parametrize("jit", [EAGER_LONG, True])
def test_jt_value_and_grad_around_the_norms_with_a_tag_in_the_cell(jit, mark):
    """``jt.value_and_grad`` of the summed norms, the user's tag ``"z"`` in the cell on the sum the reads' tag goes
    on, or on a partial sum inside the chain (two groups of reads then): the value, the leaves' gradients and the
    gradient at ``"z"`` are those of the definition written with ``+ eps`` there."""
    model, x = make(3, mark=mark)
    tags, _, _ = placement(model, x)
    assert len(tags) == (1 if mark == "sum" else 2), tags
    diff, static = eqx.partition(model, eqx.is_inexact_array)

    def summed(d):
        return jnp.sum(jt.per_example_norms(losses, total=True, fallback="error")(eqx.combine(d, static), x)[1])

    run = jt.value_and_grad(summed)
    value, (grads, tag_grads) = (jax.jit(run) if jit else run)(diff)
    expected_value, (expected, expected_z) = _eps_oracle_total(model, x, diff, static)
    assert_close(value, expected_value, "the summed norms", rtol=1e-10, atol=0)
    assert_close(grads, expected, "the leaves' gradients", rtol=1e-9, atol=1e-12)
    assert set(tag_grads) == {"z"}, set(tag_grads)
    assert_close(tag_grads["z"], expected_z, "the gradient at the user's tag", rtol=1e-9, atol=1e-12)


def test_jt_grad_around_the_clipped_sum_with_a_tag_in_a_reversed_cell():
    """``jt.grad`` of a projection of the clipped sum, ``sum_i min(1, C / |g_i|) g_i``, the user's tag on the sum in a
    reversed scan: the leaves' gradients and the gradient at the tag against the definition with ``+ eps``."""
    model, x = make(3, mark="sum", reverse=True)
    diff, static = eqx.partition(model, eqx.is_inexact_array)
    probe = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), diff)
    dot = lambda g: sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(probe)))  # noqa: E731
    grads, tag_grads = jax.jit(jt.grad(lambda d: dot(jt.clipped_grad(losses, C, fallback="error")(eqx.combine(d, static), x)[1])))(diff)

    def definition(d, eps):
        return dot(oracle_per_example(lambda m, x: losses(m, x, eps), eqx.combine(d, static), x).clipped(C))

    expected, expected_z = jax.grad(definition, argnums=(0, 1))(diff, jnp.zeros_like(x))
    assert_close(grads, expected, "the leaves' gradients", rtol=1e-9, atol=1e-12)
    assert_close(tag_grads["z"], jnp.swapaxes(expected_z, 0, 1), "the gradient at the user's tag", rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("reverse", [False, True])
def test_reads_adding_up_under_disable_jit(reverse):
    """``jax.disable_jit`` unrolls the scan in Python: each step's reads add up at the top level (one sum tag per step,
    no ``xs`` left to record on). The first step reads the initial carry, zeros every example shares, so ``b``
    takes the exact path there (``fallback="vmap"``); the numbers are the definition's."""
    model, x = make(3, reverse=reverse)
    ref = oracle_per_example(losses, model, x)
    with jax.disable_jit():
        tags, moved, n = placement(model, x)
        sq = jt.per_example_norms(losses)(model, x)[1]
        clipped = jt.clipped_grad(losses, C)(model, x)[1]
    assert len(tags - {None}) == 3 and moved == 0 and n == 12, (tags, moved, n)
    assert_close(sq, ref.sq_norms, "per-leaf squared norms", rtol=1e-10, atol=1e-12)
    assert_close(clipped, ref.clipped(C), "clipped sum", rtol=1e-10, atol=1e-12)


def test_the_transforms_in_a_scan_over_microbatches():
    """Gradient accumulation: ``per_example_norms`` and ``clipped_grad`` in the body of a ``lax.scan`` over two
    microbatches, the model's cell a reversed scan whose reads add up: each microbatch's norms, and the clipped
    sums added up, are the definition's."""
    model, _ = make(3, reverse=True)
    xs = jax.random.normal(KEYS[3], (2, B, 3, D))

    def body(acc, x):
        sq = jt.per_example_norms(losses, total=True, fallback="error")(model, x)[1]
        return jax.tree.map(jnp.add, acc, jt.clipped_grad(losses, C, fallback="error")(model, x)[1]), sq

    zeros = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))
    summed, sq = eqx.filter_jit(lambda xs: lax.scan(body, zeros, xs))(xs)
    refs = [oracle_per_example(losses, model, x) for x in xs]
    assert_close(sq, jnp.stack([r.total for r in refs]), "each microbatch's norms", rtol=1e-10, atol=1e-12)
    assert_close(summed, jax.tree.map(jnp.add, *(r.clipped(C) for r in refs)), "the clipped sums added up", rtol=1e-10, atol=1e-12)
