"""The pass: one ``jt.vjp(..., with_values=True)`` over the tagged model, and the norms from it.

``Call`` traces ``fun`` once, proves from that program which layers' factors give exact
per-example gradients (``_proof``: independent examples, the weight is the leaf, the
example axis of each layer's output), runs one pass that gives every covered layer's input
and output gradient (and those of each leaf read by one primitive, ``_reads``, and where a
leaf used as it is meets the examples, at the top level or, one step's slice of it or all of it
at every step, in the body of the one scan over it or closing over it: ``_meetings``), and turns the factors of each leaf's uses into
per-leaf squared norms or, weighted per example, into the clipped sum. Every other leaf (no rule, used outside
its layers, transformed before its layer, examples not proven apart at its layer, its layer
called inside a custom derivative rule's function) takes
the exact path: the definition, the pullback of the losses vector against each example's
basis vector, or a ``TagError`` naming it under ``fallback="error"``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

from .. import _compat, _equation_params, _higher_order
from .._ad import vjp as _vjp
from .._module_tags import INPUT_SUFFIX
from .._program import Program
from .._sites import TagError
from .._stateful import lift
from .._tag import opened
from ._factors import Use, example_weights, examples_first, finite, over_loops, with_rows
from ._groups import call_groups
from ._leaf_sums import sq_norm, step_module, weighted_sum
from ._meetings import Replay, shared_gradient
from ._plan import plan_for
from ._owners import Every
from ._proof import prove
from ._reads import find_reads
from ._uses import used_outside

__all__ = ["Call"]

_SHARED = ":shared:"  # "<path>:shared:<k>": a shared layer output where it meets the examples
_NO_RULE = "no per-layer rule covers it"
_READ = ":read:"  # "<leaf name>:read:<k>": a leaf read by one primitive outside its layers (``_reads``)
_WHOLE = ":whole"  # "<leaf name>:whole": a leaf no layer or read holds, shared by every example as it is
_STEPS = ":whole:steps"  # "<leaf name>:whole:steps": such a leaf that a scan slices, each step's slice used as it is
_REPEATS = ":whole:repeated"  # "<leaf name>:whole:repeated": such a leaf a scan's body closes over, used whole each step


def _stepped_loops(occs, depths: set, axis: int):
    """The loops around a stacked layer's calls, outermost first: ``"stepped"``, the scan that slices the
    stack (at ``depths``' one depth), and ``"repeated"``, a scan that closes over it; ``None`` unless every
    call is in the same loops (called twice a step: positions side by side), one scan slices the stack and
    the examples are not on a loop's axis (``axis``, in the stacked values)."""
    n = occs[0].steps
    if n < 1 or axis < n or len(depths) != 1 or len({tuple(map(id, occ.ctx)) for occ in occs}) != 1:
        return None
    (depth,) = depths
    return tuple("stepped" if k == depth else "repeated" for k in range(n))


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


class Call:
    """One call of a per-example transform: the proof, the pass, then the norms and weighted sums."""

    def __init__(self, fun, argnums, fallback, has_aux, args, kwargs):
        if not isinstance(argnums, int):
            raise TypeError(f"argnums must be an int (the position of the model), got {argnums!r}.")
        if fallback not in ("vmap", "error"):
            raise ValueError(f'fallback must be "vmap" or "error", got {fallback!r}.')
        self.fun, self.argnums, self.fallback, self.has_aux, self.kwargs = fun, argnums, fallback, has_aux, kwargs
        self.args = list(args)
        self.plan = plan = plan_for(args[argnums])
        try:
            self._trace(plan)
        except (ValueError, TypeError) as e:
            if "jaxtrace._equinox" not in str(e) and "Custom node type mismatch" not in str(e):
                raise
            # ``fun`` combines the model with a pytree of the untagged classes that it closes over (the
            # static half of an ``eqx.partition``): trace the untagged model. Its layers carry no tags,
            # so each leaf's uses are found as reads (``_reads``) or whole, and proven as such.
            self.plan = plan = dataclasses.replace(plan, layers=[], run_model=plan.plain_model)
            self._trace(plan)
        paths = {layer.path for layer in plan.layers}
        losses_aval = self.jaxpr.outvars[0].aval
        if len(losses_aval.shape) != 1:
            raise ValueError(
                "jaxtrace.per_example_norms and jaxtrace.clipped_grad need `fun` to return one loss per "
                f"example, of shape (batch,){' and its aux' if has_aux else ''}; got shape {losses_aval.shape}."
            )
        self.batch = losses_aval.shape[0]
        self.read_names = {
            f"{plan.names[read.leaf]}{_READ}{k}": read
            for k, read in enumerate(find_reads(self.jaxpr, len(plan.leaves), paths))
        }
        read = {r.leaf for r in self.read_names.values()}
        whole = {f"{plan.names[i]}{_WHOLE}": i for i in range(len(plan.leaves)) if i not in read}
        in_scans = _in_scans(self.jaxpr, set(whole.values()))
        steps = {f"{plan.names[i]}{_STEPS if 'stepped' in loops else _REPEATS}": i for i, (_, _, loops) in in_scans.items()}
        self.scan_loops = {n: in_scans[i][2] for n, i in steps.items()}
        self.proof = prove(
            self.jaxpr, len(plan.leaves), self.batch, paths,
            {n: (r.eqn.outvars[0], r.ctx) for n, r in self.read_names.items()}
            | {n: (self.jaxpr.invars[i], ()) for n, i in whole.items()},
            {n: in_scans[i][:2] for n, i in steps.items()},
        )
        called = {i for layer in plan.layers if self.proof.occurrences.get(layer.path) for i in layer.leaves.values()}
        whole = {n: i for n, i in whole.items() if i not in called}  # a called layer's leaves: its factors
        steps = {n: i for n, i in steps.items() if i not in called}
        self.proof.shared = [
            u for u in self.proof.shared
            if not u.path.endswith((_WHOLE, _STEPS, _REPEATS)) or u.path in whole or u.path in steps
        ]
        if self.proof.mixing is not None:
            raise TagError(
                f"jaxtrace per-example gradients: {self.proof.mixing}. Per-example gradients (and DP-SGD's "
                "clipping bound) need independent examples: compute batch statistics outside `fun` (BatchNorm "
                "in inference mode, GroupNorm or LayerNorm instead), and give each example a loss of its own."
            )
        # layers called where the proof reads; not those called inside a custom derivative rule's
        # function, whose gradient JAX takes from the rule (their tags have none: the exact path)
        around = {p: _custom_around(self.proof.occurrences.get(p, ())) for p in paths}
        self.in_custom = {p: eqn for p, eqn in around.items() if eqn is not None}
        found = {p for p in paths if p in self.proof.occurrences and p not in self.in_custom}
        # a layer's calls of one layout stack as one tag; those of another layout get a name of their own
        self.groups, self.group_why, renamed = {}, {}, {}
        for p in sorted(found):
            self.groups[p], more, why = call_groups(p, self.proof.occurrences[p], lambda p=p: self._stacks(p))
            renamed.update(more)
            if why is not None:
                self.group_why[p] = why
        names = {n for gs in self.groups.values() for g in gs for n in (g.name, g.name + INPUT_SUFFIX)}
        self.shared_names = {}
        for k, use in enumerate(self.proof.shared):
            self.shared_names.setdefault(use.path, []).append((f"{use.path}{_SHARED}{k}", use))
        names |= {n for uses in self.shared_names.values() for n, _ in uses}
        self.reads, self.read_why = self._proven_reads()
        # a leaf used as it is (``h + b``, a whole position table ``wpe[:T]`` with T its length) where every
        # use meets the examples: each example's gradient is the cotangent of its broadcast there
        self.whole = {n: i for n, i in whole.items() if n in self.shared_names}
        # ``h + b[l]`` in a scan over ``b``; ``h + b`` in a scan whose body closes over ``b``
        self.whole_steps = {n: i for n, i in steps.items() if n in self.shared_names}
        names |= set(self.reads) | {n + INPUT_SUFFIX for n in self.reads}
        run = self._traced  # the program again, with tags at the meetings and reads where there are any
        # (not for one example: its gradient is the plain one, ``sq_norms`` and ``weighted_grads`` read no factors),
        # and a name of their own on the tags of a layer's calls of another layout
        placed = self.batch > 1 and (self.proof.shared or self.reads)
        if placed or renamed:
            run = Replay(
                self.jaxpr, self.consts, self._out_tree, self.proof, self.batch, self.shared_names if placed else {},
                self.reads if placed else {}, plan.scope, renamed,
            )
        with opened(plan.scope):  # the plan's tags and the replay's are this pass's: no transform around it sees them
            self.losses, self.pullback, (self.aux, self.state), self.values = _vjp(
                lambda leaves: _losses_first(run(leaves), has_aux), plan.leaves, with_values=True, has_aux=True,
                tags=lambda n: n in names,
            )

    def _trace(self, plan) -> None:
        """Trace ``fun`` on ``plan``'s model: the program (``jaxpr``, ``consts``), its output tree, and
        the arguments each trace sees (the other half of an ``eqx.partition`` made tagged alike)."""
        args, kwargs, argnums = self.args, self.kwargs, self.argnums
        self.tagged_args, self.tagged_kwargs = _partition_twins(
            args[argnums], lambda: plan.run_model(plan.leaves), args, kwargs, argnums
        )
        # NNX objects among the other arguments (an nnx.Rngs that dropout draws from) enter each trace
        # as merged copies and their changed state is written back, as nnx.grad does (``_stateful``).
        self._lift = lift(self.fun, self.tagged_args, self.tagged_kwargs, skip=(argnums,))
        twins = self.tagged_args is args and self.tagged_kwargs is kwargs
        self._plain_lift = self._lift if twins else lift(self.fun, args, kwargs, skip=(argnums,))

        def flat(leaves):
            out, self._out_tree = jax.tree_util.tree_flatten(self._traced(leaves))
            return out

        self.jaxpr, self.consts = _compat.jaxpr_and_consts(jax.make_jaxpr(flat)(list(plan.leaves)))

    @functools.cached_property
    def _sites(self) -> dict:
        """The sites of the program's tags, the plan's among them, as the pass's split stacks them."""
        with opened(self.plan.scope):
            return Program(self.jaxpr).sites

    def _stacks(self, path: str) -> bool:
        """Whether the pass stacks the calls of the layer ``path`` as one value (its input's and its output's)."""
        return not any(site.problem for (name, _), site in self._sites.items() if name in (path, path + INPUT_SUFFIX))

    def _proven_reads(self) -> tuple[dict, dict]:
        """``({tag name: Read}, {leaf: why its reads are not on factors})``: the reads of a leaf by one
        primitive (``_reads``) whose output positions each reach one example's loss, or whose output
        is shared by every example and meets them where the proof lists it."""
        met = {id(use.eqn) for use in self.proof.shared}
        proven, why = {}, {}
        for name, read in self.read_names.items():
            if id(read.eqn) in met:
                continue
            if self.proof.axis_at(read.eqn.outvars[0], self.batch, read.ctx) is None and name not in self.shared_names:
                why[read.leaf] = f"its read {_compat.construct(read.eqn)} has outputs that reach several examples' losses"
                continue
            proven[name] = read
        return proven, why

    def _traced(self, leaves):
        """``(fun's output, (the state the model changed, the state other NNX arguments changed))``, the
        model rebuilt from ``leaves``."""
        model = self.plan.run_model(leaves)
        if self._lift is None:
            return self._call(self.fun, self.tagged_args, self.tagged_kwargs, model), (self.plan.state_of(model), None)
        out, changed = self._call(self._lift.fun, self._lift.args, self._lift.kwargs, model)
        return out, (self.plan.state_of(model), changed)

    def _call_with(self, leaves, model_fn):
        """``fun``'s output with the model ``model_fn(leaves)``; the state a call changes is left behind
        (the exact path runs from the state the pass started from, so it draws the same random numbers)."""
        if self._plain_lift is None:
            return self._call(self.fun, self.args, self.kwargs, model_fn(leaves))
        return self._call(self._plain_lift.fun, self._plain_lift.args, self._plain_lift.kwargs, model_fn(leaves))[0]

    def _call(self, fun, args, kwargs, model):
        args = list(args)
        args[self.argnums] = model
        return fun(*args, **kwargs)

    def write_back(self) -> None:
        """Leaves the model and the other NNX arguments as one plain call of ``fun`` leaves them, as ``nnx.grad`` does."""
        model_state, changed = self.state
        self.plan.write_back(model_state)
        if self._lift is not None:
            self._lift.write_back(changed)

    @functools.cached_property
    def _dtypes(self) -> list:
        return [_compute_dtype(jnp.result_type(leaf)) for leaf in self.plan.leaves]

    @functools.cached_property
    def _first_pullback(self):
        """The pullback of ``sum(losses)``: ``(leaf gradients, tag gradients)``."""
        (leaf_cts,), tag_cts = self.pullback(jnp.ones_like(self.losses))
        return leaf_cts, tag_cts

    def _layer_inputs(self, layer, group, tag_cts):
        """``(x, g, (axis, inner))`` of the layer's calls in ``group`` (``_groups.Group``: the calls of one
        layout), examples located; or ``None`` and why not."""
        x, g = self.values.get(group.name + INPUT_SUFFIX), tag_cts.get(group.name)
        if not isinstance(x, jax.Array) or not isinstance(g, jax.Array):
            return None, "its input or output is not one array"
        if layer.path in self.shared_names:
            occs = self.proof.occurrences[layer.path]
            if len(occs) != 1:
                return None, "a layer applied to a value shared by every example is called once only"
            use_g = 0.0
            for name, use in self.shared_names[layer.path]:
                use_g = use_g + shared_gradient(tag_cts[name], use, self.proof, self.batch)
            # each example's gradient in the program's layout of the output; ``x`` and ``g`` have the
            # vmap axes first (an eqx.nn.Linear without bias under jax.vmap: (features, T) against (T, features))
            use_g = jnp.transpose(use_g, (0, *(1 + a for a in occs[0].order)))
            return (jnp.broadcast_to(x, (self.batch, *x.shape)), use_g, (0, 1)), None
        where = self.proof.example_axis(group.occurrences, g.ndim, self.batch)
        if where is None:
            why = next((occ.out for occ in reversed(group.occurrences) if isinstance(occ.out, Every)), None)
            if isinstance(why, Every) and why.eqn is not None and _higher_order.kind(why.eqn) == _higher_order.CUSTOM:
                return None, (
                    f"its output's gradient comes through a custom derivative rule ({_compat.construct(why.eqn)}) "
                    "that is not proven to keep each example's cotangent to that example"
                )
            return None, "its output reaches several examples' losses" + (
                f" ({_compat.construct(why.eqn)})" if isinstance(why, Every) and why.eqn is not None else ""
            )
        return (x, g, where), None

    def _layer_uses(self, layer, tag_cts, why: dict) -> dict:
        """``{leaf: [Use or (steps, Use)]}``: the uses of each of the layer's leaves that are on factors in
        every group of its calls (``_groups``: one a layout); ``why`` gets the reason for the others."""
        occs = self.proof.occurrences.get(layer.path, [])
        if layer.path in self.in_custom or layer.path in self.group_why:
            reason = self.group_why.get(layer.path) or (
                f"its layer {layer.path!r} is called inside a function with a custom derivative rule "
                f"({_compat.construct(self.in_custom[layer.path])}), whose gradient JAX takes from the rule"
            )
            why.update({i: reason for i in layer.leaves.values()})
            return {}
        groups = self.groups.get(layer.path, [])
        if not layer.leaves or not occs or not groups or any(g.name not in tag_cts for g in groups):
            return {}  # never called: its leaves are zero unless used elsewhere (``_factors``)
        leaves = {}
        for attr in layer.leaves:
            origins = {occ.params.get(attr) for occ in occs}
            origin = origins.pop() if len(origins) == 1 else None
            if origin is None:
                why[layer.leaves[attr]] = f"its layer {layer.path!r} multiplies a value computed from it, not the leaf itself"
                continue
            leaves[attr] = origin
        per_group = [self._group_uses(layer, leaves, group, tag_cts, why) for group in groups]
        return {
            origin.leaf: [items[attr] for items in per_group]
            for attr, origin in leaves.items()
            if all(items.get(attr) is not None for items in per_group)
        }

    def _group_uses(self, layer, leaves: dict, group, tag_cts, why: dict) -> dict:
        """``{attribute: Use or (steps, Use)}`` of the layer's calls in ``group``, for its ``leaves``
        (``{attribute: Origin}``); ``why`` gets the reason for the attributes it gives none."""
        dtypes = self._dtypes
        got, reason = self._layer_inputs(layer, group, tag_cts)
        if got is None:
            why.update({origin.leaf: f"at its layer {layer.path!r}: {reason}" for origin in leaves.values()})
            return {}
        x, g, (axis, inner) = got
        ri, ro = layer.rule.ranks(layer.module)
        n_lead = x.ndim - ri
        if n_lead < 1 or g.ndim - ro != n_lead or x.shape[:n_lead] != g.shape[:n_lead] or axis >= n_lead:
            why.update({origin.leaf: f"its layer {layer.path!r} is called with inputs of unexpected shapes" for origin in leaves.values()})
            return {}
        stepped = {a for a, origin in leaves.items() if origin.stepped}
        per_step: dict = {}
        dt = functools.reduce(jnp.promote_types, [dtypes[o.leaf] for o in leaves.values()], _compute_dtype(g.dtype))
        xf = x if not jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(dt)
        if stepped:
            loops = _stepped_loops(list(group.occurrences), {leaves[a].depth for a in stepped}, axis)
            if loops is None:
                for a in stepped:
                    why[leaves[a].leaf] = (
                        f"its layer {layer.path!r} is stacked and called in different loops, or its stack is sliced by two nested scans"
                    )
                return {}
            n, module = len(loops), step_module(layer.module, x.shape[loops.index("stepped")])
            step = lambda v: examples_first(v, axis - n, inner, n_lead - n)  # noqa: E731
            per_step = over_loops(
                lambda xs, gs: {a: f for a, f in layer.rule.factors(module, step(xs), step(gs.astype(dt))).items() if a in stepped},
                loops, xf, g,
            )
            for a in stepped:
                per_step.setdefault(a, None)
                if per_step[a] is None:
                    why[leaves[a].leaf] = f"its layer {layer.path!r} is stacked in a scan and called in a loop nested in it, which its rule does not cover"
        factors = {}
        if set(leaves) - stepped:
            gf = g.astype(dt)
            xb, gb = examples_first(xf, axis, inner, n_lead), examples_first(gf, axis, inner, n_lead)
            factors = layer.rule.factors(layer.module, xb, gb)
            if n_lead == 1:  # one (B * K, d) array each: the weighted sum reads them, not their views
                factors = with_rows(factors, [(v, f) for v, f in ((xb, xf), (gb, gf)) if f.ndim == 2])
        return {attr: per_step.get(attr) if attr in stepped else factors.get(attr) for attr in leaves}

    @functools.cached_property
    def _factors(self) -> tuple[dict, set, list, dict]:
        """``({leaf: [Use or (steps, Use)]}, {leaves the losses do not depend on}, [the exact-path leaves],
        {leaf: why not on factors})``, by index (for ``batch > 1``)."""
        plan, dtypes = self.plan, self._dtypes
        _, tag_cts = self._first_pullback
        uses: dict = {}
        why: dict = {i: _NO_RULE for i in range(len(plan.leaves))}
        owned: dict = {}
        for layer in plan.layers:
            for leaf, items in self._layer_uses(layer, tag_cts, why).items():
                uses.setdefault(leaf, []).extend(items)
                owned.setdefault(layer.path, set()).add(leaf)
        cut_reads = {}
        for name, read in self.reads.items():
            i = read.leaf
            x = self.values.get(name + INPUT_SUFFIX) if read.other is not None else None
            use = None
            if name in self.shared_names:  # each example's gradient where the shared output meets it
                n_loops = len(read.loops)  # (in scans: one per step)
                g = sum(
                    _over_steps(lambda c, u=u: shared_gradient(c, u, self.proof, self.batch), n_loops)(tag_cts[n])
                    for n, u in self.shared_names[name]
                )
                dt = jnp.promote_types(dtypes[i], _compute_dtype(g.dtype))
                use = over_loops(lambda xs, gs: read.shared_factors(xs, gs, dt), read.loops, x, g)
            elif read.other is None or isinstance(x, jax.Array):
                g = tag_cts.get(name)
                axis, inner = self.proof.axis_at(read.eqn.outvars[0], self.batch, read.ctx)
                dt = jnp.promote_types(dtypes[i], _compute_dtype(g.dtype)) if isinstance(g, jax.Array) else None
                if isinstance(g, jax.Array):  # (in scans: one value per step, per scan)
                    use = over_loops(lambda xs, gs: read.factors(xs, gs, axis, inner, dt), read.loops, x, g)
            if use is None:
                self.read_why.setdefault(i, f"its read {_compat.construct(read.eqn)} does not keep the examples on its own axes")
                continue
            uses.setdefault(i, []).append(use)
            cut_reads[(*map(id, read.ctx), id(read.eqn))] = (read.operand, i)
        for name, i in (self.whole | self.whole_steps).items():  # in scans: one cotangent per step, per scan
            loops = self.scan_loops.get(name, ())
            stepped = "stepped" in loops
            g = sum(_over_steps(lambda c, u=u: shared_gradient(c, u, self.proof, self.batch), len(loops))(tag_cts[n])
                    for n, u in self.shared_names[name])
            # the whole leaf at every step of a scan that closes over it: each example's gradient sums over those steps
            g = g.sum(tuple(k for k, kind in enumerate(loops) if kind == "repeated"))
            if stepped:  # each step's own slice
                uses.setdefault(i, []).append(("steps", Use(g.reshape(g.shape[0], self.batch, 1, -1).astype(dtypes[i]), None)))
            else:
                uses.setdefault(i, []).append(Use(g.reshape(self.batch, 1, -1).astype(dtypes[i]), None))
        every_use_met = set(self.whole.values()) | set(self.whole_steps.values())
        outside = used_outside(self.jaxpr, len(plan.leaves), owned, cut_reads, every_use_met)
        for i in outside:
            if i in uses:
                why[i] = self.read_why.get(i) or (
                    "it is also used outside its layers other than by a read the rules cover (a module no rule "
                    "covers, a read in a branch or `while` body, an operation other than `table[ids]`, `table[:n]`, "
                    "`W[i]` or a matrix product)"
                )
            elif why[i] == _NO_RULE:
                why[i] = self.read_why.get(i) or (
                    f"{_NO_RULE}, and no read rule (`table[ids]`, `table[:n]`, `W[i]`, a matrix product, or one of "
                    "these on a scan step's slice of a stacked leaf) covers how the program uses it"
                )
        mixed = {i for i, us in uses.items() if len({isinstance(u, tuple) for u in us}) > 1}
        for i in mixed:
            why[i] = "it is used both as a whole and one slice per scan step"
        uses = {i: us for i, us in uses.items() if i not in outside and i not in mixed}
        zero = {i for i in range(len(plan.leaves)) if i not in uses and i not in outside}
        exact = [i for i in range(len(plan.leaves)) if i not in uses and i not in zero]
        return uses, zero, exact, why

    @functools.cached_property
    def _exact_grads(self) -> dict:
        """``{leaf index: per-example gradient (B, *leaf.shape)}`` for the leaves no factors cover."""
        _, _, exact, why = self._factors
        return dict(zip(exact, self._exact(exact, why))) if exact else {}

    def sq_norms(self):
        """Per-leaf squared norms ``(B,)``, in the order of ``plan.leaves``."""
        dtypes = self._dtypes
        if self.batch == 1:
            leaf_cts, _ = self._first_pullback
            return [jnp.sum(jnp.square(c.astype(dt)))[None] for c, dt in zip(leaf_cts, dtypes)]
        uses, zero, _, _ = self._factors
        out = []
        for i in range(len(self.plan.leaves)):
            if i in uses:
                out.append(sq_norm(uses[i], dtypes[i]).astype(dtypes[i]))
            elif i in zero:
                out.append(jnp.zeros(self.batch, dtypes[i]))
            else:
                p = self._exact_grads[i].astype(dtypes[i])
                out.append(jnp.sum(jnp.square(p).reshape(p.shape[0], -1), axis=1))
        return out

    def definition_sq_norms(self) -> list:
        """Each leaf's per-example squared norms by the definition, for the audit: ``jax.jacrev`` of
        the losses vector through the untagged model (a pullback per example, every leaf)."""

        def losses(leaves):
            out = self._call_with(leaves, model_fn=self.plan.plain_model)
            return out[0] if self.has_aux else out

        rows = jax.jacrev(losses)(list(self.plan.leaves))
        return [jnp.sum(jnp.square(r.astype(dt)).reshape(r.shape[0], -1), axis=1) for r, dt in zip(rows, self._dtypes)]

    def leaf_paths(self) -> list[tuple[str, str]]:
        """Per leaf, in the order of ``plan.leaves``: ``(path, why)``, the path ``sq_norms`` takes
        (``"factors"``, ``"zero"``, ``"exact"`` or, for one example, ``"batch of one"``) and, for the
        exact path, why no factors cover the leaf."""
        if self.batch == 1:
            return [("batch of one", "")] * len(self.plan.leaves)
        uses, zero, _, why = self._factors
        return [
            ("factors", "") if i in uses else ("zero", "") if i in zero else ("exact", why.get(i, ""))
            for i in range(len(self.plan.leaves))
        ]

    def weighted_grads(self, weights, nan_safe: bool = False):
        """Per-leaf ``sum_i weights[i] g_i`` (the clipped sum, for clipping weights; ``weights`` ``None``:
        every weight 1, the gradient of ``sum(losses)``), in the leaves' dtypes.
        With ``nan_safe``, the non-finite entries of the factors (and exact-path rows) read as zeros: an
        example of weight 0 for a non-finite norm adds zeros (its factors hold ``nan``, and ``0 * nan`` is
        ``nan``); one whose norm is finite has none.

        From the pass's factors (and the exact path's per-example gradients): no second pullback.
        """
        leaves, dtypes = self.plan.leaves, self._dtypes
        if self.batch == 1:
            leaf_cts, _ = self._first_pullback
            if weights is None:
                return list(leaf_cts)
            z = finite if nan_safe else (lambda c: c)
            return [(weights[0].astype(dt) * z(c.astype(dt))).astype(c.dtype) for c, dt in zip(leaf_cts, dtypes)]
        uses, zero, _, _ = self._factors
        out = []
        for i, leaf in enumerate(leaves):
            if i in uses:
                g = weighted_sum(uses[i], weights, jnp.shape(leaf), dtypes[i], nan_safe)
            elif i in zero:
                g = jnp.zeros(jnp.shape(leaf), dtypes[i])
            else:
                rows = self._exact_grads[i].astype(dtypes[i])
                rows = finite(rows) if nan_safe else rows
                g = jnp.tensordot(example_weights(weights, self.batch, dtypes[i]), rows, 1)
            out.append(g.astype(jnp.result_type(leaf)))
        return out

    def _exact(self, missing, why):
        """Per-example gradients of the ``missing`` leaves by the definition: the pullback of the losses
        vector against each example's basis vector (``jax.vmap`` over the rows of an identity)."""
        plan = self.plan
        if self.fallback == "error":
            lines = [
                f"  {plan.names[i]!r} (in module {plan.owners[i][0]!r}, {plan.owners[i][1]}): {why.get(i, '')}"
                for i in missing
            ]
            raise TagError(
                "jaxtrace.per_example_norms cannot give these leaves' per-example gradients from their "
                "layers' factors (a rule covers Linear, Embedding, LayerNorm, RMSNorm and Conv layers whose "
                "weight is the leaf itself and whose output positions each reach one example's loss):\n"
                + "\n".join(lines)
                + '\nPass fallback="vmap" to compute them exactly from the definition (a pullback of the '
                "losses per example, for those leaves only)."
            )
        fixed = list(plan.leaves)

        def losses_of(sub):
            ls = list(fixed)
            for i, v in zip(missing, sub):
                ls[i] = v
            out = self._call_with(ls, model_fn=plan.plain_model)
            return out[0] if self.has_aux else out

        losses, pullback = jax.vjp(losses_of, [fixed[i] for i in missing])
        (rows,) = jax.vmap(pullback)(jnp.eye(self.batch, dtype=losses.dtype))
        return rows


def _in_scans(jaxpr, candidates: set) -> dict:
    """``{leaf: (scan equations, body invar, loops)}`` for the leaves among ``candidates`` whose only use in
    ``jaxpr`` is as one operand of one top-level scan, followed into the scans nested in its body while
    the body's input has no other use either: ``loops`` per scan, outermost first, ``"stepped"`` for an
    ``xs`` operand (the body sees one step's slice; one such scan at most) or ``"repeated"`` for a const
    (the body closes over it, the same at every step); the body invar is the innermost's."""
    found = {}
    for i in candidates:
        where, var, eqns, loops = jaxpr, jaxpr.invars[i], (), ()
        while (use := _only_use(where, var)) is not None and _higher_order.kind(use[0]) == _higher_order.SCAN:
            eqn, k = use
            p = _equation_params.scan_params(eqn)
            stepped = k >= p.num_consts + p.num_carry
            if p.num_consts <= k < p.num_consts + p.num_carry or (stepped and "stepped" in loops):
                break  # a carry; or a slice scanned over again
            where, _ = _compat.jaxpr_and_consts(p.body)
            var, eqns, loops = where.invars[k], (*eqns, eqn), (*loops, "stepped" if stepped else "repeated")
        if eqns:
            found[i] = (eqns, var, loops)
    return found


def _only_use(jaxpr, var):
    """``(equation, operand index)`` of ``var``'s one use in ``jaxpr``; None if it has another, or none."""
    uses = [(eqn, k) for eqn in jaxpr.eqns for k, a in enumerate(eqn.invars) if a is var]
    return uses[0] if len(uses) == 1 and not any(a is var for a in jaxpr.outvars) else None


def _over_steps(f, n: int):
    """``f`` mapped over ``n`` leading (loop) axes."""
    for _ in range(n):
        f = jax.vmap(f)
    return f


def _custom_around(occurrences):
    """The outermost ``custom_jvp``/``custom_vjp`` equation around any of a layer's calls, or ``None``."""
    for occ in occurrences:
        for eqn in occ.ctx:
            if hasattr(eqn, "primitive") and _higher_order.kind(eqn) == _higher_order.CUSTOM:  # (a branch is a jaxpr)
                return eqn
    return None


def _is_none(x) -> bool:
    return x is None


def _partition_twins(model, tagged_model, args: list, kwargs: dict, argnums: int) -> tuple[list, dict]:
    """``(args, kwargs)`` with each other half of an ``eqx.partition`` of the model (a module of the
    model's class and pytree structure, ``None`` wherever the model holds a leaf and the other way
    round) rebuilt with the tagged model's classes, so that ``eqx.combine(params, static)`` inside
    ``fun`` combines two halves of one tagged model (``tagged_model()``). Nothing else is touched."""
    eqx = sys.modules.get("equinox")
    if eqx is None or not isinstance(model, eqx.Module):
        return args, kwargs
    plain_def = jax.tree_util.tree_structure(model, is_leaf=_is_none)
    tagged_def = jax.tree_util.tree_structure(tagged_model(), is_leaf=_is_none)
    if plain_def == tagged_def:
        return args, kwargs
    held = [leaf is not None for leaf in jax.tree_util.tree_leaves(model, is_leaf=_is_none)]
    cls = type(model)

    def twin(x):
        if type(x) is not cls or jax.tree_util.tree_structure(x, is_leaf=_is_none) != plain_def:
            return x
        leaves = jax.tree_util.tree_leaves(x, is_leaf=_is_none)
        if any(h and leaf is not None for h, leaf in zip(held, leaves)):
            return x  # not a complement of the model: leave it as the user passed it
        return jax.tree_util.tree_unflatten(tagged_def, leaves)

    swap = lambda a: jax.tree_util.tree_map(twin, a, is_leaf=lambda x: type(x) is cls)  # noqa: E731
    return [a if k == argnums else swap(a) for k, a in enumerate(args)], {k: swap(v) for k, v in kwargs.items()}


def _losses_first(out, has_aux):
    """``(losses, (aux, state))`` from ``(fun's output, state)``."""
    value, state = out
    return (value[0], (value[1], state)) if has_aux else (value, (None, state))
