"""``NonfiniteReport``: what ``jaxtrace.find_nonfinite`` found, read and told on the host.

Its leaves are one small integer per tag for the values and for the gradients (the first
non-finite entry, coded as ``2 * flat index + is_inf``, or ``NONE``), a few more per tag for where
that entry is inside the value, and one that names the shardings the compiler chose
(``_nonfinite_shards``); which tag is which and where each sits in the program is static, in its
tree structure, so the report can leave ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax
import numpy as np

from . import _compat
from ._nonfinite_order import SHARD, entry_order, program_key, step_order
from ._nonfinite_shards import shard_at
from ._sites import Site

__all__ = ["NONE", "LeafInfo", "NonfiniteAt", "NonfiniteReport", "ReportMeta", "TagInfo", "own_split", "source"]

NONE = np.iinfo(np.int32).max  # the code of a tag with no non-finite entry
_MINOR = 2**30  # the most entries whose index (and is_inf) one int32 key holds


def own_split(shape: tuple) -> int:
    """How many leading axes of a value's own ``shape`` the device indexes apart (``major``): the
    fewest that leave fewer than 2**30 entries (almost always 0)."""
    m = 0
    while m < len(shape) and math.prod(shape[m:]) >= _MINOR:
        m += 1
    return m


# --- static description of the tags ------------------------------------------------------------


def source(site: Site, module: bool) -> str:
    """``file:line`` of the ``jt.tag`` call(s), or the module path for a ``tag_modules`` tag."""
    if module:
        return site.name
    lines = []
    for entry in site.sources:
        match = re.match(r"^(.*?):(\d+)(?::\d+)?(?: \(.*\))?$", entry)
        lines.append(f"{match.group(1)}:{match.group(2)}" if match else entry)
    return ", ".join(lines)


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One floating leaf of a tag: its index in the tagged pytree, its own shape (one shard's, in a
    shard_map body), and there the layout of its vmap and own axes across the shards
    (``_manual_layout``; None outside shard_map)."""

    leaf: int
    shape: tuple
    layout: tuple | None = None


@dataclasses.dataclass(frozen=True)
class TagInfo:
    """One tag name, as the report needs it on the host."""

    name: str
    source: str
    loops: tuple  # the sizes of its stack axes, loops and shard_map mesh axes (outer first)
    examples: tuple  # the sizes of its vmap axes (outer first)
    template: tuple
    leaves: tuple = ()  # LeafInfo of each floating leaf
    invariant: tuple = ()  # in a shard_map body: the mesh axes along which it is the same on every shard


@dataclasses.dataclass(frozen=True)
class ReportMeta:
    """What a report keeps static (in its tree structure): the tags, the parameter paths, ``has_aux``."""

    tags: tuple  # TagInfo per name, in the program's order of first reach
    params: tuple  # the path of each differentiated leaf
    has_aux: bool
    sizes: tuple = ()  # the number of entries of each differentiated leaf
    probed: tuple = ()  # (tag name, is gradient, leaf) of each array the sharding probe looked at


# --- the report ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NonfiniteAt:
    """Where a non-finite entry was found: the tag, the entry, and what it is.

    Attributes:
        name: the tag's name.
        index: the loop steps (outer loop first) and then the vmapped example(s) of the first
            non-finite entry; ``()`` for a tag outside loops and ``vmap``.
        source: ``"file:line"`` of the ``jt.tag`` call, or the module path for ``jt.tag_modules``.
        kind: ``"NaN"`` or ``"inf"``.
        steps: the loop part of ``index``.
        examples: the vmap part of ``index``: global indices, into the whole batch, also under a
            sharded ``jax.jit`` and inside ``jax.shard_map`` (see ``local``).
        loop_kinds: ``"scan step"``, ``"reverse scan step"`` (a ``lax.scan(..., reverse=True)``,
            which computes its last index first) or ``"call"`` (repeated calls) for each entry of
            ``steps``.
        entry: the index of the first non-finite entry (of that kind) inside the tagged value, at
            those steps and examples: its own axes, global as ``examples`` are; ``()`` for a
            scalar. For a batch that is not vmapped, ``entry[0]`` is the example.
        leaf: which leaf of the tagged pytree holds it (``0`` for an array).
        shard: ``{mesh axis: coordinate}`` of the device that held it, for a program on more than
            one device: the compiler's sharding of the value under ``jax.jit``, the shard that
            computed it inside ``jax.shard_map`` (its manual axes); ``None`` on one device.
            Along an axis of ``replicated`` every device holds a copy, and the lowest is named.
        replicated: the mesh axes along which the value is the same on every device.
        local: inside ``jax.shard_map``, ``True`` where jaxtrace could not follow how the value's
            axes are laid out across the shards: ``examples`` and ``entry`` are then that
            shard's own indices.
    """

    name: str
    index: tuple
    source: str
    kind: str
    steps: tuple = ()
    examples: tuple = ()
    loop_kinds: tuple = ()
    entry: tuple = ()
    leaf: int = 0
    shard: dict | None = dataclasses.field(default=None, hash=False)
    replicated: tuple = ()
    local: bool = False
    _stack: tuple = dataclasses.field(default=(), repr=False, compare=False)  # loop steps and shard coordinates

    def where(self) -> str:
        """``", scan step 4, example 1"``: the entry, for a sentence; on several devices, with the
        entry inside the value and the shard: ``", entry [11, 0] (on the shard data=2, model=1)"``."""
        parts = [f"{kind} {step}" for kind, step in zip(self.loop_kinds, self.steps)]
        if len(self.examples) == 1:
            parts.append(f"example {self.examples[0]}")
        elif self.examples:
            parts.append(f"example {self.examples} (outer vmap first)")
        if self.shard is not None and self.entry:
            parts.append(f"entry {list(self.entry)}")
        return "".join(", " + p for p in parts) + ("" if self.shard is None else f" ({self._on()})")

    def _on(self) -> str:
        split = [f"{axis}={c}" for axis, c in self.shard.items() if axis not in self.replicated]  # pyright: ignore
        if not split:
            where = "on every device: it is replicated"
        else:
            where = "on the shard " + ", ".join(split)
            if self.replicated:
                where += f", a copy on every shard along {' and '.join(map(repr, self.replicated))}"
        if self.local:
            where += "; the indices are that shard's own: how its value sits in the global arrays is not known"
        return where


@jax.tree_util.register_pytree_node_class
class NonfiniteReport:
    """What ``jaxtrace.find_nonfinite`` found: a pytree, so it can be the output of ``jax.jit``.

    Its leaves are the function's value (and aux) and a few integers per tag; which tag is which,
    and where each sits in the program, is static (in the tree structure). The properties read the
    integers on the host.

    Attributes:
        value: the function's value.
        aux: its auxiliary output, with ``has_aux=True`` (else ``None``).
        first_value: ``None`` if every tagged value is finite, else a ``NonfiniteAt`` for the first
            tag, in the order the program computes them, with a non-finite entry: its loop step,
            example and entry inside the value, and on several devices the shard that held it.
        first_gradient: the same for the gradients (cotangents) at the tags, in the order the
            backward pass computes them (the reverse of the forward order).
        params: the paths of the differentiated leaves whose gradient has a non-finite entry.
        nonfinite_params: ``{path: number of non-finite entries}`` of the differentiated leaves
            that are not finite themselves, before the call (in parameters, an earlier update or
            the initialisation made them); what the program computes from them follows.
        names: the tag names, in the order the program first reaches them.
    """

    def __init__(
        self, value, aux, value_codes, gradient_codes, param_bad, param_counts, meta: ReportMeta,
        value_entries=None, gradient_entries=None, probe=None,
    ):  # fmt: skip
        self.value = value
        self.aux = aux
        self._value_codes = value_codes
        self._gradient_codes = gradient_codes
        self._param_bad = param_bad
        self._param_counts = param_counts
        self._meta = meta
        self._value_entries = value_entries
        self._gradient_entries = gradient_entries
        self._probe = probe

    def tree_flatten(self):
        children = (self.value, self.aux, self._value_codes, self._gradient_codes, self._param_bad, self._param_counts)
        return (*children, self._value_entries, self._gradient_entries, self._probe), self._meta

    @classmethod
    def tree_unflatten(cls, meta, children):
        return cls(*children[:6], meta, *children[6:])

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._meta.tags]

    def _codes(self, codes, ndim: int = 1) -> np.ndarray:
        if isinstance(codes, _compat.Tracer):
            raise TypeError(
                "A NonfiniteReport is read on the host, after the call: its properties cannot be used inside "
                "jax.jit (or another transform) around jaxtrace.find_nonfinite. Return the report from the "
                "jitted function and read it there."
            )
        codes = np.asarray(codes)
        if codes.ndim != ndim:
            raise ValueError(
                f"This NonfiniteReport holds its per-tag entries with shape {codes.shape}, not one per tag: a "
                "transform around jaxtrace.find_nonfinite (jax.vmap) added axes to them. Put the jax.vmap inside "
                "the function given to find_nonfinite (the report then names the example), or call it once per batch."
            )
        return codes

    def _found(self, codes, entries, backward: bool) -> list[tuple[tuple, NonfiniteAt]]:
        """``(sort key, NonfiniteAt)`` for every tag with a non-finite entry."""
        found = []
        rows = None if entries is None else self._codes(entries, 2).tolist()
        probe = None if self._probe is None else int(self._codes(self._probe, 0))
        for i, (tag, code) in enumerate(zip(self._meta.tags, self._codes(codes).tolist())):
            if code == NONE:
                continue
            flat, inf = divmod(int(code), 2)
            order = step_order(tag.template, tag.loops)
            position, example = divmod(flat, math.prod(tag.examples))
            if backward:  # the device counted the positions from the last
                position = order.backward(position)
            stack = order.steps(position)
            examples = tuple(int(i) for i in np.unravel_index(example, tag.examples)) if tag.examples else ()
            key, kinds = entry_order(tag.template, stack)
            where = _Where(tag, stack, kinds, examples, None if rows is None else rows[i])
            operand = _index_of(self._meta.probed, (tag.name, backward, where.leaf))
            at = where.at("inf" if inf else "NaN", probe, operand)
            found.append((key, at))
        return found

    @property
    def first_value(self) -> NonfiniteAt | None:
        found = self._found(self._value_codes, self._value_entries, backward=False)
        return min(found, key=lambda f: f[0])[1] if found else None

    @property
    def first_gradient(self) -> NonfiniteAt | None:
        found = self._found(self._gradient_codes, self._gradient_entries, backward=True)
        return max(found, key=lambda f: f[0])[1] if found else None

    @property
    def params(self) -> list[str]:
        bad = self._codes(self._param_bad)
        return [p for p, b in zip(self._meta.params, bad.tolist()) if b]

    @property
    def nonfinite_params(self) -> dict[str, int]:
        counts = self._codes(self._param_counts)
        return {p: int(n) for p, n in zip(self._meta.params, counts.tolist()) if n}

    def _neighbour(self, at: NonfiniteAt, before: bool) -> NonfiniteAt | None:
        """The entry the program computes just before (or after) ``at``, among all the tags (the
        shards of one step run at once: none is before another)."""
        target = program_key(self._tag(at.name).template, at._stack)
        best = None
        for tag in self._meta.tags:
            order = step_order(tag.template, tag.loops)
            # A binary search over the entries of one tag, numbered in program order, for the first
            # not before (or not at or before) ``at``.
            lo, hi = 0, order.size
            while lo < hi:
                mid = (lo + hi) // 2
                key = program_key(tag.template, order.steps(mid))
                if key < target or (not before and key == target):
                    lo = mid + 1
                else:
                    hi = mid
            position = lo - 1 if before else lo
            if not 0 <= position < order.size:
                continue
            stack = order.steps(position)
            key = program_key(tag.template, stack)
            if best is None or (key > best[0] if before else key < best[0]):
                best = (key, _Where(tag, stack, entry_order(tag.template, stack)[1], (), None).at("", None, None))
        return None if best is None else best[1]

    def _tag(self, name: str) -> TagInfo:
        return next(t for t in self._meta.tags if t.name == name)

    def __str__(self) -> str:
        sentences = []
        value = self.value
        if isinstance(value, jax.Array | np.ndarray | float) and np.size(value) == 1:
            number = float(np.asarray(value, dtype=np.float64).reshape(()))
            if not np.isfinite(number):
                sentences.append(f"The function's value is {number}.")
        broken = self.nonfinite_params
        if broken:
            sentences.append(_broken_params(broken, dict(zip(self._meta.params, self._meta.sizes))))
        first = self.first_value
        if first is None:
            sentences.append(f"Every tagged value is finite ({_count(len(self._meta.tags), 'tag')}).")
        else:
            before = self._neighbour(first, before=True)
            if before is None:
                origin = "those arguments, the other inputs" if broken else "the inputs"
                sentences.append(
                    f"The value at {_name(first)}{_at(first)}{first.where()} is {_a(first.kind)}, and it is "
                    f"the first tag the program computes: the {first.kind} comes from {origin} or from the code "
                    "before that tag."
                )
            else:
                sentences.append(
                    f"The values are finite up to {_name(before)}{_step_note(before, first)} and not at "
                    f"{_name(first)}{_at(first)}{first.where()}: the {first.kind} begins in the code between them."
                )
        gradient = self.first_gradient
        if gradient is None:
            sentences.append("Every gradient at the tags is finite.")
        else:
            after = self._neighbour(gradient, before=False)
            only = " Every tagged value is finite: it appears only in the backward pass." if first is None else ""
            if after is None:
                sentences.append(
                    f"The gradient at {_name(gradient)}{_at(gradient)}{gradient.where()} is "
                    f"{_a(gradient.kind)}, and it is the last tag the program computes: the {gradient.kind} comes "
                    f"from the backward pass of the code after that tag.{only}"
                )
            else:
                sentences.append(
                    f"The gradients are finite down to {_name(after)}{_step_note(after, gradient)} and not at "
                    f"{_name(gradient)}{_at(gradient)}{gradient.where()}: the {gradient.kind} begins in "
                    f"the backward pass of the code between them.{only}"
                )
            if first is None:
                sentences.append(
                    "Look there for a derivative that is infinite at a finite point: jnp.sqrt or a power below 1 "
                    "at 0, or jnp.log or a division in the branch that jnp.where does not take (compute it on a "
                    "safe input instead)."
                )
        params = self.params
        if params:
            shown = ", ".join(repr(p) if p else "the argument itself" for p in params[:8])
            shown += f" and {len(params) - 8} more" if len(params) > 8 else ""
            sentences.append(f"Non-finite entries in the gradient of {shown}.")
        elif self._meta.params:
            sentences.append("Every parameter gradient is finite.")
        return " ".join(sentences)

    def __repr__(self) -> str:
        return f"NonfiniteReport({self})"


class _Where:
    """One entry of a tag, decoded: its loop steps and shard coordinates (``stack``, whose ``kinds``
    ``entry_order`` gives), its vmapped example, and ``row``, the device's ``[leaf, i_0, ...]``."""

    def __init__(self, tag: TagInfo, stack: tuple, kinds: tuple, examples: tuple, row: list | None):
        self.tag, self.stack, self.examples = tag, stack, examples
        shard = [k.startswith(SHARD + " ") for k in kinds]
        self.steps = tuple(s for s, m in zip(stack, shard) if not m)
        self.loop_kinds = tuple(k for k, m in zip(kinds, shard) if not m)
        self.manual = {k[len(SHARD) + 1 :]: (s, n) for s, k, n, m in zip(stack, kinds, tag.loops, shard) if m}
        leaf = None if row is None or row[0] < 0 else next((x for x in tag.leaves if x.leaf == row[0]), None)
        self.leaf = leaf.leaf if leaf is not None else 0
        self.info = leaf
        self.entry = ()
        if leaf is not None:  # row: [leaf, major, minor] (own_split)
            m = own_split(leaf.shape)
            major = np.unravel_index(row[1], leaf.shape[:m]) if m else ()
            self.entry = tuple(int(i) for i in (*major, *np.unravel_index(row[2], leaf.shape[m:])))

    def at(self, kind: str, probe: int | None, operand: int | None) -> NonfiniteAt:
        examples, entry, local = self.examples, self.entry, False
        shard, replicated = None, ()
        if self.manual:  # inside shard_map: the shard that computed it, and the global indices
            if math.prod(n for _, n in self.manual.values()) > 1:  # on one device: no shard, as under jit
                shard = {axis: c for axis, (c, _) in self.manual.items()}
                replicated = self.tag.invariant
            if self.info is not None:
                layout = self.info.layout or (None,) * (len(self.examples) + len(self.info.shape))
                sizes = (*self.tag.examples, *self.info.shape)
                indices, local = _global(self.manual, layout, sizes, (*examples, *entry))
                examples, entry = indices[: len(examples)], indices[len(examples) :]
        elif probe is not None and operand is not None and self.info is not None:
            found = shard_at(probe, operand, (*self.stack, *self.examples, *self.entry))
            if found is not None:
                shard, replicated = found
        return NonfiniteAt(
            self.tag.name, (*self.steps, *examples), self.tag.source, kind, self.steps, examples, self.loop_kinds,
            entry, self.leaf, shard, replicated, local, self.stack,
        )  # fmt: skip


def _global(manual: dict, layout: tuple, sizes: tuple, local: tuple) -> tuple[tuple, bool]:
    """Indices into the global arrays of a shard_map body value's entry ``local`` on the shard at
    ``manual`` (``{axis: (coordinate, size)}``), by its ``layout``; and whether one axis's layout is
    unknown (that index stays the shard's own)."""
    out, unknown = [], False
    for axes, size, i in zip(layout, sizes, local):
        if axes is None or any(a not in manual for a in axes):
            unknown = True
            out.append(i)
            continue
        block = 0
        for a in axes:
            block = block * manual[a][1] + manual[a][0]
        out.append(block * size + i)
    return tuple(out), unknown


def _index_of(items: tuple, item) -> int | None:
    return items.index(item) if item in items else None


def _broken_params(broken: dict, sizes: dict) -> str:
    """The sentences on differentiated leaves that are not finite before the call."""

    def one(path: str, n: int) -> str:
        name = repr(path) if path else "the argument itself"
        size = sizes.get(path)
        return f"{name} ({n} of {size})" if size else f"{name} ({n})"

    items = list(broken.items())
    shown = ", ".join(one(p, n) for p, n in items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")
    return (
        f"The differentiated arguments hold non-finite entries before this call: {shown}. In parameters, an "
        "earlier update made them (or the initialisation did), and what follows here comes from them. To find "
        "that update, keep the last state whose loss and gradients are all finite (one flag in the training "
        "step) and call find_nonfinite on that state and the batch of the step that broke it."
    )


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _name(at: NonfiniteAt) -> str:
    """The tag's name for a sentence: ``'' (the whole model)`` for the tag ``jt.tag_modules`` puts on
    the model's own output."""
    return "'' (the whole model)" if at.name == "" and at.source == "" else repr(at.name)


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "inf" else f"a {kind}"


def _at(at: NonfiniteAt) -> str:
    """`` (model.py:41)`` for a tag at ``/path/to/model.py:41``; nothing for a module tag, whose name
    is its path."""
    if at.source == at.name:
        return ""
    return " (" + ", ".join(os.path.basename(part) for part in at.source.split(", ")) + ")"


def _step_note(neighbour: NonfiniteAt, at: NonfiniteAt) -> str:
    """`` (scan step 3)`` when the neighbouring entry is at other loop steps than ``at``."""
    if not neighbour.steps or neighbour.steps == at.steps[: len(neighbour.steps)]:
        return ""
    return " (" + ", ".join(f"{k} {s}" for k, s in zip(neighbour.loop_kinds, neighbour.steps)) + ")"
