"""Flax Linen models: ``jaxtrace.flax.tag_modules``, a ``flax.linen.intercept_methods`` interceptor.

A Linen module holds no parameters, so there is nothing to copy or subclass:
its ``__call__`` output is tagged while ``model.apply`` is traced, under the
module's path in the parameter tree joined by ``/``.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn

from .._frameworks import is_linen_module, is_nnx_module
from .._module_tags import ModuleTag, Where, parse_where
from ._nnx import tag_arrays, tag_call_inputs

__all__ = ["tag_modules"]

_API = "jaxtrace.flax.tag_modules"


def _path(module: nn.Module) -> str:
    return "/".join(str(p) for p in module.path)


class _LinenTags(contextlib.ContextDecorator):
    """What ``tag_modules`` returns: a context manager and a decorator."""

    def __init__(self, where: Where, inputs: bool):
        if is_linen_module(where) or is_nnx_module(where):
            fix = (
                "jaxtrace.tag_modules(model) returns a tagged copy of an nnx.Module"
                if is_nnx_module(where)
                else "a Linen module is tagged while it runs: `with jaxtrace.flax.tag_modules(): "
                "jt.grad(lambda p, x: loss(model.apply(p, x)))(params, x)`"
            )
            raise TypeError(
                f"{_API} takes which modules to tag (paths, classes or a predicate), not a model; "
                f"got a {type(where).__name__}. {fix[0].upper()}{fix[1:]}."
            )
        self._wanted, self._selected = parse_where(where, _API)  # the paths named (or None), the test
        self._inputs = bool(inputs)
        self._seen: list[dict] = []  # one {path: None} per active entry (they can nest)
        self._context = None  # the interceptor, installed once however deep the nesting

    def _intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        path = _path(module)
        for seen in self._seen:
            seen[path] = None
        if not self._selected(path, module):
            return next_fun(*args, **kwargs)
        spec = ModuleTag(path, self._inputs)
        return spec.call(next_fun, args, kwargs, tag_inputs=tag_call_inputs, tag_output=tag_arrays)

    def __enter__(self):
        if not self._seen:  # re-entered (a decorated function calling itself): one interceptor, one tag
            self._context = nn.intercept_methods(self._intercept)
            self._context.__enter__()
        self._seen.append({})
        return self

    def __exit__(self, kind, value, traceback):
        seen = list(self._seen.pop())
        if not self._seen and self._context is not None:
            self._context.__exit__(kind, value, traceback)
            self._context = None
        if kind is not None:
            return False
        if not seen:
            raise ValueError(
                f"{_API}: no Linen module was called while it was active, so nothing was "
                "tagged. Call model.apply (or model.init) inside the `with` block or the decorated function. "
                "A function jitted and traced before the block reuses its trace without the tags: decorate "
                "the function before jitting it (jax.jit(jaxtrace.flax.tag_modules()(loss)))."
            )
        unknown = [w for w in self._wanted or () if w not in seen]
        if unknown:
            raise ValueError(
                f"{_API}: no module at {', '.join(repr(w) for w in unknown)} was called. "
                f"The modules called were: {', '.join(repr(p) for p in seen)}. Paths are the module names "
                "of the parameter tree joined by '/' (\"encoder/Dense_0\"); the root is \"\"."
            )
        return False


def tag_modules(where: Where = None, *, inputs: bool = False) -> _LinenTags:
    """Tags the output of every selected Flax Linen module called while it is active.

    Use it as a context manager around the code that traces ``model.apply``
    (usually the ``jaxtrace.grad`` call), or as a decorator on the loss
    function. Each selected module's ``__call__`` output is tagged under the
    module's path: the names of its parameter tree joined by ``/``
    (``"Dense_0"``, ``"encoder/layers_1"``), the root ``""``. Calls are stacked
    as for ``jaxtrace.tag_modules``: per step inside ``nn.scan``, per example
    inside ``nn.vmap``. A function ``jax.jit`` compiled before the block reuses
    its trace without the tags, so decorate before jitting. The guide *Flax
    models* has the details.

    Args:
        where: which modules: ``None`` (all), a path, a list of paths, a class
            or tuple of classes, or a predicate ``(path, module) -> bool``.
        inputs: also tag the positional array arguments, as ``"<path>:in"``.

    Returns:
        A context manager that is also a decorator.

    Raises:
        TypeError: if ``where`` is a model or none of the forms above.
        ValueError: when the block ends, if a listed path was never called or
            no Linen module ran at all (a tag is never silently missing).

    Example:
        >>> import jax, jax.numpy as jnp, jaxtrace as jt, jaxtrace.flax
        >>> import flax.linen as nn
        >>> model = nn.Sequential([nn.Dense(4), nn.tanh, nn.Dense(1)])
        >>> x = jnp.ones((3, 2))
        >>> params = model.init(jax.random.key(0), x)
        >>> with jaxtrace.flax.tag_modules():
        ...     grads, tag_grads = jt.grad(lambda p, x: jnp.sum(model.apply(p, x)))(params, x)
        >>> {name: g.shape for name, g in tag_grads.items()}
        {'layers_0': (3, 4), 'layers_2': (3, 1), '': (3, 1)}

        As a decorator, under ``jax.jit``:

        >>> @jax.jit
        ... @jaxtrace.flax.tag_modules(["layers_0"], inputs=True)
        ... def tag_grads_of(params, x):
        ...     return jt.grad(lambda p, x: jnp.sum(model.apply(p, x)))(params, x)[1]
        >>> sorted(tag_grads_of(params, x))
        ['layers_0', 'layers_0:in']
    """
    return _LinenTags(where, inputs)
