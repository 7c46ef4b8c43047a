"""The split's rules: per kind of higher-order primitive, its sites and how to split it.

A higher-order equation that contains a selected tag is rebuilt with public JAX APIs
(``lax.scan``, ``lax.switch``, ``jax.checkpoint``, ``jax.shard_map``), threading the per-site
inputs and outputs through it: loops take inputs as ``xs`` and give outputs as ``ys`` (stacked
per iteration), cond branches give zeros for sites they do not contain. ``RULES`` maps each
kind of ``_higher_order`` to its rule; constructs that cannot be split (``Unsupported``) mark
their tags with the purposes they refuse.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from . import _compat, _equation_params, _higher_order
from ._sites import Slot, with_refusal
from ._fused_runs import bind_equation
from ._stacking import merge_branches

__all__ = [
    "NO_SITES",
    "RULES",
    "Cond",
    "CustomDerivative",
    "Inline",
    "Remat",
    "Rule",
    "Scan",
    "ShardMap",
    "Unsupported",
    "While",
]

NO_SITES: dict = {}


class Rule:
    """How to find the sites inside one kind of equation, and how to split it.

    ``sites`` reads the bodies' sites from ``program.level(body)`` (a ``_program.Program``);
    ``evaluate`` evaluates them with ``splitter.eval_jaxpr`` (a ``_evaluator.ProgramEvaluator``), given
    the equation's operands, the site inputs for its sites, and ``active``, its selected sites.
    """

    def sites(self, program, eqn) -> dict:
        raise NotImplementedError

    def evaluate(self, splitter, eqn, invals, inputs: dict, active: dict) -> tuple[list, dict]:
        raise NotImplementedError


class Scan(Rule):
    """``lax.scan`` (and ``fori_loop`` with static bounds, ``lax.map``): stack per iteration."""

    def sites(self, program, eqn):
        p = _equation_params.scan_params(eqn)
        inner = program.level(p.body).sites
        return {k: dataclasses.replace(s, stack=(p.length, *s.stack), ncalls=0) for k, s in inner.items()}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        p = _equation_params.scan_params(eqn)
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
        for branch in _higher_order.bodies(eqn):
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

        branches = [make_branch(b) for b in _higher_order.bodies(eqn)]
        outs, outputs = lax.switch(index, branches, ops, inputs)
        return list(outs), outputs


class Inline(Rule):
    """Nested ``jax.jit`` and ``closed_call``: evaluated in place (XLA inlines them anyway).

    A ``jax.jit`` with explicit in/out shardings is rebuilt with them, so they
    still constrain its inputs and outputs; site inputs and outputs are left
    unconstrained.
    """

    def sites(self, program, eqn):
        return program.level(_higher_order.body(eqn)).sites

    def evaluate(self, splitter, eqn, invals, inputs, active):
        body = _higher_order.body(eqn)
        shardings = _equation_params.call_shardings(eqn)
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
        inner = program.level(_higher_order.body(eqn)).sites
        return {k: dataclasses.replace(s, remat=True) for k, s in inner.items()}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        body = _higher_order.body(eqn)
        inner = splitter.in_checkpoint()  # the tags it leaves in place are marked as such

        def run(args, inputs):
            return inner.eval_jaxpr(body, args, inputs)

        outs, outputs = jax.checkpoint(run, **_equation_params.remat_options(eqn))(list(invals), inputs)
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
        p = _equation_params.shard_map_params(eqn)
        lead = tuple(p.mesh.shape[a] for a in p.axes)
        inner = program.level(p.body).sites
        return {k: dataclasses.replace(s, stack=(*lead, *s.stack), ncalls=0) for k, s in inner.items()}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        p = _equation_params.shard_map_params(eqn)
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
        for body in _higher_order.bodies(eqn) if bodies is None else bodies:
            for key, site in program.level(body).sites.items():
                problem = (
                    f"Cannot {_VERBS[self.purpose]} the tag {site.name!r} (at {site.where}): it is inside "
                    f"{construct}, and {self.reason}. {self.fix}"
                )
                found[key] = with_refusal(site, problem, self.purpose)
        return found

    def evaluate(self, splitter, eqn, invals, inputs, active):
        # Only a rewrite that touches every tag (``_vmap_cond``) gets here; select() refuses
        # these sites to the transforms. Their tags are left as they are.
        return bind_equation(eqn, invals), NO_SITES


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
        p = _equation_params.while_params(eqn)
        return {**self.in_condition.sites(program, eqn, [p.cond]), **self.refusal.sites(program, eqn, [p.body])}

    def evaluate(self, splitter, eqn, invals, inputs, active):
        p = _equation_params.while_params(eqn)
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
        return self.refusal.sites(program, eqn, [_higher_order.body(eqn)])

    def evaluate(self, splitter, eqn, invals, inputs, active):
        outs = bind_equation(eqn, invals)
        _, outputs = splitter.eval_jaxpr(_higher_order.body(eqn), invals, inputs)
        return outs, outputs


_LINEAR = Unsupported(
    "it is a linearized custom rule (custom_lin) that JAX evaluates as a unit",
    "Move the tag outside the function with the custom derivative.",
)

RULES: dict[str, Rule] = {
    _higher_order.SCAN: Scan(),
    _higher_order.COND: Cond(),
    _higher_order.CALL: Inline(),
    _higher_order.REMAT: Remat(),
    _higher_order.WHILE: While(),
    _higher_order.CUSTOM: CustomDerivative(),
    _higher_order.CUSTOM_LINEAR: _LINEAR,
    _higher_order.SHARD_MAP: ShardMap(),
}
