"""The factors of a per-example gradient and the arithmetic of its squared norm.

A layer's per-example parameter gradient is ``sum_k outer(a_k, b_k)`` over positions ``k``;
``Use`` holds one use's ``(a, b)`` (``Index`` is a one-hot ``a`` given by its indices) and
``sq_norm`` gives the squared norm of the sum over a leaf's uses, per example, in the Gram
("ghost norm") form or from the per-example gradient, whichever is smaller.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

__all__ = ["HIGHEST", "Index", "Loop", "PerStep", "Steps", "Use", "example_weights", "examples_first", "finite", "over_loops", "positions_over_steps", "sq_norm", "weighted_sum", "with_rows"]

HIGHEST = jax.lax.Precision.HIGHEST

@dataclasses.dataclass(frozen=True)
class Index:
    """A one-hot factor given by its indices: ``ids`` of shape ``(B, K)`` into ``size`` rows.

    A negative id selects row ``id + size``, as ``weight[ids]`` does.
    """

    ids: jax.Array
    size: int

    def __post_init__(self):
        ids = self.ids
        if isinstance(ids, jax.Array) and jnp.issubdtype(ids.dtype, jnp.signedinteger):
            object.__setattr__(self, "ids", jnp.where(ids < 0, ids + self.size, ids))


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a leaf: its per-example gradient is ``sum_k outer(a[:, k], b[:, k])``.

    ``a`` is ``(B, K, dA)`` (or an ``Index``), ``b`` is ``(B, K, dB)`` or ``None`` (a
    vector-shaped leaf such as a bias: ``b = 1``). ``outer(a, b)`` flattened is the leaf
    flattened (C order). ``out`` names the factor that is the layer's output gradient
    (``"a"`` or ``"b"``): the weighted sum scales that one, as the plain backward would.
    ``rows``, where set, holds ``(a, b)`` as the forward's own ``(B * K, d)`` arrays (``None`` for
    one not held so): the weighted sum reads those, so that under sharding XLA moves the very
    arrays the plain backward moves, not a reshaped copy of them (see ``with_rows``).
    """

    a: Any
    b: Optional[jax.Array]
    out: str = "a"
    rows: Any = None


class Loop(enum.StrEnum):
    """How a ``lax.scan`` around a read or a layer's call holds the leaf."""

    STEPPED = "stepped"  # the scan runs over the leaf's leading axis: its body reads one step's slice
    REPEATED = "repeated"  # the scan's body closes over the leaf: it reads the whole leaf at every step


@dataclasses.dataclass(frozen=True)
class PerStep:
    """One slice of a leaf per ``lax.scan`` step (a layer stacked in a scan): ``use``'s arrays have a
    leading steps axis, and each step's slice is a parameter of its own (no cross terms between steps)."""

    use: Any


@dataclasses.dataclass(frozen=True)
class Steps:
    """A dense ``Use`` read at every step of the scans around it (a recurrent weight), kept steps first:
    ``use``'s arrays are ``(S, B, K, d)``, the steps (of every such scan, flattened) before the examples,
    as the scans stack them. Each example's gradient sums ``outer(a, b)`` over the steps and positions
    ``(S, K)``; its contractions run over the stacked steps in place, where moving them beside the
    positions, ``(B, S * K, d)``, would copy each array (``positions_over_steps``, the form the Gram
    arithmetic reads)."""

    use: Use


# Pytrees, so that the factors of a layer stacked in ``lax.scan`` can be mapped over its steps.
jax.tree_util.register_dataclass(Index, data_fields=["ids"], meta_fields=["size"])
jax.tree_util.register_dataclass(Use, data_fields=["a", "b", "rows"], meta_fields=["out"])
jax.tree_util.register_dataclass(Steps, data_fields=["use"], meta_fields=[])


def examples_first(x, axis: int, inner: int, n_lead: int) -> jax.Array:
    """``(B, L, *rest)`` from ``x`` whose first ``n_lead`` axes are positions: the examples' axis
    (``axis``, each example ``inner`` long) first, the other leading axes flattened into one."""
    shape = x.shape
    x = x.reshape(*shape[:axis], shape[axis] // inner, inner, *shape[axis + 1 :])
    x = jnp.moveaxis(x, axis, 0)
    return x.reshape(x.shape[0], -1, *x.shape[n_lead + 1 :])


def with_rows(factors: dict, views: list) -> dict:
    """``factors`` (a layer's ``{attr: Use}``) with each factor that is one of the ``(view, rows)``
    pairs' views (a ``(B, K, d)`` array the pass gave the rule) also held as ``rows``, the
    ``(B * K, d)`` array it was reshaped from.

    XLA's SPMD partitioner reshards each instruction on its own: a layer input read back as
    ``reshape(reshape(x))`` is gathered a second time under FSDP, where ``x`` itself reuses the
    forward's gather (issue 33: the CNN's first Linear input, 256 KiB again per step).
    """
    def rows(f):
        return next((flat for view, flat in views if f is view), None)

    def keep(u):
        if not isinstance(u, Use) or isinstance(u.a, Index):
            return u
        found = (rows(u.a), rows(u.b))
        return dataclasses.replace(u, rows=found) if any(r is not None for r in found) else u

    return {k: keep(u) for k, u in factors.items()}


def positions_over_steps(use: Use) -> Use:
    """One ``Use`` from a ``Use`` per loop step (each array with a leading steps axis ``S``): the
    steps' positions side by side, ``(B, S * K, ...)``, as one use of the leaf read at every step."""
    use = dataclasses.replace(use, rows=None)
    return jax.tree_util.tree_map(lambda t: jnp.moveaxis(t, 0, 1).reshape(t.shape[1], -1, *t.shape[3:]), use)


def over_loops(factors, loops: tuple, x, g):
    """The ``Use`` of a leaf read in the body of nested scans ``loops`` (``Loop``s, outermost first),
    from the values ``x`` and gradients ``g`` recorded there (one leading axis per loop) and ``factors(x,
    g)`` of one step's (a ``Use`` or ``None``; or a dict of them, one per leaf of a layer, mapped alike).
    The repeated loops' positions lie side by side (a dense ``Use`` in no stepped loop: ``Steps``, the
    steps kept first); under a stepped loop (one at most) it is a ``PerStep``, the steps on the ``Use``'s
    leading axis. ``None`` where ``factors`` gives ``None``, or a
    convolution's factors under a repeated loop."""
    use = _over_loops(factors, loops, x, g, Loop.STEPPED not in loops)
    mark = lambda u: PerStep(u) if u is not None and Loop.STEPPED in loops else u  # noqa: E731
    return {k: mark(u) for k, u in use.items()} if isinstance(use, dict) else mark(use)


def _over_loops(factors, loops: tuple, x, g, steps_first: bool):
    if not loops:
        return factors(x, g)
    use = jax.vmap(lambda xs, gs: _over_loops(factors, loops[1:], xs, gs, steps_first))(x, g)
    if use is None or loops[0] == Loop.STEPPED:
        return use

    def side_by_side(u):  # a convolution's factors keep their own layout: no positions to add to
        if isinstance(u, Steps):  # a repeated loop nested in this one: its steps and this one's, flattened
            return Steps(jax.tree_util.tree_map(lambda t: t.reshape(-1, *t.shape[2:]), u.use))
        if not isinstance(u, Use):
            return None
        if Loop.STEPPED in loops[1:]:
            return jax.vmap(positions_over_steps, in_axes=1)(u)
        return Steps(dataclasses.replace(u, rows=None)) if steps_first and not isinstance(u.a, Index) else positions_over_steps(u)

    return {k: side_by_side(u) for k, u in use.items()} if isinstance(use, dict) else side_by_side(use)


def _k(f) -> int:
    return f.ids.shape[1] if isinstance(f, Index) else f.shape[1]


def _width(f) -> int:
    return f.size if isinstance(f, Index) else f.shape[-1]


def _inner(f, h) -> jax.Array:
    """``<f_k, h_l>`` for every pair of positions: ``(B, Kf, Kh)``."""
    if isinstance(f, Index) and isinstance(h, Index):
        return (f.ids[:, :, None] == h.ids[:, None, :]).astype(jnp.float32)
    if isinstance(f, Index):
        return jnp.swapaxes(_inner(h, f), 1, 2)
    if isinstance(h, Index):  # <f_k, e_{id_l}> = f[k, id_l]
        return jnp.take_along_axis(f, jnp.broadcast_to(h.ids[:, None, :], (*f.shape[:2], h.ids.shape[1])), axis=2)
    return jnp.einsum("bka,bla->bkl", f, h, precision=HIGHEST)


def _dense(f, dtype) -> jax.Array:
    if isinstance(f, Index):
        return jax.nn.one_hot(f.ids, f.size, dtype=dtype)
    return f


def _use(u) -> Use:
    """The ``Use`` of ``u`` (a ``Use`` or ``Steps``), for its widths and kinds of factor."""
    return u.use if isinstance(u, Steps) else u


def _positions(u) -> Use:
    """``u`` as a ``Use``: a ``Steps``' steps side by side with its positions, ``(B, S * K, d)`` (a copy)."""
    return positions_over_steps(u.use) if isinstance(u, Steps) else u


def sq_norm(uses: list, dtype) -> jax.Array:
    """Squared norm of ``sum over uses`` (``Use``s and ``Steps``) of the per-example gradient, per example: ``(B,)``."""
    if all(_use(u).b is None for u in uses):
        total = sum(jnp.sum(u.use.a, axis=(0, 2)) if isinstance(u, Steps) else jnp.sum(_dense(u.a, dtype), axis=1) for u in uses)
        return jnp.sum(total * total, axis=-1)
    if not _per_example_form(uses):  # the Gram ("ghost") form is the smaller one
        uses = _with_b([_positions(u) for u in uses], dtype)
        out = 0.0
        for i, u in enumerate(uses):
            for j in range(i, len(uses)):
                v = uses[j]
                term = jnp.sum(_inner(u.a, v.a) * _inner(u.b, v.b), axis=(1, 2))
                out = out + (term if i == j else 2.0 * term)
        return out
    grad = per_example_grad(uses, dtype)
    return jnp.sum(grad * grad, axis=(1, 2))


def _with_b(uses: list, dtype=jnp.float32) -> list:
    """``uses`` with a vector-shaped leaf's ``b = None`` as ones ``(B, K, 1)`` (``(S, B, K, 1)`` in a ``Steps``)."""
    def one(u):
        if isinstance(u, Steps):
            return Steps(one(u.use))
        return u if u.b is not None else Use(u.a, jnp.ones((*_batch_k(u.a), 1), dtype))

    return [one(u) for u in uses]


def _per_example_form(uses: list[Use]) -> bool:
    """Whether the squared norm forms each example's gradient of the leaf (``per_example_grad``) rather
    than the Gram form. Per example, the Gram form takes ``K * K * (dA + dB)`` multiplications over the
    ``K`` positions, the gradient ``K * dA * dB``: the gradient where it takes fewer, which also bounds its
    ``dA * dB`` numbers by the factors' own ``K * (dA + dB)`` (and the gradient of ``sum(losses)`` is then
    its sum over the examples, ``weighted_sum`` with no weights). A one-hot factor (``Index``, an embedding
    table of ``dA`` rows) makes the Gram form cheap and the gradient large: the gradient only where
    ``dA * dB`` is below the ``K x K`` Gram. Never for a leaf whose every use is vector-shaped (``b``
    ``None``: its per-example gradient is a sum of ``a``)."""
    if all(_use(u).b is None for u in uses):
        return False
    first = _use(uses[0])
    k_total = sum(math.prod(u.use.a.shape[:3:2]) if isinstance(u, Steps) else _k(u.a) for u in uses)
    d_a, d_b = _width(first.a), 1 if first.b is None else _width(first.b)
    if any(isinstance(_use(u).a, Index) for u in uses):
        return k_total * k_total > d_a * d_b
    return k_total * (d_a + d_b) > d_a * d_b


def per_example_grad(uses: list, dtype) -> jax.Array:
    """Each example's gradient of the leaf, ``(B, dA, dB)``: the sum over its uses' positions of ``outer(a, b)``
    (a ``Steps``': over its steps too, contracted where they lie)."""
    grad = 0.0
    for u in _with_b(uses, dtype):
        if isinstance(u, Steps):
            grad = grad + jnp.einsum("sbka,sbkc->bac", u.use.a, u.use.b, precision=HIGHEST)
        elif isinstance(u.a, Index):
            grad = grad + jax.vmap(lambda ids, bb: jnp.zeros((u.a.size, bb.shape[-1]), dtype).at[ids].add(bb.astype(dtype)))(u.a.ids, u.b)
        else:
            grad = grad + jnp.einsum("bka,bkc->bac", u.a, u.b, precision=HIGHEST)
    return grad


def _batch_k(f):
    return f.ids.shape if isinstance(f, Index) else f.shape[:-1]


def weighted_sum(uses: list[Use], weights, shape: tuple, dtype, nan_safe: bool = False) -> jax.Array:
    """``sum_i weights[i] g_i`` over examples, ``g_i`` the leaf's per-example gradient from ``uses``;
    ``weights`` ``None``: every weight 1 (the batch gradient, no scaling).

    With ``nan_safe``, the factors' non-finite entries read as zeros (``finite``): an example left out
    for a non-finite norm (weight 0) then adds exact zeros, not ``0 * nan``; one whose norm is finite
    has no such entry (each entry of its factors enters its norm).

    Where the squared norm forms each example's gradient (``per_example_grad``), the weighted sum of
    those, as ``_conv`` does with a convolution's blocks (``nan_safe`` then zeroes their non-finite
    entries: the same sum, as ``conv_weighted_sum`` says). Elsewhere the batch gradient with each
    example scaled: one contraction per use, the size of the ordinary parameter gradient (no
    per-example gradient is formed). It is formed as the plain
    backward forms the weight gradient: the output-gradient factor scaled by its example's
    weight, then one ``dot_general`` over the rows ``(B * K)`` of both factors. Under sharding
    the factors then move only as the plain step's do (a weighted einsum over ``(b, k)`` had
    XLA gather each layer's input over the batch again: issue 33, +61% bytes under FSDP).
    """
    z = finite if nan_safe else (lambda f: f)
    if _per_example_form(uses):  # the norm forms each g_i: their (weighted) sum, shared with it in one program
        grad = z(per_example_grad(uses, dtype))
        return jnp.reshape(jnp.tensordot(example_weights(weights, grad.shape[0], dtype), grad, 1), shape)
    total = 0.0
    for u in uses:
        if isinstance(u, Steps):
            part = _steps_sum(u.use, weights, dtype, z)
        elif u.b is None:
            if isinstance(u.a, Index):
                k = u.a.ids.shape[1]
                ones = jnp.ones(u.a.ids.size, dtype) if weights is None else jnp.repeat(weights.astype(dtype), k)
                part = jnp.zeros(u.a.size, dtype).at[u.a.ids.reshape(-1)].add(ones)
            else:  # a sum over the rows, as the plain backward forms a bias's gradient (not a product with ones)
                rows = z(_rows(u, "a")).astype(dtype)
                part = jnp.sum(rows if weights is None else rows * _row_weights(weights.astype(dtype), u.a)[:, None], axis=0)
        elif isinstance(u.a, Index):
            b = z(u.b) if weights is None else z(u.b) * weights.astype(dtype)[:, None, None]
            part = jnp.zeros((u.a.size, u.b.shape[-1]), dtype).at[u.a.ids.reshape(-1)].add(b.reshape(-1, u.b.shape[-1]).astype(dtype))
        else:
            a, b = z(_rows(u, "a")), z(_rows(u, "b"))
            if weights is not None:
                wk = _row_weights(weights.astype(dtype), u.a)[:, None]
                a, b = (a * wk, b) if u.out == "a" else (a, b * wk)
            part = _contract(a, b)
        total = total + part
    return jnp.reshape(total, shape)


def _steps_sum(u: Use, weights, dtype, z) -> jax.Array:
    """``sum_i weights[i] g_i`` of a ``Steps``' use (arrays ``(S, B, K, d)``): one contraction over its
    rows ``(S * B * K)`` as they lie, the output-gradient factor scaled by each row's example's weight."""
    s, b, k = u.a.shape[:3]
    a = z(u.a).reshape(-1, u.a.shape[-1])
    bb = None if u.b is None else z(u.b).reshape(-1, u.b.shape[-1])
    w = jnp.broadcast_to(example_weights(weights, b, dtype)[None, :, None], (s, b, k)).reshape(-1)
    if bb is None:
        return _contract(w, a)
    if weights is not None:
        a, bb = (a * w[:, None], bb) if u.out == "a" else (a, bb * w[:, None])
    return _contract(a, bb)


def example_weights(weights, batch: int, dtype) -> jax.Array:
    """``weights`` in ``dtype``; ``None``: ones. A sum of per-example gradients is a product with these
    (one ``dot``), not a reduction over the examples' axis: on JAX 0.10.2's XLA:CPU that reduction
    of an RNN's two ``(32, 256, 256)`` gradients made the step 1.37x the plain one, the product 0.99x."""
    return jnp.ones(batch, dtype) if weights is None else weights.astype(dtype)


def _rows(u: Use, which: str) -> jax.Array:
    """The factor ``which`` (``"a"`` or ``"b"``) of ``u``, ``(B, K, d)``, as ``(B * K, d)``: the
    forward's own array where the pass kept it (``with_rows``), else a reshape."""
    held = u.rows[0 if which == "a" else 1] if u.rows is not None else None
    f = getattr(u, which)
    return held if held is not None else f.reshape(-1, f.shape[-1])


def _row_weights(w, f) -> jax.Array:
    """The weights ``(B,)`` repeated over the ``K`` rows of each example of ``f`` ``(B, K, d)``."""
    return w if f.shape[1] == 1 else jnp.repeat(w, f.shape[1])


def finite(f) -> jax.Array:
    """``f`` with its NaN and infinite entries zeros. Elementwise on ``f`` alone, so that a sharded factor
    stays as it is sharded (a mask of the examples, from their norms, had XLA gather the factors)."""
    return jnp.where(jnp.isfinite(f), f, jnp.zeros((), f.dtype))


def _contract(a, b) -> jax.Array:
    """``sum_r a[r] (x) b[r]`` over the rows: the plain backward's weight-gradient contraction."""
    dtype = jnp.result_type(a, b)
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())))
