"""Sites: what a tag is, where it is, and which tags a call asks for.

A *site* is one leaf of one tag name. Its value in a result is laid out as
``loop axes (outer loop first) + vmap axes (outer vmap first) + the value's
own shape``. ``repeated=True`` tags add a call axis where the calls happen.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat

Key = tuple  # (name, leaf index)
TagSelection = Union[None, str, Sequence[str], Callable[[str], bool]]


class TagError(ValueError):
    """A tag that jaxtrace cannot split, or a request for tags that do not exist."""


@dataclasses.dataclass(frozen=True)
class Site:
    name: str
    leaf: int
    tree: Any  # PyTreeDef of the tagged value
    aval: Any  # the value at the tag, as the program holds it (vmap axes anywhere)
    stack: tuple  # leading axes added by loops and repeated calls
    batch_axes: tuple  # where the vmap axes are in ``aval``, outer vmap first
    repeated: bool
    sources: tuple  # user source lines of the tag
    problem: str | None = None  # why this site cannot be split, if it cannot

    @property
    def key(self) -> Key:
        return (self.name, self.leaf)

    @property
    def shape(self) -> tuple:
        """The shape of the site's values inside the program (stack + aval)."""
        return (*self.stack, *self.aval.shape)

    @property
    def dtype(self):
        return self.aval.dtype

    @property
    def differentiable(self) -> bool:
        return jnp.issubdtype(self.dtype, jnp.inexact)

    @property
    def where(self) -> str:
        return ", ".join(self.sources)

    def _perm(self) -> tuple | None:
        """Axis permutation from the program's layout to the documented one."""
        n = len(self.stack)
        rest = [i for i in range(len(self.aval.shape)) if i not in self.batch_axes]
        perm = (*range(n), *(n + a for a in self.batch_axes), *(n + a for a in rest))
        return None if perm == tuple(range(len(perm))) else perm

    def to_user(self, value):
        """From the program's layout to the documented one (vmap axes first)."""
        perm = self._perm()
        return value if perm is None else jnp.transpose(value, perm)

    def from_user(self, value):
        perm = self._perm()
        return value if perm is None else jnp.transpose(value, np.argsort(perm))

    def user_shape(self) -> tuple:
        perm = self._perm()
        shape = self.shape
        return shape if perm is None else tuple(shape[p] for p in perm)

    def zeros(self):
        return _compat.zeros(self.shape, self.dtype, self.aval)

    def float0_zeros(self):
        return np.zeros(self.user_shape(), dtype=_compat.float0)

    def describe(self) -> str:
        return f"{self.aval.str_short()} at {self.where}"


def with_problem(site: Site, problem: str) -> Site:
    return site if site.problem else dataclasses.replace(site, problem=problem)


def stack_calls(sites: Sequence[Site]) -> Site:
    """One site from several calls of one tag at the same level (call order)."""
    first = sites[0]
    if not all(s.repeated for s in sites):
        problem = (
            f"The tag name {first.name!r} is used at {len(sites)} sites ({', '.join(s.where for s in sites)}). "
            "Give each site its own name, or pass repeated=True to jaxtrace.tag to stack the calls "
            "in call order."
        )
    elif len({(s.shape, s.dtype, s.batch_axes, s.tree) for s in sites}) > 1:
        problem = (
            f"The repeated tag {first.name!r} is called with different shapes or structures "
            f"({'; '.join(s.describe() for s in sites)}), so its calls cannot be stacked. "
            "Use a different name for each shape."
        )
    else:
        problem = next((s.problem for s in sites if s.problem), None)
    sources = tuple(dict.fromkeys(src for s in sites for src in s.sources))
    return dataclasses.replace(first, stack=(len(sites), *first.stack), sources=sources, problem=problem)


def merge_branches(sites: Sequence[Site], where: str) -> Site:
    """One site from the same tag in several branches of one cond."""
    first = sites[0]
    sources = tuple(dict.fromkeys(src for s in sites for src in s.sources))
    problem = next((s.problem for s in sites if s.problem), None)
    if len({(s.shape, s.dtype, s.batch_axes, s.tree) for s in sites}) > 1:
        problem = (
            f"The tag {first.name!r} has different shapes in the branches of the cond at {where} "
            f"({'; '.join(s.describe() for s in sites)}). Use one name per shape."
        )
    return dataclasses.replace(first, sources=sources, problem=problem)


# --- selection ------------------------------------------------------------


def tag_names(sites: Iterable[Site]) -> list[str]:
    return list(dict.fromkeys(s.name for s in sites))


def select(sites: dict, tags: TagSelection) -> list[Site]:
    """The sites that ``tags=`` asks for; raises for unknown names and unsplittable sites."""
    names = tag_names(sites.values())
    if tags is None:
        wanted = names
    elif isinstance(tags, str):
        wanted = [tags]
    elif callable(tags):
        wanted = [n for n in names if tags(n)]
    else:
        wanted = list(tags)
        bad = [t for t in wanted if not isinstance(t, str)]
        if bad:
            raise TypeError(
                f"tags= must be None, a name, a sequence of names or a predicate; got {bad[0]!r} "
                f"of type {type(bad[0]).__name__} in the sequence."
            )
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
        if site.problem:
            raise TagError(site.problem)
    return chosen


def assemble(sites: Sequence[Site], values: dict) -> dict:
    """``{name: pytree}`` from per-site values in the program's layout.

    A site missing from ``values`` (an integer or boolean tag under
    differentiation) gets float0 zeros, as ``jax.grad`` gives integer inputs.
    """
    by_name: dict[str, list[Site]] = {}
    for site in sites:
        by_name.setdefault(site.name, []).append(site)
    out = {}
    for name, group in by_name.items():
        group = sorted(group, key=lambda s: s.leaf)
        leaves = [site.to_user(values[site.key]) if site.key in values else site.float0_zeros() for site in group]
        out[name] = jax.tree_util.tree_unflatten(group[0].tree, leaves)
    return out
