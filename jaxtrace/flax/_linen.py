"""Flax Linen models: ``jaxtrace.flax.tag_modules``, a ``flax.linen.intercept_methods`` interceptor.

A Linen module holds no parameters, so there is nothing to copy or subclass:
its ``__call__`` output is tagged while ``model.apply`` is traced, under the
module's path in the parameter tree joined by ``/``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence, Union

import flax.linen as nn
from flax import nnx

from ._nnx import INPUT_SUFFIX, _tag_arrays, _tag_inputs

Where = Union[None, str, Sequence[str], Callable[[str, nn.Module], bool]]


def _path(module: nn.Module) -> str:
    return "/".join(str(p) for p in module.path)


class _LinenTags(contextlib.ContextDecorator):
    """What ``tag_modules`` returns: a context manager and a decorator."""

    def __init__(self, where: Where, inputs: bool):
        if isinstance(where, (nn.Module, nnx.Module)):
            fix = (
                "jaxtrace.tag_modules(model) returns a tagged copy of an nnx.Module"
                if isinstance(where, nnx.Module)
                else "a Linen module is tagged while it runs: `with jaxtrace.flax.tag_modules(): "
                "jt.grad(lambda p, x: loss(model.apply(p, x)))(params, x)`"
            )
            raise TypeError(
                f"jaxtrace.flax.tag_modules takes which modules to tag (paths or a predicate), not a model; "
                f"got a {type(where).__name__}. {fix[0].upper()}{fix[1:]}."
            )
        if where is None or callable(where):
            self._wanted = None
        else:
            self._wanted = [where] if isinstance(where, str) else list(where)
            bad = [w for w in self._wanted if not isinstance(w, str)]
            if bad:
                raise TypeError(
                    f"jaxtrace.flax.tag_modules: where= takes None, a path, a list of paths or a predicate "
                    f"(path, module) -> bool; got {bad[0]!r} in the list. Paths are strings such as \"Dense_0\"."
                )
        self._where = where
        self._inputs = bool(inputs)
        self._seen: list[dict] = []  # one {path: None} per active entry (they can nest)
        self._context = None  # the interceptor, installed once however deep the nesting

    def _selected(self, path: str, module: nn.Module) -> bool:
        if self._where is None:
            return True
        if self._wanted is not None:
            return path in self._wanted
        return bool(self._where(path, module))  # pyright: ignore[reportCallIssue]

    def _intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        path = _path(module)
        for seen in self._seen:
            seen[path] = None
        if not self._selected(path, module):
            return next_fun(*args, **kwargs)
        if self._inputs:
            args = _tag_inputs(tuple(args), path + INPUT_SUFFIX)
        return _tag_arrays(next_fun(*args, **kwargs), path)

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
                "jaxtrace.flax.tag_modules: no Linen module was called while it was active, so nothing was "
                "tagged. Call model.apply (or model.init) inside the `with` block or the decorated function. "
                "A function jitted and traced before the block reuses its trace without the tags: decorate "
                "the function before jitting it (jax.jit(jaxtrace.flax.tag_modules()(loss)))."
            )
        unknown = [w for w in self._wanted or () if w not in seen]
        if unknown:
            raise ValueError(
                f"jaxtrace.flax.tag_modules: no module at {', '.join(repr(w) for w in unknown)} was called. "
                f"The modules called were: {', '.join(repr(p) for p in seen)}. Paths are the module names "
                "of the parameter tree joined by '/' (\"encoder/Dense_0\"); the root is \"\"."
            )
        return False


def tag_modules(where: Where = None, *, inputs: bool = False) -> _LinenTags:
    """Tags the output of every selected Flax Linen module called while it is active.

    Use it as a context manager around the code that traces ``model.apply``
    (usually the ``jaxtrace.grad`` call), or as a decorator on the loss
    function. Each selected module's ``__call__`` output is tagged
    (``jaxtrace.tag``) under the module's path: the names of its parameter
    tree joined by ``/`` (``"Dense_0"``, ``"encoder/layers_1"``), the root
    module ``""``. With ``inputs=True`` the positional array arguments are
    tagged too, as ``"<path>:in"``: one argument as it is, several as a tuple.
    Array leaves of other outputs (an ``nn.scan`` cell's ``(carry, y)``) are
    tagged as a pytree; PRNG keys are never tagged. Only ``__call__`` is
    tagged, not other methods.

    A module called several times (weight sharing) gives its calls stacked
    on a leading axis in call order; inside ``nn.scan`` they are stacked per
    step, inside ``nn.vmap`` per example; ``nn.remat`` and ``nn.jit`` are
    transparent. No ``variable_axes`` entry, init pass or batch size is needed.

    ``where`` selects modules: ``None`` (all), a path, a list of paths, or a
    predicate ``(path, module) -> bool``. A listed path that no call reached,
    or a block in which no Linen module ran at all, is an error when the block
    ends (a tag is never silently missing). The function traced inside the
    block must be traced there: a function ``jax.jit`` compiled before the
    block reuses its trace without the tags, so decorate before jitting.

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
