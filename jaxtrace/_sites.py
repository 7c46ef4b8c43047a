"""Site layout: one leaf of one tag name, where its values sit in the program and in results.

A *site* is one leaf of one tag name. Its value in a result is laid out as
``loop axes (outer loop first) + vmap axes (outer vmap first) + the value's
own shape``. ``repeated=True`` tags add a call axis where the calls happen. A
``Slot`` is where one equation's occurrence of a site sits in its stacked calls
(``_stacking`` builds them); ``assemble`` lays per-site values out as results.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from ._errors import TagError  # re-exported: importable from here as it always was

__all__ = ["Key", "PURPOSES", "Site", "Slot", "TagError", "assemble", "site_problem", "transpose_last", "with_refusal"]

Key = tuple  # (name, leaf index)


@dataclasses.dataclass(frozen=True)
class Site:
    """One leaf of one tag name: its value as the program holds it, and how it is laid out."""

    name: str
    leaf: int
    tree: Any  # PyTreeDef of the tagged value
    aval: Any  # the value at the tag, as the program holds it (vmap axes anywhere)
    stack: tuple  # leading axes added by loops and repeated calls
    batch_axes: tuple  # where the vmap axes are in ``aval``, outer vmap first
    repeated: bool
    sources: tuple  # user source lines of the tag
    problem: str | None = None  # why this site cannot be split, if it cannot
    refusals: tuple = ()  # (purpose, why): constructs around it that refuse that purpose, outermost first
    identity: tuple = ()  # the jt.tag calls it holds (copies made by JAX share them)
    ncalls: int = 0  # >0: the first stack axis enumerates that many repeated calls
    differentiated: bool = False  # JAX took a derivative through it inside the traced function
    choice: tuple | None = None  # ((cond, branch), ...): the vmapped conds around it, outermost first
    remat: bool = False  # found inside a jax.checkpoint body (where JAX makes copies)
    copies: frozenset = frozenset()  # marks of the checkpoint bodies a split left it in (``_evaluator.marked_copy``)

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

    def to_user(self, value, lead: int = 0):
        """From the program's layout to the documented one (vmap axes first), after ``lead`` axes."""
        perm = self._perm()
        return value if perm is None else jnp.transpose(value, (*range(lead), *(lead + p for p in perm)))

    def from_user(self, value):
        perm = self._perm()
        # jnp.transpose takes an int array for axes; its stub says Sequence[int].
        return value if perm is None else jnp.transpose(value, np.argsort(perm))  # pyright: ignore[reportArgumentType]

    def user_shape(self) -> tuple:
        perm = self._perm()
        shape = self.shape
        return shape if perm is None else tuple(shape[p] for p in perm)

    def zeros(self):
        return _compat.zeros(self.shape, self.dtype, self.aval)

    def float0_zeros(self, lead: tuple = ()):
        return np.zeros((*lead, *self.user_shape()), dtype=_compat.float0)

    def describe(self) -> str:
        loops = f" with leading axes {self.stack}" if self.stack else ""
        return f"{self.aval.str_short()}{loops} at {self.where}"

    def call_count(self) -> int:
        """How many calls it contributes when stacked with other calls of its name."""
        return self.ncalls or 1

    def call_layout(self) -> tuple:
        """What must agree between copies of one call: one call's layout in the program."""
        stack = self.stack[1:] if self.ncalls else self.stack
        return (stack, self.aval.shape, self.dtype, self.batch_axes, self.tree)

    def stackable(self) -> tuple:
        """What must agree between calls to stack them: one call in the documented layout (a vmap
        axis may sit elsewhere in the program from call to call: ``relayout`` moves it)."""
        stack = self.stack[1:] if self.ncalls else self.stack
        return (stack, self.user_aval_shape(), self.dtype, len(self.batch_axes), self.tree)

    def layout(self) -> tuple:
        """What must agree between the branches of a cond: the value in the documented layout."""
        return (self.stack, self.user_aval_shape(), self.dtype, len(self.batch_axes), self.tree)

    def _user_order(self) -> tuple:
        """The program's axes of ``aval`` in the documented order: vmap axes, then the others."""
        return (*self.batch_axes, *(i for i in range(len(self.aval.shape)) if i not in self.batch_axes))

    def user_aval_shape(self) -> tuple:
        return tuple(self.aval.shape[i] for i in self._user_order())

    def relayout(self, target: "Site") -> tuple | None:
        """The transposition of this site's value axes that gives ``target``'s layout (None: same)."""
        order, to = self._user_order(), target._user_order()
        where = {axis: u for u, axis in enumerate(to)}
        perm = tuple(order[where[j]] for j in range(len(to)))
        return None if perm == tuple(range(len(perm))) else perm


PURPOSES = ("read", "forward", "reverse")  # capture; jvp and patch; gradients


def with_refusal(site: Site, why: str, purpose: str = "read") -> Site:
    """``site`` inside a construct that refuses ``purpose`` and the purposes that need more
    (reading < forward < reverse), for the reason ``why``."""
    return dataclasses.replace(site, refusals=((purpose, why), *site.refusals))


def site_problem(site: Site, purpose: str) -> str | None:
    """Why ``site`` cannot serve ``purpose``, or None.

    The outermost refusing construct speaks first: moving the tag out of it is the first fix.
    """
    level = PURPOSES.index(purpose)
    refused = (why for p, why in site.refusals if PURPOSES.index(p) <= level)
    return next(refused, None) or site.problem


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one equation's copy of a site sits in the site's stacked calls.

    ``start:stop`` are its calls: ``span`` where it holds several (a slice of the stacked calls),
    else ``start`` alone indexes its one call; ``primary`` is False for a copy that JAX made of
    calls seen before (the forward pass rematerialised in a backward pass): it gets the same
    inputs, and its values are not read again.
    """

    start: int | None = None
    stop: int | None = None
    span: bool = False
    primary: bool = True
    perm: tuple | None = None  # its value axes transposed by perm are the stacked site's (``Site.relayout``)

    def take(self, value):
        """This occurrence's part of a site input (in the stacked site's layout), in its own layout."""
        if self.start is not None:
            value = value[self.start : self.stop] if self.span else value[self.start]
        return value if self.perm is None else transpose_last(value, np.argsort(self.perm))

    def put(self, value):
        """This occurrence's value, in the stacked site's layout."""
        return value if self.perm is None else transpose_last(value, self.perm)


def transpose_last(value, perm):
    """``value`` with its last ``len(perm)`` axes transposed by ``perm``."""
    lead = jnp.ndim(value) - len(perm)
    return jnp.transpose(value, (*range(lead), *(lead + int(p) for p in perm)))


def assemble(sites: Sequence[Site], values: dict, lead: tuple = ()) -> dict:
    """``{name: pytree}`` from per-site values in the program's layout, after ``lead`` axes.

    A site missing from ``values`` (an integer or boolean tag under
    differentiation) gets float0 zeros, as ``jax.grad`` gives integer inputs.
    """
    by_name: dict[str, list[Site]] = {}
    for site in sites:
        by_name.setdefault(site.name, []).append(site)
    out = {}
    for name, group in by_name.items():
        group = sorted(group, key=lambda s: s.leaf)
        leaves = [
            site.to_user(values[site.key], len(lead)) if site.key in values else site.float0_zeros(lead)
            for site in group
        ]
        out[name] = jax.tree_util.tree_unflatten(group[0].tree, leaves)
    return out
