"""Higher-order primitives: the one table of which kind each is and where its bodies are.

The split's rules, the per-example dependency analysis and proof, and the vmapped-cond
rewrite all read this table, so a higher-order primitive that JAX renames or adds is taught
here once. The names and params themselves are read in ``_compat``.
"""

from __future__ import annotations

from typing import Any, Callable

from . import _compat, _equation_params

__all__ = [
    "CALL",
    "CALL_LIKE",
    "COND",
    "CUSTOM",
    "CUSTOM_LINEAR",
    "KINDS",
    "REMAT",
    "SCAN",
    "SHARD_MAP",
    "WHILE",
    "bodies",
    "body",
    "kind",
]

SCAN = "scan"  # lax.scan (fori_loop with static bounds, lax.map): one body, run per step
COND = "cond"  # lax.cond / lax.switch: one body per branch
WHILE = "while"  # lax.while_loop: a condition and a body
CALL = "call"  # nested jax.jit, closed_call: one body of all the operands
REMAT = "remat"  # jax.checkpoint: one body of all the operands
CUSTOM = "custom"  # jax.custom_jvp / jax.custom_vjp: the primal function, of all the operands
CUSTOM_LINEAR = "custom_linear"  # a linearized custom rule that JAX evaluates as a unit
SHARD_MAP = "shard_map"  # jax.shard_map: the per-shard body

CALL_LIKE = (CALL, REMAT, CUSTOM)  # one body that takes the equation's operands as they are

KINDS: dict[str, str] = {
    name: kind
    for kind, names in [
        (SCAN, _compat.SCAN),
        (COND, _compat.COND),
        (WHILE, _compat.WHILE),
        (CALL, _compat.INLINE_CALLS),
        (REMAT, _compat.REMAT),
        (CUSTOM, _compat.CUSTOM_DERIVATIVES),
        (CUSTOM_LINEAR, _compat.CUSTOM_LINEAR),
        (SHARD_MAP, _compat.SHARD_MAP),
    ]
    for name in names
}

_BODIES: dict[str, Callable[[Any], list]] = {
    SCAN: lambda eqn: [_equation_params.scan_params(eqn).body],
    COND: lambda eqn: list(_equation_params.cond_branches(eqn)),
    WHILE: lambda eqn: [_equation_params.while_params(eqn).cond, _equation_params.while_params(eqn).body],
    CALL: lambda eqn: [_equation_params.call_body(eqn)],
    REMAT: lambda eqn: [_equation_params.call_body(eqn)],
    CUSTOM: lambda eqn: [_equation_params.custom_primal(eqn)],
    CUSTOM_LINEAR: lambda eqn: _compat.sub_jaxprs(eqn.params),
    SHARD_MAP: lambda eqn: [_equation_params.shard_map_params(eqn).body],
}


def kind(eqn) -> str | None:
    """The kind of higher-order primitive ``eqn`` binds (``SCAN``, ``COND``, ...), or None."""
    return KINDS.get(eqn.primitive.name)


def body(eqn) -> Any:
    """The body of a call-like equation (``kind(eqn) in CALL_LIKE``): a jaxpr of all its operands
    (for a custom derivative, its primal function)."""
    if kind(eqn) not in CALL_LIKE:
        raise ValueError(f"`{eqn.primitive.name}` is not a call-like primitive: read its bodies with bodies().")
    return _BODIES[kind(eqn)](eqn)[0]


def bodies(eqn) -> list[Any]:
    """Every jaxpr inside ``eqn`` (none for a first-order equation); for a primitive not in the
    table, every jaxpr held in its params."""
    found = _BODIES.get(kind(eqn))  # type: ignore[arg-type]
    return found(eqn) if found is not None else _compat.sub_jaxprs(eqn.params)
