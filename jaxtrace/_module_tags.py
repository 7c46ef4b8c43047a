"""Tagging a model's module calls, one concept for every framework.

``jaxtrace.tag_modules`` (equinox, Flax NNX), ``jaxtrace.flax.tag_modules``
(Linen) and the hooks of ``jaxtrace.torch`` do the same thing: name each module
by its path (PyTorch's ``named_modules()`` spelling), select modules with one
``where=`` rule, and tag a selected module's output under its name and, on
request, its positional inputs under ``name + ":in"``. This module holds what
they share: the ``where=`` rule, how one call is tagged, the
tagged subclass that makes a module of the user's own class tag its calls (path names
are in ``_paths``, the ``tag_modules`` dispatcher in ``_tag_modules``). Each framework's file keeps what differs: how to
walk its models, what counts as state rather than a value, how the tagged copy
is built.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Sequence, Union

import jax
import jax.tree_util as jtu

from ._tag import module_tag, scoped

__all__ = [
    "INPUT_SUFFIX",
    "PARAMS_SUFFIX",
    "ModuleTag",
    "Where",
    "base_class",
    "choose",
    "is_callable_module",
    "parse_where",
    "tag_inputs",
    "tag_leaves",
    "tagged_subclass",
]

INPUT_SUFFIX = ":in"  # "<path>:in" names a module's positional inputs
PARAMS_SUFFIX = ":params:"  # "<path>:params:<attribute>": a parameter where the module reads it (per-example plans)

# --- where= ------------------------------------------------------------------

# None (every module), a path, a list of paths, a class or tuple of classes (their instances),
# or a predicate (path, module) -> bool.
Where = Union[None, str, Sequence[str], type, "tuple[type, ...]", Callable[[str, Any], bool]]

_FORMS = (
    "None (every module), a path, a sequence of paths, a class or tuple of classes (the modules that are "
    "instances), or a predicate (path, module) -> bool"
)


def _is_classes(where) -> bool:
    return isinstance(where, type) or (
        isinstance(where, tuple) and bool(where) and all(isinstance(w, type) for w in where)
    )


def parse_where(where: Where, api: str) -> tuple[list[str] | None, Callable[[str, Any], bool]]:
    """``(the paths named, or None when where= is not a list of paths; whether (path, module) is selected)``.

    Raises a ``TypeError`` naming ``api`` (the public function called) when ``where`` is none of
    the accepted forms.
    """
    if where is None:
        return None, lambda path, module: True
    if _is_classes(where):
        classes = where
        return None, lambda path, module: isinstance(module, classes)  # pyright: ignore[reportArgumentType]
    if callable(where):
        test = where
        return None, lambda path, module: bool(test(path, module))  # pyright: ignore[reportCallIssue]
    if isinstance(where, str):
        paths: list = [where]
    elif isinstance(where, Iterable) and not isinstance(where, (bytes, bytearray, memoryview)):
        paths = list(where)
    else:
        hint = (
            ' For one module pass its path (where="layers.0"), for several a list of paths '
            '(where=["layers.0", "layers.1"]).'
        )
        raise TypeError(f"{api}: where= must be {_FORMS}; got {where!r} of type {type(where).__name__}.{hint}")
    bad = [p for p in paths if not isinstance(p, str)]
    if bad:
        raise TypeError(
            f"{api}: where= must be {_FORMS}; got {bad[0]!r} of type {type(bad[0]).__name__} in the sequence. "
            'Paths are strings such as "layers.0".'
        )
    wanted = set(paths)
    return list(dict.fromkeys(paths)), lambda path, module: path in wanted


def choose(candidates: Sequence[tuple[str, Any]], where: Where, api: str) -> list[str]:
    """The paths among ``candidates`` (``(path, module)``, parents first) that ``where`` selects.

    A path named in ``where`` that is not among the candidates is a ``ValueError`` listing those
    that are.
    """
    wanted, selected = parse_where(where, api)
    if wanted is None:
        return [p for p, m in candidates if selected(p, m)]
    known = [p for p, _ in candidates]
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise ValueError(
            f"{api}: no callable submodule at {', '.join(repr(p) for p in unknown)}. "
            f"The model's callable modules are: {', '.join(repr(p) for p in known)}. Paths are attribute "
            'names and list indices joined by dots ("layers.0"), as PyTorch\'s named_modules() names them; '
            'a Sequential\'s children are "0", "1", ...; the root is "".'
        )
    return wanted


# --- tagging one call --------------------------------------------------------


def tag_leaves(value, name: str, *, taggable: Callable[[Any], bool], is_leaf: Callable[[Any], bool] | None = None):
    """``value`` with its ``taggable`` leaves tagged as one value ``name``; other leaves pass through.

    Where some leaves are not taggable, the tagged value keeps ``value``'s structure with ``None``
    in their place (as ``eqx.partition`` gives it), so its gradient has the structure users expect.
    """
    leaves, tree = jtu.tree_flatten(value, is_leaf=is_leaf)
    chosen = [taggable(x) for x in leaves]
    if not any(chosen):
        return value
    if all(chosen):
        return module_tag(value, name, repeated=True)
    dynamic = jtu.tree_unflatten(tree, [x if c else None for x, c in zip(leaves, chosen)])
    tagged = iter(jtu.tree_leaves(module_tag(dynamic, name, repeated=True)))
    return jtu.tree_unflatten(tree, [next(tagged) if c else x for x, c in zip(leaves, chosen)])


def tag_inputs(args: tuple, name: str, *, skip: Callable[[Any], bool], tag_arrays: Callable) -> tuple:
    """``args`` with the positional arguments that ``skip`` does not exclude (state, graph nodes)
    tagged as ``name``: one such argument as it is, several as a tuple."""
    where = [i for i, a in enumerate(args) if not skip(a)]
    if not where:
        return args
    chosen = tuple(args[i] for i in where)
    tagged = tag_arrays(chosen[0] if len(chosen) == 1 else chosen, name)
    tagged = (tagged,) if len(chosen) == 1 else tagged
    out = list(args)
    for i, value in zip(where, tagged):
        out[i] = value
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ModuleTag:
    """What a tagged module tags: its output as ``path``, its inputs as ``path + ":in"`` if ``inputs``,
    and the parameters named in ``params`` as ``path + ":params:" + name`` (marks whose values nothing
    reads: the per-example plan finds in the program which leaf the module multiplies)."""

    path: str
    inputs: bool
    params: tuple = ()
    scope: Any = None  # a transform's own tags (``_tag.scoped``: the per-example plan's), or the user's (None)

    def call(self, fn: Callable, args: tuple, kwargs: dict, *, tag_inputs: Callable, tag_output: Callable, module=None):
        """``fn(*args, **kwargs)`` with its inputs and output tagged."""
        with scoped(self.scope):  # its own tags only: the module's body may hold the user's
            for name in self.params:
                value = getattr(module, name, None)
                if not isinstance(value, jax.Array) and value is not None:  # an nnx.Variable: its array
                    value = value.get_value() if hasattr(value, "get_value") else getattr(value, "value", None)
                if isinstance(value, jax.Array):
                    module_tag(value, self.path + PARAMS_SUFFIX + name, repeated=True)
            if self.inputs:
                args = tag_inputs(tuple(args), self.path + INPUT_SUFFIX)
        out = fn(*args, **kwargs)
        with scoped(self.scope):
            return tag_output(out, self.path)


# --- the tagged subclass -----------------------------------------------------


def base_class(cls: type) -> type:
    """The user's class behind a tagged subclass (``cls`` itself if it is not one)."""
    return cls.__dict__.get("_jaxtrace_base", cls)


def is_callable_module(module) -> bool:
    """Whether ``module``'s class (not its metaclass) defines ``__call__``."""
    return any("__call__" in vars(k) for k in type(module).__mro__[:-1])


def tagged_subclass(
    base: type,
    *,
    spec_of: Callable[[Any], "ModuleTag | None"],
    tag_inputs: Callable,
    tag_output: Callable,
    reduce: Callable[[Any], tuple],
    namespace: dict,
) -> type:
    """A subclass of ``base`` whose ``__call__`` tags as ``spec_of(self)`` says (untagged where ``None``).

    It keeps ``base``'s name and qualified name (printed models look as before), and pickles and
    copies through ``reduce(self)``, which rebuilds it from ``base``. ``namespace`` adds the
    framework's own entries (``__module__``, ``__doc__``, a field holding the spec).
    """

    def __call__(self, *args, **kwargs):
        spec = spec_of(self)
        if spec is None:
            return base.__call__(self, *args, **kwargs)
        call = functools.partial(base.__call__, self)
        return spec.call(call, args, kwargs, tag_inputs=tag_inputs, tag_output=tag_output, module=self)

    def __reduce__(self):  # pickle and copy: rebuild the subclass from its base
        return reduce(self)

    body = {
        "__qualname__": base.__qualname__,
        "_jaxtrace_base": base,
        "__call__": functools.wraps(base.__call__)(__call__),
        "__reduce__": __reduce__,
        **namespace,
    }
    return type(base)(base.__name__, (base,), body)
