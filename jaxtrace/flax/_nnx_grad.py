"""Flax NNX models: ``jaxtrace.flax.grad`` / ``value_and_grad`` / ``jacrev``, shaped like ``nnx.grad``.

``fun``'s first argument is an ``nnx.Module``; the gradient is taken with respect to its ``wrt``
state (``nnx.Param`` by default, as ``nnx.grad``). The model and every other NNX object among the
arguments (an ``nnx.Rngs`` the function draws from, a second module) are split together and
merged again inside the traced function, and the state the call changes (RNG counts of
``nnx.Dropout`` and ``nnx.Rngs``, ``nnx.BatchNorm`` statistics) is written back afterwards, as
``nnx.grad`` does: the rule of ``jaxtrace.flax._state``, which every jaxtrace transform follows.

Why not plain ``jaxtrace.grad`` on ``nnx.split`` state: a model merged inside a traced function
from state made outside it cannot update its RNG counts there (Flax raises ``TraceContextError``,
for ``jax.grad`` as for ``jaxtrace.grad``).
"""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx

from .. import _stats_option
from .._ad import grad_result
from .._frameworks import is_nnx_module
from .._checks import check_callable
from .._selection import TagSelection
from ._state import Lift

__all__ = ["value_and_grad", "grad", "jacrev"]


def _lift_model(fun: Callable, args: tuple, kwargs: dict, wrt, aux_wanted: bool, who: str):
    """``(lift, split_fun)``: ``split_fun(diff, *args, **kwargs)`` returns ``(out, (aux, changed state))``,
    ``diff`` being the model's ``wrt`` state (``lift.args[0]``); ``lift.write_back`` takes the state."""
    model = args[0] if args else None
    if not is_nnx_module(model):
        raise TypeError(
            f"Functions wrapped with jaxtrace.flax.{who} take an nnx.Module as "
            f"their first argument, but got {type(model).__name__}. For a pytree of arrays use "
            "jaxtrace.grad / jaxtrace.value_and_grad / jaxtrace.jacrev."
        )
    lift = Lift(fun, args, kwargs, wrt=wrt)

    def split_fun(*args, **kwargs):
        out, changed = lift.fun(*args, **kwargs)
        value, aux = out if aux_wanted else (out, None)
        return value, (aux, changed)

    return lift, split_fun


def value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    wrt: Any = nnx.Param,
    with_values: bool = False,
    stats: Any = None,
) -> Callable:
    """Like ``nnx.value_and_grad`` (first argument a model), and also the gradients at the tags.

    Other state that ``fun`` changes (RNG counts, batch statistics), in the
    model or in other NNX arguments (an ``nnx.Rngs`` passed to it), is written
    back into them, as ``nnx.grad`` does. Works eagerly and inside ``nnx.jit``.

    Args:
        fun: the function; its first argument is an ``nnx.Module``.
        has_aux: ``fun`` returns ``(value, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        wrt: which variables to differentiate, as in ``nnx.grad``.
        with_values: also return the forward values at the tags, from the same pass.
        stats: ``True`` or statistic names (``"norm"``): reduce each tag's gradient
            inside the traced function as ``jaxtrace.stats.value_and_grad`` does,
            keeping the tag's loop axes (one value per layer of an ``nnx.scan``
            over layers); values too, with ``with_values``.

    Returns:
        A function that returns ``(value, (grads, tag_grads))``, or with
        ``has_aux`` ``((value, aux), (grads, tag_grads))``: ``grads`` is the
        ``nnx.State`` of the model's ``wrt`` variables (what
        ``nnx.Optimizer.update(model, grads)`` takes), ``tag_grads`` the dict
        of ``jaxtrace.value_and_grad`` (``{name: {stat: array}}`` with
        ``stats=``); ``with_values=True`` appends ``tag_values``.

    Raises:
        TypeError: if ``fun`` is not callable; when called, if its first
            argument is not an ``nnx.Module``.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt, jaxtrace.flax
        >>> from flax import nnx
        >>> class Net(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.dense = nnx.Linear(3, 2, rngs=rngs)
        ...         self.drop = nnx.Dropout(0.5, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.drop(self.dense(x))
        >>> model = jt.tag_modules(Net(nnx.Rngs(0)), ["dense"])
        >>> loss, (grads, tag_grads) = jaxtrace.flax.value_and_grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones(3))
        >>> sorted(grads), tag_grads["dense"].shape
        (['dense'], (2,))
    """
    check_callable(fun, "jaxtrace.flax.value_and_grad")
    aux_wanted = bool(has_aux)
    names = _stats_option.stat_names(stats)

    def value_and_grad_fun(*args, **kwargs):
        lift, split_fun = _lift_model(fun, args, kwargs, wrt, aux_wanted, "grad or jaxtrace.flax.value_and_grad")
        transform = _stats_option.value_and_grad(
            split_fun, 0, has_aux=True, tags=tags, with_values=with_values, stats=names
        )
        (value, (aux, changed)), grads, *values = transform(*lift.args, **lift.kwargs)
        lift.write_back(changed)
        return (((value, aux) if aux_wanted else value), grads, *values)

    return value_and_grad_fun


def grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    wrt: Any = nnx.Param,
    with_values: bool = False,
    stats: Any = None,
) -> Callable:
    """Like ``nnx.grad`` (first argument a model), and also the gradients at the tags.

    Args:
        fun: the function; its first argument is an ``nnx.Module``.
        has_aux: ``fun`` returns ``(value, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        wrt: which variables to differentiate, as in ``nnx.grad``.
        with_values: also return the forward values at the tags.
        stats: summarise per tag, as in ``jaxtrace.flax.value_and_grad``.

    Returns:
        A function that returns ``(grads, tag_grads)``, or with ``has_aux``
        ``((grads, tag_grads), aux)``; ``with_values=True`` appends
        ``tag_values``; see ``jaxtrace.flax.value_and_grad``.

    Raises:
        TypeError: as ``jaxtrace.flax.value_and_grad``.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt, jaxtrace.flax
        >>> from flax import nnx
        >>> model = jt.tag_modules(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        >>> grads, tag_grads = jaxtrace.flax.grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones(3))
        >>> grads["kernel"].shape, tag_grads[""].tolist()
        ((3, 2), [1.0, 1.0])
    """
    check_callable(fun, "jaxtrace.flax.grad")
    value_and_grad_fun = value_and_grad(fun, has_aux=has_aux, tags=tags, wrt=wrt, with_values=with_values, stats=stats)

    def grad_fun(*args, **kwargs):
        return grad_result(value_and_grad_fun(*args, **kwargs), has_aux)

    return grad_fun


def jacrev(
    fun: Callable,
    *,
    has_aux: bool = False,
    tags: TagSelection = None,
    wrt: Any = nnx.Param,
    stats: Any = None,
    param_stats: bool = False,
) -> Callable:
    """``jaxtrace.jacrev`` for an NNX model (first argument), differentiated as ``nnx.grad`` does.

    Which loss term reaches which layer: ``fun`` returns a pytree of loss
    terms; with ``stats=`` each tag's Jacobian is reduced per term inside the
    traced function, as ``jaxtrace.stats.jacrev`` does. State the call changes
    (RNG counts, batch statistics, in the model or an ``nnx.Rngs`` argument) is written back.

    Args:
        fun: the function; its first argument is an ``nnx.Module``.
        has_aux: ``fun`` returns ``(out, aux)``.
        tags: which tags, as in ``jaxtrace.value_and_grad``.
        wrt: which variables to differentiate, as in ``nnx.grad``.
        stats: ``None`` for the full Jacobians; ``True`` or statistic names
            (``"norm"``) for the table of ``jaxtrace.stats.jacrev``.
        param_stats: with ``stats=``, reduce ``jac`` too: the table
            ``{parameter: {term: {stat: array}}}`` in its place (parameters named
            by dotted paths, ``"0.kernel"``): which loss term reaches which parameter.

    Returns:
        A function that returns ``(jac, tag_jacs)``, or with ``has_aux``
        ``((jac, tag_jacs), aux)``: ``jac`` has the output's structure, each
        leaf an ``nnx.State`` of the ``wrt`` variables; ``tag_jacs`` is what
        ``jaxtrace.jacrev`` returns, or with ``stats=`` the table
        ``{tag: {term: {stat: array}}}`` that ``jaxtrace.stats.format_paths`` prints.

    Raises:
        TypeError: as ``jaxtrace.flax.value_and_grad``.
        ValueError: if a name in ``stats`` is not in ``jaxtrace.stats.STATS``.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt, jaxtrace.flax
        >>> from flax import nnx
        >>> model = jt.tag_modules(nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 1, rngs=nnx.Rngs(1))))
        >>> def losses(model, x):
        ...     out, acts = jt.capture(model)(x)
        ...     return {"main": jnp.sum(out ** 2), "aux": jnp.sum(acts["0"] ** 2)}
        >>> _, table = jaxtrace.flax.jacrev(losses, stats="norm")(model, jnp.ones(2))
        >>> [name for name in table if float(table[name]["aux"]["norm"]) > 0]  # aux reaches layer 0 only
        ['0']
    """
    check_callable(fun, "jaxtrace.flax.jacrev")
    aux_wanted = bool(has_aux)
    names = _stats_option.stat_names(stats)
    param_stats = _stats_option.check_param_stats(param_stats, names, "jaxtrace.flax.jacrev")

    def jacrev_fun(*args, **kwargs):
        lift, split_fun = _lift_model(fun, args, kwargs, wrt, aux_wanted, "jacrev")
        transform = _stats_option.jacrev(split_fun, 0, has_aux=True, tags=tags, stats=names, param_stats=param_stats)
        result, (aux, changed) = transform(*lift.args, **lift.kwargs)
        lift.write_back(changed)
        return (result, aux) if aux_wanted else result

    return jacrev_fun
