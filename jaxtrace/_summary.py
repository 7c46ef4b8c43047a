"""Statistics of the arrays at tags: their definitions, the one-pass reduction, the per-term table.

``summarize`` reduces each tag's gradient (or value, or Jacobian per loss term) to a few numbers
inside the traced function; ``format_paths`` prints the tag x term table as text. The transforms
that differentiate and summarise in one call are in ``_stats_grad``; the public namespace is
``jaxtrace.stats``.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._paths import param_path, path_name

STATS = ("norm", "mean_abs", "max_abs", "nonfinite")
"""The statistics :func:`summarize` computes by default; ``"rms"`` is computed when asked for."""

KNOWN = (*STATS, "rms")

LoopAxes = Union[int, Mapping[str, int], Callable[[str], int]]

__all__ = [
    "STATS",
    "KNOWN",
    "LoopAxes",
    "summarize",
    "term_name",
    "format_paths",
    "param_table",
    "check_stat_names",
    "term_names_in_order",
    "in_order",
    "entries",
    "stack_shape",
    "entry_of",
]


def summarize(
    values: Mapping[str, Any],
    *,
    loop_axes: LoopAxes = 0,
    stats: str | Sequence[str] = STATS,
    terms: Any = None,
) -> dict[str, Any]:
    """Per-tag summaries of gradients (or any arrays), for use inside ``jax.jit``.

    ``values`` is a dict ``{name: pytree of arrays}``, such as the
    ``tag_grads`` that ``jaxtrace.grad`` returns. Returns
    ``{name: {stat: array}}`` with the statistics in ``stats`` (one name
    from ``STATS``, or a sequence of them), each computed over all entries of
    all leaves of the tag except its first ``loop_axes`` axes, which are
    kept: ``loop_axes`` is an int for every tag, a dict ``{name: int}``
    (missing names: 0) or a function of the name. By jaxtrace's layout rule
    the leading axes of a tag's gradient are its loop axes (outer loop
    first), then its vmap axes, so ``loop_axes=1`` for a tag in one
    ``lax.scan`` gives one value per step, and ``2`` for a tag in a scan over
    a ``vmap`` gives one per step and example.
    :func:`value_and_grad` fills in the loop axes from the program itself.

    Norm, rms, mean and max follow NumPy on non-finite input (``nan`` if any
    entry is ``nan``, else ``inf`` if any is ``inf``). The results have the
    gradient's real dtype, at least float32, and are accumulated in it: the
    sums of squares are also taken at two fixed power-of-two scales (exact),
    and the one in range is used, so large finite float32 gradients (``|g| >
    1e19``, whose squares overflow) and tiny ones (``|g| < 1e-19``, whose
    squares underflow) still give the right norm, under ``jax.jit`` too: each
    scaled entry is capped after its multiply, and no compiler rewrite moves
    the scale through the cap into the square (XLA:CPU flushes subnormal
    entries to 0 there). A tag with no entries has norm 0 and mean and rms
    ``nan``. A ``float0`` leaf (the
    gradient of an integer tag) counts as zeros.

    With ``terms``, ``values`` is the ``tag_jacs`` of :func:`jaxtrace.jacrev`
    and ``terms`` the function's output (or ``jax.eval_shape`` of it): each
    tag is then summarised per output leaf ("term"), ``{name: {term: {stat:
    array}}}``, the term named by its path in the output (``"ce"`` for
    ``{"ce": ...}``, ``""`` for a single array). The term's own axes are
    reduced too; ``loop_axes`` counts the tag's loop axes. An exact zero
    means the term does not reach the tag at all (:func:`format_paths`
    marks it). :func:`jacrev` does the Jacobian and this split in one call,
    with no ``terms=``.

    Args:
        values: ``{name: pytree of arrays}``, such as ``tag_grads``, or the
            ``tag_jacs`` of ``jaxtrace.jacrev`` with ``terms``.
        loop_axes: how many leading axes of each tag to keep: an int, a dict
            ``{name: int}`` (missing names: 0) or a function of the name.
        stats: one name from ``STATS`` or ``"rms"``, or a sequence of them.
        terms: the function's output (or ``jax.eval_shape`` of it), to summarise
            ``tag_jacs`` per output leaf.

    Returns:
        ``{name: {stat: array}}``, or with ``terms`` ``{name: {term: {stat: array}}}``.

    Raises:
        ValueError: if a name in ``stats`` is not in ``STATS`` or ``"rms"``.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> s = jt.stats.summarize({"h": jnp.array([[3.0, -4.0], [0.0, jnp.inf]])}, loop_axes=1)
        >>> s["h"]["norm"].tolist(), s["h"]["nonfinite"].tolist()
        ([5.0, inf], [0.0, 0.5])
    """
    stats = check_stat_names(stats)
    if not isinstance(values, Mapping):
        raise TypeError(
            "jaxtrace.stats.summarize takes a dict {name: pytree of arrays} (such as tag_grads), "
            f"got {type(values).__name__}. Wrap a single tree as {{'name': tree}}."
        )
    if terms is not None:
        # OrderedDicts: jax.jit hands them back in this order (plain dicts come back sorted by key).
        return collections.OrderedDict(
            (name, _per_term(name, value, terms, _axes_for(loop_axes, name), stats)) for name, value in values.items()
        )
    return {name: _summarize_one(name, value, _axes_for(loop_axes, name), stats) for name, value in values.items()}


def term_name(path) -> str:
    """A term's name from its path in the output: ``"ce"``, ``"losses.0"``, ``""`` for the root.

    Args:
        path: a pytree path, as ``jax.tree_util.tree_flatten_with_path`` gives it.

    Returns:
        The keys, attribute names and indices of ``path`` joined by dots.

    Example:
        >>> import jax, jaxtrace as jt
        >>> [jt.stats.term_name(p) for p, _ in jax.tree_util.tree_flatten_with_path({"ce": 1.0, "losses": [2.0]})[0]]
        ['ce', 'losses.0']
    """
    return path_name(path)


def _per_term(name: str, value, terms, keep: int, stats: tuple) -> dict:
    """``{term: {stat: array}}`` for one tag of ``tag_jacs``: the output's leaves split off first."""
    paths_and_leaves, structure = jax.tree_util.tree_flatten_with_path(terms)
    try:
        parts = structure.flatten_up_to(value)
    except (ValueError, TypeError):
        raise ValueError(
            f"jaxtrace.stats.summarize: tag_jacs[{name!r}] does not have the structure of terms= "
            f"({structure}) at its top. Pass the output of the function given to jt.jacrev (or "
            "jax.eval_shape of it) as terms=."
        ) from None
    out = {}
    for (path, leaf), part in zip(paths_and_leaves, parts):
        n = len(np.shape(leaf))
        # The term's own axes come first in a Jacobian; move them behind the tag's loop axes.
        moved = jax.tree_util.tree_map(lambda a: jnp.moveaxis(jnp.asarray(_as_float(a)), tuple(range(n)), tuple(range(-n, 0))), part)
        out[term_name(path)] = _summarize_one(f"{name}/{term_name(path)}", moved, keep, stats)
    return in_order(out, term_names_in_order(terms))


def param_table(jac, terms, stats: tuple, order: list[str] | None = None) -> collections.OrderedDict:
    """``{parameter: {term: {stat: array}}}``: each leaf of a parameter Jacobian ``jac`` (the output's
    structure on top, the parameters' below it, as ``jax.jacrev`` gives it) reduced per term, the
    parameters named by their dotted paths, in the order of the parameters' leaves, and the terms in
    ``order`` (the loss's). ``None`` leaves (not differentiated) have no row; an exact zero is a term
    that does not reach the parameter."""
    paths_and_leaves, structure = jax.tree_util.tree_flatten_with_path(terms)
    parts = structure.flatten_up_to(jac)
    table: collections.OrderedDict = collections.OrderedDict()
    for (path, _), part in zip(paths_and_leaves, parts):
        term = term_name(path)
        for path_in_params, leaf in jax.tree_util.tree_flatten_with_path(part)[0]:
            name = path_name(param_path(path_in_params))
            table.setdefault(name, {})[term] = _summarize_one(f"{name}/{term}", leaf, 0, stats)
    order = term_names_in_order(terms) if order is None else order
    return collections.OrderedDict((name, in_order(per_term, order)) for name, per_term in table.items())


def term_names_in_order(tree, prefix: tuple = ()) -> list[str]:
    """The term names of an output, dicts in the order the function built them (JAX sorts dict keys)."""
    if type(tree) in (dict, collections.OrderedDict):
        return [n for key, sub in tree.items() for n in term_names_in_order(sub, (*prefix, str(key)))]
    if type(tree) in (list, tuple):
        return [n for i, sub in enumerate(tree) for n in term_names_in_order(sub, (*prefix, str(i)))]
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [".".join((*prefix, term_name(path))) if path else ".".join(prefix) for path, _ in leaves]


def in_order(per_term: dict, order: list[str]) -> collections.OrderedDict:
    """``per_term`` with its terms in ``order`` first (the order the loss built them), then the rest."""
    known = [t for t in dict.fromkeys(order) if t in per_term]
    return collections.OrderedDict((t, per_term[t]) for t in known + [t for t in per_term if t not in known])


def format_paths(
    table: Mapping[str, Mapping[str, Mapping[str, Any]]],
    stat: str = "norm",
    tags: Sequence[str] | None = None,
    header: str = "tag",
) -> str:
    """The tag x term table of :func:`summarize` ``(tag_jacs, terms=...)`` as text.

    One row per tag, in ``tags`` order if given, else the table's, and one
    column per term, in the table's order: :func:`jacrev` and ``summarize``
    keep the tags in the order the program reached them and the terms in the
    order the loss built them, under ``jax.jit`` too. Each cell is ``stat``.
    A tag with kept loop axes (a scanned stack) has one row per layer,
    ``name[i]``, as everywhere statistics are shown. A term that does not
    reach a tag (exactly zero) shows as ``0 (none)``: a detached path (a
    stray ``stop_gradient``) looks like that. The parameter table of
    ``jt.filter_jacrev(..., stats="norm", param_stats=True)`` prints the same way,
    one row per parameter (``header="parameter"``).

    Args:
        table: what ``summarize(tag_jacs, terms=...)`` returns.
        stat: the statistic to show.
        tags: the rows, in order (default: the table's).
        header: the first column's title.

    Returns:
        The table as text, one line per tag (per layer of a stacked tag).

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> table = {"h": {"ce": {"norm": jnp.float32(0.5)}, "aux": {"norm": jnp.float32(0.0)}}}
        >>> print(jt.stats.format_paths(table))
        tag  ce        aux
        h    0.5       0 (none)
    """
    names = list(table) if tags is None else list(tags)
    terms = list(dict.fromkeys(t for name in names for t in table[name]))
    rows = [[header, *[t or "(output)" for t in terms]]]
    for name in names:
        for label, index in entries(name, stack_shape(table[name], stat)):
            row = [label]
            for term in terms:
                cell = table[name].get(term, {}).get(stat)
                if cell is None:
                    row.append("-")
                    continue
                cell = entry_of(cell, index)
                row.append("0 (none)" if cell == 0 else f"{cell:.3g}")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    widths[1:-1] = [max(w, 8) for w in widths[1:-1]]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def entries(name: str, shape: tuple) -> list[tuple[str, tuple]]:
    """The one rule for a statistic with loop axes: one labelled entry per layer, never a reduction.

    A tag in a scanned stack has one statistic per layer (its loop axes, outer first; with
    ``per_example=True`` its vmap axes too): text shows a row (or cell) per entry and plots a line
    (or bar) per entry, labelled ``name[i]`` (``name[i, j]`` for nested loops); a tag with no loop
    axes is one entry, ``name``. The root module's name ``""`` is written ``""``.

    Args:
        name: the tag.
        shape: the statistic's loop axes (``()`` for a tag in plain code).

    Returns:
        ``[(label, index)]``, the indices in row-major order.

    Example:
        >>> from jaxtrace._summary import entries
        >>> entries("layers", (3,))
        [('layers[0]', (0,)), ('layers[1]', (1,)), ('layers[2]', (2,))]
    """
    shown = name or '""'
    if not shape:
        return [(shown, ())]
    return [(f"{shown}[{', '.join(map(str, i))}]", i) for i in np.ndindex(*shape)]


def stack_shape(per_term: Mapping[str, Mapping[str, Any]], stat: str) -> tuple:
    """A tag's loop axes in a tag x term table: the longest shape of its ``stat`` cells."""
    return max((np.shape(cell[stat]) for cell in per_term.values() if stat in cell), key=len, default=())


def entry_of(cell, index: tuple) -> float:
    """Entry ``index`` of a table cell; a cell without loop axes is the same for every layer."""
    cell = np.asarray(cell, dtype=np.float64)
    if cell.ndim and cell.ndim != len(index):
        raise ValueError(
            f"jaxtrace.stats: a cell of shape {cell.shape} beside cells with {len(index)} loop axes; the "
            "cells of one tag (and the tables compared) should come from the same program."
        )
    return float(cell[index] if cell.ndim else cell)


def check_stat_names(stats: str | Sequence[str]) -> tuple:
    """``stats=`` as a tuple of known names; one name alone (``"norm"``) is a one-element tuple."""
    if isinstance(stats, str):
        stats = (stats,)
    elif isinstance(stats, (bytes, bytearray)) or not isinstance(stats, Iterable):
        raise TypeError(
            f"jaxtrace.stats: stats= must be a statistic name or a sequence of names from {KNOWN}; "
            f"got {stats!r} of type {type(stats).__name__}. Pass e.g. stats=\"norm\" or stats=(\"norm\", \"max_abs\")."
        )
    stats = tuple(stats)
    unknown = [s for s in stats if s not in KNOWN]
    if unknown:
        raise ValueError(
            f"jaxtrace.stats: unknown statistic(s) {', '.join(map(repr, unknown))}. Choose from {KNOWN}, "
            "as one name or a sequence of names."
        )
    return stats


def _axes_for(loop_axes: LoopAxes, name: str) -> int:
    if isinstance(loop_axes, Mapping):
        n = loop_axes.get(name, 0)
    elif callable(loop_axes):
        n = loop_axes(name)
    else:
        n = loop_axes
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise TypeError(f"jaxtrace.stats.summarize: loop_axes for {name!r} must be an int >= 0, got {n!r}.")
    return int(n)


def _summarize_one(name: str, value, keep: int, stats: tuple) -> dict:
    """``{statistic: array of the first ``keep`` (loop) axes' shape}`` of one tag's ``value``: each
    statistic a sum (or the max) over the entries of every leaf, reduced once per leaf (``_terms``)."""
    bases, axes_of, kept_shape, count = _float_leaves(name, value, keep)
    ranges = _Ranges.of(bases[0].dtype)
    per_leaf = []
    for g, ax in zip(bases, axes_of):
        parts = _terms(g, stats, ranges, empty_leaf=_is_empty(math.prod(np.shape(g)[keep:])))
        keys = tuple(parts)
        per_leaf.append(dict(zip(keys, _separately(tuple(parts.values()), tuple(k == "max" for k in keys), ax))))
    total = {k: functools.reduce(jnp.add, [p[k] for p in per_leaf]) for k in per_leaf[0] if k != "max"}
    tops = [p["max"] for p in per_leaf if "max" in p]
    return _statistics(total, tops, stats, ranges, count, kept_shape)


def _float_leaves(name: str, value, keep: int) -> tuple[list, list, tuple, Any]:
    """``(bases, axes, kept shape, count)`` of a tag's value: per leaf, the float array every statistic
    reads (``g`` itself for a real leaf, ``|g|`` for a complex one, in one common float dtype) and the
    axes it is reduced over (all but the ``keep`` leading ones, which every leaf shares); and how many
    entries each kept index sums over. Raises ``ValueError`` for a value they do not fit."""
    leaves = jax.tree_util.tree_leaves(value)
    if not leaves:
        raise ValueError(f"jaxtrace.stats.summarize: the value for {name!r} has no arrays.")
    shapes = [np.shape(leaf) for leaf in leaves]
    if any(len(s) < keep for s in shapes):
        raise ValueError(
            f"jaxtrace.stats.summarize: loop_axes={keep} for {name!r}, but it has a leaf of shape "
            f"{min(shapes, key=len)}. Keep at most as many axes as the value has."
        )
    kept = {s[:keep] for s in shapes}
    if len(kept) > 1:
        raise ValueError(
            f"jaxtrace.stats.summarize: the leaves of {name!r} have different leading axes {sorted(kept)} "
            f"(shapes {shapes}), so they cannot be summarised per step with loop_axes={keep}."
        )
    (kept_shape,) = kept
    axes_of = [tuple(range(keep, len(s))) for s in shapes]
    floats = [_as_float(leaf) for leaf in leaves]
    dtype = jnp.result_type(*[jnp.finfo(f.dtype).dtype for f in floats])  # complex64 -> float32
    # g itself for a real leaf, |g| for a complex one: every statistic is a function of its entries
    bases = [f.astype(dtype) if not jnp.iscomplexobj(f) else jnp.abs(f).astype(dtype) for f in floats]
    count = sum(math.prod(s[keep:]) for s in shapes)  # symbolic under jax.export with a symbolic shape
    return bases, axes_of, kept_shape, count


class _Ranges(NamedTuple):
    """The power-of-two scales of the range guards, for a float dtype (float32: maxexp 128, float64: 1024).

    g * 2**-down stays finite for every finite g; its squares are used only when the plain sum
    overflowed (the entries they lose to underflow are ~2**-maxexp of it). |g| * 2**up is used
    only when the plain sum is below tiny, where its squares cannot overflow; |g| * 2**-half
    only when the plain sum of |g| overflowed."""

    info: Any
    down: int
    up: int
    half: int
    tiny: float

    @staticmethod
    def of(dtype) -> "_Ranges":
        info = jnp.finfo(dtype)
        return _Ranges(info, 3 * info.maxexp // 4, info.maxexp // 2, info.maxexp // 2, 2.0 ** -(info.maxexp // 2 - 4))


# Every statistic is a sum (or the max) of an elementwise function of g with no data-dependent
# scaling before it: one jnp.sum (or jnp.max) each, which XLA fuses with the function that
# makes its entries and, when sharded, reduces where each shard lies, then in one all-reduce
# round that XLA combines with the gradients' (a max in a round of its own). Sums of squares
# overflow (float32: |g| > 1e19) or underflow (|g| < 1e-19) where the norm does not; they are
# also summed at fixed power-of-two scales, and the one in range is picked after the
# reduction. Each scaled entry is capped after its multiply (_scaled): XLA rewrites
# square(g * 2**k) into square(g) * 2**(2k), which is 0 * inf in float32, and no rewrite moves
# the constant through the min. The elementwise functions share no intermediate array (each
# sum reads g, with its own scale): XLA:CPU writes out an array that two reductions read, where
# it fuses one that a single reduction reads (|g| shared by four sums doubled their cost).
def _terms(g, stats: tuple, ranges: _Ranges, empty_leaf: bool) -> dict:
    """The (kind, elementwise array) pairs one leaf contributes, keyed by what they sum."""
    info, out = ranges.info, {}
    if "norm" in stats or "rms" in stats:
        out["sq"] = jnp.square(g)
        out["sq_hi"] = jnp.square(_scaled(g, -ranges.down, info.max))
        out["sq_lo"] = jnp.square(_scaled(g, ranges.up, 2.0 ** (info.maxexp // 2 - 2)))
    if "mean_abs" in stats:
        out["abs"], out["abs_hi"] = jnp.abs(g), jnp.abs(g * _pow2(-ranges.half, g.dtype))
    if "max_abs" in stats and not empty_leaf:  # empty leaves are left out: a max over no entries has a 0/0 derivative
        out["max"] = jnp.maximum(g, -g)  # |g|, not jnp.abs: an array of its own, for the max alone
    if _counts_nan(stats):
        out["nan"] = jnp.isnan(g).astype(g.dtype)
    if "nonfinite" in stats:
        out["bad"] = (~jnp.isfinite(g)).astype(g.dtype)
    return out


def _counts_nan(stats: tuple) -> bool:
    """nan explicitly for max_abs rather than rely on how the backend's max reduction treats it: a
    sum computed anyway is nan exactly when an entry is (inf + nan is nan), else a count of them."""
    return "max_abs" in stats and not ("norm" in stats or "rms" in stats) and "mean_abs" not in stats


def _statistics(total: dict, tops: list, stats: tuple, ranges: _Ranges, count, kept_shape: tuple) -> dict:
    """The ``stats`` from the sums of every leaf's terms (``total``) and their maxima (``tops``), each
    sum of squares (or of ``|g|``) taken at the scale that kept it in range."""
    dtype, empty, out = ranges.info.dtype, _is_empty(count), {}
    if "sq" in total:
        mid, hi, lo = total["sq"], total["sq_hi"], total["sq_lo"]
        use_hi, use_lo = jnp.isinf(mid), mid < ranges.tiny
        sq = jnp.where(use_hi, hi, jnp.where(use_lo, lo, mid))
        scale = jnp.where(use_hi, 2.0**ranges.down, jnp.where(use_lo, 2.0**-ranges.up, 1.0)).astype(dtype)
        if "norm" in stats:
            out["norm"] = (scale * _sqrt(sq)).astype(dtype)
        if "rms" in stats:
            out["rms"] = (scale * _sqrt(sq / count) if not empty else jnp.full(kept_shape, jnp.nan)).astype(dtype)
    if "abs" in total:
        mid_abs, hi = total["abs"], total["abs_hi"]
        half = ranges.half
        mean = jnp.where(jnp.isinf(mid_abs), (hi / count) * 2.0**half, mid_abs / count) if not empty else jnp.full(kept_shape, jnp.nan)
        out["mean_abs"] = mean.astype(dtype)
    if "max_abs" in stats:
        top = functools.reduce(jnp.maximum, tops, jnp.zeros(kept_shape, dtype))
        any_nan = jnp.isnan(total["sq"]) if "sq" in total else jnp.isnan(total["abs"]) if "abs" in total else total["nan"] > 0
        out["max_abs"] = jnp.where(any_nan, jnp.nan, top).astype(dtype)
    if "nonfinite" in stats:
        out["nonfinite"] = (total["bad"] / count if not empty else jnp.zeros(kept_shape)).astype(dtype)
    return {s: out[s] for s in stats}


def _separately(operands: tuple, is_max: tuple, axes: tuple) -> tuple:
    """One ``jnp.sum`` (or ``jnp.max``) per operand over ``axes``.

    Separate reductions, not one variadic ``lax.reduce``: XLA's SPMD partitioner splits a
    one-operand reduction of a sharded array into a reduction where each shard lies plus one
    all-reduce of the results, where it gathered the operands of the variadic one first (a 4x2
    tensor-parallel step gathered its cotangents 9 to 21 times); and XLA:CPU runs one-operand
    sums with vector accumulators, where it ran the variadic one as a scalar loop (8 x 256 x 512
    float32 entries, JAX 0.10.2: the norm 0.89 ms against 2.76, all five 2.59 against 2.83)."""
    return tuple((jnp.max if m else jnp.sum)(op, axis=axes) for op, m in zip(operands, is_max))


def _pow2(k: int, dtype):
    """``2**k`` in ``dtype`` (exact: a power of two in its range)."""
    return jnp.asarray(2.0**k, dtype)


def _scaled(x, k: int, cap: float):
    """``min(|x * 2**k|, cap)``: a range guard's scaled entry, capped after the multiply.

    The cap stands between the constant and the square taken of the result, so no algebraic
    rewrite moves ``2**k`` out of the square (XLA on JAX 0.10.2 rewrote ``square(g * 2**k)`` into
    ``square(g) * 2**(2k)``, ``0 * inf`` in float32), and it keeps the entries that are not needed
    finite, with derivative 0 (an ``inf`` there would make the norm's gradient ``nan``): ``k > 0``
    caps at ``2**(maxexp/2 - 2)``, whose square is finite; ``k < 0`` at the dtype's largest value,
    whose square is ``inf`` as an ``inf`` entry's is. A multiply, an abs and a min: elementwise
    float ops that XLA fuses into the reduction that reads them."""
    return jnp.minimum(jnp.abs(x * _pow2(k, x.dtype)), jnp.asarray(cap, x.dtype))


def _sqrt(x):
    """``sqrt`` of a sum of squares, with a finite derivative (not ``inf``) at 0; ``nan`` stays ``nan``."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), x)


def _is_empty(count) -> bool:
    """No entries: a symbolic size (jax.export) is at least 1."""
    return isinstance(count, (int, np.integer)) and count == 0


def _as_float(leaf):
    if getattr(leaf, "dtype", None) == jax.dtypes.float0:
        return jnp.zeros(np.shape(leaf), jnp.float32)
    leaf = jnp.asarray(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        return leaf
    return leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
