"""Equinox models: ``filter_grad`` / ``filter_value_and_grad`` / ``filter_jacrev`` and ``tag_modules``.

``filter_value_and_grad`` is ``jaxtrace.value_and_grad`` (``filter_jacrev``
``jaxtrace.jacrev``) with equinox's convention for what is differentiated: the
inexact arrays of the first argument, ``None`` everywhere else, exactly as
``eqx.filter_value_and_grad`` (``eqx.filter_jacrev``).

``tag_modules`` tags the outputs (and optionally inputs) of the submodules of
a model nobody edited, named like PyTorch's ``named_modules()``. A selected
submodule is re-created as an instance of a subclass of its own class (cached
per class) whose ``__call__`` tags what the original ``__call__`` returns.
The subclass adds a single static field holding the tag name, so the model's
leaves (its parameters), their order, attribute access, ``isinstance`` checks
(e.g. ``eqx.nn.Sequential`` asking ``isinstance(layer, StatefulLayer)``) and
serialisation are those of the original model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, cast

import equinox as eqx
import jax.tree_util as jtu

from . import stats as jt_stats
from ._ad import jacrev, value_and_grad
from ._module_tags import (
    ModuleTag,
    Where,
    base_class,
    choose,
    is_callable_module,
    is_key,
    join,
    key_name,
    tag_inputs,
    tag_leaves,
    tagged_subclass,
)
from ._checks import check_callable
from ._selection import TagSelection, check_tags
from ._stats_option import stat_names


# --- filter_grad / filter_value_and_grad --------------------------------------


def _hashable_tags(tags: TagSelection) -> TagSelection:
    check_tags(tags)
    if tags is None or isinstance(tags, str) or callable(tags):
        return tags
    return tuple(tags)


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


class _FilterValueAndGrad(eqx.Module):
    _fun: Callable
    _has_aux: bool = eqx.field(static=True)
    _tags: Any = eqx.field(static=True)
    _with_values: bool = eqx.field(static=True, default=False)
    _stats: Any = eqx.field(static=True, default=None)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, *args, **kwargs):
        split_fun, split_args = _partitioned(self._fun, args, kwargs)
        if self._stats is not None:
            transform = jt_stats.value_and_grad(
                split_fun, 0, has_aux=self._has_aux, tags=self._tags, stats=self._stats, with_values=self._with_values
            )
        else:
            transform = value_and_grad(split_fun, 0, has_aux=self._has_aux, tags=self._tags, with_values=self._with_values)
        return transform(*split_args, **kwargs)

    def __get__(self, instance, owner):
        return self if instance is None else jtu.Partial(self, instance)


class _FilterGrad(eqx.Module):
    _value_and_grad: _FilterValueAndGrad
    _has_aux: bool = eqx.field(static=True)

    @property
    def __wrapped__(self):
        # An eqx field is an instance attribute: _FilterValueAndGrad.__get__ (a bound method's
        # Partial) never applies to it, though the checker assumes it does.
        return self._value_and_grad.__wrapped__  # pyright: ignore[reportAttributeAccessIssue]

    def __call__(self, *args, **kwargs):
        value, grads, *values = self._value_and_grad(*args, **kwargs)
        result = (grads, value[1]) if self._has_aux else grads
        return (*result, *values)  # with_values: the values (or their statistics) last, as jt.grad

    def __get__(self, instance, owner):
        return self if instance is None else jtu.Partial(self, instance)


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
    wrapper = _FilterValueAndGrad(fun, bool(has_aux), _hashable_tags(tags), bool(with_values), stat_names(stats))
    return eqx.module_update_wrapper(wrapper, fun)


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
    # filter_value_and_grad returns its _FilterValueAndGrad (module_update_wrapper keeps the type).
    value_and_grad_fun = cast(
        _FilterValueAndGrad,
        filter_value_and_grad(fun, has_aux=has_aux, tags=tags, with_values=with_values, stats=stats),
    )
    wrapper = _FilterGrad(value_and_grad_fun, bool(has_aux))
    return eqx.module_update_wrapper(wrapper, fun)


class _FilterJacrev(eqx.Module):
    _fun: Callable
    _has_aux: bool = eqx.field(static=True)
    _tags: Any = eqx.field(static=True)
    _stats: Any = eqx.field(static=True, default=None)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, *args, **kwargs):
        split_fun, split_args = _partitioned(self._fun, args, kwargs)
        if self._stats is not None:
            transform = jt_stats.jacrev(split_fun, 0, has_aux=self._has_aux, tags=self._tags, stats=self._stats)
        else:
            transform = jacrev(split_fun, 0, has_aux=self._has_aux, tags=self._tags)
        return transform(*split_args, **kwargs)

    def __get__(self, instance, owner):
        return self if instance is None else jtu.Partial(self, instance)


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
    wrapper = _FilterJacrev(fun, bool(has_aux), _hashable_tags(tags), stat_names(stats))
    return eqx.module_update_wrapper(wrapper, fun)


# --- HookPoint --------------------------------------------------------------


class HookPoint(eqx.Module):
    """An identity module: a named point for ``tag_modules``, as TransformerLens's ``HookPoint``.

    ``HookPoint()(x)`` returns ``x``. Put one in a model as a field
    (``self.hook_z = jt.HookPoint()``) and call it on a value
    (``z = self.hook_z(z)``); ``jt.tag_modules(model, jt.HookPoint)`` then
    tags each hook point by its path, so a port of a TransformerLens model
    keeps its hook names (``"blocks.0.attn.hook_z"``) in ``tag_grads`` and in
    ``jt.capture``. Untagged, it costs nothing.

    A hook point that fires several times in one call gives its calls stacked
    on a leading axis in call order (the guide *Coming from TransformerLens*
    says which entry ``run_with_cache`` keeps).

    Takes no arguments; its call returns its argument.

    Example:
        >>> import equinox as eqx, jax.numpy as jnp, jaxtrace as jt
        >>> class Block(eqx.Module):
        ...     hook_pre: jt.HookPoint = jt.HookPoint()
        ...     hook_post: jt.HookPoint = jt.HookPoint()
        ...     def __call__(self, x):
        ...         return self.hook_post(jnp.tanh(self.hook_pre(2.0 * x)))
        >>> model = jt.tag_modules(Block(), jt.HookPoint)
        >>> grads, tag_grads = jt.filter_grad(lambda m, x: jnp.sum(m(x)))(model, jnp.zeros(2))
        >>> {name: g.tolist() for name, g in tag_grads.items()}
        {'hook_pre': [1.0, 1.0], 'hook_post': [1.0, 1.0]}
    """

    def __call__(self, x):
        return x


# --- tag_modules (the equinox case; jaxtrace.tag_modules in _module_tags dispatches here) ---------


_ModuleTag = ModuleTag  # the spec's old name: pickles of tagged models made before it moved name it


def _taggable(x) -> bool:
    return eqx.is_array(x) and not is_key(x)


def _is_state(x) -> bool:
    return isinstance(x, eqx.nn.State)


def _tag_arrays(value, name: str):
    """Tags the (non-key) array leaves of ``value``; other leaves and ``State``s pass through."""
    return tag_leaves(value, name, taggable=_taggable, is_leaf=_is_state)


def _tag_output(out, name: str):
    if isinstance(out, tuple) and len(out) == 2 and _is_state(out[1]):  # equinox's (output, state)
        return (_tag_arrays(out[0], name), out[1])
    return _tag_arrays(out, name)


def _tag_inputs(args: tuple, name: str) -> tuple:
    return tag_inputs(args, name, skip=_is_state, tag_arrays=_tag_arrays)


_TAG_FIELD = "_jaxtrace_tag"
_SUBCLASSES: dict = {}  # base class -> its tagged subclass (classes live for the session anyway)


def _restore(base: type, fields: dict):
    module = object.__new__(_tagged_class(base))
    module.__dict__.update(fields)
    return module


def _tagged_class(base: type) -> type:
    """The subclass of ``base`` whose ``__call__`` tags; one per class, the spec in a static field."""
    base = base_class(base)
    cls = _SUBCLASSES.get(base)
    if cls is None:
        cls = _SUBCLASSES[base] = tagged_subclass(
            base,
            spec_of=lambda module: module.__dict__.get(_TAG_FIELD),
            tag_inputs=_tag_inputs,
            tag_output=_tag_output,
            reduce=lambda module: (_restore, (base, dict(module.__dict__))),
            namespace={
                # The class says where it comes from: <class 'jaxtrace._equinox.Linear'> (equinox prints __name__).
                "__module__": __name__,
                "__doc__": f"{base.__qualname__} whose calls are tagged by jaxtrace.tag_modules.\n\n{base.__doc__ or ''}",
                "__annotations__": {_TAG_FIELD: ModuleTag},
                _TAG_FIELD: eqx.field(static=True, repr=False, default=None),
            },
        )
    return cls


def _children(module: eqx.Module, path: str):
    """``(field name, value, path of a submodule inside it)`` for the dynamic fields."""
    for f in dataclasses.fields(module):
        if f.metadata.get("static", False) or f.name not in module.__dict__:
            continue
        # eqx.nn.Sequential's layers are named "0", "1", ... like torch.nn.Sequential's.
        prefix = path if isinstance(module, eqx.nn.Sequential) and f.name == "layers" else join(path, f.name)
        yield f.name, module.__dict__[f.name], prefix


def is_module(x) -> bool:
    """Whether ``x`` is an equinox module."""
    return isinstance(x, eqx.Module)


def _submodules(value, prefix: str):
    """``(path, module)`` for the modules directly inside the pytree ``value`` (not their children)."""
    found = jtu.tree_flatten_with_path(value, is_leaf=is_module)[0]
    return [(join(prefix, *map(key_name, p)), x) for p, x in found if is_module(x)]


def _named_modules(module: eqx.Module, path: str = ""):
    """Every module in ``module`` with its dotted path, parents first (as ``named_modules()``)."""
    yield path, module
    for _, value, prefix in _children(module, path):
        for sub_path, sub in _submodules(value, prefix):
            yield from _named_modules(sub, sub_path)


def _rebuild(module: eqx.Module, path: str, specs: dict) -> eqx.Module:
    replaced = {}
    for name, value, prefix in _children(module, path):
        subs = dict(_submodules(value, prefix))
        if not subs:
            continue
        paths = iter(subs)
        new = jtu.tree_map(lambda x: _rebuild(x, next(paths), specs) if is_module(x) else x, value, is_leaf=is_module)
        replaced[name] = new
    spec = specs.get(path)
    if spec is None and not replaced:
        return module
    cls = type(module) if spec is None else _tagged_class(type(module))
    out: Any = object.__new__(cls)  # an instance of cls (the checker types its __dict__ as a class's)
    out.__dict__.update(module.__dict__)
    out.__dict__.update(replaced)
    if spec is not None:
        out.__dict__[_TAG_FIELD] = spec
    return out


def tag_equinox(model: eqx.Module, where: Where = None, *, inputs: bool = False, params_of=None) -> eqx.Module:
    """The equinox case of ``jaxtrace.tag_modules``: a copy whose selected modules are tagged subclasses
    (``params_of``: see ``_tag_modules.tag_module_calls``)."""
    candidates = [(p, m) for p, m in _named_modules(model) if is_callable_module(m)]
    chosen = choose(candidates, where, "jaxtrace.tag_modules")
    modules = dict(candidates)
    specs = {p: ModuleTag(p, bool(inputs), tuple(params_of(modules[p])) if params_of else ()) for p in chosen}
    return _rebuild(model, "", specs)
