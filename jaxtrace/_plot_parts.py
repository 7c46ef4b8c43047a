"""The drawing pieces of ``jaxtrace.plot``: figures without ``pyplot``, log scales, the panels of
``overlay`` and ``paths``. Imported by ``jaxtrace.plot`` only, after its check that matplotlib is
installed.
"""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from numpy.typing import ArrayLike

from ._summary import entry_of

__all__ = [
    "figure",
    "finish",
    "colors",
    "positive",
    "overlay_inputs",
    "overlay_panel",
    "path_tables",
    "path_values",
    "one_scale",
    "paths_panel",
]


def figure(width: float, height: float) -> Figure:
    """A figure on the Agg canvas (no pyplot: no window, no global state)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def finish(fig: Figure, path: str | os.PathLike | None, dpi: int = 110) -> Figure:
    """``fig``, saved at ``path`` first when one is given."""
    if path is not None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        fig.savefig(path, dpi=dpi)
    return fig


def colors(n: int):
    """``n`` colours along viridis, one per line."""
    cmap = matplotlib.colormaps["viridis"]
    return [cmap(0.9 * i / max(n - 1, 1)) for i in range(n)]


def positive(values: ArrayLike) -> np.ndarray:
    """Values for a log axis: non-positive and non-finite entries become nan (gaps)."""
    values = np.asarray(values, dtype=np.float64)
    return np.where(np.isfinite(values) & (values > 0), values, np.nan)


def overlay_inputs(images, heatmaps, titles) -> tuple[list, list]:
    """``images`` and ``heatmaps`` as two lists of one entry per panel (one image alone: one panel)."""
    single = not isinstance(images, (list, tuple)) and (
        np.ndim(images) == 2 or (np.ndim(images) == 3 and np.shape(images)[-1] in (3, 4))
    )
    if single:
        images, heatmaps = [images], [heatmaps]
    images, heatmaps = list(images), list(heatmaps)
    if len(images) != len(heatmaps):
        raise ValueError(
            f"jaxtrace.plot.overlay: {len(images)} images but {len(heatmaps)} heatmaps; pass one heatmap "
            "(or None) per image."
        )
    if titles is not None and len(titles) != len(images):
        raise ValueError(f"jaxtrace.plot.overlay: {len(titles)} titles for {len(images)} images.")
    return images, heatmaps


def overlay_panel(ax, i: int, image, heat, *, alpha: float, cmap: str, vmax: float | None) -> None:
    """Image ``i`` rescaled to [0, 1], and its heatmap (if any) over it on [0, its max or ``vmax``]."""
    image = np.asarray(image, dtype=np.float64)
    # 2 or 3 axes; NumPy >= 2.5's stubs guess a 1-D array from asarray of an untyped value.
    h, w = image.shape[:2]  # pyright: ignore[reportAssignmentType]
    lo, hi = np.nanmin(image), np.nanmax(image)
    image = (image - lo) / (hi - lo) if hi > lo else np.zeros_like(image)
    ax.imshow(image, cmap="gray" if image.ndim == 2 else None, extent=(0, w, h, 0), interpolation="nearest")
    if heat is None:
        return
    heat = np.asarray(heat, dtype=np.float64)
    if heat.ndim != 2:
        raise ValueError(f"jaxtrace.plot.overlay: heatmap {i} has shape {heat.shape}; expected (h, w).")
    top = np.nanmax(heat) if vmax is None else vmax
    heat = np.clip(heat / top, 0, 1) if top > 0 else np.zeros_like(heat)
    ax.imshow(heat, cmap=cmap, alpha=alpha, extent=(0, w, h, 0), interpolation="bilinear", vmin=0, vmax=1)


def path_tables(table, tags: Sequence[str] | None, titles: Sequence[str] | None) -> tuple[list, list]:
    """``(tables, row names)``: one table or a list of them as dicts, each checked to hold every row."""
    tables = [dict(t) for t in table] if isinstance(table, (list, tuple)) else [dict(table)]
    if not tables:
        raise ValueError("jaxtrace.plot.paths: pass a table, or a list of tables to compare.")
    if titles is not None and len(titles) != len(tables):
        raise ValueError(f"jaxtrace.plot.paths: {len(titles)} titles for {len(tables)} tables.")
    tables = [{name: dict(per_term) for name, per_term in t.items()} for t in tables]
    names = list(tables[0]) if tags is None else list(tags)
    for k, t in enumerate(tables):
        missing = [name for name in names if name not in t]
        if missing:
            raise ValueError(f"jaxtrace.plot.paths: table {k} has no tag {missing[0]!r}; it has {list(t)}.")
    return tables, names


def path_values(table: dict, rows: list, terms: list, stat: str) -> np.ndarray:
    """The rows x terms array of ``stat``, a row per ``(label, tag, index)`` (a layer of a stack); ``nan`` where absent."""
    values = np.full((len(rows), len(terms)), np.nan)
    for k, (_, name, index) in enumerate(rows):
        for j, term in enumerate(terms):
            cell = table[name].get(term, {}).get(stat)
            if cell is not None:
                values[k, j] = entry_of(cell, index)
    return values


def one_scale(logs: list) -> Normalize:
    """One colour scale over the finite entries of every panel."""
    finite = np.concatenate([lg[np.isfinite(lg)] for lg in logs])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (-1.0, 0.0)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    return Normalize(vmin=lo, vmax=hi)


def paths_panel(ax, values: np.ndarray, lg: np.ndarray, norm: Normalize, cmap, terms: list):
    """One table's heatmap, its cells written in, the cells without a path crossed out."""
    image = ax.imshow(np.ma.masked_invalid(lg), cmap=cmap, norm=norm, aspect="auto")
    for i, j in zip(*np.nonzero(values == 0)):
        ax.text(j, i, "x  no path", ha="center", va="center", fontsize=8, color="#b30000")
    for i, j in zip(*np.nonzero(np.isfinite(lg))):
        dark = norm(lg[i, j]) < 0.5  # magma is dark at the low end: white text there
        ax.text(j, i, f"{values[i, j]:.2g}", ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(terms)), [t or "(output)" for t in terms])
    ax.set_xlabel("loss term")
    return image
