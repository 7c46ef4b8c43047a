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

import dataclasses
import functools

import jax
from flax import nnx
from flax.nnx import graph as _graph

from .._tag import tag
from .._module_calls import tag_inputs
from .._where import Where, choose


INPUT_SUFFIX = ":in"


@dataclasses.dataclass(frozen=True)
class ModuleTag:
    path: str
    inputs: bool


def _is_graph_node(x) -> bool:
    # Variables, Modules, Rngs, nnx.List/Dict: state, not values to tag.
    return isinstance(x, nnx.Variable) or _graph.is_graph_node(x)


def _taggable(x) -> bool:
    # jax.dtypes.issubdtype is public; JAX re-exports it without `as`, which the checker reads as private.
    return isinstance(x, jax.Array) and not jax.dtypes.issubdtype(  # pyright: ignore[reportPrivateImportUsage]
        x.dtype, jax.dtypes.prng_key
    )


def _tag_arrays(value, name: str):
    """Tags the (non-key) array leaves of ``value``; graph nodes and other leaves pass through."""
    leaves, tree = jax.tree_util.tree_flatten(value, is_leaf=_is_graph_node)
    chosen = [i for i, x in enumerate(leaves) if _taggable(x)]
    if not chosen:
        return value
    if len(chosen) == len(leaves):
        return tag(value, name, repeated=True)
    # The tagged value keeps the output's structure, with None where a leaf is not taggable
    # (as eqx.partition gives it), so that the gradient has the structure users expect.
    dynamic = jax.tree_util.tree_unflatten(tree, [x if i in chosen else None for i, x in enumerate(leaves)])
    tagged = jax.tree_util.tree_leaves(tag(dynamic, name, repeated=True))
    new = list(leaves)
    for i, x in zip(chosen, tagged):
        new[i] = x
    return jax.tree_util.tree_unflatten(tree, new)


def _tag_inputs(args: tuple, name: str) -> tuple:
    return tag_inputs(args, name, skip=_is_graph_node, tag_arrays=_tag_arrays)


_TAG_ATTR = "_jaxtrace_tag"
_SUBCLASSES: dict = {}  # (base class, ModuleTag) -> its tagged subclass


def _base_class(cls: type) -> type:
    return cls.__dict__.get("_jaxtrace_base", cls)


def restore(base: type, spec: ModuleTag, fields: dict):
    module = object.__new__(_tagged_class(base, spec))
    module.__dict__.update(fields)
    return module


def _tagged_class(base: type, spec: ModuleTag) -> type:
    """The subclass of ``base`` whose ``__call__`` tags as ``spec`` says; one per (class, spec)."""
    base = _base_class(base)
    cls = _SUBCLASSES.get((base, spec))
    if cls is not None:
        return cls

    def __call__(self, *args, **kwargs):
        if spec.inputs:
            args = _tag_inputs(args, spec.path + INPUT_SUFFIX)
        return _tag_arrays(base.__call__(self, *args, **kwargs), spec.path)

    def __reduce__(self):  # pickle and copy: rebuild the subclass from its base
        return restore, (base, spec, dict(self.__dict__))

    namespace = {
        # Printed models (nnx.display, repr) look as before; the class says where it comes from.
        "__module__": __name__,
        "__qualname__": base.__qualname__,
        "__doc__": f"{base.__qualname__} whose calls are tagged as {spec.path!r} by jaxtrace.tag_modules.\n\n"
        f"{base.__doc__ or ''}",
        "_jaxtrace_base": base,
        _TAG_ATTR: spec,
        "__call__": functools.wraps(base.__call__)(__call__),
        "__reduce__": __reduce__,
    }
    cls = _SUBCLASSES[(base, spec)] = type(base)(base.__name__, (base,), namespace)
    return cls


def _sort_key(path: tuple) -> tuple:
    # Parents before their children, list entries in index order (2 before 10).
    return tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in path)


def _callable(module) -> bool:
    return any("__call__" in vars(k) for k in type(module).__mro__[:-1])


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


def tag_modules(model: nnx.Module, where: Where = None, *, inputs: bool = False) -> nnx.Module:
    """The Flax NNX case of ``jaxtrace.tag_modules``; see its docstring."""
    named = [(name, path, m) for name, path, m in named_modules(model) if _callable(m)]
    chosen = choose([(name, m) for name, _, m in named], where)
    paths = {name: path for name, path, _ in named}
    tagged = nnx.clone(model)
    nodes = dict(nnx.iter_graph(tagged))
    for name in chosen:
        module = nodes[paths[name]]
        module.__class__ = _tagged_class(type(module), ModuleTag(name, bool(inputs)))
    return tagged
