"""Tags in a ``lax.cond`` under ``jax.vmap`` with a per-example predicate.

JAX batches such a cond by running *every* branch on every example and
selecting the outputs, so a tag in a branch sees values for examples that did
not take that branch (``log`` of the negatives in ``cond(x > 0, log, ...)``).
Before JAX batches the branches, this rewrite gives each tag in branch ``i`` a
second operand, ``active = (index == i)``, and marks it as one of the cond's
alternatives. Readers of the value (``capture``, ``with_values``) then get
zeros for the examples that took another branch, as an unbatched cond gives,
and one name in several branches stays one site. Gradients need no mask: the
select already sends zero cotangent to the branch not taken.

A cond without tags, or whose predicate is not batched, is left to JAX as is.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from . import _compat, _higher_order
from ._program import Program
from ._split import keep
from ._evaluator import ProgramEvaluator, per_leaf
from ._tag import is_tag, tag_p

__all__: list[str] = []  # nothing to import: importing it teaches jax.vmap of lax.cond to mask tags

_CONDS = itertools.count()


def _contains_tag(jaxpr) -> bool:
    jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
    return any(is_tag(eqn) or any(map(_contains_tag, _higher_order.bodies(eqn))) for eqn in jaxpr.eqns)


def _batched_cond(rule, axis_data, args, dims, *, branches, **params):
    if dims[0] is _compat.not_mapped or not any(map(_contains_tag, branches)):
        return rule(axis_data, args, dims, branches=branches, **params)
    cond = next(_CONDS)
    index_aval = jax.ShapeDtypeStruct((), args[0].dtype)
    masked = tuple(_mask_branch(branch, i, cond, index_aval) for i, branch in enumerate(branches))
    return rule(axis_data, [*args, args[0]], [*dims, dims[0]], branches=masked, **params)


def _mask_branch(branch, i: int, cond: int, index_aval):
    """``branch`` with one more input, the cond's index, and every tag in it masked by ``index == i``."""
    program = Program(branch)
    jaxpr, _ = _compat.jaxpr_and_consts(branch)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in jaxpr.invars]

    def masked(*args):
        *ops, index = args
        taken = index == i

        def retag(eqn, new, invals):
            x, *active = invals
            mask = jnp.broadcast_to(taken, jnp.shape(x))
            mask = mask & active[0] if active else mask
            # Conds are batched outermost first: an inner cond's choice comes after its outer's.
            choice = (*(eqn.params.get("choice") or ()), (cond, i))
            return tag_p.bind(new, mask, **{**eqn.params, "choice": choice})

        outs, _ = ProgramEvaluator(program, list(program.sites.values()), per_leaf(keep), retag=retag)(ops, {})
        return outs

    return jax.make_jaxpr(masked)(*avals, index_aval)


_compat.wrap_cond_batching(_batched_cond)
