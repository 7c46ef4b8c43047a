"""A leaf's per-example results from its uses, whatever their kinds: the squared norm of each
example's gradient and the weighted sum of the examples' gradients.

Factor uses (``_factors.Use``: a Linear's, an Embedding's, a norm layer's) and convolution
calls (``_conv.ConvUse``) keep their own arithmetic; this module picks it, so that neither of
the two imports the other.
"""

from __future__ import annotations

import jax

from ._conv import ConvUse, conv_sq_norm, conv_weighted_sum
from ._factors import sq_norm as factors_sq_norm
from ._factors import weighted_sum as factors_weighted_sum

__all__ = ["sq_norm", "weighted_sum"]


def sq_norm(uses: list, dtype) -> jax.Array:
    """Squared norm of the sum over ``uses`` of the per-example gradient, per example: ``(B,)``."""
    convs = [isinstance(u, ConvUse) for u in uses]
    if convs and all(convs):
        return conv_sq_norm(uses, dtype)
    # a convolution beside other kinds of use (one weight in a Conv and a Linear): all as patch factors
    return factors_sq_norm([u.expand(dtype) if c else u for u, c in zip(uses, convs)], dtype)


def weighted_sum(uses: list, weights: jax.Array, shape: tuple, dtype) -> jax.Array:
    """``sum_i weights[i] g_i`` over examples, in the leaf's ``shape``."""
    rest = [u for u in uses if not isinstance(u, ConvUse)]
    parts = [conv_weighted_sum(u, weights, shape, dtype) for u in uses if isinstance(u, ConvUse)]
    if rest or not parts:
        parts.append(factors_weighted_sum(rest, weights, shape, dtype))
    return sum(parts[1:], parts[0])
