"""Build time: runs of equations that hold no selected tag, bound as one cached call.

Under ``jax.vjp`` every equation the ``Splitter`` binds is linearized one by one, which is
most of jaxtrace's trace time. A run of two or more first-order equations that hold no
selected tag (and are no tag) is bound instead as one ``jax.jit`` function, inlined early
and cached on the run's structure (``_compat.spliced``), so the repeated layers of a network
share one function and ``jax.vjp`` linearizes it once for all of them. A run stops where the
user's source line changes: JAX gives an inlined call's equations the call's line, so every
equation keeps its own. The program is the same equation for equation.

Literal constants in a run (``* 2.0``, a mean's division) are part of its structure, keyed by
value (``Constant``: type, dtype, shape and bytes), so two runs share a function only where
their constants are the same bits; a literal too large to key cheaply keeps its run unspliced.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable

import numpy as np

from . import _compat

_LARGEST_CONSTANT = 1024  # bytes: a literal larger than this is not keyed (its run is bound unspliced)


class Constant:
    """A literal operand in a run, equal to another where its value is the same bits.

    ``value`` is what the run binds; ``key`` (type, weak type, dtype, shape and bytes) is what
    it is hashed and compared by, so ``0.0`` and ``-0.0``, ``2`` and ``2.0``, or a weak and a
    strong ``2.0`` never share a cached run, and a NaN constant does.
    """

    __slots__ = ("value", "key")

    def __init__(self, value, key: tuple):
        self.value = value
        self.key = key

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, Constant) and self.key == other.key

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


def constant(literal) -> Constant | None:
    """``literal`` (a jaxpr ``Literal``) as a ``Constant``, or None where it cannot be keyed by value."""
    value = literal.val
    kind = (type(value), getattr(value, "weak_type", None), literal.aval)
    if isinstance(value, (bool, int)):  # Python ints are exact; bool is told apart by its type
        return Constant(value, (*kind, value))
    if isinstance(value, float):
        return Constant(value, (*kind, struct.pack("<d", value)))
    if isinstance(value, complex):
        return Constant(value, (*kind, struct.pack("<dd", value.real, value.imag)))
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - a literal JAX may hold that numpy cannot read: not keyed
        return None
    if array.dtype.hasobject or array.nbytes > _LARGEST_CONSTANT:
        return None
    return Constant(value, (*kind, array.dtype.str, array.shape, array.tobytes()))


@dataclasses.dataclass(frozen=True)
class Run:
    """Equations ``start:stop`` of a jaxpr, bound as one call: ``outvars = function(*invars)``."""

    start: int
    stop: int
    invars: list
    outvars: list
    function: Any


def runs(jaxpr, eqn_sites: list, selected: Callable[[Any, dict], bool]) -> dict:
    """``{start: Run}``: the runs of two or more equations of ``jaxpr`` for which ``selected(eqn,
    sites inside it)`` is False, each bound as one call where ``jax.vjp`` differentiates them."""
    eqns = jaxpr.eqns
    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                last_use[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, _compat.Literal):
            last_use[v] = len(eqns)
    found: dict = {}
    start = 0
    while start < len(eqns):
        if selected(eqns[start], eqn_sites[start]):
            start += 1
            continue
        lines = _compat.user_lines(eqns[start])
        stop = start + 1
        while stop < len(eqns) and not selected(eqns[stop], eqn_sites[stop]) and _compat.user_lines(eqns[stop]) == lines:
            stop += 1
        if stop - start >= 2:
            run = _make_run(eqns[start:stop], start, stop, last_use)
            if run is not None:
                found[start] = run
        start = stop
    return found


def _make_run(eqns, start: int, stop: int, last_use: dict) -> Run | None:
    """A ``Run`` of ``eqns`` (equations ``start:stop``), or None if one of them cannot go in one."""
    invars: list = []
    where: dict = {}  # var -> ref
    steps = []
    for j, eqn in enumerate(eqns):
        refs = []
        for v in eqn.invars:
            if isinstance(v, _compat.Literal):
                value = constant(v)
                if value is None:
                    return None
                ref = (2, value)
            elif v in where:
                ref = where[v]
            else:
                ref = where[v] = (0, len(invars))
                invars.append(v)
            refs.append(ref)
        step = _compat.splice_step(eqn, tuple(refs))
        if step is None:
            return None
        steps.append(step)
        for k, v in enumerate(eqn.outvars):
            if not isinstance(v, _compat.DropVar):
                where[v] = (1, j, k)
    outvars = [v for eqn in eqns for v in eqn.outvars
               if not isinstance(v, _compat.DropVar) and last_use.get(v, -1) >= stop]
    return Run(start, stop, invars, outvars, _compat.spliced(tuple(steps), tuple(where[v][1:] for v in outvars)))
