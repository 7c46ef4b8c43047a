"""ProgramEvaluator: a ``Program`` evaluated again, equation by equation, with the selected tags opened.

It evaluates the jaxpr as ``jax.core.eval_jaxpr`` does, except at selected tags: there a
``AtSites`` gives the new value (``x -> perturb(x, eps)`` for gradients, ``x ->
replacement`` for patching, ...), the tag stays in place on it, and the value can be handed
out. Equations that hold no selected tag are bound unchanged (runs of them through
``_fused_runs``); higher-order ones that hold one are rebuilt by their rule (``_higher_order_rules``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax.numpy as jnp

from . import _compat, _higher_order
from ._errors import TagError
from ._program import Level, Program
from ._sites import Site
from ._fused_runs import Run, bind_equation, runs
from ._higher_order_rules import NO_SITES, RULES
from ._tag import is_tag, site_value, tag_p

__all__ = ["LeafFn", "AtSites", "ProgramEvaluator", "marked_copy", "per_leaf", "whole_call"]

LeafFn = Callable[[Site, Any, Any], Any]  # (site, value at the tag, input or None) -> new value


@dataclasses.dataclass(frozen=True)
class AtSites:
    """What a split does at its selected tags: new values for the leaves of one ``jt.tag`` call.

    ``apply(sites, operands, inputs)`` gets each leaf's site, its operands (the value, then a
    vmapped cond's mask where the tag has one) and its site input (or None), and returns each
    leaf's new value. With ``whole_calls`` it gets every leaf of a call at once (their values
    only), and a call whose leaves JAX placed apart is an error; else it gets the leaves that
    are ready, at least the one at hand.
    """

    apply: Callable[[list, list, list], list]
    whole_calls: bool = False

    def operands(self, eqn) -> list:
        """The operands of a tag equation that ``apply`` reads."""
        return eqn.invars[:1] if self.whole_calls else eqn.invars


def per_leaf(site_fn: LeafFn) -> AtSites:
    """``site_fn(site, value, input)`` leaf by leaf, the input masked to where a vmapped cond's
    branch holding the tag was taken."""

    def apply(sites, operands, inputs):
        return [site_fn(site, ops[0], _masked_input(ops, value)) for site, ops, value in zip(sites, operands, inputs)]

    return AtSites(apply)


def whole_call(call_fn: Callable[[list, list], list]) -> AtSites:
    """``call_fn(sites, values)`` on every leaf of a ``jt.tag`` call at once."""
    return AtSites(lambda sites, operands, inputs: call_fn(sites, [ops[0] for ops in operands]), whole_calls=True)


class ProgramEvaluator:
    """Evaluates a ``Program`` with the selected sites split open."""

    def __init__(
        self, program: Program, sites: Sequence[Site], at_sites: AtSites, outputs: Sequence = (), retag=None
    ):
        self.program = program
        self.sites = {site.key: site for site in sites}
        self.at_sites = at_sites
        self.output_keys = frozenset(outputs)
        self.retag = retag or _retag
        self.in_remat = False  # evaluating a jax.checkpoint body: the tags left in place are copies
        self._run_cache: dict = {}  # id(jaxpr) -> (jaxpr, {start: Run})

    def in_checkpoint(self) -> "ProgramEvaluator":
        """This splitter for a ``jax.checkpoint`` body: the tags it leaves in place there are marked
        (``marked_copy``), so that copies JAX makes of them are known as copies."""
        if self.in_remat:
            return self
        inner = copy.copy(self)
        inner.in_remat = True
        return inner

    def __call__(self, args: Sequence[Any], inputs: dict) -> tuple[list, dict]:
        """Outputs of the program, and ``{key: value}`` for the output sites."""
        return self.eval_jaxpr(self.program.jaxpr, args, inputs, consts=self.program.consts)

    def eval_jaxpr(self, jaxpr, args, inputs: dict, consts=None) -> tuple[list, dict]:
        jaxpr, closed_consts = _compat.jaxpr_and_consts(jaxpr)
        level = self.program.level(jaxpr)
        env: dict = {}
        for var, value in zip(jaxpr.constvars, closed_consts if consts is None else consts):
            env[var] = value
        for var, value in zip(jaxpr.invars, args):
            env[var] = value
        outputs: dict = {}
        hooked: dict = {}  # outvar -> value: the later leaves of a jt.tag call handled at its first
        found = self._runs(jaxpr, level)
        position = 0
        while position < len(jaxpr.eqns):
            run = found.get(position)
            if run is not None and self._bind_run(run, jaxpr.eqns[position], env):
                position = run.stop
                continue
            eqn = jaxpr.eqns[position]
            outvals = self._equation(jaxpr, level, position, env, inputs, hooked, outputs)
            for var, value in zip(eqn.outvars, outvals):
                _compat.write(env, var, value)
            position += 1
        return [_compat.read(env, v) for v in jaxpr.outvars], {k: _stack(vs) for k, vs in outputs.items()}

    def _bind_run(self, run: Run, eqn, env: dict) -> bool:
        """Binds ``run`` as one call where ``jax.vjp`` differentiates it (its point); else False."""
        invals = [_compat.read(env, v) for v in run.invars]
        if not _compat.is_linearizing(invals):
            return False
        with _compat.source_context(eqn, name_stack=False):
            outvals = run.function(*invals)
        for var, value in zip(run.outvars, outvals):
            env[var] = value
        return True

    def _equation(self, jaxpr, level: Level, position: int, env: dict, inputs: dict, hooked: dict, outputs: dict):
        """The outputs of equation ``position``, its output sites' values added to ``outputs``."""
        eqn, inside, slots = jaxpr.eqns[position], level.eqn_sites[position], level.slots[position]
        invals = [_compat.read(env, v) for v in eqn.invars]
        active = {k: s for k, s in inside.items() if k in self.sites} if inside else NO_SITES
        if not active:
            return bind_equation(eqn, invals)
        if is_tag(eqn):
            (key,) = active
            new = hooked.pop(eqn.outvars[0], None)
            if new is None:
                new = self._new_value(jaxpr, level, position, env, inputs, hooked)
            # The tag stays in place, so a transform around this one still finds it.
            with _compat.source_context(eqn):
                outvals = [self.retag(marked_copy(eqn) if self.in_remat else eqn, new, invals)]
            # What a reader gets is the tag's output (the tagged value, after the site
            # function), so a transform around this one sees the path through it.
            sub_outputs = {key: site_value([*outvals, *invals[1:]])} if key in self.output_keys else NO_SITES
        else:
            sub_inputs = {k: slots[k].take(inputs[k]) for k in active if k in inputs}
            rule = RULES[_higher_order.kind(eqn)]  # type: ignore[index]
            outvals, sub_outputs = rule.evaluate(self, eqn, invals, sub_inputs, active)
        for key, value in sub_outputs.items():
            if slots[key].primary:  # a copy's values are those already read
                outputs.setdefault(key, []).append((slots[key], value))
        return outvals

    def _runs(self, jaxpr, level: Level) -> dict:
        """``{start: Run}`` for ``jaxpr`` (``_fused_runs.runs``), built once per jaxpr."""
        found = self._run_cache.get(id(jaxpr))
        if found is None or found[0] is not jaxpr:
            selected = lambda eqn, inside: is_tag(eqn) or bool(inside) and any(k in self.sites for k in inside)  # noqa: E731
            found = self._run_cache[id(jaxpr)] = (jaxpr, runs(jaxpr, level.eqn_sites, selected))
        return found[1]

    def _leaves(self, jaxpr, start: int) -> list[int]:
        """The equations of every leaf of the jt.tag call whose first leaf is equation ``start``
        (``[start]`` if it is not a first leaf), in leaf order. They follow it, not always next to
        it: a vmapped cond computes each leaf's mask before its tag."""
        p = jaxpr.eqns[start].params
        group = [start]
        for j in range(start + 1, len(jaxpr.eqns)) if p["leaf"] == 0 else ():
            if len(group) == p["tree"].num_leaves:
                break
            e = jaxpr.eqns[j]
            if is_tag(e) and e.params["call"] == p["call"] and e.params["name"] == p["name"] and e.params["leaf"] == len(group):
                group.append(j)
        return group

    def _new_value(self, jaxpr, level: Level, start: int, env: dict, inputs: dict, hooked: dict):
        """The new value at the tag of equation ``start``. At a call's first leaf the site function
        runs on all its leaves whose operands are ready, the others' values kept in ``hooked`` for
        their own equations: they are computed before any of the call's tags, so a transform
        around this one finds its leaves together."""
        eqn = jaxpr.eqns[start]
        group = self._leaves(jaxpr, start)
        ready = all(self._ready(jaxpr.eqns[j], env) for j in group)
        if self.at_sites.whole_calls and (len(group) != eqn.params["tree"].num_leaves or not ready):
            raise TagError(
                f"jaxtrace cannot apply a function to the whole tag {eqn.params['name']!r} (at "
                f"{_compat.source_line(eqn)}): JAX placed its leaves apart in the program. Tag each leaf "
                "under its own name instead."
            )
        positions = group if ready else [start]
        eqns = [jaxpr.eqns[j] for j in positions]
        keys = [(e.params["name"], e.params["leaf"]) for e in eqns]
        operands = [[_compat.read(env, v) for v in self.at_sites.operands(e)] for e in eqns]
        site_inputs = [level.slots[j][k].take(inputs[k]) if k in inputs else None for j, k in zip(positions, keys)]
        new = self.at_sites.apply([self.sites[k] for k in keys], operands, site_inputs)
        for e, value in zip(eqns[1:], new[1:]):
            hooked[e.outvars[0]] = value
        return new[0]

    def _ready(self, eqn, env: dict) -> bool:
        """Whether the tag equation ``eqn`` is selected and the operands the site function reads are computed."""
        key = (eqn.params["name"], eqn.params["leaf"])
        return key in self.sites and all(isinstance(v, _compat.Literal) or v in env for v in self.at_sites.operands(eqn))

    def output_zeros(self, active: dict) -> dict:
        """Zeros for the output sites among ``active`` (a cond branch that lacks them)."""
        return {k: _compat.zeros(s.shape, s.dtype, s.aval) for k, s in active.items() if k in self.output_keys}


def _masked_input(invals, value):
    """A site input where the tag is active (a vmapped cond's branch): elsewhere zeros, so that
    no cotangent (not even a nan from the branch not taken) reaches it there."""
    if value is None or len(invals) == 1:
        return value
    return jnp.where(invals[1], value, jnp.zeros_like(value))


def _retag(eqn, new, invals):
    return tag_p.bind(new, *invals[1:], **eqn.params)


_COPIES = itertools.count(1)


def marked_copy(eqn):
    """``eqn``, marked as a tag left in place in a ``jax.checkpoint`` body: JAX may copy it out
    of the body when it differentiates this program (the forward pass of a remat), and a split
    around this one must know those copies from the tagged call they copy (``_stacking``).
    A mark, once there, is kept: copies of copies are one copy."""
    if eqn.params.get("copy"):
        return eqn
    return _compat.with_params(eqn, copy=next(_COPIES))


def _stack(values: list):
    """One value from the values of a site's calls at one level, in call order.

    Values in one slot are a vmapped cond's branches, each zero where its branch was not
    taken: they add up.
    """
    slots: dict = {}
    for slot, value in values:
        where = (slot.start, slot.stop, slot.span)
        value = slot.put(value)
        slots[where] = slots[where] + value if where in slots else value
    if len(slots) == 1 and next(iter(slots))[0] is None:
        return next(iter(slots.values()))
    ordered = sorted(slots.items(), key=lambda item: item[0][0])
    return jnp.concatenate([v if span else v[None] for (_, _, span), v in ordered])
