"""Flax NNX state among a call's arguments: the one rule of every jaxtrace transform.

A call of an NNX model may change its state: ``nnx.Dropout`` and ``nnx.Rngs`` advance their
RNG counts, ``nnx.BatchNorm`` in training mode its running statistics. After a jaxtrace
transform that state ends as one plain call of the function leaves it, as ``nnx.grad`` leaves
it, wherever the NNX object sits: the model, an ``nnx.Rngs`` argument, a keyword, a module
passed as the function itself (``jt.capture(model)``).

Flax lets a ``Variable`` change only inside the trace that made it, and a transform traces
the function anew, so ``Lift`` moves the objects into that trace and the changes out of it:

- **lifted** objects (the function, when it is a module or a module's bound method, and every
  NNX graph node among the arguments the transform does not differentiate) are split together
  outside the trace (``nnx.split``, so one object reached twice stays one object), merged again
  inside it (``nnx.merge(..., copy=True)``: Variables of that trace), and stand as ``_Slot``
  placeholders in the arguments the transform sees;
- **kept** arguments (the ones ``jt.grad`` differentiates as ``jax.grad`` would: pytrees, a
  module's array leaves) enter the trace as the transform passes them, already as new
  Variables, so they may change there.

Either way the Variables whose values the call replaced are handed out of the trace, and
``write_back`` sets them in the caller's objects. ``wrt=`` (``jaxtrace.flax``'s transforms)
also splits the model's ``wrt`` state off as the differentiated argument, as ``nnx.grad`` does.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import jax
from flax import nnx
from flax.nnx import graph as _graph

__all__ = ["Lift", "lift", "is_node"]


def is_node(x) -> bool:
    """An NNX graph node: a module, ``nnx.Rngs``, a ``Variable``, any ``nnx.Pytree`` object."""
    return _graph.is_graph_node(x)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _raw(variable):
    """The array a Variable holds (``get_raw_value`` since Flax 0.12.1, the ``raw_value`` attribute before)."""
    get = getattr(variable, "get_raw_value", None)
    return get() if get is not None else variable.raw_value


def _set_raw(variable, value) -> None:
    """What ``nnx.update`` does to one Variable: it holds ``value`` now."""
    set_raw = getattr(variable, "set_raw_value", None)
    if set_raw is not None:
        set_raw(value)
    else:
        variable.raw_value = value


def _variables(tree) -> list:
    """The Variables of a pytree (a kept argument), in its leaf order."""
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_variable) if _is_variable(x)]


def _reachable(tree) -> set:
    """The ids of the Variables a pytree reaches, through its leaves and the NNX objects among them."""
    found: set = set()
    for x in jax.tree_util.tree_leaves(tree, is_leaf=is_node):
        if is_node(x):
            found.update(id(v) for v in ([x] if _is_variable(x) else _graph_variables(x)))
    return found


def _graph_variables(nodes: tuple) -> list:
    """The Variables of graph nodes, each once, in ``nnx.iter_graph``'s order (an original and its merged copy agree)."""
    return [v for _, v in nnx.iter_graph(nodes) if _is_variable(v)]


class _Slot:
    """Where a lifted NNX object sat in the arguments; inside the trace its merged copy takes the place.

    A slot belongs to the ``Lift`` that made it: a transform inside another one (``jt.grad`` inside
    ``jaxtrace.flax.grad``) passes the outer one's slots through as they are.
    """

    __slots__ = ("index", "owner")

    def __init__(self, index: int, owner):
        self.index, self.owner = index, owner

    def __repr__(self):
        return f"<NNX object {self.index}, lifted by jaxtrace>"


def _is_slot(x) -> bool:
    return isinstance(x, _Slot)


class Lift:
    """``fun`` and its arguments with their NNX state moved into the transform's trace and back out.

    ``self.fun(*self.args, **self.kwargs)`` (called inside the trace) returns ``(out, changed)``;
    ``write_back(changed)`` (after the transform) sets the values in the caller's objects.

    Args:
        fun: the user's function; lifted too when it is an NNX module or a bound method of one.
        args, kwargs: its arguments.
        keep: positions passed through as they are (pytrees the transform traces and
            differentiates); their Variables are still written back.
        skip: positions passed through and never written back (a model another part of
            jaxtrace rebuilds and writes back itself).
        wrt: with it, ``args[0]`` is an ``nnx.Module`` whose ``wrt`` state (an ``nnx.Filter``)
            becomes ``self.args[0]``, the differentiated argument, as ``nnx.grad`` splits it.
    """

    def __init__(self, fun: Callable, args, kwargs: dict, *, keep=(), skip=(), wrt: Any = None):
        args = tuple(args)
        keep = {a % len(args) for a in keep} if args else set()
        skip = {a % len(args) for a in skip} if args else set()
        nodes: list = []
        ids: dict = {}

        def slot(x):
            if id(x) not in ids:
                ids[id(x)] = len(nodes)
                nodes.append(x)
            return _Slot(ids[id(x)], self)

        def slots(tree):  # an argument without NNX objects is passed as it is, not rebuilt
            if not _holds_nodes(tree):
                return tree
            return jax.tree_util.tree_map(lambda x: slot(x) if is_node(x) else x, tree, is_leaf=is_node)

        if wrt is not None:
            slot(args[0])  # the model is node 0: its wrt state is what the transform differentiates
        self._call: Any = fun
        if is_node(fun):
            self._call = slot(fun)
        elif inspect.ismethod(fun) and is_node(fun.__self__):
            self._call = (slot(fun.__self__), fun.__func__)
        self._passed = passed = keep | skip | ({0} if wrt is not None else set())
        lifted = tuple(a if i in passed else slots(a) for i, a in enumerate(args))
        self.kwargs = slots(kwargs)
        self._keep = sorted(keep - skip)
        self._nodes = tuple(nodes)
        originals = _graph_variables(self._nodes) if nodes else []
        self._lifted_count = len(originals)
        kept = [v for i in self._keep for v in _variables(args[i])]
        apart = {id(v) for v in kept} | {i for k in skip for i in _reachable(args[k])}
        if {id(v) for v in originals} & apart:
            raise TypeError(
                "jaxtrace: an nnx.Variable is reachable both from the model or an argument that is "
                "differentiated (passed as a pytree, as jax.grad takes it) and from another NNX object of the "
                "call (an nnx.Rngs or module argument, or the function itself), so where one plain call changes "
                "one Variable the transform would see two. Pass that object once (the model holds it already), "
                "or use jaxtrace.flax.grad / value_and_grad / jacrev, which split the model and every other NNX "
                "argument together, as nnx.grad does."
            )
        self._originals = originals + kept
        self._wrt = wrt
        if not nodes:
            self.args = lifted
        elif wrt is None:
            self._graphdef, self._state = nnx.split(self._nodes)
            self.args = lifted
        else:
            wanted = nnx.filterlib.to_predicate(wrt)
            self._graphdef, diff, self._rest = nnx.split(
                self._nodes, lambda path, x: path[0] == 0 and wanted(path[1:], x), ...
            )
            self.args = (diff[0] if 0 in diff else nnx.State({}), *lifted[1:])

    def fun(self, *args, **kwargs):
        """``fun`` on merged copies of the lifted objects (in the running trace); returns ``(out, changed)``:
        ``changed`` is ``{index: new value}`` of the Variables the call replaced."""
        merged: tuple = ()
        if self._nodes:
            if self._wrt is None:
                merged = nnx.merge(self._graphdef, self._state, copy=True)
            else:
                merged = nnx.merge(self._graphdef, nnx.State({0: args[0]}), self._rest, copy=True)
        put = lambda tree: jax.tree_util.tree_map(  # noqa: E731
            lambda x: merged[x.index] if _is_slot(x) and x.owner is self else x, tree, is_leaf=_is_slot
        )
        # Only where slots stand: tree_map rebuilds the pytrees it passes (a module among them, with new Variables).
        args = tuple(a if i in self._passed else put(a) for i, a in enumerate(args))
        kwargs = put(kwargs)
        if self._wrt is not None:
            args = (merged[0], *args[1:])
        inner = (_graph_variables(merged) if merged else []) + [v for i in self._keep for v in _variables(args[i])]
        before = [_raw(v) for v in inner]
        if _is_slot(self._call):
            call = merged[self._call.index]
        elif isinstance(self._call, tuple):
            call = self._call[1].__get__(merged[self._call[0].index])
        else:
            call = self._call
        out = call(*args, **kwargs)
        if merged and len(_graph_variables(merged)) != self._lifted_count:
            raise TypeError(
                "jaxtrace: the function added or removed nnx.Variables of an NNX object it was given (an "
                "attribute set to a new Variable or module during the call), which jaxtrace cannot carry out of "
                "its trace. Create that state before calling the transform (in __init__, or by one plain call), "
                "and update it in place (variable[...] = value)."
            )
        changed = {k: _raw(v) for k, (v, old) in enumerate(zip(inner, before)) if _raw(v) is not old}
        return out, changed

    def write_back(self, changed: dict) -> None:
        """Sets the values the call changed in the caller's Variables, as one plain call would have."""
        for k, value in changed.items():
            _set_raw(self._originals[k], value)


def _holds_nodes(tree) -> bool:
    return any(is_node(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_node))


def lift(fun: Callable, args, kwargs: dict, *, keep=(), skip=()) -> Optional[Lift]:
    """A ``Lift`` when NNX state is among ``fun``, ``args`` and ``kwargs`` (outside ``skip``), else ``None``."""
    args = tuple(args)
    watched = [a for i, a in enumerate(args) if i not in {s % len(args) for s in skip}]
    method_of = getattr(fun, "__self__", None) if inspect.ismethod(fun) else None
    if not (is_node(fun) or is_node(method_of) or _holds_nodes(watched) or _holds_nodes(kwargs)):
        return None
    return Lift(fun, args, kwargs, keep=keep, skip=skip)
