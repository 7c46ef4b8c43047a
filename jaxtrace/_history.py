"""``jaxtrace.stats.History``: the host-side record of per-tag statistics across training steps."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, cast

import jax
import numpy as np

from ._summary import entries

__all__ = ["History"]


class History:
    """Host-side record of per-tag statistics across training steps.

    ``append(step, stats, value_stats=None, **scalars)`` takes what
    :func:`summarize` or :func:`value_and_grad` returned (one device-to-host
    transfer), the statistics of the values at the tags if any
    (``value_and_grad(..., with_values=True)``'s ``value_stats``) and any
    scalars to log beside them (``loss=...``). ``history[name][stat]`` is a
    NumPy array of shape ``(number of appends, *loop axes)`` of the gradient
    statistics, ``history.values[name][stat]`` the same of the value
    statistics; ``history.steps`` holds the step numbers,
    ``history.scalar("loss")`` a logged scalar. A tag or scalar missing from
    some appends reads as ``nan`` there. ``jaxtrace.plot.layer_flow`` draws
    both, one line per scanned layer.

    Attributes:
        steps: the logged step numbers, a NumPy array.
        values: the value statistics, read like the History itself (same steps and scalars).

    Example:
        >>> import numpy as np, jaxtrace as jt
        >>> h = jt.stats.History()
        >>> h.append(0, {"a": {"norm": np.float32(2.0)}}, loss=1.0)
        >>> h.append(10, {"a": {"norm": np.float32(0.5)}}, {"a": {"norm": np.ones(3)}}, loss=0.5)
        >>> h.steps.tolist(), h["a"]["norm"].tolist(), h.scalar("loss").tolist()
        ([0, 10], [2.0, 0.5], [1.0, 0.5])
        >>> h.values["a"]["norm"].shape    # (appends, layers); nan where not appended
        (2, 3)
        >>> print(h.format())
        step 10  loss 0.5  | norm: a 0.5
        >>> h.append(20, {"a": {"norm": np.float32(0.5)}, "layers": {"norm": np.array([9.0, 0.5])}})
        >>> print(h.format())    # a scanned stack: one entry per layer
        step 20  | norm: a 0.5  layers[0] 9  layers[1] 0.5
    """

    def __init__(self):
        self._steps: list[int] = []
        self._stats: dict[str, dict[str, dict[int, np.ndarray]]] = {}
        self._value_stats: dict[str, dict[str, dict[int, np.ndarray]]] = {}
        self._scalars: dict[str, dict[int, float]] = {}

    def append(
        self,
        step: int,
        stats: Mapping[str, Mapping[str, Any]] | None = None,
        value_stats: Mapping[str, Mapping[str, Any]] | None = None,
        **scalars,
    ) -> None:
        """Records one step: its statistics, the value statistics if any, and scalars beside them.

        Args:
            step: the step number.
            stats: ``{name: {stat: array}}`` as :func:`summarize` returns it (``tag_stats``).
            value_stats: the same for the values at the tags (``with_values=True``).
            **scalars: numbers to log beside them (``loss=...``).

        Raises:
            TypeError: if an entry of ``stats`` or ``value_stats`` is not a dict ``{stat: array}``.
        """
        stats, value_stats, scalars = cast(
            "tuple[dict[str, Any], dict[str, Any], dict[str, Any]]",
            jax.device_get((dict(stats or {}), dict(value_stats or {}), scalars)),
        )
        row = len(self._steps)
        for what, table in (("stats", stats), ("value_stats", value_stats)):
            for name, per_stat in table.items():
                if not isinstance(per_stat, Mapping):
                    raise TypeError(
                        f"jaxtrace.stats.History.append: {what}[{name!r}] should be a dict {{stat: array}} "
                        f"as summarize returns, got {type(per_stat).__name__}."
                    )
        self._steps.append(int(step))
        for table, into in ((stats, self._stats), (value_stats, self._value_stats)):
            for name, per_stat in table.items():
                entry = into.setdefault(name, {})
                for stat, value in per_stat.items():
                    entry.setdefault(stat, {})[row] = np.asarray(value)
        for name, value in scalars.items():
            self._scalars.setdefault(name, {})[row] = float(np.asarray(value))

    @property
    def values(self) -> History:
        """The value statistics (``value_stats=`` of :meth:`append`), read like a History.

        It shares this History's steps and scalars; append to this History, not to it.
        """
        return _ValueStats(self)

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def steps(self) -> np.ndarray:
        return np.asarray(self._steps, dtype=np.int64)

    @property
    def names(self) -> list[str]:
        """Tag names, in the order they were first appended."""
        return list(self._stats)

    def __contains__(self, name: str) -> bool:
        return name in self._stats

    def __getitem__(self, name: str) -> dict[str, np.ndarray]:
        if name not in self._stats:
            raise KeyError(f"No statistics for {name!r} in this History; it has {self.names}.")
        return {stat: self._column(rows) for stat, rows in self._stats[name].items()}

    def array(self, name: str, stat: str = "norm") -> np.ndarray:
        """``history[name][stat]``: shape ``(len(history), *loop axes)``.

        Args:
            name: the tag.
            stat: the statistic.

        Returns:
            A NumPy array, ``nan`` at the steps where the tag was not appended.
        """
        per_stat = self[name]
        if stat not in per_stat:
            raise KeyError(f"No statistic {stat!r} for {name!r}; it has {sorted(per_stat)}.")
        return per_stat[stat]

    def scalar(self, name: str) -> np.ndarray:
        """A scalar logged with ``append(..., name=value)``, shape ``(len(history),)``.

        Args:
            name: the scalar's keyword in ``append``.

        Returns:
            A NumPy array, ``nan`` at the steps where it was not logged.
        """
        if name not in self._scalars:
            raise KeyError(f"No scalar {name!r} in this History; it has {sorted(self._scalars)}.")
        rows = self._scalars[name]
        return np.array([rows.get(i, np.nan) for i in range(len(self))])

    def _column(self, rows: dict) -> np.ndarray:
        template = next(iter(rows.values()))
        dtype = np.result_type(template.dtype, np.float32)
        missing = np.full(template.shape, np.nan, dtype)
        return np.stack([rows.get(i, missing).astype(dtype) for i in range(len(self))])

    def format(self, stat: str = "norm", names: Sequence[str] | None = None, row: int = -1) -> str:
        """One line for a log: the step, the scalars and ``stat`` per tag.

        A tag with loop axes (a scanned stack) shows one labelled entry per
        layer, ``name[0] 9  name[1] 0.5 ...``, as everywhere statistics are
        shown. The root module's name ``""`` (``jt.tag_modules``) is written ``""``.

        Args:
            stat: the statistic to show per tag.
            names: the tags to show, in order (default: all).
            row: which append (default: the last).

        Returns:
            The line, or ``"(empty History)"``.
        """
        if not self._steps:
            return "(empty History)"
        row = range(len(self))[row]
        parts = [f"step {self._steps[row]}"]
        parts += [f"{k} {v[row]:.4g}" for k, v in self._scalars.items() if row in v]
        cells = []
        for name in names if names is not None else self.names:
            value = self._stats.get(name, {}).get(stat, {}).get(row)
            if value is not None:  # one labelled cell per layer of a stack (entries' rule)
                cells += [f"{label} {float(value[i]):.3g}" for label, i in entries(name, np.shape(value))]
        line = "  ".join(parts)
        return f"{line}  | {stat}: " + "  ".join(cells) if cells else line


class _ValueStats(History):
    """``History.values``: the value statistics of a History, its steps and scalars shared."""

    def __init__(self, history: History):
        self._steps = history._steps
        self._stats = history._value_stats
        self._value_stats = {}
        self._scalars = history._scalars

    def append(self, *args, **kwargs) -> None:
        raise TypeError(
            "jaxtrace.stats.History.values is a view of a History's value statistics; append to the "
            "History itself: history.append(step, tag_stats, value_stats, loss=...)."
        )


History.__module__ = "jaxtrace.stats"  # its public home: pickles of a History name it there
