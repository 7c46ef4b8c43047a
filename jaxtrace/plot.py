"""Pictures of gradients: gradient flow over training, per-layer activation and gradient norms,
per-timestep norms, heatmap overlays.

Needs matplotlib (``pip install -e ".[plot]"`` from a checkout); the rest of jaxtrace
never imports it. Figures are drawn with matplotlib's Agg canvas, without
``pyplot`` (no windows, no global state): each function returns a
``matplotlib.figure.Figure`` and, given ``path=``, also saves it there.

Example:
    >>> import numpy as np, jaxtrace as jt
    >>> from jaxtrace import plot
    >>> history = jt.stats.History()
    >>> for step in range(3):
    ...     history.append(step, {"layer0": {"norm": np.float32(1.0 / (step + 1))}})
    >>> fig = plot.grad_flow(history, stat="norm")
    >>> [ax.get_title() for ax in fig.axes]
    ['norm over training', 'norm per tag at step 2']
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

try:
    import matplotlib
    import matplotlib.cm
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
except ImportError as error:  # pragma: no cover - exercised without matplotlib
    raise ImportError(
        "jaxtrace.plot needs matplotlib, which is not installed. Install it with "
        '`pip install -e ".[plot]"` from a jaxtrace checkout (or `pip install matplotlib`).'
    ) from error

from . import _plot_parts as _parts
from ._summary import entries, stack_shape

__all__ = ["grad_flow", "layer_flow", "timestep_norms", "overlay", "paths"]


def grad_flow(
    history,
    stat: str = "norm",
    names: Sequence[str] | None = None,
    *,
    title: str | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Gradient flow from a ``jaxtrace.stats.History``: per-tag curves over steps, and a bar per tag.

    Left: ``stat`` for each tag over the logged steps (log scale; one colour
    per tag, in order, so depth reads as a colour ramp). Right: one bar per tag
    at the last logged step: ``mean_abs`` and ``max_abs`` when the history has
    them (the classic gradient-flow bar chart), else ``stat``; tags with
    non-finite entries at that step are marked in red. A tag with loop axes (a
    scanned stack) gets one line and one bar per layer, labelled ``name[i]``,
    as everywhere statistics are shown.

    Args:
        history: a ``jaxtrace.stats.History``.
        stat: the statistic of the curves.
        names: the tags to draw, in order (default: all).
        title: the figure's title.
        path: where to save the figure too (any format matplotlib writes).

    Returns:
        The matplotlib ``Figure``.

    Example:
        >>> import numpy as np, jaxtrace as jt
        >>> from jaxtrace import plot
        >>> h = jt.stats.History()
        >>> h.append(0, {"a": {"norm": np.ones(4)}, "b": {"norm": np.float32(0.1)}})
        >>> [line.get_label() for line in plot.grad_flow(h).axes[0].lines]    # a: 4 scanned layers
        ['a[0]', 'a[1]', 'a[2]', 'a[3]', 'b']
    """
    names = list(history.names if names is None else names)
    if not names:
        raise ValueError("jaxtrace.plot.grad_flow: the History holds no statistics yet; append some first.")
    fig = _parts.figure(11, 4.2)
    ax_lines, ax_bars = fig.subplots(1, 2, width_ratios=[1.5, 1])
    # One line and one bar per entry: a scanned stack's layers apart (entries' rule), never reduced.
    rows = [(label, n, i) for n in names for label, i in entries(n, history.array(n, stat).shape[1:])]
    colors = _parts.colors(len(rows))
    _flow_curves(ax_lines, history, rows, colors, stat)
    _flow_bars(ax_bars, history, rows, colors, stat, set.intersection(*(set(history[name]) for name in names)))
    if title:
        fig.suptitle(title)
    return _parts.finish(fig, path)


def _column(history, name: str, stat: str, i: tuple) -> np.ndarray:
    """Entry ``i`` of a tag's ``stat`` at every logged step."""
    return np.asarray(history.array(name, stat), dtype=np.float64)[(slice(None), *i)]


def _flow_curves(ax, history, rows: list, colors: list, stat: str) -> None:
    """``grad_flow``'s left panel: ``stat`` of each entry (``rows``: ``(label, tag, index)``) over the steps."""
    steps = history.steps
    for (label, name, i), color in zip(rows, colors):
        ax.plot(steps, _parts.positive(_column(history, name, stat, i)), color=color, lw=1.8, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel(_LABELS.get(stat, stat))
    ax.set_title(f"{stat} over training")
    ax.grid(True, which="major", alpha=0.3)
    if len(rows) <= 12:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _flow_bars(ax, history, rows: list, colors: list, stat: str, available: set) -> None:
    """``grad_flow``'s right panel: a bar per entry at the last logged step, ``mean_abs`` inside
    ``max_abs`` where every tag has both (``available``: the statistics they all have), else ``stat``;
    the entries with non-finite entries at that step marked in red."""
    steps, x = history.steps, np.arange(len(rows))
    last = len(steps) - 1
    if {"mean_abs", "max_abs"} <= available:
        maxes = [_column(history, n, "max_abs", i)[last] for _, n, i in rows]
        means = [_column(history, n, "mean_abs", i)[last] for _, n, i in rows]
        ax.bar(x, _parts.positive(maxes), color="#9ecae1", width=0.75, label="max |g|")
        ax.bar(x, _parts.positive(means), color="#08519c", width=0.45, label="mean |g|")
        ax.set_ylabel("|gradient|")
        ax.legend(fontsize=8, frameon=False)
    else:
        values = [_column(history, n, stat, i)[last] for _, n, i in rows]
        ax.bar(x, _parts.positive(values), color=colors, width=0.7)
        ax.set_ylabel(_LABELS.get(stat, stat))
    if "nonfinite" in available:
        for k, (_, n, i) in enumerate(rows):
            if _column(history, n, "nonfinite", i)[last] > 0:
                ax.axvspan(k - 0.5, k + 0.5, color="red", alpha=0.2, lw=0)
    ax.set_yscale("log")
    labels = [label for label, _, _ in rows]
    ax.set_xticks(x, labels, rotation=45 if len(rows) > 4 else 0, ha="right" if len(rows) > 4 else "center")
    ax.set_title(f"{'|g|' if {'mean_abs', 'max_abs'} <= available else stat} per tag at step {steps[last]}")
    ax.grid(True, axis="y", alpha=0.3)


def layer_flow(
    history,
    stat: str = "norm",
    names: Sequence[str] | None = None,
    *,
    title: str | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Per-layer activation and gradient statistics over training, one line per scanned layer.

    Left: ``stat`` of the values at the tags (``history.values``, appended as
    ``value_stats`` from ``jt.stats.value_and_grad(..., with_values=True)``);
    right: of the gradients there (``history``). A panel without statistics is
    left out. A tag with loop axes (a stack of layers run by ``lax.scan``: one
    entry per layer) gives one line per entry, labelled ``name[i]``, coloured
    from dark (the first layer) to light (the last); a tag in plain code, one
    line. Log scale; non-positive and non-finite entries are gaps.

    Args:
        history: a ``jaxtrace.stats.History``.
        stat: the statistic to draw.
        names: the tags to draw, in order (default: all, in each panel).
        title: the figure's title.
        path: where to save the figure too (any format matplotlib writes).

    Returns:
        The matplotlib ``Figure``.

    Example:
        >>> import numpy as np, jaxtrace as jt
        >>> from jaxtrace import plot
        >>> h = jt.stats.History()
        >>> for step in range(3):   # a 4-layer scanned stack: one norm per layer
        ...     h.append(step, {"layer": {"norm": np.full(4, 0.1)}}, {"layer": {"norm": np.arange(1.0, 5.0)}})
        >>> fig = plot.layer_flow(h)
        >>> [(ax.get_title(), len(ax.lines)) for ax in fig.axes]
        [('activation norm per layer', 4), ('gradient norm per layer', 4)]
    """
    panels = [
        (table, kind)
        for table, kind in ((history.values, "activation"), (history, "gradient"))
        if (table.names if names is None else [n for n in names if n in table])
    ]
    if not panels:
        raise ValueError(
            "jaxtrace.plot.layer_flow: the History holds no statistics of these tags yet; append the "
            "tag_stats and value_stats of jt.stats.value_and_grad(..., with_values=True) first."
        )
    steps = history.steps
    fig = _parts.figure(5.5 * len(panels) + 1.5, 4.2)
    axes = np.atleast_1d(fig.subplots(1, len(panels), squeeze=False)).ravel()
    for ax, (table, kind) in zip(axes, panels):
        lines = []
        for name in table.names if names is None else [n for n in names if n in table]:
            if stat not in table[name]:
                continue
            values = np.asarray(table.array(name, stat), dtype=np.float64)
            lines += [(label, values[(slice(None), *i)]) for label, i in entries(name, values.shape[1:])]
        for (label, column), color in zip(lines, _parts.colors(len(lines))):
            ax.plot(steps, _parts.positive(column), color=color, lw=1.6, label=label)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel(f"{kind} {stat}")
        ax.set_title(f"{kind} {stat} per layer")
        ax.grid(True, which="major", alpha=0.3)
        if 0 < len(lines) <= 12:
            ax.legend(fontsize=7, frameon=False)
    if title:
        fig.suptitle(title)
    return _parts.finish(fig, path)


_LABELS = {
    "norm": "gradient L2 norm",
    "mean_abs": "mean |gradient|",
    "max_abs": "max |gradient|",
    "nonfinite": "fraction non-finite",
}


def timestep_norms(
    norms: Mapping[str, np.ndarray],
    *,
    title: str | None = "gradient norm per timestep",
    ylabel: str = "‖∂loss/∂h_t‖",
    band: tuple[float, float] = (10, 90),
    path: str | os.PathLike | None = None,
) -> Figure:
    """Per-timestep gradient norms of recurrent models, one curve per model (log scale).

    ``norms`` maps a label to an array of shape ``(T,)`` (one norm per step,
    as ``jaxtrace.stats.value_and_grad`` gives for a tag in a ``lax.scan``) or
    ``(T, B)`` (per step and example, ``per_example=True``): then the median
    over examples is drawn, with the ``band`` percentiles shaded.

    Args:
        norms: ``{label: array of shape (T,) or (T, B)}``.
        title: the figure's title.
        ylabel: the y axis label.
        band: the percentiles shaded for ``(T, B)`` arrays.
        path: where to save the figure too (any format matplotlib writes).

    Returns:
        The matplotlib ``Figure``.

    Example:
        >>> import numpy as np
        >>> from jaxtrace import plot
        >>> fig = plot.timestep_norms({"rnn": 0.9 ** np.arange(50)[::-1], "gru": np.ones((50, 8))})
        >>> [line.get_label() for line in fig.axes[0].lines]
        ['rnn', 'gru']
    """
    if not norms:
        raise ValueError("jaxtrace.plot.timestep_norms: pass at least one {label: norms} entry.")
    fig = _parts.figure(8, 4)
    ax = fig.add_subplot()
    palette = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    for i, (label, values) in enumerate(norms.items()):
        values = np.asarray(values, dtype=np.float64)
        if values.ndim not in (1, 2):
            raise ValueError(
                f"jaxtrace.plot.timestep_norms: norms[{label!r}] has shape {values.shape}; expected (T,) or (T, B)."
            )
        color = palette[i % len(palette)]
        t = np.arange(len(values))
        if values.ndim == 2:
            lo, mid, hi = np.nanpercentile(values, [band[0], 50, band[1]], axis=1)
            ax.fill_between(t, _parts.positive(lo), _parts.positive(hi), color=color, alpha=0.18, lw=0)
            values = mid
        ax.plot(t, _parts.positive(values), color=color, lw=2, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("timestep t")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(frameon=False)
    if title:
        ax.set_title(title)
    return _parts.finish(fig, path)


def overlay(
    images,
    heatmaps,
    *,
    titles: Sequence[str] | None = None,
    ncols: int | None = None,
    alpha: float = 0.5,
    cmap: str = "jet",
    vmax: float | None = None,
    colorbar: bool | None = None,
    size: float = 2.2,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Heatmaps (saliency, Grad-CAM) drawn over their images, in a grid.

    ``images``: one image or a sequence, each ``(H, W)`` (grey) or
    ``(H, W, 3)`` (RGB, values in [0, 1] or any range: each is rescaled).
    ``heatmaps``: one per image, any resolution (stretched over the image with
    bilinear interpolation, so a coarse Grad-CAM map needs no resizing), each
    drawn on the scale [0, its own max], or [0, ``vmax``] for all maps when
    ``vmax`` is given (to compare maps); ``None`` shows the image alone. With
    ``vmax`` one colorbar beside the grid shows that shared scale (``colorbar=False``
    leaves it out; without ``vmax`` each map has its own scale and no colorbar is
    drawn). Panels fill rows of ``ncols`` (default: all in one row, at most 6).

    Args:
        images: one image or a sequence.
        heatmaps: one per image (``None``: the image alone).
        titles: one title per panel.
        ncols: panels per row.
        alpha: the heatmaps' opacity.
        cmap: the heatmaps' colour map.
        vmax: one colour scale ``[0, vmax]`` for all maps.
        colorbar: draw that shared scale beside the grid (default: when ``vmax`` is given).
        size: each panel's size in inches.
        path: where to save the figure too (any format matplotlib writes).

    Returns:
        The matplotlib ``Figure``.

    Example:
        >>> import numpy as np
        >>> from jaxtrace import plot
        >>> image, cam = np.random.rand(32, 32), np.random.rand(4, 4)
        >>> fig = plot.overlay([image, image], [None, cam], titles=["input", "Grad-CAM"])
        >>> len(fig.axes)
        2
        >>> len(plot.overlay([image, image], [cam, cam / 2], vmax=1.0).axes)  # and a colorbar
        3
    """
    images, heatmaps = _parts.overlay_inputs(images, heatmaps, titles)
    n = len(images)
    ncols = ncols or min(n, 6)
    nrows = -(-n // ncols)
    colorbar = vmax is not None if colorbar is None else colorbar
    if colorbar and vmax is None:
        raise ValueError("jaxtrace.plot.overlay: colorbar=True needs vmax=, the one scale the maps share.")
    fig = _parts.figure(size * ncols + (0.7 if colorbar else 0), size * nrows + (0.25 if titles else 0))
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    for i, ax in enumerate(axes):
        ax.set_axis_off()
        if i >= n:
            continue
        _parts.overlay_panel(ax, i, images[i], heatmaps[i], alpha=alpha, cmap=cmap, vmax=vmax)
        if titles is not None:
            ax.set_title(titles[i], fontsize=9)
    if colorbar:
        # the maps were drawn as heat / vmax on [0, 1]: label the bar in the maps' own units
        mappable = matplotlib.cm.ScalarMappable(Normalize(0, vmax), cmap=cmap)
        bar = fig.colorbar(mappable, ax=list(axes), shrink=0.8, aspect=30)
        bar.set_label("heatmap (one scale for all)", fontsize=8)
        bar.ax.tick_params(labelsize=7)
    return _parts.finish(fig, path)


def paths(
    table,
    stat: str = "norm",
    tags: Sequence[str] | None = None,
    *,
    title: str | None = None,
    titles: Sequence[str] | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Which loss term reaches which tag: a heatmap of ``log10`` of ``stat``, tags x terms.

    ``table`` is what ``jt.stats.summarize(tag_jacs, terms=...)`` (or
    ``jt.stats.jacrev``) returns, or a list of such tables to compare (a clean
    model and a buggy one): one panel each, side by side, all on one colour
    scale, shown by one colorbar, so one value has one colour in every panel.
    ``titles`` names the panels; ``title`` is the figure's title.
    Rows are tags (in ``tags`` order, else the first table's; a stacked tag,
    one row per layer, ``name[i]``), columns are terms (in the tables' order). A cell that is exactly zero (the term does
    not reach the tag: a detached path) is grey and marked with a cross,
    apart from the colour scale.

    Args:
        table: what ``jt.stats.summarize(tag_jacs, terms=...)`` returns.
        stat: the statistic to show.
        tags: the rows, in order (default: the table's).
        title: the figure's title.
        titles: one title per panel, with a list of tables.
        path: where to save the figure too (any format matplotlib writes).

    Returns:
        The matplotlib ``Figure``.

    Example:
        >>> import numpy as np
        >>> from jaxtrace import plot
        >>> table = {"h": {"ce": {"norm": np.float32(0.5)}, "aux": {"norm": np.float32(0.0)}}}
        >>> fig = plot.paths(table)
        >>> fig.axes[0].get_xticklabels()[1].get_text()
        'aux'
        >>> buggy = {"h": {"ce": {"norm": np.float32(0.05)}, "aux": {"norm": np.float32(0.0)}}}
        >>> fig = plot.paths([table, buggy], titles=["clean", "buggy"])
        >>> [ax.get_title() for ax in fig.axes[:2]], fig.axes[0].images[0].norm is fig.axes[1].images[0].norm
        (['clean', 'buggy'], True)
    """
    tables, names = _parts.path_tables(table, tags, titles)
    terms = list(dict.fromkeys(term for t in tables for name in names for term in t[name]))
    # a row per layer of a stacked tag (entries' rule)
    rows = [(label, name, i) for name in names for label, i in entries(name, stack_shape(tables[0][name], stat))]
    panels = [_parts.path_values(t, rows, terms, stat) for t in tables]
    logs = [np.log10(_parts.positive(values)) for values in panels]
    norm = _parts.one_scale(logs)  # one scale for every panel
    n = len(tables)
    fig = _parts.figure(1.2 + n * (0.6 + 1.1 * len(terms)) + 0.8, 1.2 + 0.42 * len(rows) + (0.3 if title and (n > 1 or titles is not None) else 0))
    axes = np.atleast_1d(fig.subplots(1, n, sharey=True, squeeze=False)).ravel()
    cmap = matplotlib.colormaps["magma"].with_extremes(bad="#d9d9d9")
    image = None
    for k, (ax, values, lg) in enumerate(zip(axes, panels, logs)):
        image = _parts.paths_panel(ax, values, lg, norm, cmap, terms)
        if k == 0:
            ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
            ax.set_ylabel("tag")
        if titles is not None:
            ax.set_title(titles[k])
        elif n == 1:
            ax.set_title(title or f"|d term / d tag| ({stat})")
    if title and (n > 1 or titles is not None):
        fig.suptitle(title)
    fig.colorbar(image, ax=list(axes), label=f"log10 {stat}")
    return _parts.finish(fig, path)
