"""Where a value shared by every example meets the examples, found in the program.

A layer applied to a value shared by every example (position ids ``arange(T)`` inside
``jax.vmap(model)``) has an output that reaches every loss; it meets the examples where an
elementwise operation broadcasts it against a per-example value, where a broadcast lays it along
the examples' axis (a class token concatenated to each example's patches), or a ``dot_general``
contracts it with one (``h @ pos.T``). ``SharedUses`` follows such a value from where it is made
through its users (at the program's top level or in ``jit`` and ``checkpoint`` bodies, into and out
of them; a meeting inside a loop or branch body is not listed, and the layer's leaves take the exact
path), reading each use's ownership from the proof's backward walk (``_proof_backward``); the
walker maps a value into a body and back out (``into_body``, ``results_of``, ``bodies_along``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .. import _compat
from .._walker import bodies_along, into_body, results_of, scan_positions
from ._owners import ELEMENTWISE, OWNERS, SHAPE_ONLY, Axis, Every, axis_of, elementwise, shape_of
from ._proof_backward import Backward, is_call

__all__ = ["SharedUse", "SharedUses"]


@dataclasses.dataclass(frozen=True)
class SharedUse:
    """A shared layer output meeting the examples: ``eqn``'s operand ``index`` (a chain of shape
    equations ``chain`` from the layer's output) is broadcast against per-example operands
    (an elementwise ``eqn``) or contracted with one whose free axis is the examples' (a
    ``dot_general``)."""

    path: str
    eqn: Any
    index: int
    chain: tuple  # equations from the layer's output var to the operand, in order
    ctx: tuple = ()  # the calls (jit, checkpoint) that hold ``eqn``, outermost first


class SharedUses:
    """The meetings of shared values with the examples, read off a finished backward walk."""

    def __init__(self, backward: Backward, occurrences: dict):
        self.backward, self.occurrences = backward, occurrences
        self.users: dict = {}  # id(jaxpr) -> (jaxpr, its users and outputs)

    def shared_uses(self, jaxpr, reads: dict, in_scans: dict) -> list:
        """Where each layer output (and each read ``reads`` names, ``{name: (var, ctx)}``, and each scan
        body input ``in_scans`` names) that reaches every loss meets the examples, at the top level or
        in the ``jit`` and ``checkpoint`` bodies around it; one with any other use gets none (its leaves
        take the exact path)."""
        starts = [(path, occ.eqn.outvars[0], occ.ctx) for path, occs in self.occurrences.items() for occ in occs]
        places = []
        for path, var, ctx in starts:
            down = _calls_down(jaxpr, ctx)
            if down is not None:  # in no loop, branch or custom rule: followed out of its calls too
                places.append((path, var, *down, ctx))
        for path, (var, ctx) in reads.items():  # a read may sit in scan bodies too: it meets the examples there
            down = _calls_down(jaxpr, ctx, scans=True)
            if down is not None:
                places.append((path, var, *down, ctx))
        for path, (eqns, var) in in_scans.items():  # in the body of the innermost of nested scans
            places.append((path, var, *bodies_along(jaxpr, tuple(eqns)), tuple(eqns)))
        found = []
        for path, var, where, outer, ctx in places:
            state = self.backward.state.get((ctx, var))
            if not isinstance(state, Every) or state.kind != "shared":
                continue
            uses = self._meetings(where, var, [], ctx, outer)
            if uses is None:
                continue
            found.extend(SharedUse(path, eqn, index, chain, ctx) for eqn, index, chain, ctx in uses)
        return found

    def _meetings(self, jaxpr, var, chain, ctx, outer: tuple = ()) -> Optional[list]:
        """``[(eqn, operand index, chain, ctx)]``: where ``var`` of ``jaxpr`` (in the calls ``ctx``; ``outer``:
        the jaxprs that hold them) meets the examples; None if it reaches the losses any other way."""
        key = id(jaxpr)
        if key not in self.users:
            self.users[key] = (jaxpr, _users(jaxpr))  # the jaxpr kept alive: its id stays its own
        users, outs = self.users[key][1]
        found = []
        if var in outs:  # out of a jit or checkpoint body: on at the call's output; out of anything else: no
            if not ctx or len(outer) != len(ctx) or not is_call(ctx[-1]):
                return None
            for result in results_of(ctx[-1], jaxpr, var):
                more = self._meetings(outer[-1], result, chain, ctx[:-1], outer[:-1])
                if more is None:
                    return None
                found.extend(more)
        for eqn in users.get(var, []):
            if all(self.backward.state.get((ctx, v)) is None for v in eqn.outvars):
                continue  # no output of this use reaches a loss
            name = eqn.primitive.name
            if is_call(eqn):  # follow it into the call's body
                body, inners = into_body(eqn, var)
                for inner in inners:
                    more = self._meetings(body, inner, chain, (*ctx, eqn), (*outer, jaxpr))
                    if more is None:
                        return None
                    found.extend(more)
                continue
            state = self.backward.state.get((ctx, eqn.outvars[0]))
            if len(eqn.outvars) != 1:
                return None  # a loop, a branch or a split: the value meets the examples inside it (exact path)
            if name == "broadcast_in_dim" and isinstance(state, Axis):
                # the broadcast itself lays the value along the examples' axis, each example a copy
                # (``jnp.concatenate([cls, x])``, ``x.at[0].set(cls)`` inside ``jax.vmap(model)``)
                where = axis_of(shape_of(eqn.outvars[0]), state, self.backward.batch)
                ins = OWNERS[name](self.backward, eqn, [state], ctx)
                if where is None or where[1] != 1 or ins is None or not (isinstance(ins[0], Every) and ins[0].kind == "shared"):
                    return None
                found.append((eqn, 0, tuple(chain), ctx))
                continue
            if (name in SHAPE_ONLY or name == "transpose") and len(eqn.invars) == 1:
                more = self._meetings(jaxpr, eqn.outvars[0], [*chain, eqn], ctx)
                if more is None:
                    return None
                found.extend(more)
                continue
            if name not in ELEMENTWISE and name != "dot_general" or name == "jaxtrace_tag" or not isinstance(state, Axis):
                return None
            where = axis_of(shape_of(eqn.outvars[0]), state, self.backward.batch)
            if where is None or where[1] != 1:
                return None
            # elementwise: broadcast against the examples; dot_general: contracted with a per-example
            # operand whose free axis is the examples' (``h @ pos.T``)
            ins = elementwise(self.backward, eqn, [state], ctx) if name != "dot_general" else OWNERS[name](self.backward, eqn, [state], ctx)
            if ins is None or name == "dot_general" and sum(a is var for a in eqn.invars) != 1:
                return None
            for index, a in enumerate(eqn.invars):
                if a is var:
                    if not (isinstance(ins[index], Every) and ins[index].kind == "shared"):
                        return None
                    found.append((eqn, index, tuple(chain), ctx))
        return found


def _calls_down(jaxpr, ctx: tuple, scans: bool = False) -> Optional[tuple]:
    """``(the body ctx's innermost call runs, (the jaxprs that hold each call of ctx))`` where every
    equation of ``ctx`` is a ``jit`` or ``checkpoint`` call (or, with ``scans``, a ``lax.scan``); else
    None (a loop, a branch, a custom rule)."""
    loops = scan_positions(ctx) if scans else []
    if not all(is_call(eqn) or i in loops for i, eqn in enumerate(ctx)):
        return None
    return bodies_along(jaxpr, ctx)


def _users(jaxpr) -> tuple[dict, set]:
    """``({var: [the equations that read it, once each]}, {the jaxpr's output vars})``."""
    users: dict = {}
    for eqn in jaxpr.eqns:
        for a in eqn.invars:
            if not isinstance(a, _compat.Literal) and not any(e is eqn for e in users.get(a, ())):
                users.setdefault(a, []).append(eqn)  # once per equation, however many operands it is
    return users, {a for a in jaxpr.outvars if not isinstance(a, _compat.Literal)}


