"""Equinox's filter transforms with tags: ``filter_value_and_grad``, ``filter_grad``, ``filter_jacrev``.

``jaxtrace.value_and_grad`` (``jaxtrace.jacrev``, or with ``stats=`` their ``jaxtrace.stats``
forms) with equinox's convention for what is differentiated: the inexact arrays of the first
argument, ``None`` everywhere else, exactly as ``eqx.filter_value_and_grad``
(``eqx.filter_jacrev``). One wrapper class serves the three.

``tag_modules=`` tags the first argument inside the transform (``jaxtrace.tag_modules`` on the
model that the traced function rebuilds), so the model the user holds stays untagged and the
gradients come back in its structure: an optax state made from it before jaxtrace entered, and
``eqx.apply_updates`` on it, keep working.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import equinox as eqx
import jax.tree_util as jtu

from . import _stats_option
from ._ad import grad_result
from ._checks import check_callable
from ._errors import NoTags
from ._module_tags import Where, parse_where
from ._selection import Selection, TagSelection
from ._tag_modules import tag_module_calls

__all__ = ["filter_value_and_grad", "filter_grad", "filter_jacrev"]


def _partitioned(fun: Callable, args: tuple, kwargs: dict, tag: Callable | None = None):
    """``fun`` on the first argument's inexact arrays and the rest apart, as equinox's filter transforms:
    ``(split_fun, split_args)`` with ``split_fun(diff, nondiff, *rest)`` calling ``fun`` on the combined model
    (passed through ``tag`` first, if given: its tags exist only inside the transform)."""
    if not args:
        raise TypeError(
            "Functions wrapped with jaxtrace.filter_grad, jaxtrace.filter_value_and_grad or jaxtrace.filter_jacrev "
            "must get their first argument (the one that is differentiated) by position, not by keyword"
            + (f"; got only keyword arguments {sorted(kwargs)}." if kwargs else "; got no arguments.")
        )
    x, *rest = args
    diff_x, nondiff_x = eqx.partition(x, eqx.is_inexact_array)

    def split_fun(diff_x, nondiff_x, *args, **kwargs):
        model = eqx.combine(diff_x, nondiff_x)
        return fun(model if tag is None else tag(model), *args, **kwargs)

    return split_fun, (diff_x, nondiff_x, *rest)


class _Filtered(eqx.Module):
    """``fun`` under a filter transform (``kind``: ``"value_and_grad"``, ``"grad"`` or ``"jacrev"``)."""

    _fun: Callable
    _kind: str = eqx.field(static=True)
    _has_aux: bool = eqx.field(static=True)
    _tags: Any = eqx.field(static=True)
    _with_values: bool = eqx.field(static=True, default=False)
    _stats: Any = eqx.field(static=True, default=None)
    _modules: Any = eqx.field(static=True, default=False)  # tag_modules=: False, True or a where= (hashable)
    _module_inputs: bool = eqx.field(static=True, default=False)
    _param_stats: bool = eqx.field(static=True, default=False)

    @property
    def __wrapped__(self):
        return self._fun

    def _tag(self, model):
        where = None if self._modules is True else self._modules
        return tag_module_calls(model, where, inputs=self._module_inputs, api=f"jaxtrace.filter_{self._kind}(tag_modules=...)")

    def _said(self, found: dict) -> dict:
        """``found`` (a dict of tags), or where every tag was asked for and none found, a ``NoTags``
        whose reads say how to tag the model."""
        if found or type(found) not in (dict, collections.OrderedDict) or self._tags != Selection():
            return found
        if self._modules is False:
            fix = (
                f"Pass tag_modules=True (jt.filter_{self._kind}(fun, tag_modules=True)) to tag the model's modules "
                "inside the transform, or tag values in the function with jt.tag(x, name)."
            )
        else:
            fix = "tag_modules= selected no module that the function calls: select the modules it calls (paths as in named_modules())."
        return NoTags(f"jaxtrace.filter_{self._kind}", fix)

    def __call__(self, *args, **kwargs):
        tag = None if self._modules is False else self._tag
        split_fun, split_args = _partitioned(self._fun, args, kwargs, tag)
        if self._kind == "jacrev":
            transform = _stats_option.jacrev(
                split_fun, 0, has_aux=self._has_aux, tags=self._tags, stats=self._stats, param_stats=self._param_stats
            )
            result = transform(*split_args, **kwargs)
            (jac, tag_jacs), aux = result if self._has_aux else (result, None)
            return ((jac, self._said(tag_jacs)), aux) if self._has_aux else (jac, self._said(tag_jacs))
        transform = _stats_option.value_and_grad(
            split_fun, 0, has_aux=self._has_aux, tags=self._tags, with_values=self._with_values, stats=self._stats
        )
        value, (grads, tag_grads), *values = transform(*split_args, **kwargs)
        result = (value, (grads, self._said(tag_grads)), *map(self._said, values))
        return grad_result(result, self._has_aux) if self._kind == "grad" else result

    def __get__(self, instance, owner):
        return self if instance is None else jtu.Partial(self, instance)


_MODULES_FORMS = (
    "False (the model as passed), True (every module), a path, a list of paths, a class or tuple of classes, "
    "or a predicate (path, module) -> bool, as jaxtrace.tag_modules' where= takes them"
)


def _modules_option(tag_modules, module_inputs, api: str):
    """``tag_modules=`` as a hashable value (a list of paths becomes a tuple), checked now."""
    if tag_modules is None or tag_modules is False:
        if module_inputs:
            raise TypeError(
                f"{api}: module_inputs=True tags the inputs of the modules that tag_modules= selects, but "
                "tag_modules= selects none. Pass tag_modules=True (every module) or the paths to tag."
            )
        return False
    if tag_modules is True:
        return True
    if isinstance(tag_modules, list):
        tag_modules = tuple(tag_modules)
    try:
        parse_where(tag_modules, api)
    except TypeError:
        raise TypeError(
            f"{api}: tag_modules= must be {_MODULES_FORMS}; got {tag_modules!r} of type "
            f"{type(tag_modules).__name__}."
        ) from None
    return tag_modules


def _wrap(
    fun: Callable, kind: str, has_aux, tags: TagSelection, with_values, stats, tag_modules, module_inputs, param_stats=False
) -> Callable:
    api = f"jaxtrace.filter_{kind}"
    modules = _modules_option(tag_modules, module_inputs, api)
    stats = _stats_option.stat_names(stats)
    param_stats = _stats_option.check_param_stats(param_stats, stats, api)
    wrapper = _Filtered(
        fun, kind, bool(has_aux), Selection.of(tags), bool(with_values), stats, modules, bool(module_inputs), param_stats
    )
    return eqx.module_update_wrapper(wrapper, fun)


def filter_value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    with_values: bool = False,
    stats: Any = None,
    tag_modules: bool | Where = False,
    module_inputs: bool = False,
) -> Callable:
    """Like ``eqx.filter_value_and_grad``, and also the gradients at the tags in ``fun``.

    Differentiates with respect to the inexact (floating or complex) arrays of
    the first argument; ``grads`` has ``None`` at every other leaf, exactly as
    ``eqx.filter_grad`` gives it, so the model may hold functions
    (``eqx.nn.Lambda``), strings and other non-arrays.

    ``tag_modules=True`` tags the model's modules inside the transform (as
    ``jaxtrace.tag_modules`` would): the model you hold stays untagged and
    ``grads`` has its structure, so an optimiser state made from it and
    ``eqx.apply_updates`` on it work unchanged. A model tagged beforehand
    with ``jaxtrace.tag_modules`` is a different pytree (its modules are
    subclasses): its ``grads`` fit only an optimiser state made from it.

    Args:
        fun: the function; its first argument (by position) is differentiated.
        has_aux: ``fun`` returns ``(value, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        with_values: also return the forward values at the tags, from the same pass.
        stats: ``True`` or statistic names (``"norm"``): reduce each tag's gradient
            inside the traced function, as ``jaxtrace.stats.value_and_grad`` does,
            keeping each tag's loop axes (one value per layer of a ``lax.scan`` over
            layers, per step of a recurrent cell); values too, with ``with_values``.
        tag_modules: tag the first argument's modules while ``fun`` runs: ``True``
            (every module) or a ``where=`` of ``jaxtrace.tag_modules`` (a path, a
            list of paths, a class, a predicate). ``fun`` gets the tagged model;
            ``grads`` keeps the structure of the model passed.
        module_inputs: with ``tag_modules``, also tag the selected modules'
            positional inputs as ``"<path>:in"`` (``inputs=`` of ``jaxtrace.tag_modules``).

    Returns:
        A function that returns ``(value, (grads, tag_grads))``, or with
        ``has_aux`` ``((value, aux), (grads, tag_grads))``; ``with_values=True``
        appends ``tag_values``. With ``stats=``, ``tag_grads`` is
        ``{name: {stat: array}}``.

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` or ``tag_modules`` is of
            the wrong kind; when called, if the first argument is passed by keyword.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(2, 1, 4, 2, key=jax.random.key(0))  # untagged, as the loop holds it
        >>> def loss(model, x):
        ...     return jnp.sum(model(x) ** 2)
        >>> value, (grads, tag_grads) = jt.filter_value_and_grad(loss, tag_modules=True)(model, jnp.ones(2))
        >>> sorted(tag_grads), tag_grads["layers.0"].shape
        (['', 'layers.0', 'layers.1', 'layers.2'], (4,))
        >>> type(grads) is type(model)  # eqx.apply_updates(model, ...) and optax states fit it
        True
    """
    check_callable(fun, "jaxtrace.filter_value_and_grad")
    return _wrap(fun, "value_and_grad", has_aux, tags, with_values, stats, tag_modules, module_inputs)


def filter_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    with_values: bool = False,
    stats: Any = None,
    tag_modules: bool | Where = False,
    module_inputs: bool = False,
) -> Callable:
    """Like ``eqx.filter_grad``, and also the gradients at the tags in ``fun``.

    Args:
        fun: the function; its first argument (by position) is differentiated.
        has_aux: ``fun`` returns ``(value, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        with_values: also return the forward values at the tags.
        stats: summarise per tag, as in ``filter_value_and_grad``.
        tag_modules: tag the first argument's modules inside the transform, keeping
            ``grads`` in the structure of the model passed; see ``filter_value_and_grad``.
        module_inputs: with ``tag_modules``, also tag the modules' inputs (``"<path>:in"``).

    Returns:
        A function that returns ``(grads, tag_grads)``, or with ``has_aux``
        ``((grads, tag_grads), aux)``; ``with_values=True`` appends
        ``tag_values``; see ``filter_value_and_grad``.

    Raises:
        TypeError: as ``filter_value_and_grad``.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
        >>> def loss(model, x):
        ...     return jnp.sum(model(x))
        >>> grads, tag_grads = jt.filter_grad(loss, tag_modules=True)(model, jnp.ones(3))
        >>> tag_grads[""].tolist()
        [1.0, 1.0]
    """
    check_callable(fun, "jaxtrace.filter_grad")
    return _wrap(fun, "grad", has_aux, tags, with_values, stats, tag_modules, module_inputs)


def filter_jacrev(
    fun: Callable,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    stats: Any = None,
    tag_modules: bool | Where = False,
    module_inputs: bool = False,
    param_stats: bool = False,
) -> Callable:
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
        tag_modules: tag the first argument's modules inside the transform, keeping
            ``jac`` in the structure of the model passed; see ``filter_value_and_grad``.
        module_inputs: with ``tag_modules``, also tag the modules' inputs (``"<path>:in"``).
        param_stats: with ``stats=``, reduce ``jac`` too: the table
            ``{parameter: {term: {stat: array}}}`` in its place, parameters
            named by dotted paths (``"layers.0.weight"``): which loss term
            reaches which parameter.

    Returns:
        A function that returns ``(jac, tag_jacs)``, or with ``has_aux``
        ``((jac, tag_jacs), aux)``: ``jac`` is what ``eqx.filter_jacrev``
        returns (the output's structure, each leaf the model with ``None`` at
        non-differentiated leaves) and ``tag_jacs`` what ``jaxtrace.jacrev``
        returns. With ``stats=``, ``tag_jacs`` is the table
        ``{tag: {term: {stat: array}}}`` that ``jaxtrace.stats.format_paths``
        prints, and with ``param_stats=True`` so is ``jac`` (one row per parameter).

    Raises:
        TypeError: if ``fun`` is not callable, ``tags`` or ``tag_modules`` is of the
            wrong kind, or ``param_stats`` comes without ``stats``; when called, if
            the first argument is passed by keyword.
        ValueError: if a name in ``stats`` is not in ``jaxtrace.stats.STATS``.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(2, 1, 4, 2, key=jax.random.key(0))
        >>> def losses(model, x):
        ...     out, acts = jt.capture(model)(x)
        ...     return {"main": jnp.sum(out ** 2), "aux": jnp.sum(acts["layers.1"] ** 2)}
        >>> params, layers = jt.filter_jacrev(losses, stats="norm", param_stats=True, tag_modules=True)(model, jnp.ones(2))
        >>> [name for name in layers if float(layers[name]["aux"]["norm"]) > 0]  # aux reaches layers 0 and 1 only
        ['layers.0', 'layers.1']
        >>> [name for name in params if float(params[name]["aux"]["norm"]) > 0]  # ... and their parameters
        ['layers.0.weight', 'layers.0.bias', 'layers.1.weight', 'layers.1.bias']
    """
    check_callable(fun, "jaxtrace.filter_jacrev")
    return _wrap(fun, "jacrev", has_aux, tags, False, stats, tag_modules, module_inputs, param_stats)
