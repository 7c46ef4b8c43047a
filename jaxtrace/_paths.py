"""Path names: a pytree path as a dotted name, as PyTorch's ``named_modules()`` spells it.

One spelling for every name jaxtrace makes from a path: module tags, parameter names in reports
and comparisons, loss terms. It imports nothing of jaxtrace, so every module can use it.
"""

from __future__ import annotations

from typing import Iterable

import jax.tree_util as jtu

__all__ = ["key_name", "path_name", "param_path", "join"]


def key_name(key) -> str:
    """One step of a pytree path as jaxtrace names it: an attribute, a dict key, a list index."""
    return jtu.keystr((key,), simple=True, separator=".")


def path_name(path: Iterable) -> str:
    """A pytree path as a dotted name (``"layers.0.weight"``; ``""`` for the root)."""
    return ".".join(key_name(k) for k in path)


def param_path(path: tuple) -> tuple:
    """A parameter's path without the ``.value`` attribute of a Flax NNX ``Variable`` at its end
    (``0.kernel``, not ``0.kernel.value``)."""
    if path and isinstance(path[-1], jtu.GetAttrKey) and path[-1].name == "value":
        return path[:-1]
    return path


def join(prefix: str, *names: str) -> str:
    """``prefix`` and ``names`` joined by dots, empty names left out (the root's path is ``""``)."""
    return ".".join(n for n in (prefix, *names) if n != "")
