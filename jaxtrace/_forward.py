"""The forward side of a tag, from the same split: read values (``capture``),
push tangents (``jvp``) and replace values (``patch``)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from ._checks import check_callable
from ._errors import NoTags, TagError
from ._selection import Selection, TagSelection, refuse_differentiated
from ._sites import Site
from ._split import Split, is_array, keep

__all__ = ["capture", "jvp", "patch"]


def capture(fun: Callable, *, tags: TagSelection = None) -> Callable:
    """Runs ``fun`` and also returns the values at its tags.

    Values are laid out as the gradients are (loop axes, then vmap axes, then
    the value's shape); in a ``cond``, a branch not taken gives zeros. Array
    arguments are traced; other arguments (Python numbers, strings) stay static.
    The tags stay in place, so ``jaxtrace.grad`` of a captured function still sees them.

    Args:
        fun: the function; it calls ``jaxtrace.tag`` inside.
        tags: which tags, as in ``jaxtrace.value_and_grad``.

    Returns:
        A function with ``fun``'s signature that returns ``(out, tag_values)``,
        ``tag_values`` being ``{name: value}``; ``{}`` when ``fun`` has no tags,
        and reading a name from it then says so (a ``KeyError``).

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` is of the wrong kind.
        TagError: when called, if a name in ``tags`` is not a tag of ``fun``.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> def f(x):
        ...     return jnp.sum(jt.tag(x * 2.0, "double"))
        >>> out, values = jt.capture(f)(jnp.arange(3.0))
        >>> values["double"].tolist()
        [0.0, 2.0, 4.0]
    """
    check_callable(fun, "jaxtrace.capture")
    tags = Selection.of(tags)  # tags= read once, when the function is wrapped

    @functools.wraps(fun)
    def captured(*args, **kwargs):
        split = Split(fun, args, kwargs, range(len(args)), tags, dynamic=is_array, purpose="read", keep=())
        out, values = split(split.args, keep, {}, split.keys)
        split.write_back(values)
        if not split.program.sites:  # reading a name then says that nothing is tagged, and how to tag
            return out, NoTags("jaxtrace.capture", _HOW_TO_TAG)
        return out, split.tag_tree(values)

    return captured


_HOW_TO_TAG = (
    "An equinox or Flax NNX model is tagged with jt.tag_modules(model), then captured with "
    "jt.capture(tagged)(x) (a value in your own code: jt.tag(x, name)); inside jt.filter_grad(fun, "
    "tag_modules=True) and the other filter transforms, the model fun gets is tagged already."
)


def jvp(fun: Callable, primals, tangents, *, tags: TagSelection = None):
    """Like ``jax.jvp``, and also the tangents at the tags.

    Args:
        fun: the function; it calls ``jaxtrace.tag`` inside.
        primals: the point, a tuple as for ``jax.jvp``.
        tangents: the tangent at that point, a tuple of the same structure.
        tags: which tags, as in ``jaxtrace.value_and_grad``.

    Returns:
        ``(out, out_tangent, tag_tangents)``; ``tag_tangents`` is ``{name:
        tangent at the tagged value}`` (``float0`` for integer tags).

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` is of the wrong kind.
        TagError: if a name in ``tags`` is not a tag of ``fun``.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> def f(x):
        ...     return jnp.sin(jt.tag(3.0 * x, "h"))
        >>> out, out_dot, tag_dots = jt.jvp(f, (0.0,), (1.0,))
        >>> float(out_dot), float(tag_dots["h"])
        (3.0, 3.0)
    """
    check_callable(fun, "jaxtrace.jvp")
    primals, tangents = tuple(primals), tuple(tangents)
    split = Split(fun, primals, {}, range(len(primals)), tags, purpose="forward")

    def run(args):
        return split(args, keep, {}, split.keys)

    (out, values), (out_dot, values_dot) = jax.jvp(run, (split.args,), (tangents,))
    split.write_back(values)
    return out, out_dot, split.tag_tree(values_dot)


def patch(fun: Callable, replacements: Mapping[str, Any]) -> Callable:
    """``fun`` with the values at some tags replaced.

    A value cuts the gradient upstream of the tag; a function keeps it
    (``lambda v: 0.5 * v`` also halves the gradient). The tags stay in place, so
    the patched function composes with ``jaxtrace.grad``, ``capture`` (which then
    sees the new values), ``jax.jit`` and ``jax.vmap``.

    Args:
        fun: the function; it calls ``jaxtrace.tag`` inside.
        replacements: ``{tag name: new value}`` (the tag's structure, shape and
            dtype, with its loop and vmap axes: a stacked value patches step by
            step) or ``{tag name: function value -> new value}``, applied to each
            array of the tagged value.

    Returns:
        A function with ``fun``'s signature and outputs.

    Raises:
        TypeError: if a key of ``replacements`` is not a string.
        TagError: when called, if a name is not a tag of ``fun``, or a replacement
            value has another structure, shape or dtype than the tag.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> def f(x):
        ...     return jnp.sum(jt.tag(x * 2.0, "double"))
        >>> float(jt.patch(f, {"double": jnp.zeros(3)})(jnp.ones(3)))
        0.0
        >>> float(jt.patch(f, {"double": lambda v: 10 * v})(jnp.ones(3)))
        60.0
    """
    check_callable(fun, "jaxtrace.patch")
    replacements = dict(replacements)
    for name in replacements:
        if not isinstance(name, str):
            raise TypeError(f"jaxtrace.patch: replacement keys must be tag names (strings), got {name!r}.")
    functions = {n: r for n, r in replacements.items() if callable(r)}

    def site_fn(site: Site, x, replacement):
        if site.name in functions:
            replacement = functions[site.name](x)
            _check_leaf(site, jnp.shape(x), replacement)
            replacement = jnp.asarray(replacement, x.dtype)
        return replacement

    @functools.wraps(fun)
    def patched(*args, **kwargs):
        split = Split(
            fun, args, kwargs, range(len(args)), list(replacements), dynamic=is_array, purpose="forward", keep=()
        )
        refuse_differentiated(split.sites, "jaxtrace.patch", "value", "jax.grad(jt.patch(loss, ...))")
        inputs = {}
        for name, value in replacements.items():
            if name not in functions:
                inputs.update(_program_inputs([s for s in split.sites if s.name == name], value))
        out, values = split(split.args, site_fn, inputs)
        split.write_back(values)
        return out

    return patched


def _program_inputs(sites: list[Site], value) -> dict:
    """Per-site inputs in the program's layout from a user's replacement value."""
    sites = sorted(sites, key=lambda s: s.leaf)
    tree = sites[0].tree
    leaves, value_tree = jax.tree_util.tree_flatten(value)
    if value_tree != tree:
        raise TagError(
            f"jaxtrace.patch: the replacement for tag {sites[0].name!r} (at {sites[0].where}) has structure "
            f"{value_tree}, but the tagged value has structure {tree}. Pass a value of the same structure."
        )
    inputs = {}
    for site, leaf in zip(sites, leaves):
        leaf = _check_leaf(site, site.user_shape(), leaf)
        inputs[site.key] = site.from_user(jnp.asarray(leaf, site.dtype))
    return inputs


def _check_leaf(site: Site, expected_shape, leaf):
    shape, dtype = jnp.shape(leaf), jnp.result_type(leaf)
    weak = not hasattr(leaf, "dtype") or getattr(getattr(leaf, "aval", None), "weak_type", False)
    if tuple(shape) != tuple(expected_shape) or (dtype != site.dtype and not weak):
        raise TagError(
            f"jaxtrace.patch: the replacement for tag {site.name!r} (at {site.where}) has shape {tuple(shape)} "
            f"and dtype {dtype}, but the tag holds shape {tuple(expected_shape)} and dtype {site.dtype} "
            "(loop axes first, then vmap axes). Pass a value of that shape and dtype."
        )
    return leaf
