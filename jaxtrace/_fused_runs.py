"""The build-time fast path: equations bound again so that ``jax.vjp`` linearizes them cheaply.

Under ``jax.vjp`` every equation the ``ProgramEvaluator`` binds is linearized one by one, which is
most of jaxtrace's trace time. A run of two or more first-order equations that hold no
selected tag (and are no tag) is bound instead as one ``jax.jit`` function, inlined early
and cached on the run's structure (``run_function``), so the repeated layers of a network
share one function and ``jax.vjp`` linearizes it once for all of them. A single equation
(``bind_equation``) is bound through a cached jit of its primitive where JAX has no linearize
rule for it (``linearized_bind``). A run stops where the
user's source line changes: JAX gives an inlined call's equations the call's line, so every
equation keeps its own. The program is the same equation for equation.

Literal constants in a run (``* 2.0``, a mean's division) are part of its structure, keyed by
value (``Constant``: type, dtype, shape and bytes), so two runs share a function only where
their constants are the same bits; a literal too large to key cheaply keeps its run unspliced.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Any, Callable, Sequence

import jax
import numpy as np

from . import _compat

__all__ = ["Constant", "Run", "bind_equation", "constant", "linearized_bind", "run_function", "runs"]

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
        step = _step(eqn, tuple(refs))
        if step is None:
            return None
        steps.append(step)
        for k, v in enumerate(eqn.outvars):
            if not isinstance(v, _compat.DropVar):
                where[v] = (1, j, k)
    outvars = [v for eqn in eqns for v in eqn.outvars
               if not isinstance(v, _compat.DropVar) and last_use.get(v, -1) >= stop]
    return Run(start, stop, invars, outvars, run_function(tuple(steps), tuple(where[v][1:] for v in outvars)))


def _step(eqn, refs: tuple) -> tuple | None:
    """What ``run_function`` needs to bind ``eqn`` inside a run of equations, as a hashable value
    (``refs``: where its operands come from); None where it cannot go in a run (a higher-order
    or effectful equation, params that cannot be hashed)."""
    if eqn.effects or _compat.sub_jaxprs(eqn.params):
        return None
    subfuns, bind_params = _compat.bind_params(eqn)
    if subfuns:
        return None
    step = (eqn.primitive, tuple(sorted(bind_params.items())), eqn.ctx, eqn.source_info.name_stack, refs)
    try:
        hash(step)
    except TypeError:
        return None
    return step


@functools.lru_cache(maxsize=4096)
def run_function(steps: tuple, outputs: tuple):
    """A run of first-order equations as one function, inlined where it is called.

    ``steps`` are ``_step``'s, each ``refs`` entry ``(0, i)`` (the run's input ``i``),
    ``(1, j, k)`` (output ``k`` of step ``j``) or ``(2, constant)`` (a literal, bound as
    ``constant.value``, hashed by value: ``Constant``); ``outputs`` are
    ``(j, k)``. Cached on the structure, so runs that repeat (the layers of a network) share
    one function: ``jax.vjp`` linearizes it once for them all (``_pjit_linearize`` caches on
    the traced jaxpr), instead of each of their equations one by one.
    """

    def run(*args):
        values: list = []
        for primitive, params, ctx, name_stack, refs in steps:
            invals = [args[r[1]] if r[0] == 0 else values[r[1]][r[2]] if r[0] == 1 else r[1].value for r in refs]
            with _compat.name_stack_context(name_stack), ctx.manager:
                out = primitive.bind(*invals, **dict(params))
            values.append(out if primitive.multiple_results else (out,))
        return [values[j][k] for j, k in outputs]

    return jax.jit(run, inline=_compat.INLINE_EARLY)


def bind_equation(eqn, invals: Sequence[Any]) -> list[Any]:
    """Bind one equation as ``jax.core.eval_jaxpr`` does (through ``linearized_bind`` where that
    applies); always a list of outputs."""
    subfuns, bind_params = _compat.bind_params(eqn)
    with _compat.source_context(eqn), eqn.ctx.manager:
        first_order = not (subfuns or eqn.effects or "subfuns" in bind_params or _compat.sub_jaxprs(eqn.params))
        linearized = linearized_bind(eqn.primitive, bind_params, invals) if first_order else None
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params) if linearized is None else linearized
    return list(out) if eqn.primitive.multiple_results else [out]


def linearized_bind(primitive, params: dict, invals: Sequence[Any]):
    """Bind a first-order primitive that ``jax.vjp`` is differentiating through a
    cached ``jax.jit(..., inline=True)``, as ``jax.numpy`` functions are; else None.

    A bare primitive without a linearize rule makes JAX trace and partially
    evaluate its JVP rule at every bind. A jit-wrapped one is linearized once per
    primitive, params and input types (``_pjit_linearize`` caches it), then
    inlined: the program is the same, its tracing about twice as fast.
    Primitives with a linearize rule (``sin``, ``jit``, ``scan``...) are bound as they are.
    """
    if not _compat.is_linearizing(invals) or _compat.has_linearize_rule(primitive):
        return None
    try:
        fn = _jitted_primitive(primitive, tuple(sorted(params.items())))
    except TypeError:  # unhashable params
        return None
    return fn(*invals)


@functools.lru_cache(maxsize=4096)
def _jitted_primitive(primitive, params: tuple):
    def bind(*args):
        return primitive.bind(*args, **dict(params))

    return jax.jit(bind, inline=_compat.INLINE_EARLY)
