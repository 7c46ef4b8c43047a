"""Equinox models: ``filter_grad`` / ``filter_value_and_grad`` and ``tag_modules``.

``filter_value_and_grad`` is ``jaxtrace.value_and_grad`` with equinox's
convention for what is differentiated: the inexact arrays of the first
argument, ``None`` everywhere else, exactly as ``eqx.filter_value_and_grad``.

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
import functools
import sys
from typing import Any, Callable, cast

import equinox as eqx
import jax
import jax.tree_util as jtu

from . import stats as jt_stats
from ._ad import value_and_grad
from ._sites import TagSelection, check_callable, check_tags
from ._tag import tag
from ._module_calls import tag_inputs
from ._stats_option import stat_names
from ._where import Where, choose


INPUT_SUFFIX = ":in"


# --- filter_grad / filter_value_and_grad --------------------------------------


def _hashable_tags(tags: TagSelection) -> TagSelection:
    check_tags(tags)
    if tags is None or isinstance(tags, str) or callable(tags):
        return tags
    return tuple(tags)


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
        if not args:
            raise TypeError(
                "Functions wrapped with jaxtrace.filter_grad or jaxtrace.filter_value_and_grad must get "
                "their first argument (the one that is differentiated) by position, not by keyword"
                + (f"; got only keyword arguments {sorted(kwargs)}." if kwargs else "; got no arguments.")
            )
        x, *rest = args
        diff_x, nondiff_x = eqx.partition(x, eqx.is_inexact_array)
        fun = self._fun

        def split_fun(diff_x, nondiff_x, *args, **kwargs):
            return fun(eqx.combine(diff_x, nondiff_x), *args, **kwargs)

        if self._stats is not None:
            transform = jt_stats.value_and_grad(
                split_fun, 0, has_aux=self._has_aux, tags=self._tags, stats=self._stats, with_values=self._with_values
            )
        else:
            transform = value_and_grad(split_fun, 0, has_aux=self._has_aux, tags=self._tags, with_values=self._with_values)
        return transform(diff_x, nondiff_x, *rest, **kwargs)

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
    (``eqx.nn.Lambda``), strings and other non-arrays. Returns
    ``(value, (grads, tag_grads))``, or with ``has_aux``
    ``((value, aux), (grads, tag_grads))``. ``tags`` selects tags as in
    ``jaxtrace.value_and_grad``; ``with_values=True`` appends the forward
    values at the tags, ``(value, (grads, tag_grads), tag_values)``, as there.

    ``stats=True`` (or statistic names, ``stats="norm"``) reduces each tag's
    gradient inside the traced function, as ``jaxtrace.stats.value_and_grad``
    does: ``tag_grads`` becomes ``{name: {stat: array}}`` with each tag's loop
    axes kept, one value per layer of a ``lax.scan`` over layers and per step
    of a recurrent cell, with no ``loop_axes`` to pass. With ``with_values``
    the values are summarised the same way.

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

    Returns ``(grads, tag_grads)``, or with ``has_aux`` ``((grads, tag_grads), aux)``;
    ``with_values=True`` appends the values at the tags, ``(grads, tag_grads,
    tag_values)``; ``stats=`` summarises per tag. See ``filter_value_and_grad``.

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


# --- HookPoint --------------------------------------------------------------


class HookPoint(eqx.Module):
    """An identity module: a named point for ``tag_modules``, as TransformerLens's ``HookPoint``.

    ``HookPoint()(x)`` returns ``x``. Put one in a model as a field
    (``self.hook_z = jt.HookPoint()``) and call it on a value
    (``z = self.hook_z(z)``); ``jt.tag_modules(model, jt.HookPoint)`` then
    tags each hook point by its path, so a port of a TransformerLens model
    keeps its hook names (``"blocks.0.attn.hook_z"``) in ``tag_grads`` and in
    ``jt.capture``. Untagged, it costs nothing.

    A hook point that fires several times in one call (TransformerLens's
    ``ln1`` runs once each for the query, key and value inputs) gives its calls
    stacked on a leading axis in call order; TransformerLens's
    ``run_with_cache`` keeps only the last call, which is ``[-1]`` of the
    stacked activations (its ``"_grad"`` entries keep the last to fire in the
    backward pass, which is the first call, ``[0]``).

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


# --- tag_modules ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ModuleTag:
    """What a tagged module tags: its output as ``path``, its inputs as ``path + ':in'``."""

    path: str
    inputs: bool


def _taggable(x) -> bool:
    # jax.dtypes.issubdtype is public; JAX re-exports it without `as`, which the checker reads as private.
    return eqx.is_array(x) and not jax.dtypes.issubdtype(  # pyright: ignore[reportPrivateImportUsage]
        x.dtype, jax.dtypes.prng_key
    )


def _is_state(x) -> bool:
    return isinstance(x, eqx.nn.State)


def _tag_arrays(value, name: str):
    """Tags the (non-key) array leaves of ``value``; other leaves and ``State``s pass through."""
    dynamic, static = eqx.partition(value, _taggable, is_leaf=_is_state)
    if not jtu.tree_leaves(dynamic):
        return value
    return eqx.combine(tag(dynamic, name, repeated=True), static)


def _tag_output(out, name: str):
    if isinstance(out, tuple) and len(out) == 2 and _is_state(out[1]):  # equinox's (output, state)
        return (_tag_arrays(out[0], name), out[1])
    return _tag_arrays(out, name)


def _tag_inputs(args: tuple, name: str) -> tuple:
    return tag_inputs(args, name, skip=_is_state, tag_arrays=_tag_arrays)


_TAG_FIELD = "_jaxtrace_tag"
_SUBCLASSES: dict = {}  # base class -> its tagged subclass (classes live for the session anyway)


def _base_class(cls: type) -> type:
    return cls.__dict__.get("_jaxtrace_base", cls)


def _restore(base: type, fields: dict):
    module = object.__new__(_tagged_class(base))
    module.__dict__.update(fields)
    return module


def _tagged_class(base: type) -> type:
    """The subclass of ``base`` whose ``__call__`` tags; one per class."""
    base = _base_class(base)
    cls = _SUBCLASSES.get(base)
    if cls is not None:
        return cls

    def __call__(self, *args, **kwargs):
        spec = self.__dict__.get(_TAG_FIELD)
        if spec is None:
            return base.__call__(self, *args, **kwargs)
        if spec.inputs:
            args = _tag_inputs(args, spec.path + INPUT_SUFFIX)
        return _tag_output(base.__call__(self, *args, **kwargs), spec.path)

    def __reduce__(self):  # pickle and copy: rebuild the subclass from its base
        return _restore, (base, dict(self.__dict__))

    namespace = {
        # Printed models look as before (equinox prints ``__name__``); the class
        # itself says where it comes from: <class 'jaxtrace._equinox.Linear'>.
        "__module__": __name__,
        "__qualname__": base.__qualname__,
        "__doc__": f"{base.__qualname__} whose calls are tagged by jaxtrace.tag_modules.\n\n{base.__doc__ or ''}",
        "__annotations__": {_TAG_FIELD: _ModuleTag},
        _TAG_FIELD: eqx.field(static=True, repr=False, default=None),
        "_jaxtrace_base": base,
        "__call__": functools.wraps(base.__call__)(__call__),
        "__reduce__": __reduce__,
    }
    cls = _SUBCLASSES[base] = type(base)(base.__name__, (base,), namespace)
    return cls


def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)  # pragma: no cover - every jax key type has one of the above


def _join(prefix: str, *names: str) -> str:
    return ".".join(n for n in (prefix, *names) if n != "")


def _children(module: eqx.Module, path: str):
    """``(field name, value, path of a submodule inside it)`` for the dynamic fields."""
    for f in dataclasses.fields(module):
        if f.metadata.get("static", False) or f.name not in module.__dict__:
            continue
        # eqx.nn.Sequential's layers are named "0", "1", ... like torch.nn.Sequential's.
        prefix = path if isinstance(module, eqx.nn.Sequential) and f.name == "layers" else _join(path, f.name)
        yield f.name, module.__dict__[f.name], prefix


def _is_module(x) -> bool:
    return isinstance(x, eqx.Module)


def _submodules(value, prefix: str):
    """``(path, module)`` for the modules directly inside the pytree ``value`` (not their children)."""
    found = jtu.tree_flatten_with_path(value, is_leaf=_is_module)[0]
    return [(_join(prefix, *map(_key_name, p)), x) for p, x in found if _is_module(x)]


def _named_modules(module: eqx.Module, path: str = ""):
    """Every module in ``module`` with its dotted path, parents first (as ``named_modules()``)."""
    yield path, module
    for _, value, prefix in _children(module, path):
        for sub_path, sub in _submodules(value, prefix):
            yield from _named_modules(sub, sub_path)


def _callable(module) -> bool:
    # Not ``callable(type(module).__call__)``: that finds the metaclass's ``__call__``.
    return any("__call__" in vars(k) for k in type(module).__mro__[:-1])


def _rebuild(module: eqx.Module, path: str, specs: dict) -> eqx.Module:
    replaced = {}
    for name, value, prefix in _children(module, path):
        subs = dict(_submodules(value, prefix))
        if not subs:
            continue
        paths = iter(subs)
        new = jtu.tree_map(lambda x: _rebuild(x, next(paths), specs) if _is_module(x) else x, value, is_leaf=_is_module)
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


def tag_modules(model: eqx.Module, where: Where = None, *, inputs: bool = False) -> eqx.Module:
    """A copy of ``model`` whose submodules tag their outputs, named as in PyTorch.

    Each selected module's ``__call__`` output is tagged (``jaxtrace.tag``)
    under its dotted path in the style of ``torch.nn.Module.named_modules()``:
    attribute names joined by dots, list and tuple entries by their index, dict
    entries by their key (``"layers.0"``, ``"blocks.1.attn"``), the children of
    an ``eqx.nn.Sequential`` by their index alone (``"0"``, ``"1"``, as in
    ``torch.nn.Sequential``), and the root module ``""``. With ``inputs=True``
    the positional array arguments are tagged too, as ``"<path>:in"``
    (``"layers.0:in"``; the root's is ``":in"``): one argument is tagged as it
    is, several as a tuple. A ``(output, state)`` return with an
    ``eqx.nn.State`` (``BatchNorm``, stateful ``Sequential``s) tags ``output``;
    ``State`` arguments and keyword arguments (PRNG keys) are never tagged.
    Other outputs are tagged whole, as pytrees of their array leaves.

    A module called several times (weight sharing, a cell in a Python loop)
    gives its calls stacked on a leading axis in call order, as PyTorch hooks
    fire once per call; calls inside ``lax.scan`` are stacked per iteration.

    ``where`` selects modules: ``None`` (every module with a ``__call__``,
    root included), a list of paths, a class or tuple of classes (the modules
    that are instances: ``jt.tag_modules(model, jt.HookPoint)`` tags the hook
    points only), or a predicate ``(path, module) -> bool``.
    ``model`` itself is not changed; the new model has the same parameters in
    the same order (so gradients, optimiser states, ``eqx.filter_jit`` and
    ``eqx.tree_serialise_leaves`` files are interchangeable with the
    original's), and its modules are instances of subclasses of the original
    classes, so attribute access and ``isinstance`` work as before. Only
    ``__call__`` is tagged, not other methods.

    A Flax NNX model (an ``nnx.Module``) is handled the same way: names are
    attribute paths joined by dots, ``nnx.List`` and list entries by index, an
    ``nnx.Sequential``'s children by index alone (``"0"``, ``"2"``); calls
    inside ``nnx.scan`` are stacked per step. The result is a clone (new
    ``Variable`` objects holding the same arrays; changing one model does not
    change the other) whose selected modules are instances of subclasses of
    their classes, so ``nnx.state`` of both are equal trees, and states,
    optimizer states and checkpoints are interchangeable; it works inside
    ``nnx.jit``, ``nnx.grad``, ``nnx.scan``, ``nnx.vmap``, and with
    ``jaxtrace.grad`` on the module itself or on ``nnx.split`` state. Flax is
    never imported by jaxtrace for this: a Flax model means Flax is loaded.
    For Linen see ``jaxtrace.flax.tag_modules``; an example for each is in
    ``jaxtrace.flax``.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> mlp = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> model = jt.tag_modules(mlp, ["layers.0", "layers.1"], inputs=True)
        >>> grads, tag_grads = jt.filter_grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones(3))
        >>> {name: g.shape for name, g in tag_grads.items()}
        {'layers.0:in': (3,), 'layers.0': (8,), 'layers.1:in': (8,), 'layers.1': (8,)}
    """
    nnx = sys.modules.get("flax.nnx")  # never imported here: a Flax model means Flax is loaded
    if nnx is not None and isinstance(model, nnx.Module):
        from .flax._nnx import tag_modules as nnx_tag_modules

        # an nnx.Module: the annotations here name equinox's types, the nnx ones are in _nnx
        return cast(Any, nnx_tag_modules(cast(Any, model), cast(Any, where), inputs=inputs))
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(model, linen.Module):
        raise TypeError(
            "jaxtrace.tag_modules got a Flax Linen module. Linen modules hold no parameters to copy, so "
            "they are tagged while they run: `with jaxtrace.flax.tag_modules(): "
            "jt.grad(lambda p, x: loss(model.apply(p, x)))(params, x)`."
        )
    if not isinstance(model, eqx.Module):
        raise TypeError(
            f"jaxtrace.tag_modules needs an equinox.Module or a Flax nnx.Module, but got {type(model).__name__}. "
            "Pass the model itself (e.g. an eqx.nn.MLP, an nnx.Linear or your own module subclass)."
        )
    chosen = choose([(p, m) for p, m in _named_modules(model) if _callable(m)], where)
    specs = {p: _ModuleTag(p, bool(inputs)) for p in chosen}
    return _rebuild(model, "", specs)
