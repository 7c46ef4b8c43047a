"""Program: a traced jaxpr and every tag site in it, found once per jaxpr level.

``Program`` walks a traced jaxpr once and records every site (``_sites.Site``): a tag
equation is a site; a higher-order equation holds the sites its rule (``_higher_order_rules``)
finds in its bodies; one that has no rule and holds a tag makes that tag unsplittable.
The occurrences of one name in one level are stacked into one site (``_stacking``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import _compat, _higher_order
from ._sites import Site
from ._higher_order_rules import NO_SITES, RULES, Unsupported
from ._stacking import stack_calls
from ._tag import is_tag, open_scopes, visible

__all__ = ["Level", "Program"]


@dataclasses.dataclass
class Level:
    """The sites of one jaxpr: per equation, and merged over the equations."""

    eqn_sites: list  # per equation: {key: Site} of the tags inside it
    sites: dict  # {key: Site}, repeated calls stacked
    slots: list  # per equation: {key: Slot}, where its copy of the site sits in ``sites[key]``


class Program:
    """A traced function and every tag site in it."""

    def __init__(self, jaxpr):
        self.jaxpr, self.consts = _compat.jaxpr_and_consts(jaxpr)
        self.scopes = open_scopes()  # another transform's own tags (``_tag.scoped``) are not sites here
        self._levels: dict[int, tuple[Any, Level]] = {}
        self.sites: dict = self.level(self.jaxpr).sites

    def level(self, jaxpr) -> Level:
        jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
        entry = self._levels.get(id(jaxpr))
        if entry is None:
            entry = self._levels[id(jaxpr)] = (jaxpr, self._build_level(jaxpr))
        return entry[1]

    def _build_level(self, jaxpr) -> Level:
        eqn_sites, found = [], {}
        for i, eqn in enumerate(jaxpr.eqns):
            inside = self._eqn_sites(eqn)
            eqn_sites.append(inside)
            for key, site in inside.items():
                found.setdefault(key, []).append((i, site))
        sites: dict = {}
        slots: list = [{} for _ in jaxpr.eqns]
        for key, occurrences in found.items():
            sites[key], key_slots = stack_calls([site for _, site in occurrences])
            for (i, _), slot in zip(occurrences, key_slots):
                slots[i][key] = slot
        return Level(eqn_sites, sites, slots)

    def _eqn_sites(self, eqn) -> dict:
        if is_tag(eqn):
            return _tag_site(eqn) if visible(eqn, self.scopes) else NO_SITES
        rule = RULES.get(_higher_order.kind(eqn))  # type: ignore[arg-type]
        if rule is not None:
            return rule.sites(self, eqn)
        bodies = _higher_order.bodies(eqn)
        if not bodies:
            return NO_SITES
        return Unsupported(
            f"jaxtrace does not know how to split the `{eqn.primitive.name}` primitive",
            "Move the tag outside it, or open an issue so that a rule for it can be added.",
        ).sites(self, eqn, bodies)


def _tag_site(eqn) -> dict:
    """``{key: Site}`` of one tag equation."""
    p = eqn.params
    site = Site(
        name=p["name"],
        leaf=p["leaf"],
        tree=p["tree"],
        aval=eqn.invars[0].aval,
        stack=(),
        batch_axes=p["batch_axes"],
        repeated=p["repeated"],
        sources=(_compat.source_line(eqn),),
        identity=(p["call"],),
        differentiated=p.get("differentiated", False),
        choice=p.get("choice"),
        copies=frozenset([p["copy"]]) if p.get("copy") else frozenset(),
    )
    return {site.key: site}
