"""Equinox models: ``tag_modules``'s equinox case and ``HookPoint``.

``tag_modules`` tags the outputs (and optionally inputs) of the submodules of
a model nobody edited, named like PyTorch's ``named_modules()``. A selected
submodule is re-created as an instance of a subclass of its own class (cached
per class) whose ``__call__`` tags what the original ``__call__`` returns.
The subclass adds a single static field holding the tag name, so the model's
leaves (its parameters), their order, attribute access, ``isinstance`` checks
(e.g. ``eqx.nn.Sequential`` asking ``isinstance(layer, StatefulLayer)``) and
serialisation are those of the original model. (The filter transforms are in
``_equinox_grad``.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._arrays import is_array, is_key
from ._frameworks import is_equinox_module
from ._module_tags import (
    ModuleTag,
    Where,
    base_class,
    choose,
    is_callable_module,
    tag_inputs,
    tag_leaves,
    tagged_subclass,
)
from ._paths import join, key_name

__all__ = ["HookPoint", "tag_equinox"]


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


# --- tag_modules (the equinox case; jaxtrace.tag_modules in _tag_modules dispatches here) ---------


_ModuleTag = ModuleTag  # the spec's old name: pickles of tagged models made before it moved name it


def _taggable(x) -> bool:
    return is_array(x) and not is_key(x)


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


def _submodules(value, prefix: str):
    """``(path, module)`` for the modules directly inside the pytree ``value`` (not their children)."""
    found = jtu.tree_flatten_with_path(value, is_leaf=is_equinox_module)[0]
    return [(join(prefix, *map(key_name, p)), x) for p, x in found if is_equinox_module(x)]


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
        new = jtu.tree_map(lambda x: _rebuild(x, next(paths), specs) if is_equinox_module(x) else x, value, is_leaf=is_equinox_module)
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


def tag_equinox(
    model: eqx.Module, where: Where = None, *, inputs: bool = False, params_of=None, scope=None, api: str = "jaxtrace.tag_modules"
) -> eqx.Module:
    """The equinox case of ``jaxtrace.tag_modules``: a copy whose selected modules are tagged subclasses
    (``params_of``, ``api``: see ``_tag_modules.tag_module_calls``)."""
    candidates = [(p, m) for p, m in _named_modules(model) if is_callable_module(m)]
    chosen = choose(candidates, where, api)
    modules = dict(candidates)
    specs = {p: ModuleTag(p, bool(inputs), tuple(params_of(modules[p])) if params_of else (), scope) for p in chosen}
    return _rebuild(model, "", specs)
