"""Flax NNX models: ``jaxtrace.tag_modules`` for an ``nnx.Module``.

Reached through ``jaxtrace.tag_modules`` (which dispatches here when it gets an
``nnx.Module``), so the contract is the equinox one: each selected submodule's
``__call__`` output is tagged under its dotted attribute path.

How: the model is cloned (``nnx.clone``: new ``Variable`` objects holding the
same arrays), and each selected module of the clone gets, as its class, a
subclass of its own class whose ``__call__`` tags. The subclass is made once per
(class, path, inputs) and carries the tag name as a class attribute, so the
modules' attributes, their ``nnx.state`` and the state's order are exactly the
original's; only the classes recorded in the ``GraphDef`` differ. That is why
``nnx.merge(tagged_graphdef, state_of_the_untagged_model)`` works, why
``nnx.jit``/``nnx.scan``/``nnx.vmap`` (which split and merge the graph) keep
the tags, and why optimizer states and checkpoints are interchangeable.
"""

from __future__ import annotations

import jax
from flax import nnx
from flax.nnx import graph as _graph

from .._arrays import is_key
from .._module_tags import (
    ModuleTag,
    Where,
    base_class,
    choose,
    is_callable_module,
    tag_inputs,
    tag_leaves,
    tagged_subclass,
)


def _is_graph_node(x) -> bool:
    # Variables, Modules, Rngs, nnx.List/Dict: state, not values to tag.
    return isinstance(x, nnx.Variable) or _graph.is_graph_node(x)


def _taggable(x) -> bool:
    return isinstance(x, jax.Array) and not is_key(x)


def tag_arrays(value, name: str):
    """Tags the (non-key) array leaves of ``value``; graph nodes and other leaves pass through."""
    return tag_leaves(value, name, taggable=_taggable, is_leaf=_is_graph_node)


def tag_call_inputs(args: tuple, name: str) -> tuple:
    """``args`` with the positional arguments that are not graph nodes tagged as ``name``."""
    return tag_inputs(args, name, skip=_is_graph_node, tag_arrays=tag_arrays)


__all__ = ["tag_modules", "named_modules", "restore", "tag_arrays", "tag_call_inputs"]

_TAG_ATTR = "_jaxtrace_tag"
_SUBCLASSES: dict = {}  # (base class, ModuleTag) -> its tagged subclass


def restore(base: type, spec: ModuleTag, fields: dict):
    """A tagged module rebuilt from its base class, spec and attributes (what a pickle holds)."""
    module = object.__new__(_tagged_class(base, spec))
    module.__dict__.update(fields)
    return module


def _tagged_class(base: type, spec: ModuleTag) -> type:
    """The subclass of ``base`` whose ``__call__`` tags as ``spec`` says; one per (class, spec)."""
    base = base_class(base)
    cls = _SUBCLASSES.get((base, spec))
    if cls is None:
        cls = _SUBCLASSES[(base, spec)] = tagged_subclass(
            base,
            spec_of=lambda module: spec,
            tag_inputs=tag_call_inputs,
            tag_output=tag_arrays,
            reduce=lambda module: (restore, (base, spec, dict(module.__dict__))),
            namespace={
                # Printed models (nnx.display, repr) look as before; the class says where it comes from.
                "__module__": __name__,
                "__doc__": f"{base.__qualname__} whose calls are tagged as {spec.path!r} by jaxtrace.tag_modules.\n\n"
                f"{base.__doc__ or ''}",
                _TAG_ATTR: spec,
            },
        )
    return cls


def _sort_key(path: tuple) -> tuple:
    # Parents before their children, list entries in index order (2 before 10).
    return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in path)


def named_modules(model: nnx.Module) -> list:
    """``(name, graph path, module)`` of every module in ``model``, parents first.

    Names are PyTorch's ``named_modules()`` names: attribute names and list
    indices joined by dots, an ``nnx.Sequential``'s children by index alone.
    """
    nodes = dict(nnx.iter_graph(model))
    out = []
    for path in sorted(nodes, key=_sort_key):
        module = nodes[path]
        if not isinstance(module, nnx.Module):
            continue
        parts = [
            str(k)
            for i, k in enumerate(path)
            if not (k == "layers" and isinstance(nodes.get(path[:i]), nnx.Sequential))
        ]
        out.append((".".join(parts), path, module))
    return out


def tag_modules(
    model: nnx.Module, where: Where = None, *, inputs: bool = False, params_of=None, scope=None, api: str = "jaxtrace.tag_modules"
) -> nnx.Module:
    """The Flax NNX case of ``jaxtrace.tag_modules``; see its docstring (``params_of``: see
    ``jaxtrace._tag_modules.tag_module_calls``)."""
    named = [(name, path, m) for name, path, m in named_modules(model) if is_callable_module(m)]
    chosen = choose([(name, m) for name, _, m in named], where, api)
    paths = {name: path for name, path, _ in named}
    tagged = nnx.clone(model)
    nodes = dict(nnx.iter_graph(tagged))
    for name in chosen:
        module = nodes[paths[name]]
        params = tuple(params_of(module)) if params_of else ()
        module.__class__ = _tagged_class(type(module), ModuleTag(name, bool(inputs), params, scope))
    return tagged
