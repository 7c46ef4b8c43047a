"""``find_nonfinite``: where a NaN or an inf began, from one compiled forward and backward pass.

The function is split at its tags as for ``jaxtrace.value_and_grad(..., with_values=True)``
(``_ad.split_for_reverse``). Inside the traced function each tag's value and cotangent is reduced
to one small integer: the first non-finite entry of its loop and vmap axes, in the order the
program computes them (``_nonfinite_order.StepOrder``: a reversed scan from its last index down;
the cotangents in the opposite order, which the backward pass computes), and whether it is a NaN
or an inf, with where that entry is inside the value (three more integers); each differentiated
leaf to a count of its own non-finite entries. Whole arrays never leave the program. One more
integer names the shardings the compiler gives the tags' arrays (``_nonfinite_shards``). On the
host, ``NonfiniteReport`` (``_nonfinite_report``) compares those entries across tags by where each
tag sits in the traced program (``_nonfinite_order``), and names the device that held one: from
that sharding, or inside ``shard_map`` from the shard's coordinates and the layout of the body's
values across the shards (``_manual_layout``).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._ad import split_for_reverse
from ._arrays import is_inexact_array
from . import _nonfinite_shards
from ._manual_layout import site_layouts
from ._nonfinite_order import StepOrder, loop_count, step_order, templates
from ._nonfinite_report import NONE, LeafInfo, NonfiniteReport, ReportMeta, TagInfo, own_split, source
from ._paths import param_path, path_name
from ._checks import check_callable, normalize_argnums
from ._selection import Selection, TagSelection

__all__ = ["find_nonfinite", "NonfiniteReport"]


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
    with its loop step, vmapped example and entry inside the value (global indices, also in a
    sharded step) and, on several devices, the mesh coordinates of the device that held it;
    ``report.nonfinite_params`` the differentiated leaves already not finite (in parameters, an
    earlier update made them); ``str(report)`` says where.

    Tag the places to watch with ``jt.tag``, or every module of an equinox or Flax NNX model with
    ``jt.tag_modules``. The gradient is taken with respect to the inexact (floating) array leaves of
    the arguments in ``argnums``; other leaves (integers, Python numbers, functions, an equinox
    model's static parts) are held fixed and passed as they are, as ``eqx.filter_grad`` does, so a
    whole equinox model can be passed (a ``Dropout(0.0)`` keeps its Python ``p``).

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
    tags = Selection.of(tags)  # tags= read once, when the function is wrapped
    nums = normalize_argnums(argnums)

    @functools.wraps(fun)
    def report_fun(*args, **kwargs) -> NonfiniteReport:
        return _report(fun, nums, tags, has_aux, args, kwargs)

    return report_fun


def _report(fun: Callable, nums: tuple, tags: Selection, has_aux: bool, args: tuple, kwargs: dict) -> NonfiniteReport:
    """``find_nonfinite(fun, ...)(*args, **kwargs)``: one forward and backward pass over ``fun``'s inexact
    leaves (the others held fixed), each tag's value and gradient reduced in it (``_tag_report``)."""
    split, run, eps = split_for_reverse(
        fun, args, kwargs, nums, tags, has_aux, True, dynamic=is_inexact_array, api="jaxtrace.find_nonfinite"
    )
    paths_and_leaves, tree = jax.tree_util.tree_flatten_with_path(split.args)
    mask = [is_inexact_array(leaf) for _, leaf in paths_and_leaves]

    def run_inexact(diff, eps):  # ``run`` on the inexact leaves; the others are held fixed
        it = iter(diff)
        full = jax.tree_util.tree_unflatten(tree, [next(it) if m else leaf for (_, leaf), m in zip(paths_and_leaves, mask)])
        return run(full, eps)

    diff = [leaf for (_, leaf), m in zip(paths_and_leaves, mask) if m]
    (value, (aux, values)), (g_diff, g_eps) = jax.value_and_grad(run_inexact, argnums=(0, 1), has_aux=True)(diff, eps)
    split.write_back(values)  # NNX state (RNG counts, batch statistics) as a plain call leaves it
    infos, probed, found = _tag_report(split, values, g_eps)
    # Paths inside the argument with one argnum (as its gradient's), else from the tuple of arguments.
    chosen = [param_path(p[1:] if len(nums) == 1 else p) for (p, _), m in zip(paths_and_leaves, mask) if m]
    sizes = tuple(int(jnp.size(leaf)) for leaf in diff)
    meta = ReportMeta(infos, tuple(path_name(p) for p in chosen), bool(has_aux), sizes, probed)
    param_bad = [~jnp.all(jnp.isfinite(g)) for g in g_diff]
    # The parameters themselves: a NaN that an earlier update wrote shows here, not at a tag.
    param_counts = [jnp.sum(~jnp.isfinite(leaf), dtype=jnp.int32) for leaf in diff]
    return NonfiniteReport(value, aux, *found[:2], _stacked(param_bad, bool), _stacked(param_counts), meta, *found[2:])


def _tag_report(split, values: dict, g_eps: dict) -> tuple[tuple, tuple, tuple]:
    """Per tag name, in the program's order of first reach: its static description (``TagInfo``);
    which array each operand of the sharding probe is; and the report's arrays: the codes of the
    first non-finite value and gradient, their entries, and the probe."""
    modules: set = set()
    where = templates(split.program, modules=modules)
    manual = site_layouts(split.program)
    by_name: dict = {}
    for site in split.sites:
        by_name.setdefault(site.name, []).append(site)
    infos, jobs = [], []
    for rank, (name, group) in enumerate(by_name.items()):
        group = sorted(group, key=lambda s: s.leaf)
        first = group[0]
        loops, examples = len(first.stack), len(first.batch_axes)
        user = first.user_shape()
        template = where.get(first.key, ("tag", -1 - rank))
        for _ in range(loops - loop_count(template)):  # never expected: a loop the walk did not see
            template = ("loop", -1 - rank, template, False)
        group = [s for s in group if s.differentiable]  # an integer tag (its gradient is float0) is always finite
        leaves = tuple(LeafInfo(s.leaf, tuple(s.user_shape()[loops + examples :]), _user_layout(s, manual)) for s in group)
        invariant = manual[first.key][1] if first.key in manual else ()
        loop_sizes, example_sizes = tuple(user[:loops]), tuple(user[loops : loops + examples])
        infos.append(TagInfo(name, source(first, first.key in modules), loop_sizes, example_sizes, template, leaves, invariant))
        order = step_order(template, loop_sizes)
        for backward, arrays in ((False, values), (True, g_eps)):
            jobs.append((name, backward, [(s, arrays[s.key]) for s in group if s.key in arrays], order, examples))
    leaves_of = [[(s.leaf, s.to_user(a)) for s, a in pairs] for _, _, pairs, _, _ in jobs]
    found = [_first_nonfinite(leaves, order, examples, backward) for leaves, (_, backward, _, order, examples) in zip(leaves_of, jobs)]
    codes, rows = [c for c, _ in found], [r for _, r in found]
    probed = tuple((name, backward, s.leaf) for name, backward, pairs, _, _ in jobs for s, _ in pairs)
    probe = _nonfinite_shards.probe(*(a for leaves in leaves_of for _, a in leaves))
    rows = [jnp.stack(r) if r else jnp.zeros((0, 3), jnp.int32) for r in (rows[0::2], rows[1::2])]
    return tuple(infos), probed, (_stacked(codes[0::2]), _stacked(codes[1::2]), *rows, probe)


def _user_layout(site, manual: dict) -> tuple | None:
    """The layout (``_manual_layout``) of a tag in a shard_map body, on the axes after its stack in
    the documented order (vmap axes first); None outside shard_map."""
    if site.key not in manual:
        return None
    layout = manual[site.key][0]
    rest = [i for i in range(len(layout)) if i not in site.batch_axes]
    return tuple(layout[i] for i in (*site.batch_axes, *rest))


def _stacked(codes: list, dtype=jnp.int32):
    return jnp.stack(codes) if codes else jnp.zeros((0,), dtype)


def _prefix_numbers(order: StepOrder, examples: int, shape: tuple, backward: bool):
    """An int32 array of ``shape`` (loop axes, then ``examples`` vmap axes): each entry's ``position
    * number of examples + flat example``, the position in ``order`` (from the end with ``backward``)."""
    loops = len(order.loops)
    example = jnp.zeros(shape, jnp.int32)
    stride = 1
    for axis in reversed(range(loops, loops + examples)):
        example = example + lax.broadcasted_iota(jnp.int32, shape, axis) * stride
        stride *= shape[axis]
    position = order.positions(jnp)
    if backward:
        position = order.backward(position)
    return jnp.reshape(position, (*order.loops, *(1,) * examples)) * stride + example


_BIG = np.iinfo(np.int32).max


def _first_nonfinite(leaves: Sequence, order: StepOrder, examples: int, backward: bool):
    """The first non-finite entry of one tag's ``(leaf, array)``s (in the documented layout: loop
    axes, ``examples`` vmap axes, the value's own) in the order the program computes them: its
    code, ``2 * (position * number of examples + flat example) + is_inf`` (``NONE`` if all are
    finite; the position is ``order``'s, counted from the end with ``backward``), and ``[leaf,
    major, minor]``, where the first entry of that kind there is inside the value (row-major; a
    NaN if there is one; ``own_split`` says which own axes are ``major``), ``-1``s if none.

    Each leaf is reduced over its own axes in one pass, where every entry is one int32 key (its
    flat index if it is a NaN, after every NaN's if it is an inf, the largest int32 if it is
    finite) and a min; the rest works on the small per-prefix arrays. No slice of a sharded value
    is taken at a computed index (XLA could gather it), and nothing runs only when a NaN is found.
    """
    prefix = len(order.loops) + examples
    found = [(leaf_id, *_per_prefix(a, prefix)) for leaf_id, a in leaves if jnp.issubdtype(a.dtype, jnp.inexact)]
    if not found:  # an integer tag (its gradient is float0) is always finite
        return jnp.asarray(NONE, jnp.int32), jnp.full((3,), -1, jnp.int32)
    worst = found[0][1]
    for _, kind, _, _ in found[1:]:
        worst = jnp.maximum(worst, kind)
    flat = _prefix_numbers(order, examples, worst.shape, backward)
    code = jnp.min(jnp.where(worst == 0, NONE, 2 * flat + (worst == 1).astype(jnp.int32)), initial=NONE)
    at = flat == code // 2
    want = jnp.where(code % 2 == 1, jnp.int8(1), jnp.int8(2))
    row = jnp.full((3,), -1, jnp.int32)
    for leaf_id, kind, major, minor in reversed(found):  # the first leaf that has one wins
        here = at & (kind == want)
        minor = jnp.min(jnp.where(here, minor, _BIG), initial=_BIG)
        major = jnp.int32(0) if major is None else jnp.min(jnp.where(here, major, _BIG), initial=_BIG)
        row = jnp.where(minor < _BIG, jnp.stack([jnp.int32(leaf_id), major, minor]), row)
    return code, row


def _per_prefix(leaf, prefix: int):
    """Per entry of the ``prefix`` leading axes: ``(kind, major, minor)`` of the first non-finite
    entry of the worst kind (2: a NaN, 1: an inf, 0: none) among the value's own axes; ``major``
    None where the own axes are all minor (fewer than 2**30 entries: one key holds the index)."""
    own = leaf.shape[prefix:]
    m = own_split(own)
    axes = tuple(range(prefix + m, leaf.ndim))
    size = math.prod(own[m:])
    index = _flat_iota(leaf.shape, axes)
    key = jnp.where(jnp.isnan(leaf), index, jnp.where(jnp.isinf(leaf), size + index, _BIG))
    per = jnp.min(key, axis=axes, initial=_BIG)
    kind = jnp.where(per < size, jnp.int8(2), jnp.where(per < _BIG, jnp.int8(1), jnp.int8(0)))
    minor = jnp.where(per < size, per, per - size)
    if m == 0:
        return kind, None, minor
    major_axes = tuple(range(prefix, prefix + m))
    major = _flat_iota(kind.shape, major_axes)
    worst = jnp.max(kind, axis=major_axes, keepdims=True)
    first = jnp.min(jnp.where(kind == worst, major, _BIG), axis=major_axes, keepdims=True)
    minor = jnp.min(jnp.where(major == first, minor, _BIG), axis=major_axes)
    return jnp.squeeze(worst, major_axes), jnp.squeeze(first, major_axes), minor


def _flat_iota(shape: tuple, axes: tuple):
    """int32 of ``shape``: each entry's row-major flat index over ``axes``."""
    index, stride = jnp.zeros((), jnp.int32), 1
    for axis in reversed(axes):
        index = index + lax.broadcasted_iota(jnp.int32, shape, axis) * stride
        stride *= shape[axis]
    return index
