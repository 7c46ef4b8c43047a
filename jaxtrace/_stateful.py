"""Arguments whose state a call changes (Flax NNX objects): moved into a transform's trace and written back.

Every transform that traces the user's function asks ``lift`` first. It answers ``None`` unless
a framework with such state is loaded and one of its objects is among the function and its
arguments; then that framework's room gives a ``Lift``, whose function returns ``(out, changed)``
and whose ``write_back(changed)`` leaves the objects as one plain call leaves them (RNG counts,
batch statistics). The rooms are registered from above (``jaxtrace/__init__.py`` registers the
Flax room, ``jaxtrace.flax._state``), so the core names no integration: a Flax object means
Flax is loaded, and the room is loaded on first need.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["lift", "register_room"]

_ROOMS: list[tuple[str, Callable[[], Any]]] = []


def register_room(package: str, load: Callable[[], Any]) -> None:
    """Handle the objects of ``package`` (``"flax.nnx"``) with the room ``load()`` returns, once
    ``package`` is imported: the room has ``lift(fun, args, kwargs, keep=, skip=)``."""
    _ROOMS.append((package, load))


def lift(fun: Callable, args, kwargs: dict, *, keep=(), skip=()) -> Any:
    """A ``jaxtrace.flax._state.Lift`` when NNX state is among ``fun``, ``args`` and ``kwargs``, else ``None``.

    ``keep``: positions the transform traces as pytrees (its differentiated arguments), written
    back but not lifted; ``skip``: positions left alone (a model the caller rebuilds itself).
    """
    for package, load in _ROOMS:
        if sys.modules.get(package) is not None:  # with the package loaded, its room costs nothing new
            return load().lift(fun, args, kwargs, keep=keep, skip=skip)
    return None
