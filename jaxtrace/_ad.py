"""Reverse mode: ``value_and_grad`` does the work; ``grad``, ``vjp`` and ``jacrev`` share its split.

The function is traced once; each selected tag ``y = tag(x)`` becomes
``y = perturb(x, eps)`` with ``eps`` a new input held at zero, and
``jax.value_and_grad`` / ``jax.vjp`` of the split program give the cotangent
of ``eps``, which is the gradient at the tagged value.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from . import _compat
from ._perturb import perturb
from ._checks import check_callable, normalize_argnums
from ._leaves import check_nnx_differentiable
from ._selection import Selection, TagSelection
from ._sites import Site
from ._split import Split

__all__ = [
    "value_and_grad",
    "grad",
    "vjp",
    "jacrev",
    "value_and_grad_with_sites",
    "split_for_reverse",
    "grad_result",
]


def _perturb_site(site: Site, x, eps):
    return x if eps is None else perturb(x, eps)


def _zero_inputs(sites) -> dict:
    """``{key: zeros}`` for the differentiable sites, one array per shape and dtype.

    ``perturb`` never reads its ``eps`` (only its tangent matters), so sites of
    the same shape can share one zeros value: ``jax.vjp`` still gives each
    input its own cotangent. One ``jnp.zeros`` per site was the largest
    per-tag cost of tracing.
    """
    made: dict = {}
    out = {}
    for site in sites:
        if site.differentiable:
            kind = (site.shape, site.dtype, _compat.sharding_key(site.aval))
            if kind not in made:
                made[kind] = site.zeros()
            out[site.key] = made[kind]
    return out


def split_for_reverse(
    fun, args, kwargs, argnums, tags, has_aux, with_values, *, dynamic=None, api="jaxtrace.grad, value_and_grad or vjp"
):
    """The split function for reverse mode: ``(split, run, eps)`` with ``run(args, eps) -> (out, (aux,
    tag_values))`` on the differentiated arguments and ``eps`` its zeros at the sites.

    ``dynamic(leaf)`` picks the leaves to trace (default: every leaf, checked to be arrays);
    ``api`` names the caller in the error for a ``has_aux`` function that returns no pair.
    """
    if dynamic is None:
        split = Split(fun, args, kwargs, argnums, tags)
    else:
        split = Split(fun, args, kwargs, argnums, tags, dynamic=dynamic)
    eps = _zero_inputs(split.sites)
    outputs = split.keys if with_values else ()

    def run(diff_args, eps):
        result, values = split(diff_args, _perturb_site, eps, outputs)
        if not has_aux:
            return result, (None, values)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError(
                "expected function with aux output to return a two-element tuple, but got type "
                f"{type(result)} with value {result}. This comes from {api} "
                "with has_aux=True, which (as jax.grad) expects the function to return (output, aux): "
                "return such a pair, or drop has_aux=True."
            )
        out, aux = result
        return out, (aux, values)

    return split, run, eps


def grad_result(value_and_grad_result: tuple, has_aux: bool) -> tuple:
    """What ``grad`` returns from what ``value_and_grad`` returned: ``(grads, tag_grads)`` (with
    ``has_aux`` ``((grads, tag_grads), aux)``), anything appended (``with_values``) kept last."""
    value, grads, *values = value_and_grad_result
    result = (grads, value[1]) if has_aux else grads  # grads is (grads, tag_grads)
    return (*result, *values)


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    with_values: bool = False,
    holomorphic: bool = False,
) -> Callable:
    """Like ``jax.value_and_grad``, and also the gradients at the tags in ``fun``.

    ``tag_grads`` is ``{name: gradient at the tagged value}``, each with the
    tagged value's structure, shape and dtype, plus leading axes for loops and
    ``vmap`` (the layout rule in *Concepts*).

    Args:
        fun: the function to differentiate; it calls ``jaxtrace.tag`` inside.
        argnums: which positional arguments to differentiate, as in ``jax.grad``.
        has_aux: ``fun`` returns ``(value, aux)``, as in ``jax.grad``.
        tags: which tags: ``None`` (all), a name, a sequence of names, or a
            predicate on names.
        with_values: also return the forward values at the tags, from the same pass.
        holomorphic: ``jax.grad``'s, for a holomorphic ``fun`` of complex inputs and tags.

    Returns:
        A function with ``fun``'s signature that returns ``(value, (grads,
        tag_grads))``, or with ``has_aux`` ``((value, aux), (grads, tag_grads))``;
        ``grads`` is what ``jax.grad`` returns. With ``with_values`` the values
        are appended: ``(value, (grads, tag_grads), tag_values)``.

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` / ``argnums`` is of the wrong kind.
        TagError: when called, if a name in ``tags`` is not a tag of ``fun``, or a
            tag sits where a gradient cannot exist (a ``while_loop``, inside a
            ``custom_vjp`` function).

    Example:
        >>> import jax, jax.numpy as jnp, jaxtrace as jt
        >>> def loss(w, x):
        ...     h = jt.tag(x @ w, "h")
        ...     return jnp.sum(jnp.tanh(h))
        >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
        >>> value, (g_w, tag_grads) = jax.jit(jt.value_and_grad(loss))(w, x)
        >>> tag_grads["h"].shape
        (4, 2)
    """
    check_callable(fun, "jaxtrace.value_and_grad")
    fun_with_sites = value_and_grad_with_sites(
        fun, argnums, has_aux=has_aux, tags=tags, with_values=with_values, holomorphic=holomorphic
    )

    @functools.wraps(fun)
    def value_and_grad_fun(*args, **kwargs):
        return fun_with_sites(*args, **kwargs)[0]

    return value_and_grad_fun


def value_and_grad_with_sites(
    fun: Callable, argnums, *, has_aux: bool, tags: TagSelection, with_values: bool = False, holomorphic: bool = False
) -> Callable:
    """``value_and_grad(fun, ...)``, returning ``(its result, the sites it split)``: for callers that
    need each tag's layout (loop and batch axes), as ``jaxtrace.stats.value_and_grad`` does."""
    tags = Selection.of(tags)  # tags= read once, when the function is wrapped
    nums = normalize_argnums(argnums)

    def fun_with_sites(*args, **kwargs):
        check_nnx_differentiable(args, nums, "jt.grad, jt.value_and_grad, jt.stats.value_and_grad")
        split, run, eps = split_for_reverse(fun, args, kwargs, nums, tags, has_aux, with_values)
        (value, (aux, values)), (g_args, g_eps) = jax.value_and_grad(
            run, argnums=(0, 1), has_aux=True, holomorphic=holomorphic
        )(split.args, eps)
        split.write_back(values)
        grads = g_args[0] if isinstance(argnums, int) else g_args
        result = ((value, aux) if has_aux else value, (grads, split.tag_tree(g_eps)))
        return ((*result, split.tag_tree(values)) if with_values else result), split.sites

    return fun_with_sites


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    with_values: bool = False,
    holomorphic: bool = False,
) -> Callable:
    """Like ``jax.grad``, and also the gradients at the tags in ``fun``.

    Args:
        fun: the function to differentiate; it calls ``jaxtrace.tag`` inside.
        argnums: which positional arguments to differentiate (an int or a tuple
            of ints), as in ``jax.grad``.
        has_aux: ``fun`` returns ``(value, aux)``, as in ``jax.grad``.
        tags: which tags: ``None`` (all), a name, a sequence of names, or a
            predicate on names.
        with_values: also return the forward values at the tags, from the same pass.
        holomorphic: ``jax.grad``'s, for a holomorphic ``fun`` of complex inputs and tags.

    Returns:
        A function that returns ``(grads, tag_grads)``, or with ``has_aux``
        ``((grads, tag_grads), aux)``; ``with_values=True`` appends the forward
        values at the tags.

    Raises:
        TypeError: if ``fun`` is not callable or ``tags`` / ``argnums`` is of the wrong kind.
        TagError: when called, if a name in ``tags`` is not a tag of ``fun``, or a
            tag sits where a gradient cannot exist (a ``while_loop``, inside a
            ``custom_vjp`` function).

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> def loss(w):
        ...     h = jt.tag(3.0 * w, "h")
        ...     return h ** 2
        >>> grads, tag_grads = jt.grad(loss)(1.0)
        >>> float(grads), float(tag_grads["h"])
        (18.0, 6.0)
    """
    check_callable(fun, "jaxtrace.grad")
    value_and_grad_fun = value_and_grad(
        fun, argnums, has_aux=has_aux, tags=tags, with_values=with_values, holomorphic=holomorphic
    )

    @functools.wraps(fun)
    def grad_fun(*args, **kwargs):
        return grad_result(value_and_grad_fun(*args, **kwargs), has_aux)

    return grad_fun


def vjp(fun: Callable, *primals: Any, has_aux: bool = False, tags: TagSelection = None, with_values: bool = False):
    """Like ``jax.vjp``, and the pullback also gives the cotangents at the tags.

    Args:
        fun: the function to linearize; it calls ``jaxtrace.tag`` inside.
        *primals: the point to linearize at.
        has_aux: ``fun`` returns ``(out, aux)``.
        tags: which tags, as in ``value_and_grad``.
        with_values: also return the forward values at the tags.

    Returns:
        ``(out, vjp_fn)``, or with ``has_aux`` ``(out, vjp_fn, aux)``;
        ``vjp_fn(ct)`` returns ``(primal_cts, tag_cts)``: the tuple ``jax.vjp``'s
        pullback returns, and ``{name: cotangent}``. ``vjp_fn`` is linear and can
        be ``jax.vmap``-ed (rows of a Jacobian). ``with_values=True`` appends the
        forward values at the tags.

    Raises:
        TypeError: as ``value_and_grad``.
        TagError: as ``value_and_grad``.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> def f(x):
        ...     h = jt.tag(2.0 * x, "h")
        ...     return jnp.sin(h)
        >>> out, vjp_fn = jt.vjp(f, jnp.zeros(3))
        >>> (x_ct,), tag_cts = vjp_fn(jnp.ones(3))
        >>> tag_cts["h"].tolist(), x_ct.tolist()
        ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    """
    check_callable(fun, "jaxtrace.vjp")
    split, run, eps = split_for_reverse(fun, primals, {}, tuple(range(len(primals))), tags, has_aux, with_values)
    out, pullback, (aux, values) = jax.vjp(run, split.args, eps, has_aux=True)
    split.write_back(values)
    vjp_fn = jax.tree_util.Partial(functools.partial(_split_cotangents, split.tag_tree), pullback)
    result = (out, vjp_fn, aux) if has_aux else (out, vjp_fn)
    return (*result, split.tag_tree(values)) if with_values else result


def _cut(x, start, size, axis: int):
    """``size`` entries of ``x`` from ``start`` along ``axis`` (sizes may be symbolic)."""
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)


def _split_cotangents(tag_tree, pullback, ct):
    primal_cts, eps_cts = pullback(ct)
    return primal_cts, tag_tree(eps_cts)


def jacrev(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    with_values: bool = False,
) -> Callable:
    """Like ``jax.jacrev``, and also the Jacobians at the tags: which output reaches which tag.

    One forward pass; the pullback is ``jax.vmap``-ed over the output's basis,
    as in ``jax.jacrev``.

    Args:
        fun: the function; it calls ``jaxtrace.tag`` inside.
        argnums: as in ``jax.jacrev``.
        has_aux: ``fun`` returns ``(out, aux)``.
        tags: which tags, as in ``value_and_grad``.
        with_values: also return the forward values at the tags.

    Returns:
        A function that returns ``(jac, tag_jacs)``, or with ``has_aux``
        ``((jac, tag_jacs), aux)``; ``with_values=True`` appends the values.
        ``jac`` is what ``jax.jacrev(fun, argnums)`` returns; ``tag_jacs[name]``
        has the output's pytree structure, each leaf the tagged value's pytree of
        arrays of shape ``output_leaf.shape + tag_shape``.

    Raises:
        TypeError: as ``value_and_grad``.
        TagError: as ``value_and_grad``.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> def losses(w):
        ...     h = jt.tag(w * jnp.arange(3.0), "h")
        ...     return {"main": jnp.sum(h), "aux": jnp.sum(jnp.sin(jax.lax.stop_gradient(h)))}
        >>> import jax
        >>> jac, tag_jacs = jt.jacrev(losses)(2.0)
        >>> tag_jacs["h"]["main"].tolist(), tag_jacs["h"]["aux"].tolist()  # aux does not reach h
        ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    """
    check_callable(fun, "jaxtrace.jacrev")
    tags = Selection.of(tags)  # tags= read once, when the function is wrapped
    nums = normalize_argnums(argnums)

    @functools.wraps(fun)
    def jacrev_fun(*args, **kwargs):
        check_nnx_differentiable(args, nums, "jt.jacrev, jt.stats.jacrev")
        split, run, eps = split_for_reverse(fun, args, kwargs, nums, tags, has_aux, with_values)
        out, pullback, (aux, values) = jax.vjp(run, split.args, eps, has_aux=True)
        split.write_back(values)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        _check_real_outputs(out_leaves)
        basis, starts, sizes = _output_basis(out_leaves)
        g_args, g_eps = jax.vmap(pullback)(jax.tree_util.tree_unflatten(out_tree, basis))
        g_args = g_args[0] if isinstance(argnums, int) else g_args
        rows = functools.partial(_rows, starts=starts, sizes=sizes)
        shapes = [jnp.shape(leaf) for leaf in out_leaves]
        jac = jax.tree_util.tree_unflatten(out_tree, [rows(g_args, i, s) for i, s in enumerate(shapes)])
        per_leaf = [split.tag_tree(rows(g_eps, i, s), lead=s) for i, s in enumerate(shapes)]
        tag_jacs = {
            name: jax.tree_util.tree_unflatten(out_tree, [leaf_jacs[name] for leaf_jacs in per_leaf])
            for name in (per_leaf[0] if per_leaf else {})
        }
        result = ((jac, tag_jacs), aux) if has_aux else (jac, tag_jacs)
        return (*result, split.tag_tree(values)) if with_values else result

    return jacrev_fun


def _check_real_outputs(out_leaves: list) -> None:
    for leaf in out_leaves:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(
                f"jaxtrace.jacrev needs real floating-point outputs, as jax.jacrev does, but got an output of "
                f"dtype {jnp.result_type(leaf)}. Cast it, or leave it out of the differentiated output."
            )


def _output_basis(out_leaves: list) -> tuple[list, list, list]:
    """``(cotangents, starts, sizes)``: the standard basis of the output space, as ``jax.jacrev``
    builds it, one cotangent per output leaf with the basis rows in front.

    One eye in the promoted dtype, split per leaf and cast back to each leaf's dtype. Sizes stay
    symbolic under jax.export (math.prod), and a size-0 leaf gets no rows.
    """
    sizes = [math.prod(jnp.shape(leaf)) for leaf in out_leaves]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    basis = jnp.eye(total, dtype=jnp.result_type(*out_leaves))
    cts = [
        _cut(basis, start, size, axis=1).reshape(total, *jnp.shape(leaf)).astype(jnp.result_type(leaf))
        for start, size, leaf in zip(starts, sizes, out_leaves)
    ]
    return cts, starts, sizes


def _rows(tree, i: int, shape: tuple, *, starts: list, sizes: list):
    """The rows of output leaf ``i`` in the pulled-back ``tree``, with the leaf's ``shape`` in front."""
    return jax.tree_util.tree_map(lambda g: _cut(g, starts[i], sizes[i], 0).reshape(*shape, *g.shape[1:]), tree)
