"""``stats=`` of the framework transforms (equinox's ``filter_value_and_grad``, ``jaxtrace.flax``)."""

from __future__ import annotations

from typing import Any

from . import stats as jt_stats


def stat_names(stats) -> Any:
    """``stats=`` of the framework transforms as a hashable value: ``None``/``False`` (no statistics:
    gradients), ``True`` (all of ``jaxtrace.stats.STATS``), or statistic names, checked now."""
    if stats is None or stats is False:
        return None
    if stats is True:
        return jt_stats.STATS
    names = (stats,) if isinstance(stats, str) else tuple(stats) if isinstance(stats, (list, tuple)) else stats
    jt_stats.value_and_grad(lambda x: x, stats=names)  # the check of the names, at wrapping time
    return names
