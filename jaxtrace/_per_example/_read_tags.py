"""Where the pass tags a leaf's reads (``_reads``), so that a scan stacks no array twice.

A read's factors are its recorded operand and its output's gradient; in a ``lax.scan`` body each
tag stacks one array per step, carried out of the scan. Two placements keep those arrays to what
the plain step's scan already holds:

- **Reads whose outputs add up share one tag on the sum** (``W_h @ h + W_x @ x_t``): where a read's
  output is used only by an ``add`` of its own shape, and that sum's only use is another such ``add``,
  and so on, the gradient at the read's output *is* the gradient at the last sum. One tag there serves
  every read below it (one stacked cotangent, not one per read).
- **A read of a scan's ``xs`` slice is tagged on ``xs`` itself**: where the operand the pass records
  is the body's slice of an ``xs`` operand, the tag sits on that operand outside the scan, whose value
  is the whole stacked array the scan reads, not a per-step copy of it.

``ReadTags`` holds both placements, keyed as ``_meetings.Replay`` keys its places (the ids of the
calls that hold an equation, then the equation's).

Example (the tanh RNN's step ``tanh(h @ w + x @ u)``)::

    tags = place_read_tags(jaxpr, {"w:read:0": read_w, "u:read:1": read_u})
    tags.grad_tag("u:read:1")   # "w:read:0:sum": the one tag on h @ w + x @ u
    tags.on_xs                  # {(..., id(scan), 1): ["u:read:1:in"]}: xs, tagged before the scan
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .. import _compat, _higher_order
from .._walker import body_of, operand_role, uses_of
from .._module_tags import INPUT_SUFFIX

__all__ = ["ReadTags", "place_read_tags"]


@dataclasses.dataclass(frozen=True)
class ReadTags:
    """Where the reads' tags go other than on the read itself: ``sums``, ``{read name: name of the tag
    on the sum its output adds into}``; ``at_sums``, ``{(ids of the calls, id of the add): that tag's
    name}``; ``on_xs``, ``{(ids of the calls, id of the scan, operand index): [names of the input tags
    put on that operand]}``; ``moved_inputs``, the reads whose input tag is among them."""

    sums: dict = dataclasses.field(default_factory=dict)
    at_sums: dict = dataclasses.field(default_factory=dict)
    on_xs: dict = dataclasses.field(default_factory=dict)
    moved_inputs: frozenset = frozenset()

    def grad_tag(self, name: str) -> str:
        """The tag whose gradient is read ``name``'s output gradient."""
        return self.sums.get(name, name)


def place_read_tags(jaxpr, reads: dict) -> ReadTags:
    """The placements for ``reads`` (``{tag name: _reads.Read}``, proven, none shared by every example)
    in the traced program ``jaxpr``."""
    sums: dict = {}
    tops: dict = {}  # key of the last add -> the reads below it
    on_xs: dict = {}
    moved = set()
    uses_in: dict = {}  # id(body) -> (body, its uses): built once per body however many reads it holds
    for name, read in reads.items():
        body = _body(jaxpr, read.ctx)
        if body is None:
            continue
        if id(body) not in uses_in:
            uses_in[id(body)] = (body, uses_of(body))  # the body kept: its id stays its own
        uses = uses_in[id(body)][1]
        top = _last_sum(read.eqn.outvars[0], uses)
        if top is not None:
            tops.setdefault((*map(id, read.ctx), id(top)), []).append(name)
        j = _xs_operand(read, body)
        if j is not None:
            on_xs.setdefault((*map(id, read.ctx), j), []).append(name + INPUT_SUFFIX)
            moved.add(name)
    at_sums = {}
    for key, names in tops.items():
        if len(names) > 1:  # one read alone keeps its tag: nothing to share
            at_sums[key] = names[0] + ":sum"
            sums.update({n: at_sums[key] for n in names})
    return ReadTags(sums, at_sums, on_xs, frozenset(moved))


def _body(jaxpr, ctx: tuple):
    """The jaxpr that holds an equation of context ``ctx`` (the program's own at the top level), or
    ``None`` where it is not a scan's or a call's body."""
    if not ctx:
        return _compat.jaxpr_and_consts(jaxpr)[0]
    eqn = ctx[-1]
    if not hasattr(eqn, "primitive") or _higher_order.kind(eqn) not in (_higher_order.SCAN, *_higher_order.CALL_LIKE):
        return None
    return body_of(eqn)


def _last_sum(var, uses: dict):
    """The last ``add`` of the chain ``var`` flows into, each value in it used by the next add alone and
    of the add's own shape and dtype (so that each one's gradient is the last sum's); ``None`` if none."""
    top = None
    while True:
        found = uses.get(id(var), [])
        if len(found) != 1 or found[0][0] is None:
            return top
        ((eqn, _),) = found
        out = eqn.outvars[0]
        if (
            eqn.primitive.name != "add"
            or sum(a is var for a in eqn.invars) != 1
            or tuple(out.aval.shape) != tuple(var.aval.shape)
            or out.aval.dtype != var.aval.dtype
        ):
            return top
        top, var = eqn, out


def _xs_operand(read, body) -> Optional[int]:
    """The index among its scan's operands of the ``xs`` whose slice is ``read``'s recorded operand, where
    the read sits in that scan's body itself; else ``None``."""
    if read.other is None or not read.ctx:
        return None
    operand = read.eqn.invars[read.other]
    k = next((k for k, v in enumerate(body.invars) if v is operand), None)  # body_of(ctx[-1]): its operands' order
    return k if k is not None and operand_role(read.ctx[-1], k) == "xs" else None
