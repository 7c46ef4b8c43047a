"""Arguments whose state a call changes (Flax NNX objects): moved into a transform's trace and written back.

Every transform that traces the user's function asks ``lift`` first. It answers ``None`` unless
Flax NNX is loaded and an NNX object is among the function and its arguments; then the Flax
room (``jaxtrace.flax._state``) gives a ``Lift``, whose function returns ``(out, changed)`` and
whose ``write_back(changed)`` leaves the objects as one plain call leaves them (RNG counts,
batch statistics). The core never imports Flax: a Flax object means Flax is loaded.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["lift"]


def lift(fun: Callable, args, kwargs: dict, *, keep=(), skip=()) -> Any:
    """A ``jaxtrace.flax._state.Lift`` when NNX state is among ``fun``, ``args`` and ``kwargs``, else ``None``.

    ``keep``: positions the transform traces as pytrees (its differentiated arguments), written
    back but not lifted; ``skip``: positions left alone (a model the caller rebuilds itself).
    """
    if sys.modules.get("flax.nnx") is None:
        return None
    # The Flax room, loaded by name: the core sits below the integrations and imports none of them;
    # with Flax loaded, loading the room costs nothing new.
    room = importlib.import_module("jaxtrace.flax._state")
    return room.lift(fun, args, kwargs, keep=keep, skip=skip)
