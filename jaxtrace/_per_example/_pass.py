"""The pass: one ``jt.vjp(..., with_values=True)`` over the tagged model, and the norms from it.

``Call`` traces ``fun`` once (``_traced``), finds and proves from that program what contributes
to each leaf's gradient (``_find``: the covered layers' calls, with independent examples, the
weight the leaf itself and the examples located at each layer's output; the reads of leaves by
one primitive, ``_reads``; a leaf used as it is where it meets the examples, at the top level or,
one step's slice of it or all of it at every step, in the body of the one scan over it or
closing over it, ``_meetings``), runs one pass that records every tag those contributions name,
and turns each contribution's factors (``_contributions``) into per-leaf squared norms or,
weighted per example, into the clipped sum. Every other leaf (no rule, used outside its layers,
transformed before its layer, examples not proven apart at its layer, its layer called inside a
custom derivative rule's function) takes the exact path: the definition, the pullback of the
losses vector against each example's basis vector, or a ``TagError`` naming it under
``fallback="error"``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp

from .._ad import vjp as _vjp
from .._sites import TagError
from .._tag import opened
from ._contributions import Cut, Reasons, Recorded, compute_dtype
from ._factors import PerStep, example_weights, finite
from ._find import find_contributions
from ._leaf_sums import sq_norm, weighted_sum
from ._plan import input_tags
from ._traced import TracedFun
from ._uses import used_outside

__all__ = ["Call", "Route"]

_NO_RULE = "no per-layer rule covers it"


class Route(enum.Enum):
    """How a leaf's per-example results are computed (``Call.leaf_paths``)."""

    FACTORS = "factors"  # from its contributions' factors
    ZERO = "zero"  # no loss depends on it
    EXACT = "exact"  # by the definition: a pullback of the losses per example
    BATCH_OF_ONE = "batch of one"  # one example: its gradient is the batch's


@dataclasses.dataclass(frozen=True)
class Routes:
    """Each leaf's ``Route`` (by index), the ``uses`` of the leaves on factors (``{leaf: [use]}``) and
    ``why`` each other leaf is not (``{leaf: why}``)."""

    route: tuple
    uses: dict
    why: dict

    @property
    def exact(self) -> list:
        return [i for i, r in enumerate(self.route) if r is Route.EXACT]


class Call:
    """One call of a per-example transform: the proof, the pass, then the norms and weighted sums."""

    def __init__(self, fun, argnums, fallback, has_aux, args, kwargs):
        if not isinstance(argnums, int):
            raise TypeError(f"argnums must be an int (the position of the model), got {argnums!r}.")
        if fallback not in ("vmap", "error"):
            raise ValueError(f'fallback must be "vmap" or "error", got {fallback!r}.')
        self.fallback, self.has_aux = fallback, has_aux
        self.traced = traced = TracedFun(fun, argnums, has_aux, args, kwargs)
        self.plan = plan = traced.plan
        self.batch = traced.batch
        self.contributions = found = find_contributions(traced)
        run, tags = found.program(traced), found.tags
        with opened(plan.scope):  # the plan's tags and the replay's are this pass's: no transform around it sees them
            self.losses, self.pullback, (self.aux, self.state), self.values = _vjp(
                lambda leaves: _losses_first(run(leaves), has_aux), plan.leaves, with_values=True, has_aux=True,
                tags=lambda n: n in tags,
            )

    def write_back(self) -> None:
        """Leaves the model and the other NNX arguments as one plain call of ``fun`` leaves them, as ``nnx.grad`` does."""
        self.traced.write_back(self.state)

    @functools.cached_property
    def _dtypes(self) -> list:
        return [compute_dtype(jnp.result_type(leaf)) for leaf in self.plan.leaves]

    @functools.cached_property
    def _first_pullback(self):
        """The pullback of ``sum(losses)``: ``(leaf gradients, tag gradients)``."""
        (leaf_cts,), tag_cts = self.pullback(jnp.ones_like(self.losses))
        return leaf_cts, tag_cts

    @functools.cached_property
    def _routes(self) -> Routes:
        """Each leaf's route (for ``batch > 1``): its contributions' uses, one loop over them, and which
        leaves the losses also reach another way (``_uses``)."""
        found, n_leaves = self.contributions, len(self.plan.leaves)
        recorded = Recorded(self.values, self._first_pullback[1], found.proof, self.batch, self._dtypes)
        reasons, uses, cut = Reasons(found.read_why), {}, Cut()
        for part in found.parts:
            got = part.uses(recorded, reasons)
            for leaf, leaf_uses in got.items():
                uses.setdefault(leaf, []).extend(leaf_uses)
            cut = cut | part.cut(set(got))
        outside = used_outside(self.traced.jaxpr, n_leaves, cut.owned, cut.reads, cut.whole, input_tags(self.plan))
        why = {i: reasons.layer.get(i, _NO_RULE) for i in range(n_leaves)}
        for i in outside:
            if i in uses:
                why[i] = reasons.read.get(i) or (
                    "it is also used outside its layers other than by a read the rules cover (a module no rule "
                    "covers, a read in a branch or `while` body, an operation other than `table[ids]`, `table[:n]`, "
                    "`W[i]` or a matrix product)"
                )
            elif why[i] == _NO_RULE:
                why[i] = reasons.read.get(i) or (
                    f"{_NO_RULE}, and no read rule (`table[ids]`, `table[:n]`, `W[i]`, a matrix product, or one of "
                    "these on a scan step's slice of a stacked leaf) covers how the program uses it"
                )
        mixed = {i for i, us in uses.items() if len({isinstance(u, PerStep) for u in us}) > 1}
        for i in mixed:
            why[i] = "it is used both as a whole and one slice per scan step"
        uses = {i: us for i, us in uses.items() if i not in outside and i not in mixed}
        route = tuple(
            Route.FACTORS if i in uses else Route.ZERO if i not in outside else Route.EXACT for i in range(n_leaves)
        )
        return Routes(route, uses, why)

    @functools.cached_property
    def _exact_grads(self) -> dict:
        """``{leaf index: per-example gradient (B, *leaf.shape)}`` for the leaves no factors cover."""
        routes = self._routes
        return dict(zip(routes.exact, self._exact(routes.exact, routes.why))) if routes.exact else {}

    def sq_norms(self):
        """Per-leaf squared norms ``(B,)``, in the order of ``plan.leaves``."""
        dtypes = self._dtypes
        if self.batch == 1:
            leaf_cts, _ = self._first_pullback
            return [jnp.sum(jnp.square(c.astype(dt)))[None] for c, dt in zip(leaf_cts, dtypes)]
        routes = self._routes
        out = []
        for i, route in enumerate(routes.route):
            if route is Route.FACTORS:
                out.append(sq_norm(routes.uses[i], dtypes[i]).astype(dtypes[i]))
            elif route is Route.ZERO:
                out.append(jnp.zeros(self.batch, dtypes[i]))
            else:
                p = self._exact_grads[i].astype(dtypes[i])
                out.append(jnp.sum(jnp.square(p).reshape(p.shape[0], -1), axis=1))
        return out

    def definition_sq_norms(self) -> list:
        """Each leaf's per-example squared norms by the definition, for the audit: ``jax.jacrev`` of
        the losses vector through the untagged model (a pullback per example, every leaf)."""
        rows = jax.jacrev(self.traced.plain_losses)(list(self.plan.leaves))
        return [jnp.sum(jnp.square(r.astype(dt)).reshape(r.shape[0], -1), axis=1) for r, dt in zip(rows, self._dtypes)]

    def leaf_paths(self) -> list[tuple[str, str]]:
        """Per leaf, in the order of ``plan.leaves``: ``(path, why)``, the path ``sq_norms`` takes (a
        ``Route``'s value: ``"factors"``, ``"zero"``, ``"exact"`` or, for one example, ``"batch of one"``)
        and, for the exact path, why no factors cover the leaf."""
        if self.batch == 1:
            return [(Route.BATCH_OF_ONE.value, "")] * len(self.plan.leaves)
        routes = self._routes
        return [(r.value, routes.why.get(i, "") if r is Route.EXACT else "") for i, r in enumerate(routes.route)]

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
        routes = self._routes
        out = []
        for i, (leaf, route) in enumerate(zip(leaves, routes.route)):
            if route is Route.FACTORS:
                g = weighted_sum(routes.uses[i], weights, jnp.shape(leaf), dtypes[i], nan_safe)
            elif route is Route.ZERO:
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
            return self.traced.plain_losses(ls)

        losses, pullback = jax.vjp(losses_of, [fixed[i] for i in missing])
        (rows,) = jax.vmap(pullback)(jnp.eye(self.batch, dtype=losses.dtype))
        return rows


def _losses_first(out, has_aux):
    """``(losses, (aux, state))`` from ``(fun's output, state)``."""
    value, state = out
    return (value[0], (value[1], state)) if has_aux else (value, (None, state))
