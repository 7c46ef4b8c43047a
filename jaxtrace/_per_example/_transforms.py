"""The public transforms: ``per_example_norms``, ``value_grad_and_norms``, ``clipped_grad``, and the clipping weights."""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from ._pass import Call

__all__ = ["clip_weights", "clipped_grad", "per_example_norms", "value_grad_and_norms"]


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


def value_grad_and_norms(fun: Callable, argnums: int = 0, *, fallback: str = "vmap", has_aux: bool = False) -> Callable:
    """The mean loss's gradient and each example's squared gradient norms per leaf, from one pass.

    What a training step needs (the gradient of ``mean(losses)``) and what tells, when the loss
    spikes, which examples and which layers made it (``|d losses[i] / d leaf|**2`` for every
    example and leaf, as ``per_example_norms`` gives them), from the one forward and one backward
    pass of ``per_example_norms``: the gradient is ``clipped_grad``'s sum with every weight 1,
    divided by the batch size, from the factors the norms read (where a norm forms each example's
    gradient of a leaf, as for a convolution at many positions or a weight read at many steps of
    a scan, their sum; XLA then leaves the backward pass's own weight gradient out), not a second
    pullback. Push the norms into a ``NormHistory`` carried in the train state, and read it when
    the loss spikes.

    Args:
        fun: ``fun(model, *batch, **kwargs)`` returns one loss per example, shape ``(B,)``
            (with ``has_aux``, ``(losses, aux)``).
        argnums: the position of the model, an equinox or Flax NNX module, untagged.
        fallback: as for ``per_example_norms``: ``"vmap"`` (the exact path for leaves no factors
            cover) or ``"error"``.
        has_aux: ``fun`` returns ``(losses, aux)``.

    Returns:
        A function of ``fun``'s arguments giving ``(losses, (grads, sq_norms))`` (with ``has_aux``,
        ``((losses, aux), (grads, sq_norms))``): ``grads`` is the gradient of ``jnp.mean(losses)``,
        structured as ``eqx.filter_grad`` gives it (for NNX, as ``nnx.grad`` does); ``sq_norms``
        has that structure too, each leaf ``(B,)``: ``|d losses[i] / d leaf|**2``.

    Raises:
        TagError: as ``per_example_norms``.
        ValueError: if ``fun`` does not return a vector of losses.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> def losses(model, x, y):
        ...     return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> losses, (grads, sq_norms) = eqx.filter_jit(jt.value_grad_and_norms(losses))(model, x, y)
        >>> grads.layers[0].weight.shape, sq_norms.layers[0].weight.shape
        ((8, 3), (4,))
    """

    @functools.wraps(fun)
    def value_grad_and_norms_fun(*args, **kwargs):
        call = Call(fun, argnums, fallback, has_aux, args, kwargs)
        sq = call.sq_norms()
        call.write_back()
        value = (call.losses, call.aux) if has_aux else call.losses
        grads = [(g / call.batch).astype(g.dtype) for g in call.weighted_grads(None)]
        return value, (call.plan.out(grads), call.plan.out(sq))

    return value_grad_and_norms_fun


def clipped_grad(
    fun: Callable,
    max_norm,
    argnums: int = 0,
    *,
    fallback: str = "vmap",
    has_aux: bool = False,
    nan_safe: bool = True,
    count_nonfinite: bool = False,
) -> Callable:
    """The clipped sum of DP-SGD: ``sum_i min(1, max_norm / |g_i|) g_i``, without per-example gradients.

    ``g_i`` is the gradient of ``losses[i]`` for all of the model's differentiated leaves. The
    norms and the clipped sum come from ``per_example_norms``' one pass: for a covered layer its
    parameter gradient with each example's factors scaled by ``w_i = min(1, max_norm / |g_i|)``
    (one contraction, no second backward pass), for an exact-path leaf ``sum_i w_i`` of its
    per-example gradients. The result is differentiable (``jax.grad`` around it works).

    An example whose squared gradient norm is not finite (a NaN or an infinity in its loss,
    its inputs or its gradient) gets weight 0 and is left out of the sum, as jax-privacy's
    ``nan_safe`` clipping does: the non-finite entries of the factors read as zeros, so that
    its NaN does not reach the others' sum (``0 * nan`` is ``nan``); ``count_nonfinite=True``
    returns how many were left out. The sum then holds fewer examples than the batch: count
    them in what you divide by, or skip the step.

    Args:
        fun: ``fun(model, *batch, **kwargs)`` returns one loss per example, shape ``(B,)``
            (with ``has_aux``, ``(losses, aux)``).
        max_norm: the clipping bound, a finite number ``>= 0`` (a ``ValueError`` otherwise); may
            be traced under ``jax.jit``, where a bound that is negative or not finite cannot
            raise: it makes every weight, and so the clipped sum, NaN.
        argnums: the position of the model, an equinox or Flax NNX module, untagged.
        fallback: as for ``per_example_norms``.
        has_aux: ``fun`` returns ``(losses, aux)``.
        nan_safe: zero the factors' non-finite entries (the default). ``False`` keeps the
            weights of 0 but touches no factor, so a left-out example's NaN still reaches the
            sum; for finite steps it saves a pass over each layer input (and, under FSDP, its
            all-gather).
        count_nonfinite: also return the number of examples left out for a non-finite norm.

    Returns:
        A function of ``fun``'s arguments giving ``(losses, grads)`` (with ``has_aux``,
        ``((losses, aux), grads)``), ``grads`` structured as ``eqx.filter_grad`` gives them
        (for an NNX model, as ``nnx.grad`` does). With ``count_nonfinite=True``, a third
        result: an int32 scalar, the number of examples whose squared gradient norm was NaN
        or infinite (weight 0, not in ``grads``).

    Raises:
        TagError: as ``per_example_norms``.
        ValueError: if ``max_norm`` is negative, NaN or infinite (and not traced).

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> def losses(model, x, y):
        ...     return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> values, grads = eqx.filter_jit(jt.clipped_grad(losses, 1.0))(model, x, y)
        >>> grads.layers[0].weight.shape
        (8, 3)
        >>> x = x.at[1].set(jnp.nan)  # one bad example: left out, and counted
        >>> _, grads, left_out = jt.clipped_grad(losses, 1.0, count_nonfinite=True)(model, x, y)
        >>> int(left_out), bool(jnp.isfinite(grads.layers[0].weight).all())
        (1, True)
    """
    _check_bound(max_norm, "jaxtrace.clipped_grad")

    @functools.wraps(fun)
    def clipped_fun(*args, **kwargs):
        call = Call(fun, argnums, fallback, has_aux, args, kwargs)
        sq = call.sq_norms()
        sq_total = functools.reduce(jnp.add, sq) if sq else jnp.zeros(call.losses.shape, jnp.float32)
        call.write_back()
        value = (call.losses, call.aux) if has_aux else call.losses
        grads = call.plan.out(call.weighted_grads(clip_weights(sq_total, max_norm), nan_safe=nan_safe))
        if count_nonfinite:
            return value, grads, jnp.sum(~jnp.isfinite(sq_total), dtype=jnp.int32)
        return value, grads

    return clipped_fun


def clip_weights(sq_norms: jax.Array, max_norm) -> jax.Array:
    """The DP-SGD clipping weights ``min(1, max_norm / sqrt(sq_norms))``, with finite derivatives at zero norms.

    Args:
        sq_norms: each example's squared gradient norm, shape ``(B,)``.
        max_norm: the clipping bound, a finite number ``>= 0``; may be traced under ``jax.jit``
            (then a negative or non-finite bound gives NaN weights: it cannot raise there).

    Returns:
        The weights, shape ``(B,)``, in ``sq_norms``' dtype: 1 where the norm is at most
        ``max_norm``, else ``max_norm / norm``; 0 where ``sq_norms`` is NaN or infinite (the
        example is left out, as jax-privacy's ``nan_safe`` clipping does).

    Raises:
        ValueError: if ``max_norm`` is negative, NaN or infinite (and not traced).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxtrace._per_example import clip_weights
        >>> clip_weights(jnp.array([0.0, 1.0, 16.0, jnp.nan, jnp.inf]), 2.0).tolist()
        [1.0, 1.0, 0.5, 0.0, 0.0]
    """
    concrete = _check_bound(max_norm, "jaxtrace clip_weights")
    max_norm = jnp.asarray(max_norm, sq_norms.dtype)
    finite = jnp.isfinite(sq_norms)
    over = finite & (sq_norms > max_norm * max_norm)
    safe = jnp.where(over, sq_norms, 1.0)
    weights = jnp.where(over, max_norm * jax.lax.rsqrt(safe), jnp.where(finite, 1.0, 0.0).astype(sq_norms.dtype))
    if not concrete:  # a traced bound: a bad one cannot raise under jit, so it shows in every weight
        weights = jnp.where(jnp.isfinite(max_norm) & (max_norm >= 0), weights, jnp.nan)
    return weights


def _check_bound(max_norm, where: str) -> bool:
    """Whether ``max_norm`` is concrete (a number or a concrete scalar); raises if it is one that is
    negative or not finite. A traced bound returns False: its value is known only on device."""
    try:
        value = float(max_norm)
    except TypeError:  # a tracer (jax.jit, jax.vmap, jax.grad around the call): checked where it is known
        return False
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{where}: max_norm must be a finite number >= 0 (the bound C of the clipping weights "
            f"min(1, C / |g_i|)); got {max_norm!r}. A negative bound flips the sign of every clipped "
            "gradient, an infinite one clips nothing and a NaN one makes every weight NaN: pass the bound your privacy accounting "
            "uses (such as 1.0)."
        )
    return True
