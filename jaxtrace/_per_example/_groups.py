"""A layer called at several layouts: its calls in groups that stack, each group a tag name of its own.

The pass reads a covered layer's inputs and output gradients as the values of its tags, which stack
the layer's calls in call order; only calls of one layout stack (the same loops around them, and
the same shapes, dtypes and trees of the input and output). Where the calls of a layer do not stack
(one CNN on two crop sizes, an embedding shared by an encoder and a decoder of different lengths, a
Linear on the tokens and on their pooled mean, a layer before and inside a ``fori_loop``, ``lax.map``
with a remainder batch), they are grouped by place (the equations that hold them) and layout, and
each group but one keeps the layer's name is renamed ``"<path>#<k>"`` in the program the pass runs
(``_meetings.Replay``).
Each group is then a stacked value of its own, and its factors one more use of the layer's leaves:
the leaf's per-example gradient is the sum over the groups, their cross terms in its norm, as for a
layer called twice at one shape.

Example (a Linear on the tokens ``(T, d)`` and on their mean ``(d,)``, inside ``jax.vmap``)::

    groups, renamed, why = call_groups("head", proof.occurrences["head"], lambda: False)
    [g.name for g in groups]  # ["head", "head#1"]; renamed: the second call's tag equations
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from .. import _compat, _higher_order
from .._module_tags import INPUT_SUFFIX
from .._walker import scan_positions
from ._owners import Step

__all__ = ["Group", "call_groups"]

_REPLAYED = (_higher_order.CALL, _higher_order.REMAT, _higher_order.SCAN)  # bodies the pass can run again


@dataclasses.dataclass(frozen=True)
class Group:
    """Calls of one layer that stack: ``name`` is its output tag's name in the pass (its input's is
    ``name + ":in"``), ``occurrences`` the calls (``_proof.Occurrence``), in program order."""

    name: str
    occurrences: tuple


def call_groups(path: str, occurrences: list, stacked: Callable[[], bool]) -> tuple[list[Group], dict, Optional[str]]:
    """``(groups, renamed, why)`` of the calls of the layer ``path``: one group of them all where they
    are in one place, or ``stacked()`` says the pass stacks them as they are (their layouts agree) and no
    two of them are in two scans whose steps are the examples (stacked, a call axis would come before
    those scans' loop axes, where the examples are: ``_proof.Proof.example_axis``).

    ``renamed`` maps a tag equation (the ``id``s of the equations that hold it, then its own) to its name
    in the pass; ``why`` says why the groups cannot be told apart in the pass (several of them inside a
    body it cannot run again: a ``cond`` branch, a custom derivative rule), else None.
    """
    by_place: dict = {}
    for occ in occurrences:
        by_place.setdefault(_place(occ), []).append(occ)
    calls = list(by_place.values())
    if len(calls) <= 1 or len({_over_examples(occ) for occ in occurrences} - {None}) <= 1 and stacked():
        return [Group(path, tuple(occurrences))], {}, None
    fixed = [k for k, occs in enumerate(calls) if any(_blocking(occ) is not None for occ in occs)]
    if len(fixed) > 1:
        where = ", ".join(_compat.construct(_blocking(occ)) for k in fixed for occ in calls[k][:1])
        return [], {}, (
            f"its layer {path!r} is called at different shapes or in different loops, whose calls cannot be "
            f"stacked as one value, and more than one group of them sits in a body the pass cannot run again "
            f"with names of their own ({where})"
        )
    keep = fixed[0] if fixed else 0
    groups, renamed, others = [], {}, iter(range(1, len(calls)))
    for k, occs in enumerate(calls):
        name = path if k == keep else f"{path}#{next(others)}"
        groups.append(Group(name, tuple(occs)))
        if k != keep:
            for occ in occs:
                ids = tuple(map(id, occ.ctx))
                renamed[(*ids, id(occ.eqn))] = name
                renamed.update({(*ids, id(e)): name + INPUT_SUFFIX for e in occ.inputs})
    return groups, renamed, None


def _place(occ) -> tuple:
    """Calls that always stack: in the same equations (loops, calls, branches), their inputs and outputs
    of one shape (vmap axes first), dtype and tree."""
    return (tuple(map(id, occ.ctx)), _value_layout(occ.eqn), tuple(_value_layout(e) for e in occ.inputs))


def _over_examples(occ) -> Optional[tuple]:
    """The equations around the call down to the scan whose steps are the examples (``Step``), or None."""
    if not isinstance(occ.out, Step):
        return None
    scans = scan_positions(occ.ctx)
    return tuple(map(id, occ.ctx[: scans[occ.out.level] + 1]))


def _value_layout(eqn) -> tuple:
    aval, p = eqn.invars[0].aval, eqn.params
    batch = tuple(int(a) for a in p["batch_axes"])
    order = (*batch, *(i for i in range(len(aval.shape)) if i not in batch))
    return (tuple(aval.shape[i] for i in order), str(aval.dtype), len(batch), p["tree"], p["leaf"])


def _blocking(occ):
    """The first equation around the call whose body the pass cannot run again (a ``cond``, a custom
    derivative rule), or None: the call is at the top level or only in ``jit``, ``checkpoint`` and
    ``lax.scan`` bodies. (A ``cond`` branch in the context is a jaxpr, after its equation.)"""
    return next((e for e in occ.ctx if hasattr(e, "primitive") and _higher_order.kind(e) not in _REPLAYED), None)
