"""The public transforms: ``per_example_norms``, ``clipped_grad``, and the clipping weights."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ._pass import Call

def per_example_norms(
    fun: Callable, argnums: int = 0, *, fallback: str = "vmap", total: bool = False, has_aux: bool = False
) -> Callable:
    """Each example's squared parameter-gradient norm, per leaf, without a per-example gradient.

    ``fun(model, *batch)`` returns one loss per example, shape ``(B,)``; ``model`` (the
    argument at ``argnums``) is an equinox or Flax NNX model, untagged. The returned
    function gives ``(losses, sq_norms)``: ``sq_norms`` has the structure of the model's
    gradients (what ``eqx.filter_grad`` gives, for NNX what ``nnx.grad`` gives), each leaf
    of shape ``(B,)``: ``|d losses[i] / d leaf|**2``. With ``total=True`` it gives
    ``(losses, total_sq_norms)`` instead, summed over the leaves (the squared norm of each
    example's whole gradient).

    One pass (one forward, one backward of ``sum(losses)``) gives every covered layer's
    input and output gradient, and from them its parameters' per-example norms: Linear with
    any leading axes (per leaf, the Gram "ghost norm" form or the per-example gradient of
    that layer, whichever is smaller), Embedding, LayerNorm/RMSNorm scale and bias, and
    Conv (patches). Tied weights and a layer called several times are one gradient per
    example (their uses are summed, with the cross terms). Other leaves: with
    ``fallback="vmap"`` they are computed with ``jax.vmap(jax.grad)`` for those leaves
    alone, splitting every argument array whose first axis has length ``B`` into examples
    (keyword arguments and other arguments are passed to every example as they are);
    ``fallback="error"`` raises ``jt.TagError`` naming them and their modules.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> def losses(model, x, y):
        ...     return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> losses, sq = eqx.filter_jit(jt.per_example_norms(losses, total=True))(model, x, y)
        >>> sq.shape
        (4,)
    """

    @functools.wraps(fun)
    def norms_fun(*args, **kwargs):
        call = Call(fun, argnums, fallback, has_aux, args, kwargs)
        sq = call.sq_norms()
        value = (call.losses, call.aux) if has_aux else call.losses
        if total:
            return value, functools.reduce(jnp.add, sq) if sq else jnp.zeros_like(call.losses)
        return value, call.plan.out(sq)

    return norms_fun


def clipped_grad(fun: Callable, max_norm, argnums: int = 0, *, fallback: str = "vmap", has_aux: bool = False) -> Callable:
    """The clipped sum of DP-SGD: ``sum_i min(1, max_norm / |g_i|) g_i``, without per-example gradients.

    ``fun(model, *batch)`` returns one loss per example, shape ``(B,)``; ``g_i`` is the
    gradient of ``losses[i]`` for all of the model's differentiated leaves together. The
    returned function gives ``(losses, grads)``, ``grads`` structured as ``eqx.filter_grad``
    gives them (for an NNX model, as ``nnx.grad`` does). The norms come from
    ``per_example_norms`` (one forward and one backward pass); the clipped sum, with
    ``w_i = min(1, max_norm / |g_i|)``, comes from the same pass: for a covered layer it
    is its parameter gradient with each example's factors scaled by ``w_i`` (one
    contraction, the size of the ordinary gradient; no second backward pass), for a
    fallback leaf ``sum_i w_i`` of its ``vmap(grad)`` gradients. ``max_norm`` may be a
    traced value under ``jax.jit``; the result is differentiable in everything
    (``jax.grad`` around it works as around the ``vmap(grad)`` formula). ``fallback`` is
    as for ``per_example_norms``.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> def losses(model, x, y):
        ...     return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> losses, grads = eqx.filter_jit(jt.clipped_grad(losses, 1.0))(model, x, y)
        >>> grads.layers[0].weight.shape
        (8, 3)
    """

    @functools.wraps(fun)
    def clipped_fun(*args, **kwargs):
        call = Call(fun, argnums, fallback, has_aux, args, kwargs)
        sq = call.sq_norms()
        sq_total = functools.reduce(jnp.add, sq) if sq else jnp.zeros(call.losses.shape, jnp.float32)
        value = (call.losses, call.aux) if has_aux else call.losses
        return value, call.plan.out(call.weighted_grads(clip_weights(sq_total, max_norm)))

    return clipped_fun


def clip_weights(sq_norms: jax.Array, max_norm) -> jax.Array:
    """``min(1, max_norm / sqrt(sq_norms))``, with finite derivatives at zero norms."""
    max_norm = jnp.asarray(max_norm, sq_norms.dtype)
    over = sq_norms > max_norm * max_norm
    safe = jnp.where(over, sq_norms, 1.0)
    return jnp.where(over, max_norm * jax.lax.rsqrt(safe), 1.0)
