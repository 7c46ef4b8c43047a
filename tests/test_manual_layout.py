"""Where a shard_map body's values sit in the global arrays (``jaxtrace._manual_layout``), read by
``find_nonfinite`` to name the global example of an entry on a shard.

A layout says, per axis of a body value, which manual mesh axes split it (``()``: every shard holds
the axis whole; ``None``: unknown). The expected layouts are closed forms: what each operation
does to the rows of a batch split over ``data`` (a ``(4, 2)`` mesh of ``data`` and ``model``;
traced on an abstract mesh, so one device is enough). The end-to-end check, the global example
of a NaN against the same program on one device, is in ``multidevice_checks.py``.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import jaxtrace as jt
from jaxtrace._manual_layout import site_layouts
from jaxtrace._program import Program

MESH = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
ROWS, COLS, BOTH = ("data",), ("model",), ("data", "model")


def layouts_of(body, in_specs, *shapes):
    """``{tag name: layout}`` of the tags in ``body``, run by shard_map with ``in_specs``."""
    f = jax.shard_map(body, mesh=MESH, in_specs=in_specs, out_specs=P(), check_vma=False)
    jaxpr = jax.make_jaxpr(f)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
    return {key[0]: layout for key, (layout, _) in site_layouts(Program(jaxpr)).items()}


def total(*values):
    return lax.psum(sum(jnp.sum(v) for v in values), ("data", "model"))


def test_entrywise_broadcast_and_matmul():
    def body(x, w, b):
        h = jt.tag(x @ w + b, "h")  # rows of x, columns of w (and of the bias broadcast over rows)
        return total(h, jt.tag(jnp.tanh(h) * 2.0, "a"), jt.tag(x.T, "t"))

    got = layouts_of(body, (P("data"), P(None, "model"), P("model")), (16, 3), (3, 4), (4,))
    assert got == {"h": (ROWS, COLS), "a": (ROWS, COLS), "t": ((), ROWS)}


def test_reshape_keeps_a_split_major_axis():
    def body(x):
        merged = jt.tag(x.reshape(-1), "merged")  # (rows * 6,): the rows' blocks stay blocks
        split = jt.tag(merged.reshape(-1, 2, 3), "split")  # back to rows, and two whole axes
        minor = jt.tag(x.T.reshape(-1), "minor")  # the split axis is not the major one
        return total(merged, split, minor)

    got = layouts_of(body, (P(BOTH),), (16, 6))
    assert got == {"merged": (BOTH,), "split": (BOTH, (), ()), "minor": (None,)}


def test_reductions_and_collectives():
    def body(x):
        return total(
            jt.tag(jnp.sum(x, axis=1), "per_row"),  # keeps the rows
            jt.tag(jnp.sum(x, axis=0), "per_column"),  # a partial sum over this shard's rows
            jt.tag(lax.psum(x, "data"), "summed"),  # rows of different shards added: no row is one example's
            jt.tag(lax.psum(x, "model"), "summed_over_model"),  # x is split over 'data' only: its rows stay
            jt.tag(lax.all_gather(x, "data", tiled=True), "gathered"),  # every shard holds every row
            jt.tag(jnp.cumsum(x, axis=0), "running"),  # a row mixes the shard's rows before it
            jt.tag(jnp.cumsum(x, axis=1), "running_columns"),
        )

    got = layouts_of(body, (P("data"),), (16, 3))
    assert got == {
        "per_row": (ROWS,),
        "per_column": ((),),
        "summed": (None, ()),
        "summed_over_model": (ROWS, ()),
        "gathered": ((), ()),
        "running": (None, ()),
        "running_columns": (ROWS, ()),
    }


def test_embedding_lookup_takes_the_rows_of_the_tokens():
    def body(table, tokens):
        return total(jt.tag(table[tokens.astype(jnp.int32)], "embedded"))

    got = layouts_of(body, (P(), P("data")), (10, 5), (16, 7))
    assert got == {"embedded": (ROWS, (), ())}


@pytest.mark.parametrize("init", ["zeros", "rows"])
def test_scan_carry_and_cond(init):
    def body(x, w):
        def step(c, _):
            c = jt.tag(jnp.tanh(c @ w + x), "state")
            return c, None

        c0 = jnp.zeros_like(x) if init == "zeros" else x  # zeros: whole, and the same split after a step
        c, _ = lax.scan(step, c0, None, length=3)
        picked = lax.cond(jnp.sum(x) > 0, lambda v: jt.tag(v * 2.0, "picked"), lambda v: jt.tag(-v, "picked"), c)
        return total(c, picked)

    got = layouts_of(body, (P("data"), P()), (16, 3), (3, 3))
    assert got == {"state": (ROWS, ()), "picked": (ROWS, ())}


def test_an_unknown_primitive_loses_the_split_axes_only():
    def body(x):
        ordered = jt.tag(jnp.sort(x, axis=0), "sorted")  # rows reordered within the shard
        spectrum = jt.tag(jnp.fft.fft(x).real, "spectrum")  # no rule: unknown, though x's columns are whole
        return total(ordered, spectrum, jt.tag(jnp.arange(4.0), "made"))

    got = layouts_of(body, (P("data"),), (16, 4))
    assert got == {"sorted": (None, ()), "spectrum": (None, None), "made": ((),)}


def test_scan_slices_and_stacks_calls_inline_and_a_while_loop_unknown():
    """A scan over a whole axis gives each step a slice in the rest's layout and stacks ``ys`` on a whole
    axis; a ``jit`` body is inline; a ``while`` body's values are not followed (unknown), and its results
    are whole only where all its operands are."""

    def body(x, w):
        ys = lax.scan(lambda c, r: (c, jt.tag(r * 2.0, "row")), 0.0, x.T)[1]
        called = jax.jit(lambda v: jt.tag(v + 1.0, "in_jit"))(x)
        _, looped = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jt.tag(c[1] * 2.0, "in_while")), (0, x))
        _, kept = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, w))
        return total(jt.tag(ys, "ys"), called, jt.tag(looped, "after_while"), jt.tag(kept, "whole_after_while"))

    got = layouts_of(body, (P("data"), P()), (16, 3), (16, 3))
    assert got == {
        "row": (ROWS,),
        "ys": ((), ROWS),
        "in_jit": (ROWS, ()),
        "in_while": (None, None),
        "after_while": (None, None),
        "whole_after_while": ((), ()),
    }


def test_a_tag_in_a_nested_shard_map_is_unknown_not_whole():
    """A ``shard_map`` (manual over ``model``) inside a ``shard_map`` body (manual over ``data``): the walk
    does not follow the inner body, so its tag's layout is unknown, not read as a value outside any
    ``shard_map`` (which would name a shard's row as the batch's); the outer body's tag keeps its rows."""

    def inner(h):
        return jt.tag(h * 2.0, "inner")

    def body(x):
        h = jt.tag(x + 1.0, "outer")
        mesh = jax.sharding.get_abstract_mesh()  # the outer body's (data manual): the inner call's must match
        y = jax.shard_map(inner, mesh=mesh, in_specs=P(None, "model"), out_specs=P(None, "model"), axis_names={"model"}, check_vma=False)(h)
        return lax.psum(jnp.sum(y), "data")

    f = jax.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P(), axis_names={"data"}, check_vma=False)
    jaxpr = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((16, 4), jnp.float32))
    got = {key[0]: layout for key, (layout, _) in site_layouts(Program(jaxpr)).items()}
    assert got == {"outer": (ROWS, ()), "inner": (None, None)}
