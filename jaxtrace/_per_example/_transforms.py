"""The public transforms: ``per_example_norms``, ``clipped_grad``, and the clipping weights."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ._pass import Call

__all__ = ["clip_weights", "clipped_grad", "per_example_norms"]


def per_example_norms(
    fun: Callable, argnums: int = 0, *, fallback: str = "vmap", total: bool = False, has_aux: bool = False
) -> Callable:
    """Each example's squared parameter-gradient norm, per leaf, without a per-example gradient.

    One pass (one forward, one backward of ``sum(losses)``) gives every covered layer's
    input and output gradient, and from them its parameters' per-example norms: Linear with
    any leading axes (the Gram "ghost norm" form or the per-example gradient of that layer,
    whichever is smaller), Embedding, LayerNorm/RMSNorm scale and bias, and Conv. The
    conditions that make this exact are proven from the traced program (each layer output
    position reaches one example's loss, through custom derivative rules as JAX runs them; the
    layer multiplies the leaf itself, or one scan step's slice of it), never guessed from shapes; tied weights and repeated calls are one
    gradient per example with their cross terms. Every other leaf takes the exact path: the
    definition, the pullback of the losses vector against each example's basis vector, for
    those leaves only. Examples that interact (a batch mean of activations, BatchNorm in
    training mode, an in-batch contrastive loss) are refused.

    Args:
        fun: ``fun(model, *batch, **kwargs)`` returns one loss per example, shape ``(B,)``
            (with ``has_aux``, ``(losses, aux)``).
        argnums: the position of the model, an equinox or Flax NNX module, untagged.
        fallback: ``"vmap"`` (the exact path for the leaves no factors cover) or ``"error"``
            (a ``jt.TagError`` naming them, their modules and why).
        total: give the squared norm of each example's whole gradient, summed over leaves.
        has_aux: ``fun`` returns ``(losses, aux)``.

    Returns:
        A function of ``fun``'s arguments giving ``(losses, sq_norms)`` (with ``has_aux``,
        ``((losses, aux), sq_norms)``): ``sq_norms`` has the structure of the model's
        gradients (``eqx.filter_grad``'s, for NNX ``nnx.grad``'s), each leaf ``(B,)``,
        ``|d losses[i] / d leaf|**2``; with ``total=True`` one ``(B,)`` array.

    Raises:
        TagError: where examples interact, or ``fallback="error"`` and a leaf is not on factors.
        ValueError: if ``fun`` does not return a vector of losses.

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
        call.write_back()
        value = (call.losses, call.aux) if has_aux else call.losses
        if total:
            return value, functools.reduce(jnp.add, sq) if sq else jnp.zeros_like(call.losses)
        return value, call.plan.out(sq)

    return norms_fun


def clipped_grad(fun: Callable, max_norm, argnums: int = 0, *, fallback: str = "vmap", has_aux: bool = False) -> Callable:
    """The clipped sum of DP-SGD: ``sum_i min(1, max_norm / |g_i|) g_i``, without per-example gradients.

    ``g_i`` is the gradient of ``losses[i]`` for all of the model's differentiated leaves
    together. The norms come from ``per_example_norms``' pass; the clipped sum from the same
    pass: for a covered layer its parameter gradient with each example's factors scaled by
    ``w_i = min(1, max_norm / |g_i|)`` (one contraction, the size of the ordinary gradient;
    no second backward pass), for an exact-path leaf ``sum_i w_i`` of its per-example
    gradients. The result is differentiable in everything (``jax.grad`` around it works).

    Args:
        fun: ``fun(model, *batch, **kwargs)`` returns one loss per example, shape ``(B,)``
            (with ``has_aux``, ``(losses, aux)``).
        max_norm: the clipping bound; may be traced under ``jax.jit``.
        argnums: the position of the model, an equinox or Flax NNX module, untagged.
        fallback: as for ``per_example_norms``.
        has_aux: ``fun`` returns ``(losses, aux)``.

    Returns:
        A function of ``fun``'s arguments giving ``(losses, grads)`` (with ``has_aux``,
        ``((losses, aux), grads)``), ``grads`` structured as ``eqx.filter_grad`` gives them
        (for an NNX model, as ``nnx.grad`` does).

    Raises:
        TagError: as ``per_example_norms``.

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
        call.write_back()
        value = (call.losses, call.aux) if has_aux else call.losses
        return value, call.plan.out(call.weighted_grads(clip_weights(sq_total, max_norm)))

    return clipped_fun


def clip_weights(sq_norms: jax.Array, max_norm) -> jax.Array:
    """The DP-SGD clipping weights ``min(1, max_norm / sqrt(sq_norms))``, with finite derivatives at zero norms.

    Args:
        sq_norms: each example's squared gradient norm, shape ``(B,)``.
        max_norm: the clipping bound; may be traced under ``jax.jit``.

    Returns:
        The weights, shape ``(B,)``, in ``sq_norms``' dtype: 1 where the norm is at most
        ``max_norm``, else ``max_norm / norm``.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxtrace._per_example import clip_weights
        >>> clip_weights(jnp.array([0.0, 1.0, 16.0]), 2.0).tolist()
        [1.0, 1.0, 0.5]
    """
    max_norm = jnp.asarray(max_norm, sq_norms.dtype)
    over = sq_norms > max_norm * max_norm
    safe = jnp.where(over, sq_norms, 1.0)
    return jnp.where(over, max_norm * jax.lax.rsqrt(safe), 1.0)
