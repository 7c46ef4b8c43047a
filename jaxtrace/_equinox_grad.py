"""Equinox's filter transforms with tags: ``filter_value_and_grad``, ``filter_grad``, ``filter_jacrev``.

``jaxtrace.value_and_grad`` (``jaxtrace.jacrev``, or with ``stats=`` their ``jaxtrace.stats``
forms) with equinox's convention for what is differentiated: the inexact arrays of the first
argument, ``None`` everywhere else, exactly as ``eqx.filter_value_and_grad``
(``eqx.filter_jacrev``). One wrapper class serves the three.
"""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax.tree_util as jtu

from . import _stats_option
from ._ad import grad_result
from ._checks import check_callable
from ._selection import Selection, TagSelection

__all__ = ["filter_value_and_grad", "filter_grad", "filter_jacrev"]


def _partitioned(fun: Callable, args: tuple, kwargs: dict):
    """``fun`` on the first argument's inexact arrays and the rest apart, as equinox's filter transforms:
    ``(split_fun, split_args)`` with ``split_fun(diff, nondiff, *rest)`` calling ``fun`` on the combined model."""
    if not args:
        raise TypeError(
            "Functions wrapped with jaxtrace.filter_grad, jaxtrace.filter_value_and_grad or jaxtrace.filter_jacrev "
            "must get their first argument (the one that is differentiated) by position, not by keyword"
            + (f"; got only keyword arguments {sorted(kwargs)}." if kwargs else "; got no arguments.")
        )
    x, *rest = args
    diff_x, nondiff_x = eqx.partition(x, eqx.is_inexact_array)

    def split_fun(diff_x, nondiff_x, *args, **kwargs):
        return fun(eqx.combine(diff_x, nondiff_x), *args, **kwargs)

    return split_fun, (diff_x, nondiff_x, *rest)


class _Filtered(eqx.Module):
    """``fun`` under a filter transform (``kind``: ``"value_and_grad"``, ``"grad"`` or ``"jacrev"``)."""

    _fun: Callable
    _kind: str = eqx.field(static=True)
    _has_aux: bool = eqx.field(static=True)
    _tags: Any = eqx.field(static=True)
    _with_values: bool = eqx.field(static=True, default=False)
    _stats: Any = eqx.field(static=True, default=None)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, *args, **kwargs):
        split_fun, split_args = _partitioned(self._fun, args, kwargs)
        if self._kind == "jacrev":
            transform = _stats_option.jacrev(split_fun, 0, has_aux=self._has_aux, tags=self._tags, stats=self._stats)
            return transform(*split_args, **kwargs)
        transform = _stats_option.value_and_grad(
            split_fun, 0, has_aux=self._has_aux, tags=self._tags, with_values=self._with_values, stats=self._stats
        )
        result = transform(*split_args, **kwargs)
        return grad_result(result, self._has_aux) if self._kind == "grad" else result

    def __get__(self, instance, owner):
        return self if instance is None else jtu.Partial(self, instance)


def _wrap(fun: Callable, kind: str, has_aux, tags: TagSelection, with_values, stats) -> Callable:
    wrapper = _Filtered(fun, kind, bool(has_aux), Selection.of(tags), bool(with_values), _stats_option.stat_names(stats))
    return eqx.module_update_wrapper(wrapper, fun)


def filter_value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    with_values: bool = False,
    stats: Any = None,
) -> Callable:
    """Like ``eqx.filter_value_and_grad``, and also the gradients at the tags in ``fun``.

    Differentiates with respect to the inexact (floating or complex) arrays of
    the first argument; ``grads`` has ``None`` at every other leaf, exactly as
    ``eqx.filter_grad`` gives it, so the model may hold functions
    (``eqx.nn.Lambda``), strings and other non-arrays.

    Args:
        fun: the function; its first argument (by position) is differentiated.
        has_aux: ``fun`` returns ``(value, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        with_values: also return the forward values at the tags, from the same pass.
        stats: ``True`` or statistic names (``"norm"``): reduce each tag's gradient
            inside the traced function, as ``jaxtrace.stats.value_and_grad`` does,
            keeping each tag's loop axes (one value per layer of a ``lax.scan`` over
            layers, per step of a recurrent cell); values too, with ``with_values``.

    Returns:
        A function that returns ``(value, (grads, tag_grads))``, or with
        ``has_aux`` ``((value, aux), (grads, tag_grads))``; ``with_values=True``
        appends ``tag_values``. With ``stats=``, ``tag_grads`` is
        ``{name: {stat: array}}``.

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` is of the wrong kind;
            when called, if the first argument is passed by keyword.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = jt.tag_modules(eqx.nn.MLP(2, 1, 4, 2, key=jax.random.key(0)))
        >>> def loss(model, x):
        ...     return jnp.sum(model(x) ** 2)
        >>> value, (grads, tag_grads) = jt.filter_value_and_grad(loss)(model, jnp.ones(2))
        >>> sorted(tag_grads), tag_grads["layers.0"].shape
        (['', 'layers.0', 'layers.1', 'layers.2'], (4,))
    """
    check_callable(fun, "jaxtrace.filter_value_and_grad")
    return _wrap(fun, "value_and_grad", has_aux, tags, with_values, stats)


def filter_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    with_values: bool = False,
    stats: Any = None,
) -> Callable:
    """Like ``eqx.filter_grad``, and also the gradients at the tags in ``fun``.

    Args:
        fun: the function; its first argument (by position) is differentiated.
        has_aux: ``fun`` returns ``(value, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        with_values: also return the forward values at the tags.
        stats: summarise per tag, as in ``filter_value_and_grad``.

    Returns:
        A function that returns ``(grads, tag_grads)``, or with ``has_aux``
        ``((grads, tag_grads), aux)``; ``with_values=True`` appends
        ``tag_values``; see ``filter_value_and_grad``.

    Raises:
        TypeError: as ``filter_value_and_grad``.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = jt.tag_modules(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
        >>> def loss(model, x):
        ...     return jnp.sum(model(x))
        >>> grads, tag_grads = jt.filter_grad(loss)(model, jnp.ones(3))
        >>> tag_grads[""].tolist()
        [1.0, 1.0]
    """
    check_callable(fun, "jaxtrace.filter_grad")
    return _wrap(fun, "grad", has_aux, tags, with_values, stats)


def filter_jacrev(fun: Callable, *, has_aux: bool = False, tags: TagSelection = None, stats: Any = None) -> Callable:
    """Like ``eqx.filter_jacrev``, and also the Jacobians at the tags: which loss term reaches which layer.

    ``jaxtrace.jacrev`` (or, with ``stats=``, ``jaxtrace.stats.jacrev``) with
    equinox's convention: differentiates the inexact arrays of the first
    argument, so a model holding activation functions (``eqx.nn.MLP``) or
    other non-arrays goes in as it is. The output is a pytree of loss terms
    (``{"ce": ..., "aux": ...}``).

    Args:
        fun: the function; its first argument (by position) is differentiated.
        has_aux: ``fun`` returns ``(out, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        stats: ``None`` for the full Jacobians; ``True`` or statistic names
            (``"norm"``) to reduce each tag's Jacobian per term inside the traced
            function, as ``jaxtrace.stats.jacrev`` does.

    Returns:
        A function that returns ``(jac, tag_jacs)``, or with ``has_aux``
        ``((jac, tag_jacs), aux)``: ``jac`` is what ``eqx.filter_jacrev``
        returns (the output's structure, each leaf the model with ``None`` at
        non-differentiated leaves) and ``tag_jacs`` what ``jaxtrace.jacrev``
        returns. With ``stats=``, ``tag_jacs`` is the table
        ``{tag: {term: {stat: array}}}`` that ``jaxtrace.stats.format_paths``
        prints.

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` is of the wrong kind;
            when called, if the first argument is passed by keyword.
        ValueError: if a name in ``stats`` is not in ``jaxtrace.stats.STATS``.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = jt.tag_modules(eqx.nn.MLP(2, 1, 4, 2, key=jax.random.key(0)))
        >>> def losses(model, x):
        ...     out, acts = jt.capture(model)(x)
        ...     return {"main": jnp.sum(out ** 2), "aux": jnp.sum(acts["layers.1"] ** 2)}
        >>> _, table = jt.filter_jacrev(losses, stats="norm")(model, jnp.ones(2))
        >>> [name for name in table if float(table[name]["aux"]["norm"]) > 0]  # aux reaches layers 0 and 1 only
        ['layers.0', 'layers.1']
    """
    check_callable(fun, "jaxtrace.filter_jacrev")
    return _wrap(fun, "jacrev", has_aux, tags, False, stats)
