"""Stacking: the occurrences of one tag name in one jaxpr level, as one site and a slot each.

Rematerialised copies of one ``jt.tag`` call are one call; distinct calls are stacked in
call order (``repeated=True``); the branches of a vmapped ``cond`` are alternatives merged
into one site; and the branches of an ordinary ``cond`` merge likewise (``merge_branches``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ._sites import Site, Slot

__all__ = ["merge_branches", "stack_calls"]


def stack_calls(sites: Sequence[Site]) -> tuple[Site, list[Slot]]:
    """One site from every equation of one level that holds a tag name's leaf.

    Rematerialised copies of one ``jt.tag`` call (``_occurrences_by_call``) are one site.
    Distinct calls are stacked in call order, which needs ``repeated=True``;
    calls already stacked inside a nested ``jax.jit`` or ``jax.checkpoint``
    are taken in as a span of calls. The branches of one vmapped ``cond`` (``choice``) are
    alternatives: within each branch its calls are stacked as anywhere else,
    and the branches' stacks are one site, each branch's values masked to the
    examples that took it, so they add up (what an unbatched cond gives).
    """
    regrouped = _regrouped_copies(sites)  # a remat copy of several calls seen one by one
    site, slots, calls = _stack_occurrences(sites, [i for i in range(len(sites)) if i not in regrouped])
    for i in regrouped:
        slot = _copy_slot(sites[i], calls)
        if slot is None:  # not provably a copy: every occurrence its own call, never a silent merge
            return _stack_occurrences(sites, range(len(sites)))[:2]
        slots[i] = slot
    return site, slots


def _stack_occurrences(sites: Sequence[Site], chosen) -> tuple[Site, list, dict]:
    """``stack_calls`` of the occurrences ``chosen``: the site, their slots (None for the others)
    and ``_call_positions``."""
    chosen = list(chosen)
    calls = [[chosen[i] for i in call] for call in _occurrences_by_call([sites[i] for i in chosen])]
    site, call_slots = _stack_at(sites, calls, depth=0)
    slots: list = [None] * len(sites)
    for members, slot in zip(calls, call_slots):
        for j, i in enumerate(members):
            slots[i] = dataclasses.replace(slot, primary=j == 0)
    return site, slots, _call_positions(calls, call_slots, sites)


def _regrouped_copies(sites: Sequence[Site]) -> set:
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
        and not any(s.identity in seen[c] for c in s.identity)  # an exact copy is _occurrences_by_call's case
    }


def _call_positions(calls: list, call_slots: list, sites: Sequence[Site]) -> dict:
    """``{call: [(position in the stacked site, the site holding it), ...]}`` over the calls of the
    differentiated originals among ``calls`` (where a copy made by JAX can come from)."""
    positions: dict = {}
    for members, slot in zip(calls, call_slots):
        original = sites[members[0]]
        if not original.differentiated or original.remat or slot.perm is not None:
            continue
        if len(original.identity) != original.call_count():
            continue  # its calls cannot be told apart
        start = 0 if slot.start is None else slot.start
        for k, c in enumerate(original.identity):
            positions.setdefault(c, []).append((start + k, original))
    return positions


def _copy_slot(copy: Site, calls: dict) -> Slot | None:
    """The slot of a copy of consecutive calls of one layout, or None if that is not certain."""
    found = [calls.get(c, []) for c in copy.identity]
    if any(len(f) != 1 for f in found):  # not seen, or seen in two uses: which one is unknown
        return None
    positions = [f[0][0] for f in found]
    start = positions[0]
    one_layout = all(original.call_layout() == copy.call_layout() for (_, original), in found)
    if positions != list(range(start, start + len(found))) or not one_layout or len(found) != copy.call_count():
        return None
    return Slot(start, start + len(found), span=bool(copy.ncalls), primary=False)


def _choice(site: Site, depth: int):
    """``(cond, branch)`` of the vmapped cond at nesting ``depth`` around ``site``, or None."""
    return site.choice[depth] if site.choice is not None and len(site.choice) > depth else None


def _stack_at(sites: Sequence[Site], calls: list, depth: int) -> tuple[Site, list[Slot]]:
    """One site from ``calls`` (the occurrences of each call), and each call's slot.

    A part is one call, or one vmapped cond at this ``depth`` (its branches' calls stacked
    recursively, then merged as alternatives); the parts are stacked in call order.
    """
    groups: dict = {}
    for u, members in enumerate(calls):
        choice = _choice(sites[members[0]], depth)
        groups.setdefault(("cond", choice[0]) if choice else ("call", u), []).append(u)
    parts = [  # (site, {call: slot within the part})
        _cond_part(sites, calls, us, depth) if kind == "cond" else _call_part(sites, calls, us)
        for (kind, _), us in groups.items()
    ]
    if len(parts) == 1:
        site, within = parts[0]
        return site, [within[u] for u in range(len(calls))]
    return _stack_parts(parts, len(calls))


def _call_part(sites: Sequence[Site], calls: list, us: list) -> tuple[Site, dict]:
    """The part that is one call: its first occurrence, differentiated if any occurrence is."""
    (u,) = us
    occurrences = [sites[i] for i in calls[u]]
    site = dataclasses.replace(occurrences[0], differentiated=any(s.differentiated for s in occurrences))
    return site, {u: Slot()}


def _cond_part(sites: Sequence[Site], calls: list, us: list, depth: int) -> tuple[Site, dict]:
    """The part that is one vmapped cond at ``depth``: each branch's calls stacked, the branches
    merged as alternatives (each branch's vmap axes moved to the merged site's place)."""
    branches: dict = {}
    for u in us:
        branches.setdefault(_choice(sites[calls[u][0]], depth)[1], []).append(u)
    alternatives, members = [], []
    for bus in branches.values():
        site, bslots = _stack_at(sites, [calls[u] for u in bus], depth + 1)
        alternatives.append(site)
        members.append(dict(zip(bus, bslots)))
    if len(alternatives) == 1:  # one branch here: the site stays that branch's (for a level above)
        return alternatives[0], members[0]
    merged = merge_branches(alternatives, "a jax.vmap of a lax.cond")
    one_layout = len({a.layout() for a in alternatives}) == 1
    within = {}
    for site, bslots in zip(alternatives, members):
        perm = site.relayout(merged) if one_layout else None
        within.update({u: dataclasses.replace(s, perm=_compose(s.perm, perm)) for u, s in bslots.items()})
    if merged.ncalls:  # a branch whose calls were stacked below: one span of calls is all of them
        within = {u: Slot(0, merged.ncalls, span=True, perm=s.perm) if s.start is None else s for u, s in within.items()}
    return dataclasses.replace(merged, choice=merged.choice[:depth] or None), within


def _stack_parts(parts: list, n_calls: int) -> tuple[Site, list[Slot]]:
    """The parts (``(site, {call: slot})``) stacked in call order as one site, and each call's slot."""
    firsts = [site for site, _ in parts]
    first = firsts[0]
    slots: list = [None] * n_calls
    count = 0
    stackable = len({s.stackable() for s in firsts}) == 1  # else the calls have no common layout (an error)
    for site, within in parts:
        # a call whose vmap axis sits elsewhere: moved to the first's place
        perm = site.relayout(first) if stackable else None
        for u, slot in within.items():
            slots[u] = _offset(slot, count, site, perm)
        count += site.call_count()
    stack = first.stack[1:] if first.ncalls else first.stack
    merged = dataclasses.replace(
        first,
        stack=(count, *stack),
        sources=tuple(dict.fromkeys(src for s in firsts for src in s.sources)),
        problem=_stacking_problem(firsts),
        identity=tuple(i for s in firsts for i in s.identity),
        ncalls=count,
        differentiated=any(s.differentiated for s in firsts),
        remat=False,
        copies=frozenset().union(*(s.copies for s in firsts)),
        choice=_common_choice(firsts),
        **_refusals_of(firsts),
    )
    return merged, slots


def _stacking_problem(firsts: Sequence[Site]) -> str | None:
    """Why the calls ``firsts`` (one site each) cannot be stacked, or the first's own problem."""
    first = firsts[0]
    if not all(s.repeated for s in firsts):
        return (
            f"The tag name {first.name!r} is used at {len(firsts)} sites ({', '.join(s.where for s in firsts)}). "
            "Give each site its own name, or pass repeated=True to jaxtrace.tag to stack the calls "
            "in call order."
        )
    if len({s.stackable() for s in firsts}) > 1:
        return (
            f"The repeated tag {first.name!r} is called with different shapes, structures or loop axes "
            f"({'; '.join(s.describe() for s in firsts)}), so its calls cannot be stacked. "
            "Use a different name for each shape, or call it at one loop depth."
        )
    return next((s.problem for s in firsts if s.problem), None)


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
    if slot.start is None:  # the part is this one call, or (a span) all of its calls
        return Slot(start, start + part.call_count(), span=bool(part.ncalls), perm=perm)
    return Slot(start + slot.start, start + slot.stop, span=slot.span, perm=perm)


def _compose(first: tuple | None, then: tuple | None) -> tuple | None:
    """The transposition ``first`` followed by ``then``."""
    if first is None or then is None:
        return then if first is None else first
    perm = tuple(first[j] for j in then)
    return None if perm == tuple(range(len(perm))) else perm


def _refusals_of(sites: Sequence[Site]) -> dict:
    """The refusals of any of ``sites``, for the site merged from them."""
    return {"refusals": tuple(dict.fromkeys(r for s in sites for r in s.refusals))}


def _occurrences_by_call(sites: Sequence[Site]) -> list[list[int]]:
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
    calls = []
    for members in (group for call in buckets.values() for group in _by_mark(call, sites)):
        group = [sites[i] for i in members]
        copies = (
            len(group) > 1
            and all(s.differentiated for s in group)
            and len({s.call_layout() for s in group}) == 1
            and sum(not (s.remat or s.copies) for s in group) <= 1
            and len(frozenset().union(*(s.copies for s in group))) <= 1  # one mark (a stacked site may hold several)
        )
        if copies:
            original = min(members, key=lambda i: (sites[i].remat, bool(sites[i].copies)))
            calls.append([original, *(i for i in members if i != original)])
        else:
            calls.extend([i] for i in members)
    return sorted(calls, key=min)


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

