"""Where each tag sits in the traced program, for ``find_nonfinite``: an order on their entries.

A *template* says where a site's entries sit in the traced program, as nested tuples (static,
hashable): ("tag", i) the tag equation at position i; ("in", i, t) inside the i-th equation (a
jit, cond, checkpoint, ...); ("loop", i, t) inside the i-th equation, a scan, whose step is the
site's next stack axis; ("calls", ((start, stop, span, t), ...)) repeated calls stacked on the
next stack axis, each call range at its own place. ``entry_order`` turns a template and the loop
steps of one entry into a tuple that sorts entries in the order the program computes them.
"""

from __future__ import annotations

import os

from . import _compat
from ._tag import is_tag

__all__ = ["templates", "entry_order", "loop_count"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_MODULE_TAGS = os.path.join(_PACKAGE_DIR, "_module_tags.py")  # where jt.tag_modules's tags are made


def templates(program, jaxpr=None, cache=None, modules=None) -> dict:
    """``{site key: template}`` for the sites of ``jaxpr`` (default: the whole program); the keys
    of the tags that ``jt.tag_modules`` made are added to ``modules``."""
    cache = {} if cache is None else cache
    modules = set() if modules is None else modules
    jaxpr = program.jaxpr if jaxpr is None else jaxpr
    jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
    if id(jaxpr) in cache:
        return cache[id(jaxpr)]
    level = program.level(jaxpr)
    occurrences: dict = {}
    for i, (eqn, inside, slots) in enumerate(zip(jaxpr.eqns, level.eqn_sites, level.slots)):
        for key in inside:
            slot = slots[key]
            if not slot.primary:  # a copy JAX made (remat): its values are the original's
                continue
            template: tuple = ("tag", i)
            if is_tag(eqn):
                if any(os.path.abspath(f) == _MODULE_TAGS for f in _compat.frame_files(eqn)):
                    modules.add(key)
            else:
                for body in _compat.sub_jaxprs(eqn.params):
                    inner = templates(program, body, cache, modules).get(key)
                    if inner is not None:
                        kind = "loop" if eqn.primitive.name in _compat.SCAN else "in"
                        template = (kind, i, inner)
                        break
            occurrences.setdefault(key, []).append((slot, template))
    out = {}
    for key, found in occurrences.items():
        if level.sites[key].ncalls and all(slot.start is not None for slot, _ in found):
            out[key] = (
                "calls",
                tuple((slot.start, slot.stop if slot.stop is not None else slot.start + 1, slot.span, t) for slot, t in found),
            )
        else:
            out[key] = found[0][1]
    cache[id(jaxpr)] = out
    return out


def entry_order(template: tuple, steps: tuple) -> tuple[tuple, tuple]:
    """``(sort key, kind of each loop axis)`` of the entry at loop ``steps`` of a site."""
    kind = template[0]
    if kind == "tag":
        return (template[1],), ()
    if kind == "in":
        key, kinds = entry_order(template[2], steps)
        return (template[1], *key), kinds
    if kind == "loop":
        key, kinds = entry_order(template[2], steps[1:])
        return (template[1], steps[0], *key), ("scan step", *kinds)
    for start, stop, span, inner in template[1]:
        if start <= steps[0] < stop:
            key, kinds = entry_order(inner, ((steps[0] - start, *steps[1:]) if span else steps[1:]))
            return key, ("call", *kinds[1:]) if span else ("call", *kinds)
    raise ValueError(f"jaxtrace.find_nonfinite: no call {steps[0]} in {template}.")  # pragma: no cover


def loop_count(template: tuple) -> int:
    """How many stack axes ``template`` accounts for."""
    kind = template[0]
    if kind == "tag":
        return 0
    if kind == "in":
        return loop_count(template[2])
    if kind == "loop":
        return 1 + loop_count(template[2])
    start, stop, span, inner = template[1][0]
    return 1 + (loop_count(inner) - 1 if span else loop_count(inner))
