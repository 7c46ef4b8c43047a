"""``compare``: two sets of named gradients, side by side.

Typical use: the gradients at the tags of a JAX model against the gradients
at the module outputs of its PyTorch original (``jaxtrace.torch.grad``), name
by name. This module needs only NumPy; the core never imports torch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Mapping, Union

import jax
import numpy as np

from ._paths import path_name

__all__ = ["compare", "Comparison", "named_leaves"]

Layout = Union[str, Callable[[np.ndarray], Any]]
Tolerance = Union[float, Mapping[str, float]]

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-8


def _nchw_to_nhwc(x):
    return np.moveaxis(x, -3, -1)


def _nhwc_to_nchw(x):
    return np.moveaxis(x, -1, -3)


def _transpose(x):
    return np.swapaxes(x, -1, -2)


# Named layout transforms. Each acts on the trailing axes, so leading axes
# (repeated calls, loop steps) pass through. "reshape" is resolved per name.
LAYOUTS: dict[str, Callable] = {
    "NCHW->NHWC": _nchw_to_nhwc,
    "NHWC->NCHW": _nhwc_to_nchw,
    "NCH->NHC": _nchw_to_nhwc,  # 1-d convolutions: (N, C, L) -> (N, L, C)
    "NHC->NCH": _nhwc_to_nchw,
    "transpose": _transpose,  # a Linear weight (out, in) <-> a Dense kernel (in, out)
}


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch.Tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _is_float0(x) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


def _is_leaf(x) -> bool:
    return hasattr(x, "detach") and hasattr(x, "cpu")  # torch tensors are leaves


def named_leaves(tree) -> dict:
    """``{name: array}`` for a dict of gradients, or any pytree of them.

    A ``Mapping`` keeps its keys as names; a value that is itself a pytree (the
    gradient at a tag on a tuple, say) adds its path in JAX's ``keystr`` form:
    ``"attn[0]"``, ``"attn[1]"``. Any other pytree (an equinox model's
    gradients) is named by dotted paths like ``named_parameters()``:
    ``"layers.0.weight"``. ``None`` and float0 leaves (no gradient) are skipped.
    """
    out: dict = {}
    if isinstance(tree, Mapping):
        for name, value in tree.items():
            flat, _ = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_leaf)
            for path, leaf in flat:
                if leaf is None or _is_float0(leaf):
                    continue
                out[f"{name}{jax.tree_util.keystr(path)}" if path else str(name)] = leaf
    else:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
        for path, leaf in flat:
            if leaf is None or _is_float0(leaf):
                continue
            out[path_name(path)] = leaf
    return out


@dataclasses.dataclass(frozen=True)
class Row:
    """One name in a comparison."""

    name: str
    shape_a: tuple
    shape_b: tuple
    max_abs: float  # max |a - b|
    max_rel: float  # max |a - b| / max |b|: the error relative to the reference's scale
    ok: bool
    note: str = ""  # why it failed beyond the tolerance: "shape", "nan" or "layout: ..."
    rtol: float = DEFAULT_RTOL  # the tolerances this name was held to
    atol: float = DEFAULT_ATOL


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The result of ``compare``: prints as a table, one row per name.

    Attributes:
        rows: one ``Row`` per name found on both sides, in ``b``'s order.
        only_a: the names found only in ``a``.
        only_b: the names found only in ``b``.
        rtol: the default relative tolerance (a row held to another says so).
        atol: the default absolute tolerance.
        labels: the two sides' names in the table.
        strict: whether names on one side only make ``ok`` false.
        torch: whether either side held torch tensors (the verdict then says how to name them).

    Example:
        >>> import numpy as np, jaxtrace as jt
        >>> result = jt.compare({"w": np.ones(2)}, {"w": np.ones(2)})
        >>> result.ok, [row.name for row in result.rows]
        (True, ['w'])
    """

    rows: tuple
    only_a: tuple
    only_b: tuple
    rtol: float  # the default tolerances; a row held to others says so in its own rtol / atol
    atol: float
    labels: tuple
    strict: bool
    torch: bool = False

    @property
    def failed(self) -> list:
        """Names whose values differ (shape, or error over the tolerance)."""
        return [r.name for r in self.rows if not r.ok]

    @property
    def ok(self) -> bool:
        """True when every common name matches, some name is compared (unless both sides are empty)
        and (if ``strict``) no name is one-sided."""
        one_sided = bool(self.only_a or self.only_b)
        if one_sided and not self.rows:  # nothing compared: never a pass, strict or not
            return False
        return not self.failed and (not self.strict or not one_sided)

    def __bool__(self) -> bool:
        return self.ok

    def assert_ok(self, msg: str = "") -> None:
        """Raise an ``AssertionError`` with the table if the comparison failed."""
        if not self.ok:
            raise AssertionError(f"{msg + chr(10) if msg else ''}{self}")

    def table(self) -> str:
        a, b = self.labels
        head = ("name", "shape", "max abs err", "max rel err", "result")
        body = []
        for r in self.rows:
            shape = str(r.shape_a) if r.shape_a == r.shape_b else f"{r.shape_a} vs {r.shape_b}"
            no_error = r.note == "shape" or r.note.startswith("layout")
            err = ("-", "-") if no_error else (f"{r.max_abs:.2e}", f"{r.max_rel:.2e}")
            status = "ok" if r.ok else (f"FAIL ({r.note})" if r.note else "FAIL")
            body.append((r.name, shape, *err, status))
        widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]

        def fmt(line):
            return "  ".join(
                cell.ljust(w) if i in (0, 1, 4) else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))
            ).rstrip()

        lines = [fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, body)]
        if self.only_a:
            lines.append(f"only in {a}: {', '.join(self.only_a)}")
        if self.only_b:
            lines.append(f"only in {b}: {', '.join(self.only_b)}")
        n_ok = sum(r.ok for r in self.rows)
        verdict = "OK" if self.ok else "FAILED"
        lines.append(
            f"{verdict}: {n_ok}/{len(self.rows)} names match {a} vs {b}{self._one_sided()} "
            f"(pass: max abs err <= atol + rtol * max |{b}|, rtol={self.rtol:g}, atol={self.atol:g})"
        )
        failed = [_why(r) for r in self.rows if not r.ok]
        if failed:
            more = f"; and {len(failed) - 5} more (in the table)" if len(failed) > 5 else ""
            lines.append(f"failed: {'; '.join(failed[:5])}{more}")
        own = [r for r in self.rows if (r.rtol, r.atol) != (self.rtol, self.atol)]
        if own:
            lines.append(
                "held to their own tolerances: "
                + ", ".join(f"{r.name} (rtol={r.rtol:g}, atol={r.atol:g})" for r in own)
            )
        return "\n".join(lines)

    def _one_sided(self) -> str:
        """``", 2 names only in torch"`` where those make a strict comparison fail, or where no name
        is common (then how to name the two sides alike, not ``strict=False``, which compares nothing)."""
        a, b = self.labels
        counts = [(len(n), label) for label, n in ((a, self.only_a), (b, self.only_b)) if n]
        said = "".join(f", {k} name{'s' * (k != 1)} only in {label}" for k, label in counts)
        if counts and not self.rows:
            how = (
                "; for an equinox model's parameter gradients against torch's, name both as torch's "
                "named_parameters(): jt.compare(jaxtrace.torch.named_grads(grads, module), "
                "{name: p.grad for name, p in module.named_parameters()})"
                if self.torch
                else ""
            )
            return f"{said} (no name is on both sides, so nothing was compared: give both sides the same names{how})"
        if not self.strict:
            return ""
        return said + (" (strict=False ignores names on one side)" if counts and not self.failed else "")

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(self.table())


def _why(r: Row) -> str:
    """One failed row in a few words: the numbers, the shapes, or what was not finite."""
    if r.note == "shape":
        return f"{r.name} (shape {r.shape_a} vs {r.shape_b})"
    if r.note.startswith("layout"):
        return f"{r.name} ({r.note})"
    if r.note == "nan":
        return f"{r.name} (nan, not matched; equal_nan=True allows nan at the same places)"
    if r.note == "inf":
        return f"{r.name} (infinities at different places or of different signs)"
    scale = r.max_abs / r.max_rel if r.max_rel not in (0.0, float("inf")) and r.max_rel == r.max_rel else 0.0
    allowed = r.atol + r.rtol * scale
    return f"{r.name} (max abs err {r.max_abs:.2e} > {allowed:.2e} allowed)"


class LayoutError(ValueError):
    """A layout that ``compare`` does not know."""


def _layout_for(name: str, layout) -> Layout | None:
    if layout is None:
        return None
    if callable(layout) and not isinstance(layout, Mapping):
        return lambda x: layout(name, x)
    if name in layout:
        return layout[name]
    for pattern, value in layout.items():
        if fnmatch.fnmatchcase(name, pattern):
            return value
    return None


def _tolerances(kind: str, tol, default: float, names: list) -> Callable[[str], float]:
    """The tolerance of each name: a number for all, or a mapping from names / patterns."""
    if not isinstance(tol, Mapping):
        value = float(tol)
        return lambda name: value
    unknown = [k for k in tol if k != "*" and k not in names and not any(fnmatch.fnmatchcase(n, k) for n in names)]
    if unknown:
        raise ValueError(
            f"jaxtrace.compare: {kind}= names {', '.join(repr(k) for k in unknown)}, which match no name in either "
            f"input. The names are: {', '.join(repr(n) for n in names)}. A key is a name or an fnmatch "
            'pattern ("blocks.*.attn.hook_pattern"); a tag on a pytree has one name per leaf ("attn[0]").'
        )
    mapping = {k: float(v) for k, v in tol.items()}
    default = mapping.pop("*", default)  # "*" is the default for the names no other key matches
    patterns = [(k, v) for k, v in mapping.items() if any(ch in k for ch in "*?[")]

    def lookup(name: str) -> float:
        if name in mapping:
            return mapping[name]
        for pattern, value in patterns:
            if fnmatch.fnmatchcase(name, pattern):
                return value
        return default

    return lookup


def _apply_layout(name: str, spec: Layout, value: np.ndarray, target_shape: tuple) -> np.ndarray:
    if isinstance(spec, str):
        if spec == "reshape":
            if value.size != int(np.prod(target_shape)):
                raise ValueError(
                    f"jaxtrace.compare: the layout 'reshape' for {name!r} cannot reshape {value.shape} to "
                    f"{target_shape}: the sizes differ."
                )
            return value.reshape(target_shape)
        if spec not in LAYOUTS:
            raise LayoutError(
                f"jaxtrace.compare: unknown layout {spec!r} for {name!r}. Use one of "
                f"{', '.join(repr(k) for k in [*LAYOUTS, 'reshape'])}, or a function of the array."
            )
        return LAYOUTS[spec](value)
    return _to_numpy(spec(value))


def compare(
    a,
    b,
    *,
    rtol: Tolerance = DEFAULT_RTOL,
    atol: Tolerance = DEFAULT_ATOL,
    layout: Mapping[str, Layout] | Callable[[str, Any], Any] | None = None,
    labels: tuple = ("a", "b"),
    strict: bool = True,
    equal_nan: bool = False,
) -> Comparison:
    """Compares two sets of named gradients (or any arrays) name by name.

    A name passes when the shapes agree and ``max |a - b| <= atol + rtol * max
    |b|`` over the finite entries; infinities must match in position and sign.
    Rows follow ``b``'s order (the reference). The rules for per-name
    tolerances, layouts and row order are in the guide *Checking against PyTorch*.

    Args:
        a: ``{name: array or pytree of arrays}`` (``tag_grads`` from
            ``jaxtrace.grad``, ``module_grads`` from ``jaxtrace.torch.grad``), or a
            pytree such as an equinox model's gradients, named by dotted paths.
            NumPy, JAX and torch arrays are accepted.
        b: the reference, in the same form.
        rtol: the relative tolerance: a number, or ``{name or fnmatch pattern:
            tolerance}`` (``"*"`` changes the default, an exact name wins over a
            pattern); a key that matches no name is an error.
        atol: the absolute tolerance, in the same form.
        layout: converts ``b``'s value into ``a``'s layout first:
            ``{name or pattern: function or one of "NCHW->NHWC", "NHWC->NCHW",
            "NCH->NHC", "NHC->NCH", "transpose", "reshape"}``, or a function
            ``(name, array) -> array`` for every name.
        labels: the two sides' names in the printed table.
        strict: names found on one side only make ``.ok`` false. With no name on
            both sides ``.ok`` is false either way: nothing was compared.
        equal_nan: ``nan`` passes where both sides have it at the same places.

    Returns:
        A ``Comparison``: ``print`` it for a table; ``.ok`` says whether
        everything matched, ``.assert_ok()`` raises with the table if not. The
        table ends with the verdict (how many names match, how many are on one
        side only) and, when something failed, a ``failed:`` line with each
        failed name and why (the error against what was allowed, the two
        shapes, or the ``nan`` / infinity that did not match).

    Raises:
        ValueError: if a key of ``rtol`` / ``atol`` / ``layout`` matches no name,
            or a layout cannot apply to a value.
        TypeError: if ``labels`` is not a pair of strings.

    Example:
        >>> import numpy as np, jaxtrace as jt
        >>> a = {"conv": np.ones((2, 4, 4, 3)), "fc.weight": np.ones((5, 3))}
        >>> b = {"conv": np.ones((2, 3, 4, 4)), "fc.weight": np.ones((3, 5)), "extra": np.zeros(1)}
        >>> result = jt.compare(a, b, layout={"conv": "NCHW->NHWC", "fc.weight": "transpose"})
        >>> result.failed, result.only_b, result.ok
        ([], ('extra',), False)
    """
    if not (isinstance(labels, (tuple, list)) and len(labels) == 2):
        raise TypeError(f"jaxtrace.compare: labels must be a pair of strings such as ('jax', 'torch'), got {labels!r}.")
    flat_a, flat_b = named_leaves(a), named_leaves(b)
    names = [*flat_b, *(n for n in flat_a if n not in flat_b)]
    rtol_of = _tolerances("rtol", rtol, DEFAULT_RTOL, names)
    atol_of = _tolerances("atol", atol, DEFAULT_ATOL, names)
    rows = tuple(
        _row(name, flat_a[name], value_b, rtol_of(name), atol_of(name), _layout_for(name, layout), bool(equal_nan))
        for name, value_b in flat_b.items()
        if name in flat_a
    )
    only_a = tuple(n for n in flat_a if n not in flat_b)
    only_b = tuple(n for n in flat_b if n not in flat_a)
    # The default tolerances, for the table's last line: what a name no key matches is held to.
    default_rtol, default_atol = _default(rtol, DEFAULT_RTOL), _default(atol, DEFAULT_ATOL)
    torch = any(type(v).__module__.split(".")[0] == "torch" for v in [*flat_a.values(), *flat_b.values()])
    return Comparison(rows, only_a, only_b, default_rtol, default_atol, tuple(labels), bool(strict), torch)


def _default(tol: Tolerance, default: float) -> float:
    """The tolerance of a name that no key of ``tol`` matches."""
    return float(tol.get("*", default)) if isinstance(tol, Mapping) else float(tol)


def _row(name: str, value_a, value_b, rtol: float, atol: float, spec: Layout | None, equal_nan: bool) -> Row:
    """One name's row: ``b``'s value put in ``a``'s layout (``spec``), then compared."""
    x = _to_numpy(value_a)
    y = _to_numpy(value_b)
    if spec is not None:
        try:
            y = _apply_layout(name, spec, y, x.shape)
        except LayoutError:
            raise
        except Exception as e:  # a layout that does not fit this array: a failed row, not a crash
            return Row(name, x.shape, y.shape, float("nan"), float("nan"), False, f"layout: {e}", rtol, atol)
    return _compare_one(name, x, y, rtol, atol, equal_nan)


def _compare_one(name: str, x: np.ndarray, y: np.ndarray, rtol: float, atol: float, equal_nan: bool) -> Row:
    row = _compare_values(name, x, y, rtol, atol, equal_nan)
    return dataclasses.replace(row, rtol=rtol, atol=atol)


def _compare_values(name: str, x: np.ndarray, y: np.ndarray, rtol: float, atol: float, equal_nan: bool) -> Row:
    if x.shape != y.shape:
        return Row(name, x.shape, y.shape, float("nan"), float("nan"), False, "shape")
    if x.size == 0:
        return Row(name, x.shape, y.shape, 0.0, 0.0, True)
    xf = x.astype(np.float64) if not np.iscomplexobj(x) else x.astype(np.complex128)
    yf = y.astype(np.float64) if not np.iscomplexobj(y) else y.astype(np.complex128)
    # Non-finite entries must match exactly: nan with nan (only with equal_nan), an infinity with
    # the same infinity (attention scores hold -inf at masked positions). They never enter the
    # error or the scale, which are taken over the entries finite on both sides.
    nan_x, nan_y = np.isnan(xf), np.isnan(yf)
    if (nan_x | nan_y).any() and not (equal_nan and np.array_equal(nan_x, nan_y)):
        return Row(name, x.shape, y.shape, float("nan"), float("nan"), False, "nan")
    inf_x, inf_y = np.isinf(xf), np.isinf(yf)
    if not np.array_equal(inf_x, inf_y) or not np.array_equal(xf[inf_x], yf[inf_y]):
        return Row(name, x.shape, y.shape, float("inf"), float("nan"), False, "inf")
    finite = ~(nan_x | inf_x)
    if not finite.any():
        return Row(name, x.shape, y.shape, 0.0, 0.0, True)
    diff = np.abs(xf[finite] - yf[finite])
    max_abs = float(np.max(diff))
    scale = float(np.max(np.abs(yf[finite])))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    ok = bool(max_abs <= atol + rtol * scale)
    return Row(name, x.shape, y.shape, max_abs, max_rel, ok)
