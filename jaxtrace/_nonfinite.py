"""``find_nonfinite``: where a NaN or an inf began, from one compiled forward and backward pass.

The function is split at its tags as for ``jaxtrace.value_and_grad(..., with_values=True)``.
Inside the traced function each tag's value and cotangent is reduced to one small integer: the
first non-finite entry of its loop and vmap axes, in the order the program computes them (loop
steps ascending for values, descending for cotangents, which the backward pass computes in
reverse), and whether it is a NaN or an inf. Whole arrays never leave the program. On the host,
``NonfiniteReport`` compares those entries across tags by where each tag sits in the traced
program (equation positions, loop steps between them), which is static and kept in the report's
tree structure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat
from ._module_tags import path_name
from ._perturb import perturb
from ._checks import check_callable
from ._selection import TagSelection, check_tags
from ._sites import Site
from ._split import Split
from ._tag import is_tag

_NONE = np.iinfo(np.int32).max  # the code of a tag with no non-finite entry
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


# --- where each tag sits in the program ----------------------------------------------------------
#
# A *template* says where a site's entries sit in the traced program, as nested tuples (static,
# hashable): ("tag", i) the tag equation at position i; ("in", i, t) inside the i-th equation (a
# jit, cond, checkpoint, ...); ("loop", i, t) inside the i-th equation, a scan, whose step is the
# site's next stack axis; ("calls", ((start, stop, spliced, t), ...)) repeated calls stacked on the
# next stack axis, each call range at its own place. ``_path`` turns a template and the loop steps
# of one entry into a tuple that sorts entries in the order the program computes them.


_MODULE_TAGS = os.path.join(_PACKAGE_DIR, "_module_tags.py")


def _templates(program, jaxpr=None, cache=None, modules=None) -> dict:
    """``{site key: template}`` for the sites of ``jaxpr`` (default: the whole program); the keys
    of the tags that ``jt.tag_modules`` made are added to ``modules``."""
    cache = {} if cache is None else cache
    modules = set() if modules is None else modules
    jaxpr = program.jaxpr if jaxpr is None else jaxpr
    jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
    if id(jaxpr) in cache:
        return cache[id(jaxpr)]
    level = program.level(jaxpr)
    occurrences: dict = {}
    for i, (eqn, inside, slots) in enumerate(zip(jaxpr.eqns, level.eqn_sites, level.slots)):
        for key in inside:
            slot = slots[key]
            if not slot.primary:  # a copy JAX made (remat): its values are the original's
                continue
            template: tuple = ("tag", i)
            if is_tag(eqn):
                if any(os.path.abspath(f) == _MODULE_TAGS for f in _compat.frame_files(eqn)):
                    modules.add(key)
            else:
                for body in _compat.sub_jaxprs(eqn.params):
                    inner = _templates(program, body, cache, modules).get(key)
                    if inner is not None:
                        kind = "loop" if eqn.primitive.name in _compat.SCAN else "in"
                        template = (kind, i, inner)
                        break
            occurrences.setdefault(key, []).append((slot, template))
    out = {}
    for key, found in occurrences.items():
        if level.sites[key].ncalls and all(slot.start is not None for slot, _ in found):
            out[key] = (
                "calls",
                tuple((slot.start, slot.stop if slot.stop is not None else slot.start + 1, slot.spliced, t) for slot, t in found),
            )
        else:
            out[key] = found[0][1]
    cache[id(jaxpr)] = out
    return out


def _path(template: tuple, steps: tuple) -> tuple[tuple, tuple]:
    """``(sort key, kind of each loop axis)`` of the entry at loop ``steps`` of a site."""
    kind = template[0]
    if kind == "tag":
        return (template[1],), ()
    if kind == "in":
        key, kinds = _path(template[2], steps)
        return (template[1], *key), kinds
    if kind == "loop":
        key, kinds = _path(template[2], steps[1:])
        return (template[1], steps[0], *key), ("scan step", *kinds)
    for start, stop, spliced, inner in template[1]:
        if start <= steps[0] < stop:
            key, kinds = _path(inner, ((steps[0] - start, *steps[1:]) if spliced else steps[1:]))
            return key, ("call", *kinds[1:]) if spliced else ("call", *kinds)
    raise ValueError(f"jaxtrace.find_nonfinite: no call {steps[0]} in {template}.")  # pragma: no cover


# --- static description of the tags ------------------------------------------------------------


def _source(site: Site, module: bool) -> str:
    """``file:line`` of the ``jt.tag`` call(s), or the module path for a ``tag_modules`` tag."""
    if module:
        return site.name
    lines = []
    for source in site.sources:
        match = re.match(r"^(.*?):(\d+)(?::\d+)?(?: \(.*\))?$", source)
        lines.append(f"{match.group(1)}:{match.group(2)}" if match else source)
    return ", ".join(lines)


@dataclasses.dataclass(frozen=True)
class _Tag:
    """One tag name, as the report needs it on the host."""

    name: str
    source: str
    loops: tuple  # the sizes of its loop axes (outer first)
    examples: tuple  # the sizes of its vmap axes (outer first)
    template: tuple


@dataclasses.dataclass(frozen=True)
class _Meta:
    tags: tuple  # _Tag per name, in the program's order of first reach
    params: tuple  # the path of each differentiated leaf
    has_aux: bool


# --- the report ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NonfiniteAt:
    """Where a non-finite entry was found: the tag, the entry, and what it is.

    Attributes:
        name: the tag's name.
        index: the loop steps (outer loop first) and then the vmapped example(s) of the first
            non-finite entry; ``()`` for a tag outside loops and ``vmap``.
        source: ``"file:line"`` of the ``jt.tag`` call, or the module path for ``jt.tag_modules``.
        kind: ``"NaN"`` or ``"inf"``.
        steps: the loop part of ``index``.
        examples: the vmap part of ``index``.
        loop_kinds: ``"scan step"`` or ``"call"`` (repeated calls) for each entry of ``steps``.
    """

    name: str
    index: tuple
    source: str
    kind: str
    steps: tuple = ()
    examples: tuple = ()
    loop_kinds: tuple = ()

    def where(self) -> str:
        """``", scan step 4, example 1"``: the entry, for a sentence."""
        parts = [f"{kind} {step}" for kind, step in zip(self.loop_kinds, self.steps)]
        if len(self.examples) == 1:
            parts.append(f"example {self.examples[0]}")
        elif self.examples:
            parts.append(f"example {self.examples} (outer vmap first)")
        return "".join(", " + p for p in parts)


@jax.tree_util.register_pytree_node_class
class NonfiniteReport:
    """What ``jaxtrace.find_nonfinite`` found: a pytree, so it can be the output of ``jax.jit``.

    Its leaves are the function's value (and aux) and a few integers per tag; which tag is which,
    and where each sits in the program, is static (in the tree structure). The properties read the
    integers on the host.

    Attributes:
        value: the function's value.
        aux: its auxiliary output, with ``has_aux=True`` (else ``None``).
        first_value: ``None`` if every tagged value is finite, else a ``NonfiniteAt`` for the first
            tag, in the order the program computes them, with a non-finite entry.
        first_gradient: the same for the gradients (cotangents) at the tags, in the order the
            backward pass computes them (the reverse of the forward order).
        params: the paths of the differentiated leaves whose gradient has a non-finite entry.
        names: the tag names, in the order the program first reaches them.
    """

    def __init__(self, value, aux, value_codes, gradient_codes, param_bad, meta: _Meta):
        self.value = value
        self.aux = aux
        self._value_codes = value_codes
        self._gradient_codes = gradient_codes
        self._param_bad = param_bad
        self._meta = meta

    def tree_flatten(self):
        return (self.value, self.aux, self._value_codes, self._gradient_codes, self._param_bad), self._meta

    @classmethod
    def tree_unflatten(cls, meta, children):
        return cls(*children, meta)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._meta.tags]

    def _codes(self, codes) -> np.ndarray:
        if isinstance(codes, _compat.Tracer):
            raise TypeError(
                "A NonfiniteReport is read on the host, after the call: its properties cannot be used inside "
                "jax.jit (or another transform) around jaxtrace.find_nonfinite. Return the report from the "
                "jitted function and read it there."
            )
        codes = np.asarray(codes)
        if codes.ndim != 1:
            raise ValueError(
                f"This NonfiniteReport holds its per-tag entries with shape {codes.shape}, not one per tag: a "
                "transform around jaxtrace.find_nonfinite (jax.vmap) added axes to them. Put the jax.vmap inside "
                "the function given to find_nonfinite (the report then names the example), or call it once per batch."
            )
        return codes

    def _found(self, codes, backward: bool) -> list[tuple[tuple, NonfiniteAt]]:
        """``(sort key, NonfiniteAt)`` for every tag with a non-finite entry."""
        found = []
        for tag, code in zip(self._meta.tags, self._codes(codes).tolist()):
            if code == _NONE:
                continue
            flat, inf = divmod(int(code), 2)
            shape = (*tag.loops, *tag.examples)
            index = tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()
            steps, examples = index[: len(tag.loops)], index[len(tag.loops) :]
            if backward:  # the loop axes were reversed on the device
                steps = tuple(n - 1 - s for n, s in zip(tag.loops, steps))
            key, kinds = _path(tag.template, steps)
            kind = "inf" if inf else "NaN"
            found.append((key, NonfiniteAt(tag.name, (*steps, *examples), tag.source, kind, steps, examples, kinds)))
        return found

    @property
    def first_value(self) -> NonfiniteAt | None:
        found = self._found(self._value_codes, backward=False)
        return min(found, key=lambda f: f[0])[1] if found else None

    @property
    def first_gradient(self) -> NonfiniteAt | None:
        found = self._found(self._gradient_codes, backward=True)
        return max(found, key=lambda f: f[0])[1] if found else None

    @property
    def params(self) -> list[str]:
        bad = self._codes(self._param_bad)
        return [p for p, b in zip(self._meta.params, bad.tolist()) if b]

    def _neighbour(self, at: NonfiniteAt, before: bool) -> NonfiniteAt | None:
        """The entry the program computes just before (or after) ``at``, among all the tags."""
        target, _ = _path(self._tag(at.name).template, at.steps)
        best = None
        for tag in self._meta.tags:
            size = math.prod(tag.loops)
            steps_of = lambda flat: tuple(int(i) for i in np.unravel_index(flat, tag.loops)) if tag.loops else ()  # noqa: E731,B023
            # Entries of one tag are in program order by their flat loop index: a binary search for
            # the first entry not before (or not at or before) ``at``.
            lo, hi = 0, size
            while lo < hi:
                mid = (lo + hi) // 2
                key = _path(tag.template, steps_of(mid))[0]
                if key < target or (not before and key == target):
                    lo = mid + 1
                else:
                    hi = mid
            flat = lo - 1 if before else lo
            if not 0 <= flat < size:
                continue
            key, kinds = _path(tag.template, steps_of(flat))
            if best is None or (key > best[0] if before else key < best[0]):
                best = (key, NonfiniteAt(tag.name, steps_of(flat), tag.source, "", steps_of(flat), (), kinds))
        return None if best is None else best[1]

    def _tag(self, name: str) -> _Tag:
        return next(t for t in self._meta.tags if t.name == name)

    def __str__(self) -> str:
        sentences = []
        value = self.value
        if isinstance(value, jax.Array | np.ndarray | float) and np.size(value) == 1:
            number = float(np.asarray(value, dtype=np.float64).reshape(()))
            if not np.isfinite(number):
                sentences.append(f"The function's value is {number}.")
        first = self.first_value
        if first is None:
            sentences.append(f"Every tagged value is finite ({_count(len(self._meta.tags), 'tag')}).")
        else:
            before = self._neighbour(first, before=True)
            if before is None:
                sentences.append(
                    f"The value at {first.name!r}{_at(first)}{first.where()} is {_a(first.kind)}, and it is "
                    f"the first tag the program computes: the {first.kind} comes from the inputs or from the code "
                    "before that tag."
                )
            else:
                sentences.append(
                    f"The values are finite up to {before.name!r}{_step_note(before, first)} and not at "
                    f"{first.name!r}{_at(first)}{first.where()}: the {first.kind} begins in the code between them."
                )
        gradient = self.first_gradient
        if gradient is None:
            sentences.append("Every gradient at the tags is finite.")
        else:
            after = self._neighbour(gradient, before=False)
            only = " Every tagged value is finite: it appears only in the backward pass." if first is None else ""
            if after is None:
                sentences.append(
                    f"The gradient at {gradient.name!r}{_at(gradient)}{gradient.where()} is "
                    f"{_a(gradient.kind)}, and it is the last tag the program computes: the {gradient.kind} comes "
                    f"from the backward pass of the code after that tag.{only}"
                )
            else:
                sentences.append(
                    f"The gradients are finite down to {after.name!r}{_step_note(after, gradient)} and not at "
                    f"{gradient.name!r}{_at(gradient)}{gradient.where()}: the {gradient.kind} begins in "
                    f"the backward pass of the code between them.{only}"
                )
            if first is None:
                sentences.append(
                    "Look there for a derivative that is infinite at a finite point: jnp.sqrt or a power below 1 "
                    "at 0, or jnp.log or a division in the branch that jnp.where does not take (compute it on a "
                    "safe input instead)."
                )
        params = self.params
        if params:
            shown = ", ".join(repr(p) if p else "the argument itself" for p in params[:8])
            shown += f" and {len(params) - 8} more" if len(params) > 8 else ""
            sentences.append(f"Non-finite entries in the gradient of {shown}.")
        elif self._meta.params:
            sentences.append("Every parameter gradient is finite.")
        return " ".join(sentences)

    def __repr__(self) -> str:
        return f"NonfiniteReport({self})"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "inf" else f"a {kind}"


def _at(at: NonfiniteAt) -> str:
    """`` (model.py:41)`` for a tag at ``/path/to/model.py:41``; nothing for a module tag, whose name
    is its path."""
    if at.source == at.name:
        return ""
    return " (" + ", ".join(os.path.basename(part) for part in at.source.split(", ")) + ")"


def _step_note(neighbour: NonfiniteAt, at: NonfiniteAt) -> str:
    """`` (scan step 3)`` when the neighbouring entry is at other loop steps than ``at``."""
    if not neighbour.steps or neighbour.steps == at.steps[: len(neighbour.steps)]:
        return ""
    return " (" + ", ".join(f"{k} {s}" for k, s in zip(neighbour.loop_kinds, neighbour.steps)) + ")"


# --- the device side ---------------------------------------------------------------------------------


def _first_code(leaves: Sequence, prefix: int, loops: int, backward: bool):
    """The first non-finite entry of ``leaves`` (one tag, in the documented layout) over the first
    ``prefix`` axes (loops, then vmap), as ``2 * flat index + is_inf``; ``_NONE`` if all are finite.
    With ``backward`` the loop axes count down.

    Each leaf is reduced over its own axes first, as one byte per entry (2: a NaN, 1: an inf, 0:
    finite) and a max, so what XLA writes between the elementwise step and the reduction is a
    quarter of an int32 array; the positions are then found on the small per-prefix array.
    """
    worst = None
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            continue  # an integer tag (its gradient is float0) is always finite
        kind = jnp.where(jnp.isnan(leaf), jnp.int8(2), jnp.where(jnp.isinf(leaf), jnp.int8(1), jnp.int8(0)))
        per_prefix = jnp.max(kind, axis=tuple(range(prefix, leaf.ndim)), initial=jnp.int8(0))
        worst = per_prefix if worst is None else jnp.maximum(worst, per_prefix)
    if worst is None:
        return jnp.asarray(_NONE, jnp.int32)
    shape = worst.shape
    flat = jnp.zeros(shape, jnp.int32)
    stride = 1
    for axis in reversed(range(prefix)):
        iota = lax.broadcasted_iota(jnp.int32, shape, axis)
        if backward and axis < loops:
            iota = (shape[axis] - 1) - iota
        flat = flat + iota * stride
        stride *= shape[axis]
    code = jnp.where(worst == 0, _NONE, 2 * flat + (worst == 1).astype(jnp.int32))
    return jnp.min(code, initial=_NONE)


def _is_inexact_array(leaf) -> bool:
    """A leaf to differentiate: an inexact array, or a Python float as ``jax.grad`` takes one."""
    if isinstance(leaf, (float, complex)):
        return True
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def find_nonfinite(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
) -> Callable:
    """Where a NaN or an inf begins in ``fun``'s values and gradients, from one compiled pass.

    The returned function takes ``fun``'s arguments and returns a :class:`NonfiniteReport`, a pytree
    that can be the output of ``jax.jit``: one forward and backward pass, as
    ``jaxtrace.value_and_grad``'s, in which each tag's value and gradient is reduced inside the
    program to the position of its first non-finite entry (no arrays leave it). On the host,
    ``report.first_value`` is the first tag the program computes with a non-finite value,
    ``report.first_gradient`` the first the backward pass computes with a non-finite gradient, each
    with its loop step and vmapped example; ``str(report)`` says between which tags it began.

    Tag the places to watch with ``jt.tag``, or every module of an equinox or Flax NNX model with
    ``jt.tag_modules``. The gradient is taken with respect to the inexact (floating) array leaves of
    the arguments in ``argnums``; other leaves (integers, functions, an equinox model's static
    parts) are held fixed, as ``eqx.filter_grad`` does, so a whole equinox model can be passed.

    Args:
        fun: a function returning a scalar (with ``has_aux``, ``(scalar, aux)``); it calls
            ``jaxtrace.tag`` inside.
        argnums: whose gradients to check, as in ``jax.grad``.
        has_aux: ``fun`` returns ``(value, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.

    Returns:
        A function with ``fun``'s signature that returns a :class:`NonfiniteReport`.

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` / ``argnums`` is of the wrong kind.
        TagError: when called, as ``jaxtrace.value_and_grad``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxtrace as jt
        >>> def loss(params, x):
        ...     h = jt.tag(x * params["w"], "h")
        ...     y = jt.tag(jnp.where(h > 0, jnp.log(h), 0.0), "y")  # log's derivative at 0 reaches h
        ...     return jnp.sum(y)
        >>> report = jax.jit(jt.find_nonfinite(loss))({"w": 1.0}, jnp.array([1.0, 0.0]))
        >>> report.first_value is None, report.first_gradient.name, report.params
        (True, 'h', ['w'])
        >>> print(report)  # doctest: +ELLIPSIS
        Every tagged value is finite (2 tags). The gradients are finite down to 'y' and not at 'h' (...): the NaN begins in the backward pass of the code between them. ...
    """
    check_callable(fun, "jaxtrace.find_nonfinite")
    check_tags(tags)
    if isinstance(argnums, int):
        nums: tuple = (argnums,)
    else:
        nums = tuple(argnums)
        if not nums or not all(isinstance(a, int) for a in nums):
            raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}.")

    @functools.wraps(fun)
    def report_fun(*args, **kwargs) -> NonfiniteReport:
        split = Split(fun, args, kwargs, nums, tags, dynamic=_is_inexact_array)
        sites = split.sites
        paths_and_leaves, tree = jax.tree_util.tree_flatten_with_path(split.args)
        mask = [_is_inexact_array(leaf) for _, leaf in paths_and_leaves]
        diff = [leaf for (_, leaf), m in zip(paths_and_leaves, mask) if m]
        zeros: dict = {}  # one zeros array per shape, dtype and sharding, as jaxtrace.value_and_grad
        eps = {}
        for site in sites:
            if site.differentiable:
                kind = (site.shape, site.dtype, _compat.sharding_key(site.aval))
                if kind not in zeros:
                    zeros[kind] = site.zeros()
                eps[site.key] = zeros[kind]

        def run(diff, eps):
            it = iter(diff)
            full = jax.tree_util.tree_unflatten(tree, [next(it) if m else leaf for (_, leaf), m in zip(paths_and_leaves, mask)])
            result, values = split(full, lambda site, x, e: x if e is None else perturb(x, e), eps, split.keys)
            if has_aux:
                if not (isinstance(result, (tuple, list)) and len(result) == 2):
                    raise TypeError(
                        "jaxtrace.find_nonfinite with has_aux=True expects the function to return (value, aux), "
                        f"but it returned {type(result).__name__}. Return such a pair, or drop has_aux=True."
                    )
                return result[0], (result[1], values)
            return result, (None, values)

        (value, (aux, values)), (g_diff, g_eps) = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)(diff, eps)

        modules: set = set()
        templates = _templates(split.program, modules=modules)
        by_name: dict = {}
        for site in sites:
            by_name.setdefault(site.name, []).append(site)
        meta_tags, value_codes, gradient_codes = [], [], []
        for rank, (name, group) in enumerate(by_name.items()):
            group = sorted(group, key=lambda s: s.leaf)
            first = group[0]
            loops, examples = len(first.stack), len(first.batch_axes)
            user = first.user_shape()
            template = templates.get(first.key, ("tag", -1 - rank))
            for _ in range(loops - _loop_count(template)):  # never expected: a loop the walk did not see
                template = ("loop", -1 - rank, template)
            meta_tags.append(_Tag(name, _source(first, first.key in modules), tuple(user[:loops]), tuple(user[loops : loops + examples]), template))
            prefix = loops + examples
            value_codes.append(_first_code([s.to_user(values[s.key]) for s in group if s.key in values], prefix, loops, False))
            grads = [s.to_user(g_eps[s.key]) for s in group if s.key in g_eps]
            gradient_codes.append(_first_code(grads, prefix, loops, True))
        param_bad = [~jnp.all(jnp.isfinite(g)) for g in g_diff]
        # Paths inside the argument with one argnum (as its gradient's), else from the tuple of arguments.
        chosen = [_param_path(p[1:] if len(nums) == 1 else p) for (p, _), m in zip(paths_and_leaves, mask) if m]
        meta = _Meta(tuple(meta_tags), tuple(path_name(p) for p in chosen), bool(has_aux))
        return NonfiniteReport(
            value,
            aux,
            jnp.stack(value_codes) if value_codes else jnp.zeros((0,), jnp.int32),
            jnp.stack(gradient_codes) if gradient_codes else jnp.zeros((0,), jnp.int32),
            jnp.stack(param_bad) if param_bad else jnp.zeros((0,), bool),
            meta,
        )

    return report_fun


def _param_path(path: tuple) -> tuple:
    """A parameter's path without the ``.value`` attribute of a Flax NNX ``Variable`` at its end."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        return path[:-1]
    return path


def _loop_count(template: tuple) -> int:
    """How many stack axes ``template`` accounts for."""
    kind = template[0]
    if kind == "tag":
        return 0
    if kind == "in":
        return _loop_count(template[2])
    if kind == "loop":
        return 1 + _loop_count(template[2])
    start, stop, spliced, inner = template[1][0]
    return 1 + (_loop_count(inner) - 1 if spliced else _loop_count(inner))
