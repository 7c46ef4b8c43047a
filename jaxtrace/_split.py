"""The split: trace a function once, find its tags, and re-run it with the
selected tags opened up.

``Program`` walks a traced jaxpr once and records every site (``_sites.Site``).
``Splitter`` evaluates the jaxpr equation by equation, as
``jax.core.eval_jaxpr`` does, except at selected tags: there it calls a
*site function* (``x -> perturb(x, eps)`` for gradients, ``x -> replacement``
for patching, ...) and can also hand the tagged value out. Equations that
contain no selected tag are bound unchanged.

Higher-order equations that contain a selected tag are rebuilt with public
JAX APIs (``lax.scan``, ``lax.switch``, ``jax.checkpoint``, ``jax.shard_map``), threading the
per-site inputs and outputs through them: loops take inputs as ``xs`` and
give outputs as ``ys`` (stacked per iteration), cond branches give zeros for
sites they do not contain. Each primitive's rule lives in ``RULES``; a
primitive without a rule that contains a tag makes that tag unsplittable,
and asking for it is an error that names the primitive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat
from ._leaves import check_array_leaves
from ._splice import runs
from ._sites import Site, Slot, TagError, assemble, merge_branches, select, stack_calls, with_problem
from ._tag import evaluated_tags, is_tag, site_value, tag_p

SiteFn = Callable[[Site, Any, Any], Any]  # (site, value at the tag, input or None) -> new value
_NO_SITES: dict = {}


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
        rule = RULES.get(eqn.primitive.name)
        if rule is not None:
            return rule.sites(self, eqn)
        bodies = _compat.sub_jaxprs(eqn.params)
        if not bodies:
            return _NO_SITES
        return Unsupported(
            f"jaxtrace does not know how to split the `{eqn.primitive.name}` primitive",
            "Move the tag outside it, or open an issue so that a rule for it can be added.",
        ).sites(self, eqn)


class Splitter:
    """Evaluates a ``Program`` with the selected sites split open."""

    def __init__(
        self, program: Program, sites: Sequence[Site], site_fn, outputs: Sequence = (), retag=None, call_fn=None
    ):
        self.program = program
        self.sites = {site.key: site for site in sites}
        self.site_fn = site_fn
        self.output_keys = frozenset(outputs)
        self.retag = retag or _retag
        self.call_fn = call_fn  # (sites, values) -> values: one jt.tag call, all its leaves at once
        self.in_remat = False  # evaluating a jax.checkpoint body: the tags left in place are copies
        self._run_cache: dict = {}  # id(jaxpr) -> (jaxpr, {start: Run})

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
        hooked: dict = {}  # outvar -> value: the later leaves of a jt.tag call that call_fn handled at once
        runs = self._runs(jaxpr, level)
        skip_to = 0
        for position, (eqn, inside, slots) in enumerate(zip(jaxpr.eqns, level.eqn_sites, level.slots)):
            if position < skip_to:
                continue
            run = runs.get(position)
            if run is not None:
                invals = [_compat.read(env, v) for v in run.invars]
                if _compat.is_linearizing(invals):
                    with _compat.source_context(eqn, name_stack=False):
                        outvals = run.function(*invals)
                    for var, value in zip(run.outvars, outvals):
                        env[var] = value
                    skip_to = run.stop
                    continue
            invals = [_compat.read(env, v) for v in eqn.invars]
            active = {k: s for k, s in inside.items() if k in self.sites} if inside else _NO_SITES
            if not active:
                outvals = _compat.bind_equation(eqn, invals)
            else:
                sub_inputs = {k: slots[k].take(inputs[k]) for k in active if k in inputs}
                if is_tag(eqn):
                    (key,) = active
                    if self.call_fn is not None:
                        new = hooked.pop(eqn.outvars[0], None)
                        if new is None:
                            new = self._call(jaxpr, position, env, hooked)
                    else:
                        new = hooked.pop(eqn.outvars[0], None)
                        if new is None:
                            new = self._site_values(jaxpr, level, position, env, inputs, hooked)
                    # The tag stays in place, so a transform around this one still finds it.
                    with _compat.source_context(eqn):
                        outvals = [self.retag(_marked_copy(eqn) if self.in_remat else eqn, new, invals)]
                    # What a reader gets is the tag's output (the tagged value, after the site
                    # function), so a transform around this one sees the path through it.
                    sub_outputs = {key: site_value([*outvals, *invals[1:]])} if key in self.output_keys else _NO_SITES
                else:
                    outvals, sub_outputs = RULES[eqn.primitive.name].evaluate(self, eqn, invals, sub_inputs, active)
                for key, value in sub_outputs.items():
                    if slots[key].primary:  # a copy's values are those already read
                        outputs.setdefault(key, []).append((slots[key], value))
            for var, value in zip(eqn.outvars, outvals):
                _compat.write(env, var, value)
        return [_compat.read(env, v) for v in jaxpr.outvars], {k: _stack(vs) for k, vs in outputs.items()}

    def _runs(self, jaxpr, level: Level) -> dict:
        """``{start: Run}`` for ``jaxpr`` (``_splice.runs``), built once per jaxpr."""
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

    def _site_values(self, jaxpr, level: Level, start: int, env: dict, inputs: dict, hooked: dict):
        """``site_fn`` at the tag of equation ``start``; at a call's first leaf, for all its leaves
        whose operands are ready, the others' kept in ``hooked``: the new values are computed
        before any of the call's tags, so a transform around this one finds its leaves together."""
        group = self._leaves(jaxpr, start)
        ready = all(
            (e.params["name"], e.params["leaf"]) in self.sites
            and all(isinstance(v, _compat.Literal) or v in env for v in e.invars)
            for e in (jaxpr.eqns[j] for j in group)
        )
        new = None
        for j in group if ready else [start]:
            e = jaxpr.eqns[j]
            key = (e.params["name"], e.params["leaf"])
            invals = [_compat.read(env, v) for v in e.invars]
            value = level.slots[j][key].take(inputs[key]) if key in inputs else None
            result = self.site_fn(self.sites[key], invals[0], _masked_input(invals, value))
            if j == start:
                new = result
            else:
                hooked[e.outvars[0]] = result
        return new

    def _call(self, jaxpr, start: int, env: dict, hooked: dict):
        """``call_fn`` on every leaf of the jt.tag call whose first leaf is equation ``start``; the
        others' new values are kept in ``hooked`` for their own equations."""
        eqn = jaxpr.eqns[start]
        p = eqn.params
        group = [jaxpr.eqns[j] for j in self._leaves(jaxpr, start)]
        ready = all(isinstance(e.invars[0], _compat.Literal) or e.invars[0] in env for e in group)
        if len(group) != p["tree"].num_leaves or not ready:
            raise TagError(
                f"jaxtrace cannot apply a function to the whole tag {p['name']!r} (at {_compat.source_line(eqn)}): "
                "JAX placed its leaves apart in the program. Tag each leaf under its own name instead."
            )
        sites = [self.sites[(e.params["name"], e.params["leaf"])] for e in group]
        assert self.call_fn is not None
        new = self.call_fn(sites, [_compat.read(env, e.invars[0]) for e in group])
        for e, value in zip(group[1:], new[1:]):
            hooked[e.outvars[0]] = value
        return new[0]

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


def _marked_copy(eqn):
    """``eqn``, marked as a tag left in place in a ``jax.checkpoint`` body: JAX may copy it out
    of the body when it differentiates this program (the forward pass of a remat), and a split
    around this one must know those copies from the tagged call they copy (``_sites._copies``).
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
        where = (slot.start, slot.stop, slot.spliced)
        value = slot.put(value)
        slots[where] = slots[where] + value if where in slots else value
    if len(slots) == 1 and next(iter(slots))[0] is None:
        return next(iter(slots.values()))
    ordered = sorted(slots.items(), key=lambda item: item[0][0])
    return jnp.concatenate([v if spliced else v[None] for (_, _, spliced), v in ordered])


# --- rules, one per higher-order primitive ------------------------------------


class Rule:
    """How to find the sites inside one kind of equation, and how to split it."""

    def sites(self, program: Program, eqn) -> dict:
        raise NotImplementedError

    def evaluate(self, splitter: Splitter, eqn, invals, inputs: dict, active: dict) -> tuple[list, dict]:
        raise NotImplementedError


class Scan(Rule):
    """``lax.scan`` (and ``fori_loop`` with static bounds, ``lax.map``): stack per iteration."""

    def sites(self, program, eqn):
        p = _compat.scan_params(eqn)
        inner = program.level(p.body).sites
        return {k: dataclasses.replace(s, stack=(p.length, *s.stack), ncalls=0) for k, s in inner.items()}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        p = _compat.scan_params(eqn)
        consts = invals[: p.num_consts]
        init = invals[p.num_consts : p.num_consts + p.num_carry]
        xs = invals[p.num_consts + p.num_carry :]

        def body(carry, step):
            xs_t, inputs_t = step
            outs, outputs_t = splitter.eval_jaxpr(p.body, [*consts, *carry, *xs_t], inputs_t)
            return outs[: p.num_carry], (outs[p.num_carry :], outputs_t)

        carry, (ys, outputs) = lax.scan(
            body, list(init), (list(xs), inputs), length=p.length, reverse=p.reverse, unroll=p.unroll
        )
        return [*carry, *ys], outputs


class Cond(Rule):
    """``lax.cond`` / ``lax.switch``: one site per name; zeros from the branches not taken.

    A branch whose vmap axes sit elsewhere than in the merged site (the first branch's layout)
    gets its inputs and gives its outputs moved there (``Site.relayout``).
    """

    def sites(self, program, eqn):
        found: dict = {}
        for branch in _compat.cond_branches(eqn):
            for key, site in program.level(branch).sites.items():
                found.setdefault(key, []).append(site)
        where = _compat.source_line(eqn)
        return {key: merge_branches(sites, where) for key, sites in found.items()}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        index, *ops = invals

        def make_branch(branch):
            own = splitter.program.level(branch).sites
            # Branches of another layout are an error when asked for; a rewrite of every tag
            # (``_vmap_cond``) still passes them through as they are.
            slots = {
                k: Slot(perm=own[k].relayout(active[k]) if own[k].layout() == active[k].layout() else None)
                for k in active
                if k in own
            }

            def run(ops, inputs):
                inputs = {k: slots[k].take(v) for k, v in inputs.items() if k in own}
                outs, outputs = splitter.eval_jaxpr(branch, ops, inputs)
                return outs, {**splitter.output_zeros(active), **{k: slots[k].put(v) for k, v in outputs.items()}}

            return run

        branches = [make_branch(b) for b in _compat.cond_branches(eqn)]
        outs, outputs = lax.switch(index, branches, ops, inputs)
        return list(outs), outputs


class Inline(Rule):
    """Nested ``jax.jit`` and ``closed_call``: evaluated in place (XLA inlines them anyway).

    A ``jax.jit`` with explicit in/out shardings is rebuilt with them, so they
    still constrain its inputs and outputs; site inputs and outputs are left
    unconstrained.
    """

    def sites(self, program, eqn):
        return program.level(_compat.call_body(eqn)).sites

    def evaluate(self, splitter, eqn, invals, inputs, active):
        body = _compat.call_body(eqn)
        shardings = _compat.call_shardings(eqn)
        if shardings is None:
            return splitter.eval_jaxpr(body, invals, inputs)

        def run(args, inputs):
            outs, outputs = splitter.eval_jaxpr(body, args, inputs)
            return tuple(outs), outputs

        in_shardings, out_shardings = shardings
        outs, outputs = jax.jit(run, in_shardings=(in_shardings, None), out_shardings=(out_shardings, None))(
            tuple(invals), inputs
        )
        return list(outs), outputs


class Remat(Rule):
    """``jax.checkpoint``: rebuilt with the same policy; site inputs and outputs pass through it."""

    def sites(self, program, eqn):
        inner = program.level(_compat.call_body(eqn)).sites
        return {k: dataclasses.replace(s, remat=True) for k, s in inner.items()}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        body = _compat.call_body(eqn)

        def run(args, inputs):
            outer, splitter.in_remat = splitter.in_remat, True
            try:
                return splitter.eval_jaxpr(body, args, inputs)
            finally:
                splitter.in_remat = outer

        outs, outputs = jax.checkpoint(run, **_compat.remat_options(eqn))(list(invals), inputs)
        return list(outs), outputs


class ShardMap(Rule):
    """``jax.shard_map``: one leading axis per manual mesh axis, in mesh order.

    Entry ``[i, j, ...]`` of a tag's result belongs to the shard at mesh
    position ``(i, j, ...)``: the result is the global array whose block on
    each shard is that shard's value, laid out with ``P(*manual axes)`` on the
    new leading axes. Summing a gradient over a mesh axis gives the gradient
    at the value as a whole. Without ``check_vma`` each shard's copy of a value
    is its own value, with its own gradient. Under ``check_vma=True`` a value
    that is the same on every shard along a mesh axis (invariant, e.g.
    computed from replicated inputs) is one value shared by its copies: the
    gradient at it is split equally between its entries along that axis, and
    a site input for it (a replacement value) is the mean of those entries.
    """

    def sites(self, program, eqn):
        p = _compat.shard_map_params(eqn)
        lead = tuple(p.mesh.shape[a] for a in p.axes)
        inner = program.level(p.body).sites
        return {k: dataclasses.replace(s, stack=(*lead, *s.stack), ncalls=0) for k, s in inner.items()}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        p = _compat.shard_map_params(eqn)
        n = len(p.axes)
        specs, global_inputs = {}, {}
        for key, value in inputs.items():
            varying = p.varying_axes(splitter.sites[key].aval)
            # An invariant value's copies are one value: they share one input, the
            # mean of theirs (right for an additive eps and for a replacement value).
            shared = tuple(i for i, a in enumerate(p.axes) if a not in varying)
            global_inputs[key] = jnp.mean(value, axis=shared, keepdims=True) if shared else value
            specs[key] = jax.sharding.PartitionSpec(*(a if a in varying else None for a in p.axes))

        def run(args, inputs):
            outs, outputs = splitter.eval_jaxpr(p.body, args, {k: v.reshape(v.shape[n:]) for k, v in inputs.items()})
            return tuple(outs), {k: v.reshape((1,) * n + v.shape) for k, v in outputs.items()}

        outs, outputs = _compat.shard_map(
            run,
            mesh=p.mesh,
            in_specs=(p.in_specs, specs),
            out_specs=(p.out_specs, jax.sharding.PartitionSpec(*p.axes)),
            axis_names=p.axes,
            check_vma=p.check_vma,
        )(tuple(invals), global_inputs)
        return list(outs), outputs


@dataclasses.dataclass
class Unsupported(Rule):
    """A construct that cannot be split: its tags carry a problem, raised if they are asked for.

    ``purpose`` is the least that is refused: ``"read"`` (everything), ``"forward"`` (replacing
    values and tangents; reading works), ``"reverse"`` (gradients only).
    """

    reason: str
    fix: str
    purpose: str = "read"

    def sites(self, program, eqn, bodies=None):
        construct = _compat.construct(eqn, bodies)
        found: dict = {}
        for body in _compat.sub_jaxprs(eqn.params) if bodies is None else bodies:
            for key, site in program.level(body).sites.items():
                problem = (
                    f"Cannot {_VERBS[self.purpose]} the tag {site.name!r} (at {site.where}): it is inside "
                    f"{construct}, and {self.reason}. {self.fix}"
                )
                found[key] = with_problem(site, problem, self.purpose)
        return found

    def evaluate(self, splitter, eqn, invals, inputs, active):
        # Only a rewrite that touches every tag (``_vmap_cond``) gets here; select() refuses
        # these sites to the transforms. Their tags are left as they are.
        return _compat.bind_equation(eqn, invals), _NO_SITES


_VERBS = {"read": "split", "forward": "replace or differentiate", "reverse": "take a gradient at"}


class While(Rule):
    """``lax.while_loop``: forward only, no loop axis.

    Its trip count is not known when tracing, so its iterations cannot be
    stacked and JAX cannot differentiate it in reverse mode. A tag in the body
    holds the value of the *last* iteration (zeros if the loop runs zero
    times): ``capture`` and ``jvp`` read it; a ``patch`` applies at every
    iteration (a value replaces every iteration's). Gradients are refused.
    """

    refusal = Unsupported(
        "a while_loop's trip count is not known when tracing, so JAX cannot differentiate it in reverse "
        "mode (capture, jvp and patch work there: they see the last iteration)",
        "Use lax.scan, or lax.fori_loop with Python-int bounds (which becomes a scan), or move the tag "
        "outside the loop.",
        purpose="reverse",
    )
    in_condition = Unsupported(
        "a tag in a while_loop's condition function is evaluated once more than the body",
        "Tag the value in the body, or outside the loop.",
    )

    def sites(self, program, eqn):
        p = _compat.while_params(eqn)
        return {**self.in_condition.sites(program, eqn, [p.cond]), **self.refusal.sites(program, eqn, [p.body])}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        p = _compat.while_params(eqn)
        cond_consts = invals[: p.cond_nconsts]
        body_consts = invals[p.cond_nconsts : p.cond_nconsts + p.body_nconsts]
        init = invals[p.cond_nconsts + p.body_nconsts :]

        def cond_fn(state):
            (pred,), _ = splitter.eval_jaxpr(p.cond, [*cond_consts, *state[0]], {})
            return pred

        def body_fn(state):
            outs, outputs = splitter.eval_jaxpr(p.body, [*body_consts, *state[0]], inputs)
            return outs, {k: outputs[k] for k in state[1]}

        carry, outputs = lax.while_loop(cond_fn, body_fn, (list(init), splitter.output_zeros(active)))
        return list(carry), outputs


class CustomDerivative(Rule):
    """``jax.custom_jvp`` / ``jax.custom_vjp`` functions: their tags can be read, not written.

    JAX treats such a function as a unit with its own derivative rule. Its
    outputs come from the call as it is (so the rule still applies); the
    values at its tags come from its primal function, evaluated beside it
    (under ``jit`` XLA merges the two). Replacing those values, pushing
    tangents to them or differentiating at them would bypass the rule.
    """

    refusal = Unsupported(
        "JAX treats a function with a custom derivative (jax.custom_jvp / jax.custom_vjp, as in odeint) as a "
        "unit: it differentiates it with its own rule, so no gradient or tangent exists at values inside it, "
        "and replacing them would bypass that rule (capture can read them)",
        "Move the tag outside that function: tag its inputs or its output instead.",
        purpose="forward",
    )

    def sites(self, program, eqn):
        return self.refusal.sites(program, eqn, [_compat.custom_primal(eqn)])

    def evaluate(self, splitter, eqn, invals, inputs, active):
        outs = _compat.bind_equation(eqn, invals)
        _, outputs = splitter.eval_jaxpr(_compat.custom_primal(eqn), invals, inputs)
        return outs, outputs


_LINEAR = Unsupported(
    "it is a linearized custom rule (custom_lin) that JAX evaluates as a unit",
    "Move the tag outside the function with the custom derivative.",
)

RULES: dict[str, Rule] = {}
for names, rule in [
    (_compat.SCAN, Scan()),
    (_compat.COND, Cond()),
    (_compat.INLINE_CALLS, Inline()),
    (_compat.REMAT, Remat()),
    (_compat.WHILE, While()),
    (_compat.CUSTOM_DERIVATIVES, CustomDerivative()),
    (_compat.CUSTOM_LINEAR, _LINEAR),
    (_compat.SHARD_MAP, ShardMap()),
]:
    for name in names:
        RULES[name] = rule


# --- tracing ----------------------------------------------------------------


def _always(leaf) -> bool:
    return True


def _report_evaluated(evaluated: dict, sites: dict, tags) -> None:
    """Tags that ``jax.ensure_compile_time_eval`` evaluated away: a ``TagError`` when the call asks
    for them (by name, ``tags=None`` or a predicate), never a silent drop."""
    staged = {s.name for s in sites.values()}
    lost = {n: line for n, line in evaluated.items() if n not in staged}
    if isinstance(tags, str):
        tags = [tags]
    asked = [n for n in lost if tags is None or (tags(n) if callable(tags) else n in tags)]
    if asked:
        listed = ", ".join(f"{n!r} (at {lost[n]})" for n in asked)
        raise TagError(
            f"The tag {listed} was evaluated under jax.ensure_compile_time_eval(): it is a constant "
            "computed while tracing, not part of the program, so no gradient, tangent or replacement can "
            "reach it. Move the jt.tag call out of the ensure_compile_time_eval block, or leave the tag out "
            "with tags=."
        )


def _as_array(value):
    """A program output read from a literal (a JAX-internal scalar type) as an array."""
    return value if isinstance(value, jax.Array) else jnp.asarray(value)


def is_array(leaf) -> bool:
    """An array leaf (traced as an input, or passed through as an output); anything else stays static."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def keep(site: Site, x, _):
    """The site function that leaves the value as it is (the tag stays in place)."""
    return x


@contextlib.contextmanager
def _explain_tracer_errors(fun):
    """Say why Python control flow on a value fails, and what to do, when ``fun`` is traced."""
    try:
        yield
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError) as e:
        name = getattr(fun, "__qualname__", repr(fun))
        e.add_note(
            f"jaxtrace traces {name} once into a program (as jax.jit does), even when it is called "
            "without jax.jit, so Python control flow (if/while/bool()/int()) cannot depend on the value of "
            "an array argument. Use jnp.where, lax.cond or lax.select for value-dependent choices, or pass "
            "the value as a Python number (jaxtrace keeps Python numbers static)."
        )
        raise


class Split:
    """``fun`` traced once at ``args``, with the sites that ``tags`` selects.

    The leaves of the arguments in ``argnums`` for which ``dynamic(leaf)``
    holds become the program's inputs; everything else is closed over as is
    (so Python numbers stay static, as with ``jax.grad``'s other arguments).
    Calling it re-runs the program on new values of those inputs, applying
    ``site_fn`` at each selected tag and handing out the values at the sites
    in ``outputs``.
    """

    def __init__(self, fun, args, kwargs, argnums, tags, *, dynamic=_always, purpose="reverse"):
        args = tuple(args)
        for a in argnums:
            if not -len(args) <= a < len(args):
                raise TypeError(
                    f"argnums={a} is out of range: the function was called with {len(args)} positional "
                    "argument(s)."
                )
        argnums = tuple(a % len(args) for a in argnums)
        self.args = tuple(args[i] for i in argnums)
        if dynamic is _always:  # every leaf is traced: a clear error for functions, strings (issue 24)
            check_array_leaves(self.args, argnums)
        leaves, tree = jax.tree_util.tree_flatten(self.args)
        mask = [dynamic(leaf) for leaf in leaves]

        def flat_fun(*dynamic_leaves):
            it = iter(dynamic_leaves)
            chosen = jax.tree_util.tree_unflatten(tree, [next(it) if m else leaf for leaf, m in zip(leaves, mask)])
            full = list(args)
            for i, a in zip(argnums, chosen):
                full[i] = a
            out_leaves, self.out_tree = jax.tree_util.tree_flatten(fun(*full, **kwargs))
            # Leaves that are not arrays (strings, Python numbers in an aux output) pass through as they are.
            self._static = {i: leaf for i, leaf in enumerate(out_leaves) if not is_array(leaf)}
            return [leaf for leaf in out_leaves if is_array(leaf)]

        self._mask = mask
        self.out_tree: Any = None
        self._static: dict = {}
        with jax.disable_jit(False), _explain_tracer_errors(fun), evaluated_tags() as evaluated:
            # Traced as under jit even inside jax.disable_jit(): a scan stays one scan, so a tag in
            # its body is one site, laid out as it is under jit.
            jaxpr = jax.make_jaxpr(flat_fun)(*[l for l, m in zip(leaves, mask) if m])
        self.program = Program(jaxpr)
        _report_evaluated(evaluated, self.program.sites, tags)
        self.sites = select(self.program.sites, tags, purpose)

    def __call__(self, args, site_fn, inputs: dict, outputs=(), call_fn=None) -> tuple[Any, dict]:
        """``fun(*args)`` (for the traced arguments) split at the selected sites."""
        leaves = [leaf for leaf, m in zip(jax.tree_util.tree_leaves(args), self._mask) if m]
        outs, site_outputs = Splitter(self.program, self.sites, site_fn, outputs, call_fn=call_fn)(leaves, inputs)
        it = iter(map(_as_array, outs))
        site_outputs = {k: _as_array(v) for k, v in site_outputs.items()}
        out_leaves = [self._static[i] if i in self._static else next(it) for i in range(self.out_tree.num_leaves)]
        return jax.tree_util.tree_unflatten(self.out_tree, out_leaves), site_outputs

    @property
    def keys(self) -> list:
        return [site.key for site in self.sites]

    def tag_tree(self, values: dict, lead: tuple = ()) -> dict:
        """``{name: pytree}`` in the documented layout, from per-site values (after ``lead`` axes)."""
        return assemble(self.sites, values, lead)
