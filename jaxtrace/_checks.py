"""Argument checks that every transform makes before tracing: the function is a function."""

from __future__ import annotations

__all__ = ["check_callable"]


def check_callable(fun, where: str) -> None:
    """Raises as ``jax.grad(3.0)`` does when ``fun`` is not a function; ``where`` is e.g. ``"jaxtrace.grad"``."""
    if not callable(fun):
        raise TypeError(
            f"Expected a callable value, got {fun!r}. {where} takes the function itself as its first "
            "argument, not a value computed by it: pass f, not f(x)."
        )
