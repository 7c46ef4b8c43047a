"""The per-example oracle: the definition, row ``i`` of ``jax.jacrev`` of the losses vector.

``oracle_per_example(losses_fn, model, *args, **kwargs)`` differentiates the vector
``losses_fn(model, *args, **kwargs)`` (shape ``(B,)``) with ``jax.jacrev`` with respect to
the model's differentiated leaves (equinox: ``eqx.partition(model, eqx.is_inexact_array)``;
Flax NNX: the ``nnx.Param`` state, as ``nnx.grad`` differentiates), and derives from those
rows each example's per-leaf squared norms, the total squared norms and the clipped sum
``sum_i min(1, C / |g_i|) g_i``. It assumes nothing about the batch: no argument is split,
closures, keywords, any layout and even interacting examples are fine (row ``i`` is then
``d losses[i] / d params`` whatever ``losses[i]`` reads, through whatever custom derivative
rules JAX runs). It never imports jaxtrace. At the end: custom derivative rules the per-example
tests call, some mixing the examples in their derivative alone.

Use it in float64 (``jax_enable_x64``, a float64 model): that is what makes a 1e-10
comparison meaningful. ``float64=True`` (the default) refuses a model with other
differentiated dtypes.

Example:
    >>> import equinox as eqx, jax, jax.numpy as jnp
    >>> jax.config.update("jax_enable_x64", True)
    >>> model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    >>> model = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, model)
    >>> fun = lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2, axis=-1)
    >>> ref = oracle_per_example(fun, model, jnp.ones((4, 3)))
    >>> ref.total.shape, ref.grads.weight.shape
    ((4,), (4, 2, 3))
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


def _is_nnx(model) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is installed in every CI cell
        return False
    return isinstance(model, nnx.Module)


def split_model(model, with_rest: bool = False):
    """``(diff, rebuild)``: the differentiated leaves of ``model`` and ``diff -> model``.

    ``diff`` has the structure of the model's gradients (``eqx.filter_grad``'s, or for an
    NNX model ``nnx.grad``'s: the ``nnx.Param`` state). With ``with_rest=True`` it gives
    ``(diff, rest, rebuild)`` with ``rebuild(diff, rest)``: pass ``rest`` (an NNX model's
    other state, ``None`` for equinox) into the transform that calls ``rebuild``, so that
    a model that writes its state (``nnx.BatchNorm`` in training mode) writes it at the
    transform's level.
    """
    if _is_nnx(model):
        from flax import nnx

        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        rebuild = lambda p, r=rest: nnx.merge(graphdef, p, r)  # noqa: E731
        return (params, rest, rebuild) if with_rest else (params, rebuild)
    import equinox as eqx

    diff, static = eqx.partition(model, eqx.is_inexact_array)
    rebuild = lambda d, r=None: eqx.combine(d, static)  # noqa: E731
    return (diff, None, rebuild) if with_rest else (diff, rebuild)


def clip_weights(total_sq, max_norm):
    """``min(1, max_norm / |g_i|)`` from the squared norms; 1 where ``g_i = 0``."""
    norm = jnp.sqrt(total_sq)
    over = norm > max_norm
    return jnp.where(over, max_norm / jnp.where(over, norm, 1.0), 1.0)


class PerExample(NamedTuple):
    """What the definition gives: each leaf of ``grads`` has shape ``(B, *leaf.shape)``."""

    losses: jax.Array  # (B,)
    grads: Any  # the gradients' structure; leaves (B, *leaf.shape): row i = d losses[i] / d leaf
    sq_norms: Any  # the gradients' structure; leaves (B,)
    total: jax.Array  # (B,): |g_i|**2 summed over the leaves

    def clipped(self, max_norm):
        """``sum_i min(1, max_norm / |g_i|) g_i``, in the gradients' structure (no B axis)."""
        w = clip_weights(self.total, max_norm)
        return jax.tree.map(lambda g: jnp.tensordot(w.astype(g.dtype), g, 1), self.grads)


def oracle_per_example(losses_fn: Callable, model, *args, float64: bool = True, **kwargs) -> PerExample:
    """Per-example gradients by definition: ``jax.jacrev`` of ``losses_fn(model, *args, **kwargs)``.

    Args:
        losses_fn: ``losses_fn(model, *args, **kwargs)`` returns the losses, shape ``(B,)``.
        model: an equinox model (differentiated leaves: ``eqx.is_inexact_array``) or a Flax
            NNX model (differentiated: its ``nnx.Param`` state).
        *args, **kwargs: passed to ``losses_fn`` as they are (never split).
        float64: refuse differentiated leaves that are not float64 (the default).

    Returns:
        A ``PerExample``: ``losses``, ``grads`` (row ``i`` of the Jacobian per leaf),
        ``sq_norms`` (per leaf, ``(B,)``), ``total`` (``(B,)``), and ``.clipped(C)``.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp
        >>> jax.config.update("jax_enable_x64", True)
        >>> m = eqx.nn.Linear(2, 1, key=jax.random.key(0))
        >>> m = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, m)
        >>> ref = oracle_per_example(lambda m, x: jax.vmap(m)(x)[:, 0], m, jnp.eye(2))
        >>> ref.sq_norms.weight  # d (w . x_i + b) / d w = x_i
        Array([1., 1.], dtype=float64)
    """
    diff, rest, rebuild = split_model(model, with_rest=True)
    if float64:
        bad = [leaf.dtype for leaf in jax.tree.leaves(diff) if leaf.dtype != jnp.float64]
        if bad:
            raise TypeError(
                f"oracle_per_example checks in float64, but the model has differentiated leaves of dtypes "
                f"{sorted(set(map(str, bad)))}; cast the model to float64 (with jax_enable_x64) first, "
                "or pass float64=False."
            )

    def losses_of(d, r):
        losses = losses_fn(rebuild(d, r), *args, **kwargs)
        if jnp.ndim(losses) != 1:
            raise ValueError(f"losses_fn must return one loss per example, shape (B,); got shape {jnp.shape(losses)}.")
        return losses

    if rest is not None:
        # An NNX model that writes its state (nnx.BatchNorm in training mode) may only do so
        # at the level of the trace its Variables were made at: make them from traced values.
        losses_of = jax.jit(losses_of)
    # The losses come out of jacrev's own forward pass (as aux): under an outer jax.jvp a second,
    # plain forward call would meet a custom_vjp in forward mode, which JAX refuses.
    grads, losses = jax.jacrev(lambda d, r: (losses_of(d, r),) * 2, has_aux=True)(diff, rest)
    b = losses.shape[0]
    sq = jax.tree.map(lambda g: jnp.sum(jnp.square(g).reshape(b, -1), axis=1), grads)
    total = sum(jax.tree.leaves(sq), jnp.zeros((b,), losses.dtype))
    return PerExample(losses, grads, sq, total)


def finite_difference_row(losses_fn, model, *args, i: int = 0, leaf: int = 0, index=0, h: float = 1e-6, **kwargs):
    """``d losses[i] / d leaf[index]`` by central differences: a spot check of the oracle itself."""
    diff, rebuild = split_model(model)
    leaves, treedef = jax.tree.flatten(diff)

    def at(delta):
        ls = list(leaves)
        flat = ls[leaf].reshape(-1)
        ls[leaf] = flat.at[index].add(delta).reshape(ls[leaf].shape)
        return losses_fn(rebuild(jax.tree.unflatten(treedef, ls)), *args, **kwargs)[i]

    return (at(h) - at(-h)) / (2 * h)


# --- custom derivative rules (whose derivative the definition takes as JAX does) ------------------


@jax.custom_vjp
def centred_backward(h):
    """The identity, whose backward pass subtracts the cotangent's mean over the first axis."""
    return h


centred_backward.defvjp(lambda h: (h, None), lambda _, g: (g - jnp.mean(g, axis=0),))


@jax.custom_vjp
def batch_normalised_ste(h):
    """A straight-through estimator (rounding) whose backward pass divides by the RMS of the cotangent over the first axis."""
    return jnp.round(h)


batch_normalised_ste.defvjp(lambda h: (jnp.round(h), None), lambda _, g: (g / jnp.sqrt(1.0 + jnp.mean(g**2, axis=0)),))


@jax.custom_jvp
def centred_tangent(h):
    """The identity, whose tangent is centred over the first axis (so is its transpose, the cotangent)."""
    return h


centred_tangent.defjvp(lambda primals, tangents: (primals[0], tangents[0] - jnp.mean(tangents[0], axis=0)))


@jax.custom_vjp
def clipped_backward(h):
    """The identity, whose backward pass clips each element of the cotangent: each element's own."""
    return h


clipped_backward.defvjp(lambda h: (h, None), lambda _, g: (jnp.clip(g, -0.05, 0.05),))
