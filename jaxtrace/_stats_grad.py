"""The statistics transforms: differentiate and summarise each tag in one traced call.

``jaxtrace.stats.value_and_grad`` (each tag's gradient reduced, keeping its loop axes) and
``jaxtrace.stats.jacrev`` (each tag's Jacobian reduced per loss term), built on ``_ad`` and the
reduction in ``_summary``.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._ad import jacrev as _jacrev
from ._ad import value_and_grad_with_sites
from ._checks import check_callable
from ._selection import Selection, TagSelection
from ._summary import STATS, LoopAxes, check_stat_names, in_order, param_table, summarize, term_names_in_order

__all__ = ["value_and_grad", "jacrev"]


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    stats: str | Sequence[str] = STATS,
    per_example: bool = False,
    with_values: bool = False,
) -> Callable:
    """``jaxtrace.value_and_grad`` with each tag's gradient reduced by :func:`summarize`.

    Returns a function with ``fun``'s signature that returns
    ``(value, (grads, tag_stats))`` (with ``has_aux``
    ``((value, aux), (grads, tag_stats))``), where
    ``tag_stats = {name: {stat: array}}``. Each statistic keeps the tag's
    loop axes: a tag in plain code gives scalars, a tag in a ``lax.scan`` of
    length ``T`` (or a ``fori_loop``, ``lax.map``, or ``repeated=True`` calls)
    gives arrays of shape ``(T,)``, nested loops ``(T1, T2)``. Everything else
    (``vmap`` axes and the value's own axes) is reduced, unless
    ``per_example=True``, which keeps the vmap axes of ``vmap`` inside ``fun``
    too: shape ``(*loop axes, *vmap axes)``. Under ``jax.jit`` only these
    summaries leave the compiled program, not the cotangents.
    ``with_values=True`` appends the same statistics of the forward values at
    the tags (activations), from the same pass:
    ``(value, (grads, tag_stats), value_stats)``.

    Equinox and Flax NNX models get the same from their own transforms:
    ``jt.filter_value_and_grad(loss, stats=True)`` and
    ``jaxtrace.flax.value_and_grad(loss, stats=True)`` (a Linen model's
    ``params`` are a plain pytree: use this function).

    Args:
        fun: the function; it calls ``jaxtrace.tag`` inside.
        argnums: as in ``jaxtrace.value_and_grad``.
        has_aux: as in ``jaxtrace.value_and_grad``.
        tags: as in ``jaxtrace.value_and_grad``.
        stats: one name from ``STATS`` or ``"rms"``, or a sequence of them.
        per_example: also keep the axes of ``vmap`` inside ``fun``.
        with_values: also return the same statistics of the values at the tags.

    Returns:
        A function that returns ``(value, (grads, tag_stats))``, or with
        ``has_aux`` ``((value, aux), (grads, tag_stats))``; ``with_values=True``
        appends ``value_stats``.

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` is of the wrong kind.
        ValueError: if a name in ``stats`` is not in ``STATS`` or ``"rms"``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxtrace as jt
        >>> def loss(w, xs):
        ...     def step(h, x):
        ...         h = jt.tag(jnp.tanh(w * h + x), "h")
        ...         return h, None
        ...     h, _ = jax.lax.scan(step, jnp.zeros(2), xs)
        ...     return jnp.sum(h)
        >>> _, (_, s) = jax.jit(jt.stats.value_and_grad(loss))(0.5, jnp.ones((5, 2)))
        >>> s["h"]["norm"].shape    # one norm per scan step
        (5,)
    """
    check_callable(fun, "jaxtrace.stats.value_and_grad")
    fun_with_sites = value_and_grad_with_sites(fun, argnums, has_aux=has_aux, tags=tags, with_values=with_values)
    stats = check_stat_names(stats)  # check the statistic names now, not at the first call

    @functools.wraps(fun)
    def stats_fun(*args, **kwargs):
        result, sites = fun_with_sites(*args, **kwargs)
        value, (grads, tag_grads), *values = result
        keep = {}
        for site in sites:
            keep[site.name] = len(site.stack) + (len(site.batch_axes) if per_example else 0)
        out = (value, (grads, summarize(tag_grads, loop_axes=keep, stats=stats)))
        return (*out, summarize(values[0], loop_axes=keep, stats=stats)) if with_values else out

    return stats_fun


def jacrev(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    stats: str | Sequence[str] = STATS,
    loop_axes: LoopAxes = 0,
    param_stats: bool = False,
) -> Callable:
    """:func:`jaxtrace.jacrev` with each tag's Jacobian reduced per term: which loss term reaches which tag.

    Returns a function with ``fun``'s signature that returns ``(jac, table)``
    (with ``has_aux`` ``((jac, table), aux)``), where ``jac`` is what
    ``jax.jacrev`` returns and ``table = {tag: {term: {stat: array}}}`` is
    :func:`summarize` of the tag Jacobians per output leaf ("term", named by
    its path in the output: ``"ce"`` for ``{"ce": ...}``). The tags come in the
    order the program reached them and the terms in the order ``fun`` built
    its output, under ``jax.jit`` too, so :func:`format_paths` prints them in
    that order. An exact zero: the term does not reach the tag.
    ``loop_axes`` is :func:`summarize`'s (default: every axis reduced).
    ``param_stats=True`` reduces ``jac`` the same way, to the table
    ``{parameter: {term: {stat: array}}}`` (parameters named by dotted paths,
    ``"layers.0.weight"``): which loss term reaches which parameter.

    One way per framework, as for gradients: a pytree of arrays goes here; an
    equinox model to ``jt.filter_jacrev(fun, stats=...)`` (its floating arrays,
    as ``eqx.filter_jacrev``), an NNX model to ``jaxtrace.flax.jacrev(fun,
    stats=...)`` (its ``nnx.Param`` state, as ``nnx.grad``).

    Args:
        fun: the function; it returns the loss terms (a pytree) and calls ``jaxtrace.tag`` inside.
        argnums: as in ``jax.jacrev``.
        has_aux: ``fun`` returns ``(terms, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        stats: one name from ``STATS``, or a sequence of them.
        loop_axes: how many leading axes of each tag to keep, as in :func:`summarize`.
        param_stats: return the parameters' table in place of ``jac``.

    Returns:
        A function that returns ``(jac, table)``, or with ``has_aux``
        ``((jac, table), aux)``; with ``param_stats=True``, ``jac`` is the
        parameters' table.

    Example:
        >>> import jax, jax.numpy as jnp, jaxtrace as jt
        >>> def losses(w):
        ...     h = jt.tag(w * jnp.arange(3.0), "h")
        ...     return {"main": jnp.sum(h ** 2), "aux": jnp.sum(jax.lax.stop_gradient(h))}
        >>> _, table = jax.jit(jt.stats.jacrev(losses, stats="norm"))(2.0)
        >>> print(jt.stats.format_paths(table))
        tag  main      aux
        h    8.94      0 (none)
    """
    check_callable(fun, "jaxtrace.stats.jacrev")
    tags = Selection.of(tags)  # tags= read once, when the function is wrapped
    stats = check_stat_names(stats)  # check the statistic names now, not at the first call

    @functools.wraps(fun)
    def table_fun(*args, **kwargs):
        seen = []

        def recorded(*a, **k):  # sees the output as fun built it, before JAX sorts its dicts
            result = fun(*a, **k)
            out = result[0] if has_aux and isinstance(result, tuple) and len(result) == 2 else result
            shapes = jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf)), out)
            seen.append((shapes, term_names_in_order(out)))
            return result

        result = _jacrev(recorded, argnums, has_aux=has_aux, tags=tags)(*args, **kwargs)
        (jac, tag_jacs), aux = result if has_aux else (result, None)
        shapes, order = seen[0]
        table = summarize(tag_jacs, terms=shapes, loop_axes=loop_axes, stats=stats)
        table = collections.OrderedDict((name, in_order(per_term, order)) for name, per_term in table.items())
        if param_stats:
            jac = param_table(jac, shapes, stats, order)
        return ((jac, table), aux) if has_aux else (jac, table)

    return table_fun
