"""Which submodules ``tag_modules`` tags: the ``where=`` argument, one rule for equinox and NNX."""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

# None (every callable module), a path, a list of paths, a class or tuple of classes, or a
# predicate (path, module) -> bool.
Where = Union[None, str, Sequence[str], type, tuple, Callable[[str, Any], bool]]


def _is_classes(where) -> bool:
    return isinstance(where, type) or (
        isinstance(where, tuple) and bool(where) and all(isinstance(w, type) for w in where)
    )


def choose(candidates: Sequence[tuple[str, Any]], where: Where) -> list[str]:
    """The paths among ``candidates`` (``(path, module)``, parents first) that ``where`` selects."""
    if where is None:
        return [p for p, _ in candidates]
    if _is_classes(where):
        return [p for p, m in candidates if isinstance(m, where)]  # pyright: ignore[reportArgumentType]
    if callable(where):
        return [p for p, m in candidates if where(p, m)]
    wanted = [where] if isinstance(where, str) else list(where)
    known = [p for p, _ in candidates]
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise ValueError(
            f"jaxtrace.tag_modules: no callable submodule at {', '.join(repr(p) for p in unknown)}. "
            f"The model's callable modules are: {', '.join(repr(p) for p in known)}. Paths are attribute "
            'names and list indices joined by dots ("layers.0"), as PyTorch\'s named_modules() names them; '
            'a Sequential\'s children are "0", "1", ...; the root is "".'
        )
    return list(dict.fromkeys(wanted))
