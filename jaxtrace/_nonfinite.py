"""``find_nonfinite``: where a NaN or an inf began, from one compiled forward and backward pass.

The function is split at its tags as for ``jaxtrace.value_and_grad(..., with_values=True)``
(``_ad.split_for_reverse``). Inside the traced function each tag's value and cotangent is reduced
to one small integer: the first non-finite entry of its loop and vmap axes, in the order the
program computes them (``_nonfinite_order.StepOrder``: a reversed scan from its last index down;
the cotangents in the opposite order, which the backward pass computes), and whether it is a NaN
or an inf; each differentiated leaf to a count of its own non-finite entries. Whole arrays never
leave the program. On the host, ``NonfiniteReport`` (``_nonfinite_report``) compares those entries
across tags by where each tag sits in the traced program (``_nonfinite_order``).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ._ad import split_for_reverse
from ._arrays import is_inexact_array
from ._nonfinite_order import StepOrder, loop_count, step_order, templates
from ._nonfinite_report import NONE, NonfiniteReport, ReportMeta, TagInfo, source
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
    with its loop step and vmapped example; ``report.nonfinite_params`` the differentiated leaves
    already not finite (in parameters, an earlier update made them); ``str(report)`` says where.

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
        infos, value_codes, gradient_codes = _tag_codes(split, values, g_eps)
        # Paths inside the argument with one argnum (as its gradient's), else from the tuple of arguments.
        chosen = [param_path(p[1:] if len(nums) == 1 else p) for (p, _), m in zip(paths_and_leaves, mask) if m]
        sizes = tuple(int(jnp.size(leaf)) for leaf in diff)
        meta = ReportMeta(infos, tuple(path_name(p) for p in chosen), bool(has_aux), sizes)
        param_bad = [~jnp.all(jnp.isfinite(g)) for g in g_diff]
        # The parameters themselves: a NaN that an earlier update wrote shows here, not at a tag.
        param_counts = [jnp.sum(~jnp.isfinite(leaf), dtype=jnp.int32) for leaf in diff]
        return NonfiniteReport(
            value,
            aux,
            _stacked(value_codes),
            _stacked(gradient_codes),
            _stacked(param_bad, bool),
            _stacked(param_counts),
            meta,
        )

    return report_fun


def _tag_codes(split, values: dict, g_eps: dict) -> tuple[tuple, list, list]:
    """Per tag name, in the program's order of first reach: its static description (``TagInfo``),
    and the codes of its first non-finite value and gradient."""
    modules: set = set()
    where = templates(split.program, modules=modules)
    by_name: dict = {}
    for site in split.sites:
        by_name.setdefault(site.name, []).append(site)
    infos, value_codes, gradient_codes = [], [], []
    for rank, (name, group) in enumerate(by_name.items()):
        group = sorted(group, key=lambda s: s.leaf)
        first = group[0]
        loops, examples = len(first.stack), len(first.batch_axes)
        user = first.user_shape()
        template = where.get(first.key, ("tag", -1 - rank))
        for _ in range(loops - loop_count(template)):  # never expected: a loop the walk did not see
            template = ("loop", -1 - rank, template, False)
        loop_sizes, example_sizes = tuple(user[:loops]), tuple(user[loops : loops + examples])
        infos.append(TagInfo(name, source(first, first.key in modules), loop_sizes, example_sizes, template))
        order = step_order(template, loop_sizes)
        value_codes.append(_first_code([s.to_user(values[s.key]) for s in group if s.key in values], order, examples, False))
        grads = [s.to_user(g_eps[s.key]) for s in group if s.key in g_eps]
        gradient_codes.append(_first_code(grads, order, examples, True))
    return tuple(infos), value_codes, gradient_codes


def _stacked(codes: list, dtype=jnp.int32):
    return jnp.stack(codes) if codes else jnp.zeros((0,), dtype)


def _first_code(leaves: Sequence, order: StepOrder, examples: int, backward: bool):
    """The first non-finite entry of ``leaves`` (one tag, in the documented layout: loop axes,
    ``examples`` vmap axes, the value's own) in the order the program computes them, as ``2 *
    (position * number of examples + flat example) + is_inf``; ``NONE`` if all are finite. The
    position is ``order``'s, counted from the end with ``backward``.

    Each leaf is reduced over its own axes first, as one byte per entry (2: a NaN, 1: an inf, 0:
    finite) and a max, so what XLA writes between the elementwise step and the reduction is a
    quarter of an int32 array; the positions are then found on the small per-prefix array.
    """
    loops = len(order.loops)
    prefix = loops + examples
    worst = None
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            continue  # an integer tag (its gradient is float0) is always finite
        kind = jnp.where(jnp.isnan(leaf), jnp.int8(2), jnp.where(jnp.isinf(leaf), jnp.int8(1), jnp.int8(0)))
        per_prefix = jnp.max(kind, axis=tuple(range(prefix, leaf.ndim)), initial=jnp.int8(0))
        worst = per_prefix if worst is None else jnp.maximum(worst, per_prefix)
    if worst is None:
        return jnp.asarray(NONE, jnp.int32)
    shape = worst.shape
    example = jnp.zeros(shape, jnp.int32)
    stride = 1
    for axis in reversed(range(loops, prefix)):
        example = example + lax.broadcasted_iota(jnp.int32, shape, axis) * stride
        stride *= shape[axis]
    position = order.positions(jnp)
    if backward:
        position = (order.size - 1) - position
    flat = jnp.reshape(position, (*order.loops, *(1,) * examples)) * stride + example
    code = jnp.where(worst == 0, NONE, 2 * flat + (worst == 1).astype(jnp.int32))
    return jnp.min(code, initial=NONE)
