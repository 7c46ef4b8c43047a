"""``stats=`` of the framework transforms, and the one entry point they call.

Equinox's ``filter_value_and_grad`` / ``filter_jacrev`` and ``jaxtrace.flax``'s transforms take
``stats=``: ``None`` for the gradients (``jaxtrace.value_and_grad``, ``jaxtrace.jacrev``), names
for their statistics (``jaxtrace.stats.value_and_grad``, ``jaxtrace.stats.jacrev``). The choice
between the two is made here, once.
"""

from __future__ import annotations

from typing import Any, Callable

from . import _ad
from . import _stats_grad
from ._selection import TagSelection
from ._summary import STATS, check_stat_names

__all__ = ["stat_names", "check_param_stats", "value_and_grad", "jacrev"]


def stat_names(stats) -> Any:
    """``stats=`` of the framework transforms as a hashable value: ``None``/``False`` (no statistics:
    gradients), ``True`` (all of ``jaxtrace.stats.STATS``), or statistic names, checked now."""
    if stats is None or stats is False:
        return None
    if stats is True:
        return STATS
    names = (stats,) if isinstance(stats, str) else tuple(stats) if isinstance(stats, (list, tuple)) else stats
    check_stat_names(names)  # the check of the names, at wrapping time
    return names


def value_and_grad(
    fun: Callable, argnums, *, has_aux: bool, tags: TagSelection, with_values: bool, stats: Any
) -> Callable:
    """``jaxtrace.value_and_grad``, or with ``stats`` (what ``stat_names`` returns) ``jaxtrace.stats.value_and_grad``."""
    if stats is None:
        return _ad.value_and_grad(fun, argnums, has_aux=has_aux, tags=tags, with_values=with_values)
    return _stats_grad.value_and_grad(fun, argnums, has_aux=has_aux, tags=tags, stats=stats, with_values=with_values)


def check_param_stats(param_stats, stats, api: str) -> bool:
    """``param_stats=`` checked against ``stats=`` (what ``stat_names`` returns): it needs statistics to reduce with."""
    if param_stats and stats is None:
        raise TypeError(
            f"{api}: param_stats=True reduces the parameters' Jacobian with the statistics of stats=, but "
            'stats= is None. Pass stats="norm" (or True for all of jaxtrace.stats.STATS) with it.'
        )
    return bool(param_stats)


def jacrev(fun: Callable, argnums, *, has_aux: bool, tags: TagSelection, stats: Any, param_stats: bool = False) -> Callable:
    """``jaxtrace.jacrev``, or with ``stats`` (what ``stat_names`` returns) ``jaxtrace.stats.jacrev``
    (``param_stats``: its parameters' table in place of ``jac``; checked by ``check_param_stats``)."""
    if stats is None:
        return _ad.jacrev(fun, argnums, has_aux=has_aux, tags=tags)
    return _stats_grad.jacrev(fun, argnums, has_aux=has_aux, tags=tags, stats=stats, param_stats=param_stats)
