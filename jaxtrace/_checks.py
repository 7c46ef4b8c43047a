"""Argument checks that the transforms make before tracing: the function is a function, ``argnums`` is valid."""

from __future__ import annotations

__all__ = ["check_callable", "normalize_argnums"]


def check_callable(fun, where: str) -> None:
    """Raises as ``jax.grad(3.0)`` does when ``fun`` is not a function; ``where`` is e.g. ``"jaxtrace.grad"``."""
    if not callable(fun):
        raise TypeError(
            f"Expected a callable value, got {fun!r}. {where} takes the function itself as its first "
            "argument, not a value computed by it: pass f, not f(x)."
        )


def normalize_argnums(argnums) -> tuple[int, ...]:
    """``argnums`` as a non-empty tuple of ints (``jax.grad``'s forms); a ``TypeError`` otherwise."""
    if isinstance(argnums, int):
        return (argnums,)
    argnums = tuple(argnums)
    if not argnums or not all(isinstance(a, int) for a in argnums):
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}.")
    return argnums
