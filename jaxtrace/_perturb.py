"""``perturb(x, eps)``: the split form of a tag for reverse mode.

Mathematically ``x + eps``, evaluated only at ``eps = 0``. Its primal is ``x``
itself (no add, no read of the zeros), and its tangent is ``x_dot + eps_dot``:
so the cotangent of ``eps`` is exactly the cotangent at the tagged value, and
the program computes nothing that a plain backward pass would not.
"""

from __future__ import annotations

import jax
from jax import lax

from . import _compat

__all__ = ["perturb", "perturb_p"]


def _impl(x, eps):
    return x


def _abstract_eval(x, eps):
    return x


def _tangent(x_dot, eps_dot):
    if _compat.is_zero(eps_dot):
        return x_dot
    if _compat.is_zero(x_dot):
        return eps_dot
    return lax.add(x_dot, eps_dot)


def _jvp(primals, tangents):
    (x, _), (x_dot, eps_dot) = primals, tangents
    return x, _tangent(x_dot, eps_dot)


def _linearize(nonzeros, x, eps):
    return x, any(nonzeros), (), lambda _, x_dot, eps_dot: _tangent(x_dot, eps_dot)


def _batch(args, dims):
    (x, eps), (dx, de) = args, dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _compat.not_mapped)
    x, eps = (
        jax.numpy.broadcast_to(a, (size, *a.shape)) if d is _compat.not_mapped else _compat.moveaxis_batched(a, d, 0)
        for a, d in ((x, dx), (eps, de))
    )
    return perturb_p.bind(x, eps), 0


def _lowering(ctx, x, eps):
    return [x]


perturb_p = _compat.define_primitive(
    "jaxtrace_perturb",
    impl=_impl,
    abstract_eval=_abstract_eval,
    jvp=_jvp,
    batch=_batch,
    lowering=_lowering,
    linearize=_linearize,
)


def perturb(x, eps):
    return perturb_p.bind(x, eps)
