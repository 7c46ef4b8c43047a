"""A leaf's per-example results from its uses, whatever their kinds: the squared norm of each
example's gradient and the weighted sum of the examples' gradients.

A use is a ``Use`` or a ``ConvUse`` of the whole leaf, or a ``PerStep``: one slice of the leaf
per ``lax.scan`` step (layers stacked in a scan), whose slices are parameters of their own (no
cross terms between steps).

Factor uses (``_factors.Use``: a Linear's, an Embedding's, a norm layer's) and convolution
calls (``_conv.ConvUse``) keep their own arithmetic; this module picks it, so that neither of
the two imports the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._conv import ConvUse, conv_sq_norm, conv_weighted_sum
from ._factors import PerStep
from ._factors import sq_norm as factors_sq_norm
from ._factors import weighted_sum as factors_weighted_sum

__all__ = ["sq_norm", "step_module", "weighted_sum"]


def _sq_norm(uses: list, dtype) -> jax.Array:
    """Squared norm of the sum over ``uses`` of the per-example gradient, per example: ``(B,)``."""
    convs = [isinstance(u, ConvUse) for u in uses]
    if convs and all(convs):
        return conv_sq_norm(uses, dtype)
    # a convolution beside other kinds of use (one weight in a Conv and a Linear): all as patch factors
    return factors_sq_norm([u.expand(dtype) if c else u for u, c in zip(uses, convs)], dtype)


def _weighted_sum(uses: list, weights, shape: tuple, dtype, nan_safe: bool) -> jax.Array:
    """``sum_i weights[i] g_i`` over examples, in the leaf's ``shape``."""
    rest = [u for u in uses if not isinstance(u, ConvUse)]
    parts = [conv_weighted_sum(u, weights, shape, dtype, nan_safe) for u in uses if isinstance(u, ConvUse)]
    if rest or not parts:
        parts.append(factors_weighted_sum(rest, weights, shape, dtype, nan_safe))
    return sum(parts[1:], parts[0])


def sq_norm(uses: list, dtype) -> jax.Array:
    """Squared norm of each example's gradient, ``(B,)``, from the leaf's uses: whole-leaf uses
    together, plus each scan step's slice on its own (no cross terms between steps)."""
    whole = [u for u in uses if not isinstance(u, PerStep)]
    steps = [u.use for u in uses if isinstance(u, PerStep)]
    total = _sq_norm(whole, dtype) if whole else 0.0
    if steps:
        total = total + jnp.sum(jax.vmap(lambda us: _sq_norm(us, dtype))(steps), axis=0)
    return total


def weighted_sum(uses: list, weights, shape: tuple, dtype, nan_safe: bool = False) -> jax.Array:
    """``sum_i weights[i] g_i`` over examples, in the leaf's ``shape``, from the leaf's uses (``weights``
    ``None``: every weight 1, the batch gradient); with ``nan_safe``, non-finite factor entries read as zeros (an example of weight 0 adds zeros, not ``0 * nan``)."""
    whole = [u for u in uses if not isinstance(u, PerStep)]
    steps = [u.use for u in uses if isinstance(u, PerStep)]
    if not steps:
        return _weighted_sum(whole, weights, shape, dtype, nan_safe)
    per_step = jax.vmap(lambda us: _weighted_sum(us, weights, shape[1:], dtype, nan_safe))(steps)
    return jnp.reshape(per_step, shape)


def step_module(module, steps: int):
    """One step's module of a layer stacked for ``lax.scan`` (its arrays with a leading ``steps`` axis)."""
    return jax.tree_util.tree_map(
        lambda a: a[0] if isinstance(a, jax.Array) and a.ndim >= 1 and a.shape[0] == steps else a, module
    )
