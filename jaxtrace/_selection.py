"""Selection: which sites a call's ``tags=`` asks for, and the refusals it raises for them."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np

from ._errors import TagError
from ._sites import Site, site_problem

__all__ = ["Selection", "TagSelection", "check_tags", "refuse_differentiated", "report_evaluated", "select", "tag_names"]

TagSelection = Union[None, str, Sequence[str], Callable[[str], bool]]


def tag_names(sites: Iterable[Site]) -> list[str]:
    return list(dict.fromkeys(s.name for s in sites))


def check_tags(tags: TagSelection) -> None:
    """Raises a ``TypeError`` if ``tags=`` is none of the accepted forms (the names in a sequence are checked by ``select``)."""
    if tags is None or isinstance(tags, str) or callable(tags):
        return
    if isinstance(tags, (bytes, bytearray, memoryview)):
        hint = f" Decode it to a str first: tags={bytes(tags).decode(errors='replace')!r}."
    elif isinstance(tags, (bool, np.bool_)):
        hint = " Pass tags=None for every tag."
    elif not isinstance(tags, Iterable):
        hint = ' For one tag pass its name (tags="h"), for several a list of names (tags=["h", "out"]).'
    else:
        return
    raise TypeError(
        "tags= must be None (every tag), a tag name, a sequence of names or a predicate on names "
        f"(name -> bool); got {tags!r} of type {type(tags).__name__}.{hint}"
    )


@dataclasses.dataclass(frozen=True)
class Selection:
    """``tags=`` read once, when a function is wrapped: every tag, some names, or a predicate.

    Hashable (a static field of an equinox wrapper, a jit cache key); ``Selection.of`` checks the
    argument and gives its one form, so every transform reads ``tags=`` the same way.
    """

    names: Optional[tuple] = None  # the names asked for; None with no predicate: every tag
    predicate: Optional[Callable[[str], bool]] = None

    @classmethod
    def of(cls, tags: "TagSelection | Selection") -> "Selection":
        """The selection ``tags=`` makes; a ``TypeError`` that says the accepted forms if it is none."""
        if isinstance(tags, Selection):
            return tags
        check_tags(tags)
        if tags is None:
            return cls()
        if isinstance(tags, str):
            return cls(names=(tags,))
        if callable(tags):
            return cls(predicate=tags)
        names = tuple(tags)
        bad = [t for t in names if not isinstance(t, str)]
        if bad:
            raise TypeError(
                f"tags= must be None, a name, a sequence of names or a predicate; got {bad[0]!r} "
                f"of type {type(bad[0]).__name__} in the sequence."
            )
        return cls(names=names)

    def wanted(self, names: Sequence[str]) -> list[str]:
        """Of the tag names a function has, the ones asked for (asked-for names it lacks included)."""
        if self.predicate is not None:
            return [n for n in names if self.predicate(n)]
        return list(names) if self.names is None else list(self.names)

    def asks_for(self, name: str) -> bool:
        if self.predicate is not None:
            return bool(self.predicate(name))
        return self.names is None or name in self.names


def select(sites: dict, tags: "TagSelection | Selection", purpose: str = "reverse") -> list[Site]:
    """The sites that ``tags=`` asks for; raises for unknown names and sites that cannot serve
    ``purpose`` (``"read"``: capture; ``"forward"``: jvp, patch; ``"reverse"``: gradients)."""
    names = tag_names(sites.values())
    wanted = Selection.of(tags).wanted(names)
    known_names, wanted_names = set(names), set(wanted)
    unknown = [n for n in wanted if n not in known_names]
    if unknown:
        known = ", ".join(repr(n) for n in names) if names else "none"
        raise TagError(
            f"No tag named {', '.join(repr(n) for n in unknown)} in this function. "
            f"Tags found: {known}. Check the name passed to jaxtrace.tag, and that the tagged "
            "value is computed inside the function being differentiated."
        )
    chosen = [s for s in sites.values() if s.name in wanted_names]
    for site in chosen:
        problem = site_problem(site, purpose)
        if problem:
            raise TagError(problem)
    return chosen


def refuse_differentiated(sites: Iterable[Site], transform: str, change: str, instead: str) -> None:
    """``transform`` rewrites ``change`` at a tag; a derivative the traced function already took
    through that tag was formed before, and would not see it: a TagError saying what to write."""
    for site in sites:
        if site.differentiated:
            raise TagError(
                f"{transform} cannot change the {change} at the tag {site.name!r} (at {site.where}): the function "
                "takes a derivative through it (jax.grad, jax.vjp, jax.jvp or a jaxtrace gradient inside the "
                "function), and that derivative was formed before the change applies, so it would not see it. "
                f"Apply it to the function being differentiated instead: {instead}."
            )


def report_evaluated(evaluated: dict, sites: dict, tags: "TagSelection | Selection") -> None:
    """Tags that ``jax.ensure_compile_time_eval`` evaluated away: a ``TagError`` when the call asks
    for them (by name, ``tags=None`` or a predicate), never a silent drop."""
    staged = {s.name for s in sites.values()}
    lost = {n: line for n, line in evaluated.items() if n not in staged}
    selection = Selection.of(tags)
    asked = [n for n in lost if selection.asks_for(n)]
    if asked:
        listed = ", ".join(f"{n!r} (at {lost[n]})" for n in asked)
        raise TagError(
            f"The tag {listed} was evaluated under jax.ensure_compile_time_eval(): it is a constant "
            "computed while tracing, not part of the program, so no gradient, tangent or replacement can "
            "reach it. Move the jt.tag call out of the ensure_compile_time_eval block, or leave the tag out "
            "with tags=."
        )
