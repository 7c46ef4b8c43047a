"""``fun`` traced once on the tagged model: the program the proof reads and the pass runs again.

``TracedFun`` plans the model (``_plan``), traces ``fun`` on the tagged model rebuilt from the
plan's leaves (the other half of an ``eqx.partition`` among the arguments made tagged alike; NNX
objects among the other arguments entering each trace as merged copies, as ``nnx.grad`` has
them), and holds the program (``jaxpr``, ``consts``, the output tree) and the batch size. It calls
``fun`` again on leaves, on the tagged model (``run``, what the pass differentiates) or the untagged
one (``plain_losses``, the definition), and writes back the state a call changed.
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from .. import _compat
from .._stateful import lift
from ._plan import plan_for

__all__ = ["TracedFun"]


class TracedFun:
    """``fun`` with the model at ``args[argnums]``, traced on its plan's leaves (``plan``, ``jaxpr``,
    ``consts``, ``batch``: the length of the losses vector, ``fun``'s first output)."""

    def __init__(self, fun, argnums: int, has_aux: bool, args, kwargs):
        self.fun, self.argnums, self.has_aux, self.kwargs = fun, argnums, has_aux, kwargs
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
            self.plan = plan = dataclasses.replace(plan, layers=[], run_model=plan.plain_model, roles={})
            self._trace(plan)
        losses_aval = self.jaxpr.outvars[0].aval
        if len(losses_aval.shape) != 1:
            raise ValueError(
                "jaxtrace.per_example_norms and jaxtrace.clipped_grad need `fun` to return one loss per "
                f"example, of shape (batch,){' and its aux' if has_aux else ''}; got shape {losses_aval.shape}."
            )
        self.batch = losses_aval.shape[0]

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
            out, self.out_tree = jax.tree_util.tree_flatten(self.run(leaves))
            return out

        self.jaxpr, self.consts = _compat.jaxpr_and_consts(jax.make_jaxpr(flat)(list(plan.leaves)))

    def run(self, leaves):
        """``(fun's output, (the state the model changed, the state other NNX arguments changed))``, the
        tagged model rebuilt from ``leaves``."""
        model = self.plan.run_model(leaves)
        if self._lift is None:
            return self._call(self.fun, self.tagged_args, self.tagged_kwargs, model), (self.plan.state_of(model), None)
        out, changed = self._call(self._lift.fun, self._lift.args, self._lift.kwargs, model)
        return out, (self.plan.state_of(model), changed)

    def plain_losses(self, leaves):
        """The losses of ``fun`` with the untagged model rebuilt from ``leaves``; the state a call changes
        is left behind (the exact path runs from the state the pass started from, so it draws the same
        random numbers)."""
        model = self.plan.plain_model(leaves)
        if self._plain_lift is None:
            out = self._call(self.fun, self.args, self.kwargs, model)
        else:
            out = self._call(self._plain_lift.fun, self._plain_lift.args, self._plain_lift.kwargs, model)[0]
        return out[0] if self.has_aux else out

    def _call(self, fun, args, kwargs, model):
        args = list(args)
        args[self.argnums] = model
        return fun(*args, **kwargs)

    def write_back(self, state) -> None:
        """Leaves the model and the other NNX arguments as a call that changed ``state`` (``run``'s second
        output) leaves them, as ``nnx.grad`` does."""
        model_state, changed = state
        self.plan.write_back(model_state)
        if self._lift is not None:
            self._lift.write_back(changed)


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
