"""The differentiated arguments must be arrays: a clear error before JAX's own.

``jt.grad`` / ``jt.value_and_grad`` (like ``jax.grad``) trace every leaf of the
arguments in ``argnums``. An equinox model holding an ``eqx.nn.Lambda``, an
activation function or a string has leaves that are not arrays, and JAX's error
("Error interpreting argument ... as an abstract array") names neither the
leaf's place in the model nor the fix. ``check_array_leaves`` names both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._arrays import is_array_like
from ._frameworks import is_nnx_module

__all__ = ["check_array_leaves", "check_nnx_differentiable"]


def check_array_leaves(args: tuple, argnums: tuple) -> None:
    """A ``TypeError`` naming each non-array leaf of ``args`` (the arguments at ``argnums``) and the fix."""
    bad = []
    for position, arg in zip(argnums, args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if not is_array_like(leaf):
                bad.append((position, jax.tree_util.keystr(path), leaf))
    if not bad:
        return
    shown = "; ".join(f"argument {i}{' at ' + path if path else ''}: {_describe(leaf)}" for i, path, leaf in bad[:5])
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    is_nnx = any(is_nnx_module(a) for a in args)
    hint = (
        "For a Flax NNX module use jaxtrace.flax.grad / jaxtrace.flax.value_and_grad / jaxtrace.flax.jacrev, "
        "which differentiate its nnx.Param state (as nnx.grad). "
        if is_nnx
        else "For an equinox model use jt.filter_grad / jt.filter_value_and_grad / jt.filter_jacrev (with "
        "stats= for the table of jt.stats.jacrev), which differentiate its floating arrays only (as "
        "eqx.filter_grad); for a Flax NNX module, jaxtrace.flax.grad / value_and_grad / jacrev. "
    )
    raise TypeError(
        "jaxtrace differentiates every leaf of the arguments in argnums, as jax.grad does, and those must "
        f"be arrays, but found leaves that are not: {shown}{more}. {hint}Or split the arguments yourself "
        "(eqx.partition / nnx.split) and pass the non-array part as an argument that is not differentiated."
    )


def _describe(leaf) -> str:
    name = getattr(leaf, "__name__", None) or getattr(getattr(leaf, "__wrapped__", None), "__name__", None)
    kind = type(leaf).__name__
    return f"{kind} {name}" if name and callable(leaf) else f"a {kind}"


def check_nnx_differentiable(args: tuple, argnums: tuple, api: str) -> None:
    """A ``TypeError`` when an ``nnx.Module`` in ``argnums`` holds integer or PRNG-key state (an RNG count
    or key), which ``jax.grad`` cannot differentiate: its own error names neither the module nor the fix."""
    for position in argnums:
        arg = args[position]
        if not any(is_nnx_module(x) for x in jax.tree_util.tree_leaves(arg, is_leaf=is_nnx_module)):
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if is_array_like(leaf) and not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
                raise TypeError(
                    f"jaxtrace ({api}) differentiates every leaf of argument {position}, as jax.grad does, but the "
                    f"nnx.Module there holds state that has no gradient: a {jnp.result_type(leaf)} array at "
                    f"{jax.tree_util.keystr(path)} (an RNG count or key). Use "
                    "jaxtrace.flax.grad / value_and_grad / jacrev, which differentiate its nnx.Param state and "
                    "write the RNG counts back, as nnx.grad does."
                )
