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
    refusals: tuple = ()  # (purpose, why): constructs around it that refuse that purpose, outermost first
    identity: tuple = ()  # the jt.tag calls it holds (copies made by JAX share them)
    ncalls: int = 0  # >0: the first stack axis enumerates that many repeated calls
    differentiated: bool = False  # JAX took a derivative through it inside the traced function
    choice: tuple | None = None  # ((cond, branch), ...): the vmapped conds around it, outermost first
    remat: bool = False  # found inside a jax.checkpoint body (where JAX makes copies)
    copies: frozenset = frozenset()  # marks of the checkpoint bodies a split left it in (``_split._marked_copy``)

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

    def units(self) -> int:
        """How many calls it contributes when stacked with other calls of its name."""
        return self.ncalls or 1

    def unit(self) -> tuple:
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


def with_problem(site: Site, problem: str, purpose: str = "read") -> Site:
    """``site`` inside a construct that refuses ``purpose`` and the purposes that need more
    (reading < forward < reverse), for the reason ``problem``."""
    return dataclasses.replace(site, refusals=((purpose, problem), *site.refusals))


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

    ``start:stop`` are its calls (``index`` alone where it is a single call);
    ``primary`` is False for a copy that JAX made of calls seen before (the
    forward pass rematerialised in a backward pass): it gets the same inputs,
    and its values are not read again.
    """

    start: int | None = None
    stop: int | None = None
    spliced: bool = False
    primary: bool = True
    perm: tuple | None = None  # its value axes transposed by perm are the stacked site's (``Site.relayout``)

    def take(self, value):
        """This occurrence's part of a site input (in the stacked site's layout), in its own layout."""
        if self.start is not None:
            value = value[self.start : self.stop] if self.spliced else value[self.start]
        return value if self.perm is None else _transpose_last(value, np.argsort(self.perm))

    def put(self, value):
        """This occurrence's value, in the stacked site's layout."""
        return value if self.perm is None else _transpose_last(value, self.perm)


def _transpose_last(value, perm):
    """``value`` with its last ``len(perm)`` axes transposed by ``perm``."""
    lead = jnp.ndim(value) - len(perm)
    return jnp.transpose(value, (*range(lead), *(lead + int(p) for p in perm)))


def stack_calls(sites: Sequence[Site]) -> tuple[Site, list[Slot]]:
    """One site from every equation of one level that holds a tag name's leaf.

    Rematerialised copies of one ``jt.tag`` call (``_copies``) are one site.
    Distinct calls are stacked in call order, which needs ``repeated=True``;
    calls already stacked inside a nested ``jax.jit`` or ``jax.checkpoint``
    are spliced in. The branches of one vmapped ``cond`` (``choice``) are
    alternatives: within each branch its calls are stacked as anywhere else,
    and the branches' stacks are one site, each branch's values masked to the
    examples that took it, so they add up (what an unbatched cond gives).
    """
    spliced = _spliced_copies(sites)  # a remat copy of several calls seen one by one
    site, slots, calls = _stack_occurrences(sites, [i for i in range(len(sites)) if i not in spliced])
    for i in spliced:
        slot = _copy_slot(sites[i], calls)
        if slot is None:  # not provably a copy: every occurrence its own call, never a silent merge
            return _stack_occurrences(sites, range(len(sites)))[:2]
        slots[i] = slot
    return site, slots


def _stack_occurrences(sites: Sequence[Site], chosen) -> tuple[Site, list, dict]:
    """``stack_calls`` of the occurrences ``chosen``: the site, their slots (None for the others)
    and ``_call_positions``."""
    chosen = list(chosen)
    units = [[chosen[i] for i in unit] for unit in _copies([sites[i] for i in chosen])]
    site, unit_slots = _stack_units(sites, units, depth=0)
    slots: list = [None] * len(sites)
    for members, slot in zip(units, unit_slots):
        for j, i in enumerate(members):
            slots[i] = dataclasses.replace(slot, primary=j == 0)
    return site, slots, _call_positions(units, unit_slots, sites)


def _spliced_copies(sites: Sequence[Site]) -> set:
    """Occurrences that may be a rematerialised copy of calls held elsewhere in other groupings.

    Under a ``jax.grad`` inside the traced function, JAX may inline the forward pass of a
    ``jax.checkpoint`` (one occurrence per call, or one per cond holding several) and keep in
    the backward pass a ``remat`` of just the calls it needs: a copy whose calls are all seen in
    differentiated occurrences outside a rematerialised body, grouped differently.
    """
    seen: dict = {}  # call -> identities of the differentiated originals holding it
    for s in sites:
        if s.differentiated and not s.remat:
            for c in s.identity:
                seen.setdefault(c, set()).add(s.identity)
    return {
        i
        for i, s in enumerate(sites)
        if s.remat
        and s.differentiated
        and s.identity
        and all(c in seen for c in s.identity)
        and not any(s.identity in seen[c] for c in s.identity)  # an exact copy is _copies' case
    }


def _call_positions(units: list, unit_slots: list, sites: Sequence[Site]) -> dict:
    """``{call: [(position in the stacked site, the site holding it), ...]}`` over the calls of the
    differentiated originals among ``units`` (where a copy made by JAX can come from)."""
    calls: dict = {}
    for members, slot in zip(units, unit_slots):
        original = sites[members[0]]
        if not original.differentiated or original.remat or slot.perm is not None:
            continue
        if len(original.identity) != original.units():
            continue  # its calls cannot be told apart
        start = 0 if slot.start is None else slot.start
        for k, c in enumerate(original.identity):
            calls.setdefault(c, []).append((start + k, original))
    return calls


def _copy_slot(copy: Site, calls: dict) -> Slot | None:
    """The slot of a copy of consecutive calls of one layout, or None if that is not certain."""
    found = [calls.get(c, []) for c in copy.identity]
    if any(len(f) != 1 for f in found):  # not seen, or seen in two uses: which one is unknown
        return None
    positions = [f[0][0] for f in found]
    start = positions[0]
    one_layout = all(original.unit() == copy.unit() for (_, original), in found)
    if positions != list(range(start, start + len(found))) or not one_layout or len(found) != copy.units():
        return None
    return Slot(start, start + len(found), bool(copy.ncalls), primary=False)


def _choice(site: Site, depth: int):
    """``(cond, branch)`` of the vmapped cond at nesting ``depth`` around ``site``, or None."""
    return site.choice[depth] if site.choice is not None and len(site.choice) > depth else None


def _stack_units(sites: Sequence[Site], units: list, depth: int) -> tuple[Site, list[Slot]]:
    """One site from the calls ``units`` (the occurrences of each call), and each call's slot.

    A part is one call, or one vmapped cond at this ``depth`` (its branches' calls stacked
    recursively, then merged as alternatives); the parts are stacked in call order.
    """
    groups: dict = {}
    for u, members in enumerate(units):
        choice = _choice(sites[members[0]], depth)
        groups.setdefault(("cond", choice[0]) if choice else ("call", u), []).append(u)
    parts = []  # (site, {unit: slot within the part})
    for (kind, _), us in groups.items():
        if kind == "call":
            (u,) = us
            occurrences = [sites[i] for i in units[u]]
            site = dataclasses.replace(occurrences[0], differentiated=any(s.differentiated for s in occurrences))
            parts.append((site, {u: Slot()}))
            continue
        branches: dict = {}
        for u in us:
            branches.setdefault(_choice(sites[units[u][0]], depth)[1], []).append(u)
        alternatives, members = [], []
        for bus in branches.values():
            site, bslots = _stack_units(sites, [units[u] for u in bus], depth + 1)
            alternatives.append(site)
            members.append(dict(zip(bus, bslots)))
        if len(alternatives) == 1:  # one branch here: the site stays that branch's (for a level above)
            parts.append((alternatives[0], members[0]))
            continue
        merged = merge_branches(alternatives, "a jax.vmap of a lax.cond")
        within = {}
        for site, bslots in zip(alternatives, members):  # each branch's vmap axes moved to the merged site's place
            perm = site.relayout(merged) if len({a.layout() for a in alternatives}) == 1 else None
            within.update({u: dataclasses.replace(s, perm=_compose(s.perm, perm)) for u, s in bslots.items()})
        if merged.ncalls:  # a branch whose calls were stacked below: one spliced call is all of them
            within = {u: Slot(0, merged.ncalls, True, perm=s.perm) if s.start is None else s for u, s in within.items()}
        parts.append((dataclasses.replace(merged, choice=merged.choice[:depth] or None), within))
    if len(parts) == 1:
        site, within = parts[0]
        return site, [within[u] for u in range(len(units))]
    firsts = [site for site, _ in parts]
    first = firsts[0]
    sources = tuple(dict.fromkeys(src for s in firsts for src in s.sources))
    if not all(s.repeated for s in firsts):
        problem = (
            f"The tag name {first.name!r} is used at {len(firsts)} sites ({', '.join(s.where for s in firsts)}). "
            "Give each site its own name, or pass repeated=True to jaxtrace.tag to stack the calls "
            "in call order."
        )
    elif len({s.stackable() for s in firsts}) > 1:
        problem = (
            f"The repeated tag {first.name!r} is called with different shapes, structures or loop axes "
            f"({'; '.join(s.describe() for s in firsts)}), so its calls cannot be stacked. "
            "Use a different name for each shape, or call it at one loop depth."
        )
    else:
        problem = next((s.problem for s in firsts if s.problem), None)
    slots: list = [None] * len(units)
    count = 0
    stackable = len({s.stackable() for s in firsts}) == 1  # else the calls have no common layout (an error)
    for site, within in parts:
        # a call whose vmap axis sits elsewhere: moved to the first's place
        perm = site.relayout(first) if stackable else None
        for u, slot in within.items():
            slots[u] = _offset(slot, count, site, perm)
        count += site.units()
    stack = first.stack[1:] if first.ncalls else first.stack
    merged = dataclasses.replace(
        first,
        stack=(count, *stack),
        sources=sources,
        problem=problem,
        identity=tuple(i for s in firsts for i in s.identity),
        ncalls=count,
        differentiated=any(s.differentiated for s in firsts),
        remat=False,
        copies=frozenset().union(*(s.copies for s in firsts)),
        choice=_common_choice(firsts),
        **_refusals_of(firsts),
    )
    return merged, slots


def _common_choice(sites: Sequence[Site]) -> tuple | None:
    """The vmapped-cond branches that all of ``sites`` are in (outermost first), or None."""
    common: tuple = ()
    for entries in zip(*(s.choice or () for s in sites)):
        if len(set(entries)) > 1:
            break
        common += (entries[0],)
    return common or None


def _offset(slot: Slot, start: int, part: Site, perm: tuple | None) -> Slot:
    """``slot`` within a part that starts at call ``start`` of the stacked site, its layout then
    transposed by ``perm`` (the part's layout to the stacked site's)."""
    perm = _compose(slot.perm, perm)
    if slot.start is None:  # the part is this one call, or (spliced) all of its calls
        return Slot(start, start + part.units(), bool(part.ncalls), perm=perm)
    return Slot(start + slot.start, start + slot.stop, slot.spliced, perm=perm)


def _compose(first: tuple | None, then: tuple | None) -> tuple | None:
    """The transposition ``first`` followed by ``then``."""
    if first is None or then is None:
        return then if first is None else first
    perm = tuple(first[j] for j in then)
    return None if perm == tuple(range(len(perm))) else perm


def _refusals_of(sites: Sequence[Site]) -> dict:
    """The refusals of any of ``sites``, for the site merged from them."""
    return {"refusals": tuple(dict.fromkeys(r for s in sites for r in s.refusals))}


def _copies(sites: Sequence[Site]) -> list[list[int]]:
    """The occurrences of each call: equations that hold one ``jt.tag`` call (``identity``).

    JAX copies an equation when it rematerialises a ``jax.checkpoint`` body in
    the backward pass of a ``jax.grad`` inside the traced function: those
    copies compute the same value and are one call. The same call can also
    appear several times for another reason, e.g. a ``jax.jit`` whose cached
    trace is called twice: those are distinct uses. Occurrences are taken as
    copies only when that is certain (differentiated, one layout, at most one
    outside a rematerialised body and unmarked); otherwise each is its own
    use, which is an error or a stack, never a silent merge. A split that
    leaves a tag in a checkpoint body marks it (``copies``): where JAX, in a
    transform around that split, copies it out of the body, the copy is known
    as one, and copies of two different calls carry two marks.
    """
    buckets: dict = {}
    for i, site in enumerate(sites):
        buckets.setdefault(site.identity, []).append(i)
    units = []
    for members in (group for call in buckets.values() for group in _by_mark(call, sites)):
        group = [sites[i] for i in members]
        copies = (
            len(group) > 1
            and all(s.differentiated for s in group)
            and len({s.unit() for s in group}) == 1
            and sum(not (s.remat or s.copies) for s in group) <= 1
            and len(frozenset().union(*(s.copies for s in group))) <= 1  # one mark (a stacked site may hold several)
        )
        if copies:
            original = min(members, key=lambda i: (sites[i].remat, bool(sites[i].copies)))
            units.append([original, *(i for i in members if i != original)])
        else:
            units.extend([i] for i in members)
    return sorted(units, key=min)


def _by_mark(members: list, sites: Sequence[Site]) -> list[list[int]]:
    """The occurrences of one call, split by the checkpoint body a split marked them in (each body
    holds its own call: a cached trace evaluated twice); the unmarked join the marked, if they
    are of one body, and are each their own use where it is not known which one they copy."""
    marked: dict = {}
    for i in members:
        marked.setdefault(sites[i].copies, []).append(i)
    plain = marked.pop(frozenset(), [])
    if len(marked) <= 1:
        return [sorted(plain + next(iter(marked.values()), []))]
    return [[i] for i in plain] + list(marked.values())


def merge_branches(sites: Sequence[Site], where: str) -> Site:
    """One site from the same tag in several branches of one cond, in the first branch's layout.

    The branches must agree in the documented layout (``Site.layout``); a vmap axis may sit
    elsewhere in the program from branch to branch (``relayout`` moves it), as between repeated calls.
    """
    first = sites[0]
    sources = tuple(dict.fromkeys(src for s in sites for src in s.sources))
    problem = next((s.problem for s in sites if s.problem), None)
    if len({s.layout() for s in sites}) > 1:
        problem = (
            f"The tag {first.name!r} has different shapes in the branches of the cond at {where} "
            f"({'; '.join(s.describe() for s in sites)}). Use one name per shape."
        )
    identity = tuple(i for s in sites for i in s.identity)
    differentiated = any(s.differentiated for s in sites)
    return dataclasses.replace(
        first,
        sources=sources,
        problem=problem,
        identity=identity,
        differentiated=differentiated,
        **_refusals_of(sites),
    )


# --- selection ------------------------------------------------------------


def tag_names(sites: Iterable[Site]) -> list[str]:
    return list(dict.fromkeys(s.name for s in sites))


def check_callable(fun, where: str) -> None:
    """Raises as ``jax.grad(3.0)`` does when ``fun`` is not a function; ``where`` is e.g. ``"jaxtrace.grad"``."""
    if not callable(fun):
        raise TypeError(
            f"Expected a callable value, got {fun!r}. {where} takes the function itself as its first "
            "argument, not a value computed by it: pass f, not f(x)."
        )


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


def select(sites: dict, tags: TagSelection, purpose: str = "reverse") -> list[Site]:
    """The sites that ``tags=`` asks for; raises for unknown names and sites that cannot serve
    ``purpose`` (``"read"``: capture; ``"forward"``: jvp, patch; ``"reverse"``: gradients)."""
    check_tags(tags)
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
