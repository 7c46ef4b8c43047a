"""The contributions to the leaves' gradients, found in the traced program and proven.

``find_contributions`` lists every leaf's candidate uses outside its layers (its reads by one
primitive, ``_reads``; where no read holds it, the leaf used as it is, at the top level or in the
body of the one scan over it or closing over it), proves from the program (``_proof``) which of
them and of the covered layers' calls keep the examples apart and where shared values meet the
examples, and gives one record per contribution (``_contributions``), in the order their uses add
up: the layers' calls, the reads, the whole leaves. The proof is read, never changed.

Each record's tags are named by what holds them (the names are keys; nothing parses them back):
a layer's output tag is its path (``"<path>#<k>"`` for its calls of another layout, ``_groups``),
``"<leaf name>:read:<k>"`` a read, ``"<leaf name>:whole"`` (``":whole:steps"``, ``":whole:repeated"``
in a scan over it or closing over it) a leaf used as it is, ``"<name>:shared:<k>"`` a place where
the value so named meets the examples.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .. import _compat, _higher_order
from .._program import Program
from .._sites import TagError
from .._tag import opened
from .._walker import into_bodies
from ._contributions import LayerCalls, LeafRead, Meeting, WholeLeaf
from ._factors import Loop
from ._groups import call_groups
from ._meetings import Replay
from ._plan import TagKind, input_tags
from ._proof import prove
from ._read_tags import ReadTags, place_read_tags
from ._reads import find_reads

__all__ = ["Contributions", "find_contributions"]


@dataclasses.dataclass(frozen=True)
class Contributions:
    """What contributes to each leaf's gradient: the covered ``layers``' calls (``LayerCalls``), the
    proven ``reads`` (``LeafRead``) and the ``wholes`` (``WholeLeaf``); the ``proof`` they rest on,
    every place a shared value meets the examples (``meetings``: ``{name of the value: (Meeting,
    ...)}``), why a read is not proven (``read_why``: ``{leaf: why}``) and the tags of a layer's calls
    of another layout (``renamed``, ``_groups``)."""

    layers: tuple
    reads: tuple
    wholes: tuple
    proof: Any
    meetings: dict
    read_why: dict
    renamed: dict
    read_tags: ReadTags = ReadTags()

    @property
    def parts(self) -> tuple:
        """Every contribution, in the order their uses add up."""
        return (*self.layers, *self.reads, *self.wholes)

    @property
    def tags(self) -> set:
        """The names of the tags the pass records."""
        return {t for part in self.parts for t in part.tags} | {m.tag for ms in self.meetings.values() for m in ms}

    def program(self, traced):
        """``traced.run`` with tags at the meetings and reads where there are any (not for one example:
        its gradient is the plain one), and a name of their own on the tags of a layer's calls of another
        layout."""
        reads = {part.name: part.read for part in self.reads}
        placed = traced.batch > 1 and bool(self.meetings or reads)
        if not placed and not self.renamed:
            return traced.run
        meetings = {name: [(m.tag, m.use) for m in ms] for name, ms in self.meetings.items()} if placed else {}
        return Replay(
            traced.jaxpr, traced.consts, traced.out_tree, self.proof, traced.batch, meetings, reads if placed else {},
            traced.plan.scope, self.renamed, self.read_tags if placed else ReadTags(),
        )


def find_contributions(traced) -> Contributions:
    """The contributions to the gradients of ``traced.plan``'s leaves in the program ``traced.jaxpr``.

    Raises:
        TagError: where the examples interact (``Proof.mixing``).
    """
    plan, jaxpr, batch = traced.plan, traced.jaxpr, traced.batch
    n_leaves = len(plan.leaves)
    reads = {f"{plan.names[r.leaf]}:read:{k}": r for k, r in enumerate(find_reads(jaxpr, n_leaves, input_tags(plan)))}
    read_leaves = {r.leaf for r in reads.values()}
    whole = {f"{plan.names[i]}:whole": i for i in range(n_leaves) if i not in read_leaves}
    in_scans = _in_scans(jaxpr, set(whole.values()))
    scanned = {
        f"{plan.names[i]}:whole:{'steps' if Loop.STEPPED in loops else 'repeated'}": i for i, (_, _, loops) in in_scans.items()
    }
    proof = prove(
        jaxpr, n_leaves, batch, plan.roles,
        {name: (r.eqn.outvars[0], r.ctx) for name, r in reads.items()} | {name: (jaxpr.invars[i], ()) for name, i in whole.items()},
        {name: in_scans[i][:2] for name, i in scanned.items()},
    )
    if proof.mixing is not None:
        raise TagError(
            f"jaxtrace per-example gradients: {proof.mixing}. Per-example gradients (and DP-SGD's "
            "clipping bound) need independent examples: compute batch statistics outside `fun` (BatchNorm "
            "in inference mode, GroupNorm or LayerNorm instead), and give each example a loss of its own."
        )
    # a called layer's leaves have its factors: where they are also used as they are, the exact path
    called = {i for layer in plan.layers if proof.occurrences.get(layer.path) for i in layer.leaves.values()}
    not_whole = {name for name, i in (whole | scanned).items() if i in called}
    meetings: dict = {}
    for k, use in enumerate(use for use in proof.shared if use.path not in not_whole):
        meetings.setdefault(use.path, []).append(Meeting(f"{use.path}:shared:{k}", use))
    meetings = {name: tuple(ms) for name, ms in meetings.items()}
    layers, renamed = _layer_calls(traced, proof, meetings)
    leaf_reads, read_why = _proven_reads(reads, proof, meetings, batch)
    read_tags = place_read_tags(jaxpr, {r.name: r.read for r in leaf_reads if not r.meetings})
    leaf_reads = [dataclasses.replace(r, grad_tag=read_tags.sums.get(r.name)) for r in leaf_reads]
    wholes = [WholeLeaf(name, i, meetings[name]) for name, i in whole.items() if name in meetings]
    wholes += [WholeLeaf(name, i, meetings[name], in_scans[i][2]) for name, i in scanned.items() if name in meetings]
    return Contributions(tuple(layers), tuple(leaf_reads), tuple(wholes), proof, meetings, read_why, renamed, read_tags)


def _layer_calls(traced, proof, meetings: dict) -> tuple[list, dict]:
    """``([LayerCalls per covered layer], renamed)``: each layer's calls grouped by layout (``_groups``),
    and the tags of the calls of another layout with their names in the pass. A layer called inside a
    function with a custom derivative rule is not grouped: JAX takes its gradient from the rule."""
    stacks = _Stacks(traced)
    found, renamed = [], {}
    for layer in traced.plan.layers:
        occurrences = proof.occurrences.get(layer.path, ())
        custom, groups, why = _custom_around(occurrences), (), None
        if custom is not None:
            why = (
                f"its layer {layer.path!r} is called inside a function with a custom derivative rule "
                f"({_compat.construct(custom)}), whose gradient JAX takes from the rule"
            )
        elif occurrences:
            groups, more, why = call_groups(layer.path, occurrences, lambda p=layer.path: stacks(p))
            renamed.update(more)
        found.append(LayerCalls(layer, tuple(groups), meetings.get(layer.path, ()), why))
    return found, renamed


class _Stacks:
    """Whether the pass stacks the calls of a layer as one value (its input's and its output's): the
    sites of the program's tags, the plan's among them, as the pass's split stacks them."""

    def __init__(self, traced):
        self.traced = traced
        self.stacked_tags: dict = {}  # layer path -> the names of its output's and input's tags (``Plan.roles``)
        for name, role in traced.plan.roles.items():
            if role.kind in (TagKind.OUTPUT, TagKind.INPUT):
                self.stacked_tags.setdefault(role.layer, set()).add(name)

    @functools.cached_property
    def _sites(self) -> dict:
        with opened(self.traced.plan.scope):
            return Program(self.traced.jaxpr).sites

    def __call__(self, path: str) -> bool:
        names = self.stacked_tags.get(path, set())
        return not any(site.problem for (name, _), site in self._sites.items() if name in names)


def _proven_reads(reads: dict, proof, meetings: dict, batch: int) -> tuple[list, dict]:
    """``([LeafRead], {leaf: why its reads are not on factors})``: the reads of a leaf by one primitive
    (``_reads``) whose output positions each reach one example's loss, or whose output is shared by
    every example and meets them where the proof lists it; not a read where another shared value meets them."""
    met = {id(m.use.eqn) for ms in meetings.values() for m in ms}
    proven, why = [], {}
    for name, read in reads.items():
        if id(read.eqn) in met:
            continue
        if proof.axis_at(read.eqn.outvars[0], batch, read.ctx) is None and name not in meetings:
            why[read.leaf] = f"its read {_compat.construct(read.eqn)} has outputs that reach several examples' losses"
            continue
        proven.append(LeafRead(name, read, meetings.get(name, ())))
    return proven, why


def _in_scans(jaxpr, candidates: set) -> dict:
    """``{leaf: (scan equations, body invar, loops)}`` for the leaves among ``candidates`` whose only use in
    ``jaxpr`` is as one operand of one top-level scan, followed into the scans nested in its body while
    the body's input has no other use either (``into_bodies``): ``loops`` per scan, outermost first,
    ``Loop.STEPPED`` for an ``xs`` operand (the body sees one step's slice; one such scan at most) or
    ``Loop.REPEATED`` for a const (the body closes over it, the same at every step); the body invar is
    the innermost's."""
    found = {}
    for i in candidates:
        eqns, var, loops = (), None, ()
        for eqn, role, inner in into_bodies(jaxpr, jaxpr.invars[i]):
            if role not in ("const", "xs") or (role == "xs" and Loop.STEPPED in loops):
                break  # a call or a carry; or a slice scanned over again
            eqns, var, loops = (*eqns, eqn), inner, (*loops, Loop.STEPPED if role == "xs" else Loop.REPEATED)
        if eqns:
            found[i] = (eqns, var, loops)
    return found


def _custom_around(occurrences):
    """The outermost ``custom_jvp``/``custom_vjp`` equation around any of a layer's calls, or ``None``."""
    for occ in occurrences:
        for eqn in occ.ctx:
            if hasattr(eqn, "primitive") and _higher_order.kind(eqn) == _higher_order.CUSTOM:  # (a branch is a jaxpr)
                return eqn
    return None
