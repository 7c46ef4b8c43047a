"""The pass: one ``jt.vjp(..., with_values=True)`` over the tagged model, and the norms from it.

``Call`` runs ``fun`` once with every covered layer's input and output tagged, checks it
returns one loss per example, finds each layer's batch axis, collects the factors of each
leaf's uses and turns them into per-leaf squared norms, or, weighted per example, into the
clipped sum; the leaves no rule covers, and those also used outside their layers
(``_uses``), go to the ``jax.vmap(jax.grad)`` fallback or to a ``TagError``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._ad import vjp as _vjp
from .._forward import capture as _capture
from .._module_tags import INPUT_SUFFIX
from .._sites import TagError
from ._factors import sq_norm, weighted_sum
from ._plan import plan_for
from ._uses import used_outside

def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _batch_axis(shape, n_lead, batch, probe_shape):
    """Which of the leading axes is the batch axis, or ``None``."""
    lead = shape[:n_lead]
    cands = [i for i, s in enumerate(lead) if s == batch]
    if len(cands) == 1:
        return cands[0]
    if probe_shape is None or len(probe_shape) != len(shape):
        return None
    diff = [i for i in range(n_lead) if probe_shape[i] != shape[i]]
    return diff[0] if len(diff) == 1 and diff[0] in cands else None


def _to_bl(x, axis, n_lead):
    """Batch axis first, the other leading axes flattened into one: ``(B, L, *rest)``."""
    x = jnp.moveaxis(x, axis, 0)
    return x.reshape(x.shape[0], -1, *x.shape[n_lead:])


class Call:
    """One call of a per-example transform: the pass, then the norms and the weighted sums from it."""

    def __init__(self, fun, argnums, fallback, args, kwargs):
        if not isinstance(argnums, int):
            raise TypeError(f"argnums must be an int (the position of the model), got {argnums!r}.")
        if fallback not in ("vmap", "error"):
            raise ValueError(f'fallback must be "vmap" or "error", got {fallback!r}.')
        self.fun, self.argnums, self.fallback, self.kwargs = fun, argnums, fallback, kwargs
        self.args = list(args)
        self.plan = plan = plan_for(args[argnums])
        names = set()
        for layer in plan.layers:
            names.update((layer.path, layer.path + INPUT_SUFFIX))
        self.tag_names = names
        self.losses, self.pullback, self.values = _vjp(
            self._call_with, plan.leaves, with_values=True, tags=lambda n: n in names
        )
        if jnp.ndim(self.losses) != 1:
            raise ValueError(
                "jaxtrace.per_example_norms and jaxtrace.clipped_grad need `fun` to return one loss per "
                f"example, of shape (batch,); got shape {jnp.shape(self.losses)}."
            )
        self.batch = self.losses.shape[0]

    def _call_with(self, leaves, model_fn=None, args=None):
        args = list(self.args if args is None else args)
        args[self.argnums] = (model_fn or self.plan.run_model)(leaves)
        return self.fun(*args, **self.kwargs)

    def _others(self):
        return [a for i, a in enumerate(self.args) if i != self.argnums]

    def _with_others(self, others):
        it = iter(others)
        return [self.args[i] if i == self.argnums else next(it) for i in range(len(self.args))]

    def _probe(self):
        """Tag shapes for a batch of one: tells the batch axis apart from axes of the same size."""
        flat, tdef = jax.tree_util.tree_flatten(self._others())
        sliced = [a[:1] if _batched(a, self.batch) else a for a in flat]
        where = [k for k, a in enumerate(sliced) if _is_array(a)]

        def shapes(*arrays):
            vals = list(sliced)
            for k, a in zip(where, arrays):
                vals[k] = a
            full = self._with_others(jax.tree_util.tree_unflatten(tdef, vals))
            run = _capture(lambda lv: self._call_with(lv, args=full), tags=lambda n: n in self.tag_names)
            return run(self.plan.leaves)[1]

        try:
            return jax.eval_shape(shapes, *[sliced[k] for k in where])
        except Exception:  # a model that cannot run on one example: its ambiguous layers fall back
            return {}

    @functools.cached_property
    def _dtypes(self) -> list:
        return [_compute_dtype(jnp.result_type(leaf)) for leaf in self.plan.leaves]

    @functools.cached_property
    def _first_pullback(self):
        """The pullback of ``sum(losses)``: ``(leaf gradients, tag gradients)``."""
        (leaf_cts,), tag_cts = self.pullback(jnp.ones_like(self.losses))
        return leaf_cts, tag_cts

    @functools.cached_property
    def _factors(self) -> tuple[dict, set, list]:
        """``({leaf: [Use, ...]}, {leaves the losses do not depend on}, [the other leaves])``, by index
        (for ``batch > 1``)."""
        plan, batch, dtypes = self.plan, self.batch, self._dtypes
        _, tag_cts = self._first_pullback
        uses: dict = {}
        bad = set(plan.blocked)
        probe = None
        for layer in plan.layers:
            if not layer.leaves:
                continue
            if layer.path not in tag_cts:  # never called: its leaves are zero unless used elsewhere (below)
                continue
            x, g = self.values.get(layer.path + INPUT_SUFFIX), tag_cts[layer.path]
            ri, ro = layer.rule.ranks(layer.module)
            ok = isinstance(x, jax.Array) and isinstance(g, jax.Array)
            n_lead = x.ndim - ri if ok else 0
            ok = ok and n_lead >= 1 and g.ndim - ro == n_lead and x.shape[:n_lead] == g.shape[:n_lead]
            axis = None
            if ok:
                axis = _batch_axis(x.shape, n_lead, batch, None)
                if axis is None and x.shape[:n_lead].count(batch) > 1:
                    probe = self._probe() if probe is None else probe
                    p = probe.get(layer.path + INPUT_SUFFIX)
                    axis = _batch_axis(x.shape, n_lead, batch, getattr(p, "shape", None))
            if axis is None:
                bad.update(layer.leaves.values())
                continue
            dt = functools.reduce(jnp.promote_types, [dtypes[i] for i in layer.leaves.values()], _compute_dtype(g.dtype))
            xb = _to_bl(x if not jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(dt), axis, n_lead)
            gb = _to_bl(g.astype(dt), axis, n_lead)
            for attr, use in layer.rule.factors(layer.module, xb, gb).items():
                if attr in layer.leaves:
                    uses.setdefault(layer.leaves[attr], []).append(use)
        # Which leaves the losses depend on other than through their covered layers' calls: with
        # factors, a use outside them (a tied head `h @ embed.weight.T`): not by factors; without,
        # none at all: a zero gradient.
        owned: dict = {}
        for layer in plan.layers:
            owned.setdefault(layer.path, set()).update(i for i in layer.leaves.values() if i in uses and i not in bad)
        outside = used_outside(self._call_with, plan.leaves, owned)
        uses = {i: us for i, us in uses.items() if i not in bad and i not in outside}
        zero = {i for i in range(len(plan.leaves)) if i not in uses and i not in outside}
        return uses, zero, [i for i in range(len(plan.leaves)) if i not in uses and i not in zero]

    @functools.cached_property
    def _fallback_grads(self) -> dict:
        """``{leaf index: per-example gradient (B, *leaf.shape)}`` for the leaves no factors cover."""
        _, _, missing = self._factors
        return dict(zip(missing, self._fallback(missing))) if missing else {}

    def sq_norms(self):
        """Per-leaf squared norms ``(B,)``, in the order of ``plan.leaves``."""
        dtypes = self._dtypes
        if self.batch == 1:
            leaf_cts, _ = self._first_pullback
            return [jnp.sum(jnp.square(c.astype(dt)))[None] for c, dt in zip(leaf_cts, dtypes)]
        uses, zero, _ = self._factors
        out = []
        for i in range(len(self.plan.leaves)):
            if i in uses:
                out.append(sq_norm(uses[i], dtypes[i]).astype(dtypes[i]))
            elif i in zero:
                out.append(jnp.zeros(self.batch, dtypes[i]))
            else:
                p = self._fallback_grads[i].astype(dtypes[i])
                out.append(jnp.sum(jnp.square(p).reshape(p.shape[0], -1), axis=1))
        return out

    def weighted_grads(self, weights):
        """Per-leaf ``sum_i weights[i] g_i`` (the clipped sum, for clipping weights), in the leaves' dtypes.

        From the pass's factors (and the fallback's per-example gradients): no second pullback.
        """
        leaves, dtypes = self.plan.leaves, self._dtypes
        if self.batch == 1:
            leaf_cts, _ = self._first_pullback
            return [(weights[0].astype(dt) * c.astype(dt)).astype(c.dtype) for c, dt in zip(leaf_cts, dtypes)]
        uses, zero, _ = self._factors
        out = []
        for i, leaf in enumerate(leaves):
            if i in uses:
                g = weighted_sum(uses[i], weights, jnp.shape(leaf), dtypes[i])
            elif i in zero:
                g = jnp.zeros(jnp.shape(leaf), dtypes[i])
            else:
                g = jnp.tensordot(weights.astype(dtypes[i]), self._fallback_grads[i].astype(dtypes[i]), 1)
            out.append(g.astype(jnp.result_type(leaf)))
        return out

    def _fallback(self, missing):
        """Per-example gradients of the ``missing`` leaves, by ``jax.vmap(jax.grad)`` of those leaves alone."""
        plan = self.plan
        if self.fallback == "error":
            lines = [
                f"  {plan.names[i]!r} (in module {plan.owners[i][0]!r}, {plan.owners[i][1]})" for i in missing
            ]
            raise TagError(
                "jaxtrace.per_example_norms has no per-layer rule for these leaves (a rule covers "
                "Linear, Embedding, LayerNorm, RMSNorm and Conv layers called by their __call__ with "
                "the batch on a leading axis, where the leaf is used by such layers only; a tied head "
                "written `h @ embed.weight.T` is a use outside them):\n" + "\n".join(lines) + "\nPass "
                "fallback=\"vmap\" to compute them with jax.vmap(jax.grad), for those leaves only."
            )
        fixed = list(plan.leaves)
        flat, tdef = jax.tree_util.tree_flatten(self._others())
        where = [k for k, a in enumerate(flat) if _batched(a, self.batch)]

        def one(sub, batched):
            ls = list(fixed)
            for i, v in zip(missing, sub):
                ls[i] = v
            args = list(flat)
            for k, a in zip(where, batched):
                args[k] = a[None]
            full = self._with_others(jax.tree_util.tree_unflatten(tdef, args))
            return self._call_with(ls, model_fn=plan.plain_model, args=full)[0]

        return jax.vmap(jax.grad(one), in_axes=(None, 0))([fixed[i] for i in missing], [flat[k] for k in where])


def _is_array(a) -> bool:
    return isinstance(a, (jax.Array, np.ndarray))


def _batched(a, batch) -> bool:
    return _is_array(a) and np.ndim(a) >= 1 and np.shape(a)[0] == batch

