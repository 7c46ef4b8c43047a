"""``patch_grad``: change the gradient at a tag, the other half of ``register_hook``.

The split puts ``hook(x)`` at each named tag: an identity whose *tangent* is
``grad_hook_p(x_dot)``, a linear primitive that evaluates as the identity
(forward mode sees the tangents unchanged) and whose transpose applies the
user's ``fn`` to the cotangent. So every reverse-mode entry point of JAX
(``jax.grad``, ``vjp``, ``jacrev``, and jaxtrace's own) sees ``fn(g)`` where
``g`` arrives, with no custom_vjp (which would refuse ``jax.jvp``).
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from . import _compat
from ._checks import check_callable
from ._errors import TagError
from ._selection import refuse_differentiated
from ._sites import Site
from ._split import Split, is_array

__all__ = ["grad_hook_p", "patch_grad"]


def _impl(*args, n, **params):
    return list(args[:n])


def _abstract_eval(*args, n, **params):
    return list(args[:n])


def _jvp(primals, tangents, *, n, **params):
    # It evaluates as the identity on its first n operands, whatever the values after them.
    dots = [jnp.zeros(jnp.shape(p), jnp.result_type(p)) if _compat.is_zero(t) else t for p, t in zip(primals, tangents[:n])]
    return grad_hook_p.bind(*primals, n=n, **params), grad_hook_p.bind(*dots, *primals[n:], n=n, **params)


def _batch(args, dims, *, n, batched, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _compat.not_mapped)
    moved = [
        jnp.broadcast_to(a, (size, *a.shape)) if d is _compat.not_mapped else _compat.moveaxis_batched(a, d, 0)
        for a, d in zip(args, dims)
    ]
    return grad_hook_p.bind(*moved, n=n, batched=batched + 1, **params), [0] * n


def _transpose(cts, *args, n, batched, fn, with_values, tree, name, where):
    tangents, values = args[:n], args[n:]
    cts = [
        jnp.zeros(t.aval.shape, t.aval.dtype) if _compat.is_zero(ct) else ct
        for ct, t in zip(cts, tangents)
    ]

    def apply(cts, values):
        g = jax.tree_util.tree_unflatten(tree, cts)
        new = fn(g, jax.tree_util.tree_unflatten(tree, values)) if with_values else fn(g)
        return _check(new, g, name, where)

    for _ in range(batched):  # fn sees one example's cotangent, as code inside a vmap does
        apply = jax.vmap(apply)
    new = apply(list(cts), list(values))
    return [*new, *(None for _ in values)]


def _lowering(ctx, *args, n, **params):
    return list(args[:n])


def _check(new, g, name, where) -> list:
    leaves, tree = jax.tree_util.tree_flatten(new)
    g_leaves, g_tree = jax.tree_util.tree_flatten(g)
    bad = tree != g_tree or any(
        jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b) for a, b in zip(leaves, g_leaves)
    )
    if bad:
        shapes = lambda t: jax.tree_util.tree_map(lambda a: f"{jnp.result_type(a)}{list(jnp.shape(a))}", t)  # noqa: E731
        raise TagError(
            f"jaxtrace.patch_grad: the function for tag {name!r} (at {where}) returned {shapes(new)}, but the "
            f"cotangent it was given is {shapes(g)}. Return a cotangent of the same structure, shapes and dtypes."
        )
    return leaves


grad_hook_p = _compat.define_primitive(
    "jaxtrace_grad_hook",
    impl=_impl,
    abstract_eval=_abstract_eval,
    jvp=_jvp,
    batch=_batch,
    lowering=_lowering,
    transpose=_transpose,
    multiple_results=True,
)


def _hook(leaves: list, *, fn, with_values: bool, tree, name: str, where: str, batched: int) -> list:
    """``leaves`` unchanged; their tangents pass through ``grad_hook_p`` (``fn`` on cotangents)."""
    params = dict(fn=fn, with_values=with_values, tree=tree, name=name, where=where)

    @jax.custom_jvp
    def hook(*xs):
        return list(xs)

    @hook.defjvp
    def hook_jvp(primals, tangents):
        values = list(primals) if with_values else []
        return list(primals), grad_hook_p.bind(*tangents, *values, n=len(primals), batched=batched, **params)

    return hook(*leaves)


def patch_grad(fun: Callable, fns: Mapping[str, Callable], *, with_values: bool = False) -> Callable:
    """``fun`` whose reverse-mode derivatives see ``fn(g)`` in place of the cotangent ``g`` at a tag.

    The forward pass is unchanged; under ``jax.grad``, ``jax.vjp``,
    ``jax.jacrev``, ``jt.grad`` and friends the cotangent that arrives at each
    named tag is replaced by ``fn(g)`` before it flows on: in a ``lax.scan`` at
    each step, under a ``jax.vmap`` for one example. ``jt.grad`` of the patched
    function reports, at a patched tag, the cotangent that *arrives* there; the
    tags and leaves upstream see the changed one. ``jax.jvp`` sees the tangents unchanged.

    Args:
        fun: the function; it calls ``jaxtrace.tag`` inside.
        fns: ``{tag name: fn}``; ``fn`` gets and returns the tag's pytree, with
            its shapes and dtypes.
        with_values: call ``fn(g, value)``, ``value`` being the tagged forward value.

    Returns:
        A function with ``fun``'s signature and outputs.

    Raises:
        TypeError: if ``fns`` does not map strings to functions.
        TagError: when differentiated, if a name is not a tag of ``fun`` or ``fn``
            returns another structure, shape or dtype.

    Example:
        >>> import jax, jax.numpy as jnp, jaxtrace as jt
        >>> def loss(w):
        ...     h = jt.tag(3.0 * w, "h")
        ...     return h ** 2
        >>> reversed_loss = jt.patch_grad(loss, {"h": lambda g: -g})   # gradient reversal
        >>> float(jax.grad(loss)(1.0)), float(jax.grad(reversed_loss)(1.0))
        (18.0, -18.0)
    """
    check_callable(fun, "jaxtrace.patch_grad")
    fns = dict(fns)
    for name, fn in fns.items():
        if not isinstance(name, str) or not callable(fn):
            raise TypeError(
                f"jaxtrace.patch_grad: fns must map tag names (strings) to functions of the cotangent, got "
                f"{name!r}: {fn!r}. Pass e.g. {{'hidden': lambda g: -g}}."
            )

    @functools.wraps(fun)
    def patched(*args, **kwargs):
        split = Split(fun, args, kwargs, range(len(args)), list(fns), dynamic=is_array, purpose="reverse", keep=())
        refuse_differentiated(split.sites, "jaxtrace.patch_grad", "gradient", "jax.grad(jt.patch_grad(loss, ...))")
        out, values = split(split.args, None, {}, call_fn=functools.partial(_call_fn, fns, with_values))
        split.write_back(values)
        return out

    return patched


def _call_fn(fns: dict, with_values: bool, sites: list[Site], xs: list) -> list:
    """The hooked values of one ``jt.tag`` call (all its leaves), in the program's layout."""
    first = sites[0]
    counts = {len(s.batch_axes) for s in sites}
    if len(counts) > 1:
        raise TagError(
            f"jaxtrace.patch_grad: the leaves of the tag {first.name!r} (at {first.where}) are batched by "
            "different vmaps, so one example's cotangent is not defined. Tag the leaves separately."
        )
    (batched,) = counts
    # vmap axes to the front, as the hook applies fn per example; back afterwards.
    front = [jnp.moveaxis(x, s.batch_axes, tuple(range(batched))) for s, x in zip(sites, xs)]
    hooked = _hook(
        front,
        fn=fns[first.name],
        with_values=with_values,
        tree=first.tree,
        name=first.name,
        where=first.where,
        batched=batched,
    )
    return [jnp.moveaxis(h, tuple(range(batched)), s.batch_axes) for s, h in zip(sites, hooked)]
