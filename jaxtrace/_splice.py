"""Build time: runs of equations that hold no selected tag, bound as one cached call.

Under ``jax.vjp`` every equation the ``Splitter`` binds is linearized one by one, which is
most of jaxtrace's trace time. A run of two or more first-order equations that hold no
selected tag (and are no tag) is bound instead as one ``jax.jit`` function, inlined early
and cached on the run's structure (``_compat.spliced``), so the repeated layers of a network
share one function and ``jax.vjp`` linearizes it once for all of them. A run stops where the
user's source line changes: JAX gives an inlined call's equations the call's line, so every
equation keeps its own. The program is the same equation for equation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from . import _compat


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
                ref = (2, v.val, v.aval, type(v.val))
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
