"""Where each tag sits in the traced program, for ``find_nonfinite``: an order on their entries.

A *template* says where a site's entries sit in the traced program, as nested tuples (static,
hashable): ("tag", i) the tag equation at position i; ("in", i, t) inside the i-th equation (a
jit, cond, checkpoint, ...); ("loop", i, t, reverse) inside the i-th equation, a scan, whose step
is the site's next stack axis (``reverse``: the scan runs from its last index down, as
``lax.scan(..., reverse=True)``); ("calls", ((start, stop, span, t), ...)) repeated calls stacked
on the next stack axis, each call range at its own place; ("shards", i, t, axes) inside the i-th
equation, a ``jax.shard_map`` manual over the mesh ``axes``, whose coordinates are the next stack
axes (one per manual axis, as ``_higher_order_rules.ShardMap`` lays them out). ``entry_order`` turns a
template and the loop steps of one entry into a tuple that sorts entries in the order the program
computes them; ``StepOrder`` numbers one site's entries in that order (a stacked result is by index:
index ``i`` of a scan is the step that reads ``xs[i]``, which a reversed scan computes ``i``-th from
last). The shards of a ``shard_map`` run side by side, not one after another: their coordinates
come last in the sort key (after every loop step, the lowest shard first) and are not part of the
program position (``program_key``).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import _compat, _higher_order
from ._tag import MODULE_TAGS, is_tag
from ._walker import nesting

__all__ = ["SHARD", "StepOrder", "templates", "entry_order", "loop_count", "program_key", "step_order"]

SHARD = "shard"  # the kind of a stack axis that is a shard_map's mesh axis: ``f"{SHARD} {axis name}"``



def templates(program, jaxpr=None, cache=None, modules=None) -> dict:
    """``{site key: template}`` for the sites of ``jaxpr`` (default: the whole program); the keys
    of the tags that ``jt.tag_modules`` made are added to ``modules``."""
    cache = {} if cache is None else cache
    modules = set() if modules is None else modules
    jaxpr = program.jaxpr if jaxpr is None else jaxpr
    jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
    if id(jaxpr) in cache:
        return cache[id(jaxpr)]
    level = program.level(jaxpr)
    occurrences: dict = {}
    for i, (eqn, inside, slots) in enumerate(zip(jaxpr.eqns, level.eqn_sites, level.slots)):
        for key in inside:
            slot = slots[key]
            if not slot.primary:  # a copy JAX made (remat): its values are the original's
                continue
            template: tuple = ("tag", i)
            if is_tag(eqn):
                if eqn.params.get("origin") == MODULE_TAGS:
                    modules.add(key)
            else:
                for body in _higher_order.bodies(eqn):
                    inner = templates(program, body, cache, modules).get(key)
                    if inner is not None:  # ("loop", i, inner, reverse), ("shards", i, inner, axes) or ("in", i, inner)
                        kind, *how = nesting(eqn)
                        template = (kind, i, inner, *how)
                        break
            occurrences.setdefault(key, []).append((slot, template))
    out = {}
    for key, found in occurrences.items():
        if level.sites[key].ncalls and all(slot.start is not None for slot, _ in found):
            out[key] = (
                "calls",
                tuple((slot.start, slot.stop if slot.stop is not None else slot.start + 1, slot.span, t) for slot, t in found),
            )
        else:
            out[key] = found[0][1]
    cache[id(jaxpr)] = out
    return out


def entry_order(template: tuple, steps: tuple) -> tuple[tuple, tuple]:
    """``(sort key, kind of each loop axis)`` of the entry at loop ``steps`` of a site."""
    kind = template[0]
    if kind == "tag":
        return (template[1],), ()
    if kind == "in":
        key, kinds = entry_order(template[2], steps)
        return (template[1], *key), kinds
    if kind == "loop":
        key, kinds = entry_order(template[2], steps[1:])
        if template[3]:  # a reversed scan computes its last index first
            return (template[1], -steps[0], *key), ("reverse scan step", *kinds)
        return (template[1], steps[0], *key), ("scan step", *kinds)
    if kind == "shards":  # side by side: the coordinates sort after every loop step
        n = len(template[3])
        key, kinds = entry_order(template[2], steps[n:])
        return (template[1], *key, *steps[:n]), (*(f"{SHARD} {a}" for a in template[3]), *kinds)
    for start, stop, span, inner in template[1]:
        if start <= steps[0] < stop:
            key, kinds = entry_order(inner, ((steps[0] - start, *steps[1:]) if span else steps[1:]))
            return key, ("call", *kinds[1:]) if span else ("call", *kinds)
    raise ValueError(f"jaxtrace.find_nonfinite: no call {steps[0]} in {template}.")  # pragma: no cover


def program_key(template: tuple, steps: tuple) -> tuple:
    """Where the entry at ``steps`` sits in the program: ``entry_order``'s key without the shard
    coordinates (the shards of one step run at once)."""
    key, kinds = entry_order(template, steps)
    shards = sum(1 for k in kinds if k.startswith(SHARD + " "))
    return key[: len(key) - shards]


def loop_count(template: tuple) -> int:
    """How many stack axes ``template`` accounts for."""
    kind = template[0]
    if kind == "tag":
        return 0
    if kind == "in":
        return loop_count(template[2])
    if kind == "loop":
        return 1 + loop_count(template[2])
    if kind == "shards":
        return len(template[3]) + loop_count(template[2])
    start, stop, span, inner = template[1][0]
    return 1 + (loop_count(inner) - 1 if span else loop_count(inner))


@dataclasses.dataclass(frozen=True, eq=False)
class StepOrder:
    """One site's entries (the loop steps of its stack axes, ``loops``) numbered in the order the
    program computes them: ``positions()`` of every entry, and ``steps(position)`` of one.

    Each loop axis runs up or down (``flips``), and the axes count from the most significant,
    ``major`` (the stack's own order, except a shard_map's mesh axes, which come after the loops
    inside it), unless an axis's direction changes from one entry of an outer axis to the next
    (repeated calls of one tag in a forward and a reversed scan): then the numbering is a table,
    ``ranks``.
    """

    loops: tuple
    flips: tuple | None  # per loop axis: it runs from its last index down
    ranks: np.ndarray | None  # else: the position of each entry (flat row-major index -> position)
    major: tuple = ()  # with flips: the stack axes from the most significant (default: in order)
    parallel: int = 1  # the entries of one step that run at once (a shard_map's shards): the last digit

    @property
    def size(self) -> int:
        return int(np.prod(self.loops, dtype=np.int64)) if self.loops else 1

    def backward(self, position):
        """``position`` counted from the end (the order of the backward pass), the shards of one step
        still from the lowest; an int or an array."""
        p = self.parallel
        return ((self.size // p) - 1 - position // p) * p + position % p

    def _major(self) -> tuple:
        return self.major or tuple(range(len(self.loops)))

    def steps(self, position: int) -> tuple:
        """The loop steps of the entry the program computes ``position``-th."""
        if not self.loops:
            return ()
        if self.flips is None:
            flat = int(np.flatnonzero(self.ranks == position)[0])  # pyright: ignore[reportOptionalSubscript]
            return tuple(int(i) for i in np.unravel_index(flat, self.loops))
        index = [0] * len(self.loops)
        for axis in reversed(self._major()):
            position, index[axis] = divmod(position, self.loops[axis])
        return tuple(int(n - 1 - i) if flip else int(i) for n, i, flip in zip(self.loops, index, self.flips))

    def positions(self, xp=np):
        """An int32 array of shape ``loops``: each entry's position (``xp``: numpy or jax.numpy; with
        ``flips`` made from iotas, so nothing of size ``loops`` is a constant of the program)."""
        if self.flips is None:
            return xp.asarray(self.ranks.reshape(self.loops).astype(np.int32))  # pyright: ignore[reportOptionalMemberAccess]
        out = xp.zeros(self.loops, np.int32)
        stride = 1
        for axis in reversed(self._major()):
            n = self.loops[axis]
            iota = xp.arange(n, dtype=np.int32)
            if self.flips[axis]:
                iota = (n - 1) - iota
            out = out + (iota * stride).reshape([n if a == axis else 1 for a in range(len(self.loops))])
            stride *= n
        return out


@functools.lru_cache(maxsize=512)
def step_order(template: tuple, loops: tuple) -> StepOrder:
    """The ``StepOrder`` of a site at ``template`` whose stack axes have sizes ``loops``."""
    found = _axis_order(template, len(loops))
    parallel = int(np.prod([loops[a] for a in _shard_axes(template, len(loops))], dtype=np.int64))
    if found is not None or not loops:
        major, flips = found if found is not None else ((), ())
        return StepOrder(loops, flips, None, major if major != tuple(range(len(loops))) else (), parallel)
    every = np.ndindex(*loops)  # row-major, as the flat index
    keys = [entry_order(template, tuple(int(i) for i in steps))[0] for steps in every]
    ranks = np.empty(len(keys), np.int64)
    ranks[sorted(range(len(keys)), key=keys.__getitem__)] = np.arange(len(keys))
    return StepOrder(loops, None, ranks, (), parallel)


def _shard_axes(template: tuple, n: int) -> list:
    """The stack axes that are a shard_map's mesh axes."""
    kind = template[0]
    if kind == "tag":
        return []
    if kind == "in":
        return _shard_axes(template[2], n)
    if kind == "loop":
        return [a + 1 for a in _shard_axes(template[2], n - 1)]
    if kind == "shards":
        k = len(template[3])
        return [*range(k), *(a + k for a in _shard_axes(template[2], n - k))]
    _, _, span, inner = template[1][0]
    return _shard_axes(inner, n) if span else [a + 1 for a in _shard_axes(inner, n - 1)]


def _axis_order(template: tuple, n: int) -> tuple[tuple, tuple] | None:
    """``(major, flips)``: the stack axes from the most significant, and per axis whether it runs
    down; None where one axis runs both ways."""
    kind = template[0]
    if kind == "tag":
        return tuple(range(n)), (False,) * n  # axes the walk did not see run up
    if kind == "in":
        return _axis_order(template[2], n)
    if kind == "loop":
        inner = _axis_order(template[2], n - 1)
        return None if inner is None else ((0, *(a + 1 for a in inner[0])), (bool(template[3]), *inner[1]))
    if kind == "shards":
        k = len(template[3])
        inner = _axis_order(template[2], n - k)
        return None if inner is None else ((*(a + k for a in inner[0]), *range(k)), ((False,) * k + inner[1]))
    found = set()
    for _, _, span, inner in template[1]:
        order = _axis_order(inner, n if span else n - 1)
        if order is None or order[0] != tuple(range(len(order[0]))) or (span and order[1][0]):
            return None
        found.add(order[1][1:] if span else order[1])
    return (tuple(range(n)), (False, *found.pop())) if len(found) == 1 else None
