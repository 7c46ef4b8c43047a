"""``per_example_audit``: the fast path checked against the definition, on the user's own model and batch."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ._pass import Call

__all__ = ["LeafAudit", "PerExampleAudit", "per_example_audit"]

# The relative difference below which a leaf passes, by the dtype its norms are computed in: a
# few hundred ulps of the largest norm (sums over many entries, reassociated by XLA).
_TOLERANCE = {jnp.dtype(jnp.float64): 1e-10, jnp.dtype(jnp.float32): 1e-4}


@dataclasses.dataclass(frozen=True)
class LeafAudit:
    """One differentiated leaf: how ``per_example_norms`` computed it, and how far it is from the definition.

    Attributes:
        name: the leaf's path in the model (``"layers[0].weight"``), as in jaxtrace's errors.
        module: the module that holds it and that module's class, ``"layers[0] (Linear)"``.
        path: ``"factors"`` (its layers' inputs and output gradients), ``"exact"`` (the
            definition, a pullback of the losses per example), ``"zero"`` (no loss depends on it)
            or ``"batch of one"`` (one example: its gradient is the batch's).
        why: for ``"exact"``, why no factors cover it; else ``""``.
        relative_difference: ``max_i |n_i - d_i| / max_i d_i``, ``n_i`` the fast path's norm of
            example ``i``'s gradient of this leaf and ``d_i`` the definition's (0 when both are 0).
    """

    name: str
    module: str
    path: str
    why: str
    relative_difference: float


@dataclasses.dataclass(frozen=True)
class PerExampleAudit:
    """What ``jt.per_example_audit`` found: one ``LeafAudit`` a leaf, and whether every leaf is within ``tolerance``.

    Each ``LeafAudit`` has ``name`` (the leaf's path in the model), ``module`` (its module and
    class), ``path`` (``"factors"``, ``"exact"``, ``"zero"`` or ``"batch of one"``), ``why`` (for
    the exact path, why no factors cover it) and ``relative_difference`` (``max_i |n_i - d_i| /
    max_i d_i`` over the examples, fast-path norm ``n_i`` against the definition's ``d_i``).

    ``str(audit)`` is a table to read; ``audit.as_dict()`` a JSON-ready record to log beside a DP
    training run.
    """

    examples: int
    dtype: str
    tolerance: float
    leaves: tuple

    @property
    def max_relative_difference(self) -> float:
        return max((leaf.relative_difference for leaf in self.leaves), default=0.0)

    @property
    def passed(self) -> bool:
        return self.max_relative_difference <= self.tolerance

    def as_dict(self) -> dict:
        return {
            "examples": self.examples,
            "dtype": self.dtype,
            "tolerance": self.tolerance,
            "passed": self.passed,
            "max_relative_difference": self.max_relative_difference,
            "leaves": [dataclasses.asdict(leaf) for leaf in self.leaves],
        }

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        lines = [
            f"per-example audit: {verdict} on {self.examples} example(s), {self.dtype}: largest relative "
            f"difference {self.max_relative_difference:.1e} (tolerance {self.tolerance:.0e})"
        ]
        width = max((len(leaf.name) for leaf in self.leaves), default=4)
        for leaf in self.leaves:
            why = f"  ({leaf.why})" if leaf.why else ""
            lines.append(f"  {leaf.name:<{width}}  {leaf.path:<12}  {leaf.relative_difference:.1e}{why}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"PerExampleAudit({json.dumps(self.as_dict())})"


def per_example_audit(fun: Callable, argnums: int = 0, *, has_aux: bool = False, tolerance: float | None = None) -> Callable:
    """Check ``per_example_norms`` against the definition on your own model and a slice of your batch.

    For every differentiated leaf it reports which path the fast computation took (the layers'
    factors, the exact path, or zero) and the relative difference between each example's
    gradient norm from that path and from the definition: ``jax.jacrev`` of the losses vector,
    row ``i`` being ``d losses[i] / d leaf``, with the untagged model. The definition costs one
    backward pass per example, so give it a small slice of the batch (a few examples; keep the
    batch's other axes as they are).

    Args:
        fun: as for ``per_example_norms``: ``fun(model, *batch, **kwargs)`` returns one loss per
            example (with ``has_aux``, ``(losses, aux)``).
        argnums: the position of the model, an equinox or Flax NNX module, untagged.
        has_aux: ``fun`` returns ``(losses, aux)``.
        tolerance: the largest relative difference that passes; by default 1e-10 where the norms
            are computed in float64 and 1e-4 in float32.

    Returns:
        A function of ``fun``'s arguments giving a ``PerExampleAudit``. It runs outside
        ``jax.jit`` (it reads numbers back) and raises what
        ``per_example_norms`` raises (examples that interact).

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> def losses(model, x, y):
        ...     return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> audit = jt.per_example_audit(losses)(model, x[:3], y[:3])
        >>> audit.passed, [leaf.path for leaf in audit.leaves][:2]
        (True, ['factors', 'factors'])
    """

    def audit(*args, **kwargs) -> PerExampleAudit:
        call = Call(fun, argnums, "vmap", has_aux, args, kwargs)
        sq_norms = call.sq_norms()
        fast = [np.sqrt(np.asarray(sq)) for sq in sq_norms]
        definition = [np.sqrt(np.asarray(sq)) for sq in call.definition_sq_norms()]
        dtype = jnp.dtype(sq_norms[0].dtype) if sq_norms else jnp.dtype(jnp.float32)
        plan = call.plan
        leaves = []
        for i, ((path, why), n, d) in enumerate(zip(call.leaf_paths(), fast, definition)):
            scale = float(np.max(d)) if d.size else 0.0
            diff = float(np.max(np.abs(n - d))) if d.size else 0.0
            relative = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
            module, cls = plan.owners[i]
            leaves.append(LeafAudit(plan.names[i], f"{module} ({cls})", path, why, relative))
        return PerExampleAudit(
            examples=call.batch,
            dtype=str(dtype),
            tolerance=tolerance if tolerance is not None else _TOLERANCE.get(dtype, 1e-4),
            leaves=tuple(leaves),
        )

    return audit

