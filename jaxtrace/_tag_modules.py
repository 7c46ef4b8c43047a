"""``jaxtrace.tag_modules``: the dispatcher to each framework's room.

It sits above the framework rooms (``_equinox``, ``flax/_nnx``), which build on the shared
pieces in ``_module_tags``; so no framework room imports back up into it.
"""

from __future__ import annotations

from typing import Any, Callable

from ._equinox import tag_equinox
from ._frameworks import is_equinox_module, is_linen_module, is_nnx_module
from ._module_tags import Where

__all__ = ["tag_modules", "tag_module_calls"]


def tag_modules(model: Any, where: Where = None, *, inputs: bool = False) -> Any:
    """A copy of ``model`` whose submodules tag their outputs, named as in PyTorch.

    Each selected module's ``__call__`` output is tagged (``jaxtrace.tag``)
    under its path in the style of ``torch.nn.Module.named_modules()``:
    attribute names joined by dots, list, tuple and dict entries by index or
    key (``"layers.0"``, ``"blocks.1.attn"``), the children of an
    ``eqx.nn.Sequential`` / ``nnx.Sequential`` by index alone (``"0"``), the
    root ``""``. A module called several times gives its calls stacked on a
    leading axis in call order; calls inside ``lax.scan`` / ``nnx.scan`` are
    stacked per step. A tag holds what the module's ``__call__`` returns and
    nothing its parent does with it: on ``eqx.nn.MLP``, ``"layers.0"`` is the
    first ``Linear``'s output *before* the activation (which the MLP applies),
    and the activation's output is ``"layers.1:in"`` (``inputs=True``).

    ``model`` itself is not changed. The copy holds the same parameter arrays
    in the same order, and its modules are instances of subclasses of the
    original classes, so it is another pytree structure: for an equinox
    model, its gradients do not fit an optimiser state made from the original
    (an NNX model's ``nnx.state`` is the same tree). In a training loop that
    holds the untagged model, tag inside the transform instead:
    ``jt.filter_value_and_grad(loss, tag_modules=True)``. What is tagged for each
    kind of output and state, and the Flax NNX details, are in the guides
    (*Equinox models*, *Flax models*); for Linen see ``jaxtrace.flax.tag_modules``.

    Args:
        model: an ``equinox.Module`` or a Flax ``nnx.Module``.
        where: which modules: ``None`` (every module with a ``__call__``, the
            root too), a path, a list of paths, a class or tuple of classes
            (their instances: ``jt.tag_modules(model, jt.HookPoint)``), or a
            predicate ``(path, module) -> bool``.
        inputs: also tag each selected module's positional array arguments,
            as ``"<path>:in"`` (one argument as it is, several as a tuple;
            ``eqx.nn.State`` arguments and keyword arguments are not tagged).

    Returns:
        The tagged copy, of the same type as ``model``.

    Raises:
        TypeError: if ``model`` is not an equinox or NNX module (a Linen module
            is tagged while it runs, with ``jaxtrace.flax.tag_modules``), or
            ``where`` is none of the forms above.
        ValueError: if ``where`` names a path that is not a callable module.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> mlp = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> model = jt.tag_modules(mlp, ["layers.0", "layers.1"], inputs=True)
        >>> grads, tag_grads = jt.filter_grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones(3))
        >>> {name: g.shape for name, g in tag_grads.items()}
        {'layers.0:in': (3,), 'layers.0': (8,), 'layers.1:in': (8,), 'layers.1': (8,)}
    """
    return tag_module_calls(model, where, inputs=inputs)


def tag_module_calls(
    model: Any,
    where: Where = None,
    *,
    inputs: bool = False,
    params_of: Callable | None = None,
    scope=None,
    api: str = "jaxtrace.tag_modules",
) -> Any:
    """``tag_modules``, and with ``params_of(module) -> attribute names`` each selected module also marks
    those parameters where it reads them (``ModuleTag.params``); ``scope``: the tags are a transform's
    own (``_tag.scoped``), found only while it traces; ``api``: the public call the errors name."""
    if is_nnx_module(model):
        from .flax._nnx import tag_modules as tag_nnx  # imports Flax, which an nnx model has loaded

        return tag_nnx(model, where, inputs=inputs, params_of=params_of, scope=scope, api=api)
    if is_linen_module(model):
        raise TypeError(
            f"{api} got a Flax Linen module. Linen modules hold no parameters to copy, so "
            "they are tagged while they run: `with jaxtrace.flax.tag_modules(): "
            "jt.grad(lambda p, x: loss(model.apply(p, x)))(params, x)`."
        )
    if not is_equinox_module(model):
        raise TypeError(
            f"{api} needs an equinox.Module or a Flax nnx.Module, but got {type(model).__name__}. "
            "Pass the model itself (e.g. an eqx.nn.MLP, an nnx.Linear or your own module subclass)."
        )
    return tag_equinox(model, where, inputs=inputs, params_of=params_of, scope=scope, api=api)
