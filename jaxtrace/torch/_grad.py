"""``jaxtrace.torch.value_and_grad`` / ``grad``: a torch module's forward and backward pass, watched.

One forward pass with the recorder's hooks on the selected modules, one backward pass with them off,
and the results as NumPy arrays.

The naming and layout of the results are described in the ``jaxtrace.torch`` package docstring;
the hooks, in ``_recorder``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .._module_tags import INPUT_SUFFIX, Where, parse_where
from ._recorder import Recorder
from ._tensors import describe, is_float_tensor, map_leaves, np_dtype, to_numpy

__all__ = ["grad", "value_and_grad"]


def value_and_grad(
    module: "torch.nn.Module",
    *args,
    loss: Callable | None = None,
    where: Where = None,
    inputs: bool = False,
    kwargs: dict | None = None,
    patch_grads: dict | None = None,
    with_values: bool = False,
) -> Any:
    """Runs ``loss(module(*args))`` and returns the loss, the parameter gradients and the gradients
    at the selected modules' outputs (and inputs), as ``jaxtrace.value_and_grad`` does on the JAX side.

    Gradients come from ``torch.autograd.grad`` (``.grad`` fields are not
    touched), with respect to every floating parameter, frozen ones included,
    and the floating tensors among ``args`` (which are not changed). The module
    runs in its current mode: call ``.eval()`` on both sides for a parity check.
    The hooks leave every value the model computes as it is and work with
    in-place modules (``ReLU(inplace=True)``); names, tuples, repeated calls,
    ``":in"``, aliasing outputs, ``torch.no_grad()`` and activation checkpointing
    are described in the ``jaxtrace.torch`` package docstring. A module output of
    a dict subclass (Hugging Face's ``ModelOutput``), NamedTuple or dataclass
    keeps its type in the forward pass; its gradient is a plain ``dict`` of its
    fields (a NamedTuple stays one).

    Args:
        module: the ``torch.nn.Module`` to run.
        *args: its positional arguments.
        loss: maps the module's output to a scalar tensor (default: the output
            is the scalar).
        where: which modules: ``None`` (all, the root ``""`` too), a path, a
            list of paths (``"name:in"`` asks for an input), a class or tuple of
            classes, or a predicate ``(path, module) -> bool``.
        inputs: also the gradients at the selected modules' inputs.
        kwargs: keyword arguments for ``module``.
        patch_grads: ``{path: fn}``: ``fn(g)`` replaces the gradient ``g`` that
            arrives at that output (or input, ``"path:in"``), as a tensor hook
            returning a new gradient does and ``jaxtrace.patch_grad`` does in
            JAX. The result reports ``g`` as it arrives; upstream sees ``fn(g)``.
        with_values: also return the values at the modules, with the keys and
            structure of ``module_grads`` (``None`` where that has ``None``), each a
            NumPy copy of the tensor as it was when the module returned (for
            ``":in"``: when it was called), so a later in-place op does not change it.

    Returns:
        ``(value, (param_grads, module_grads))``: the loss as a Python float;
        ``{named_parameters() name: gradient}``; ``{named_modules() path:
        gradient at the output}``; NumPy arrays in the module's dtypes
        (bfloat16 and float8 as ``ml_dtypes`` arrays, bit for bit, as JAX has them).
        ``with_values=True`` appends ``module_values``, as ``jaxtrace.value_and_grad`` does.

    Raises:
        TypeError: if ``module`` is not a ``torch.nn.Module`` or ``where`` is
            none of the forms above.
        ValueError: if ``loss`` (or the output) is not a scalar floating tensor,
            or a path in ``where`` / ``patch_grads`` names no module or a module
            that this forward pass never called, or a module called several times
            has outputs of different shapes or structures, or a selected output
            is a view of an input whose memory the model changes in place later,
            or the forward pass ran ``torch.utils.checkpoint`` with
            ``use_reentrant=True``.

    Example:
        >>> import torch, jaxtrace.torch as jtt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 1))
        >>> value, (params, modules) = jtt.value_and_grad(net, torch.ones(2, 3), loss=lambda y: y.sum())
        >>> sorted(modules), modules["2"].tolist(), params["0.weight"].shape
        (['', '0', '1', '2'], [[1.0], [1.0]], (4, 3))
    """
    return _value_and_grad(
        "jaxtrace.torch.value_and_grad", module, args, loss, where, inputs, kwargs, patch_grads, with_values
    )


def grad(
    module: "torch.nn.Module",
    *args,
    loss: Callable | None = None,
    where: Where = None,
    inputs: bool = False,
    kwargs: dict | None = None,
    patch_grads: dict | None = None,
    with_values: bool = False,
) -> Any:
    """The gradients of ``loss(module(*args))``: ``value_and_grad`` without the value.

    The order mirrors ``jaxtrace.grad``'s ``(grads, tag_grads)``.

    Args:
        module: the ``torch.nn.Module`` to run.
        *args: its positional arguments.
        loss: as in ``value_and_grad``.
        where: as in ``value_and_grad``.
        inputs: as in ``value_and_grad``.
        kwargs: as in ``value_and_grad``.
        patch_grads: as in ``value_and_grad``.
        with_values: as in ``value_and_grad``.

    Returns:
        ``(param_grads, module_grads)``, as ``value_and_grad`` gives them;
        ``with_values=True`` appends ``module_values``.

    Raises:
        TypeError: as ``value_and_grad``.
        ValueError: as ``value_and_grad``.

    Example:
        >>> import torch, jaxtrace.torch as jtt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
        >>> params, modules = jtt.grad(net, torch.ones(2, 3), loss=lambda y: y.sum(), where=["0", "0:in"])
        >>> list(modules), modules["0:in"].shape
        (['0:in', '0'], (2, 3))
    """
    _, grads, *values = _value_and_grad(
        "jaxtrace.torch.grad", module, args, loss, where, inputs, kwargs, patch_grads, with_values
    )
    return (*grads, *values) if with_values else grads



# --- what both do -------------------------------------------------------------


def _value_and_grad(api, module, args, loss, where, inputs, kwargs, patch_grads, with_values=False) -> Any:
    """What ``value_and_grad`` and ``grad`` do; ``api`` is the one called, which the errors name."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{api} needs a torch.nn.Module, got {type(module).__name__}.")
    named = dict(module.named_modules())
    patch_grads = dict(patch_grads or {})
    outs, ins, explicit = _select(named, where, inputs, patch_grads, api)
    recorder = Recorder(api, patch_grads, bool(with_values))
    params = dict(module.named_parameters())
    value, grads = _run(api, module, args, kwargs, loss, params, _hooked(named, outs, ins), recorder)
    param_grads = {}
    for i, (name, p) in enumerate(params.items()):
        g = None if grads is None else grads[i]
        param_grads[name] = to_numpy(g) if g is not None else np.zeros(tuple(p.shape), np_dtype(p.dtype))
    module_grads = recorder.results()
    missing = [n for n in explicit if n not in module_grads]
    if missing:
        raise ValueError(
            f"{api}: {', '.join(repr(n) for n in missing)} was selected but never called in this "
            "forward pass, so it has no gradient. Leave it out of where=."
        )
    result = (float(value.detach().reshape(()).real), (param_grads, module_grads))
    return (*result, recorder.results(values=True)) if with_values else result


def _select(named: dict, where: Where, inputs: bool, patch_grads: dict, api: str) -> tuple[set, set, list]:
    """(paths whose outputs are watched, paths whose inputs are, names asked for explicitly):
    those ``where`` and ``inputs`` select, and those ``patch_grads`` patches."""
    explicit, selected = parse_where(where, api)
    if explicit is None:
        outs = {p for p, m in named.items() if selected(p, m)}
        ins, explicit = (set(outs) if inputs else set()), []
    else:
        _check_paths(named, explicit, api, "no module at", "the root is ''; add ':in' for a module's input")
        outs = {n for n in explicit if not n.endswith(INPUT_SUFFIX)}
        ins = {n.removesuffix(INPUT_SUFFIX) for n in explicit if n.endswith(INPUT_SUFFIX)} | (outs if inputs else set())
    _check_paths(named, patch_grads, api, "patch_grads names no module at", "add ':in' for a module's input")
    outs |= {p for p in patch_grads if not p.endswith(INPUT_SUFFIX)}
    ins |= {p.removesuffix(INPUT_SUFFIX) for p in patch_grads if p.endswith(INPUT_SUFFIX)}
    return outs, ins, explicit


def _check_paths(named: dict, names, api: str, problem: str, hint: str) -> None:
    """An error naming those of ``names`` (``":in"`` allowed) that are no path of ``named``."""
    unknown = [n for n in names if n.removesuffix(INPUT_SUFFIX) not in named]
    if unknown:
        raise ValueError(
            f"{api}: {problem} {', '.join(repr(n) for n in unknown)}. The module's "
            f"named_modules() paths are: {', '.join(repr(p) for p in named)} ({hint})."
        )


def _hooked(named: dict, outs: set, ins: set) -> list:
    """``[(path, module, watch its inputs, watch its outputs)]`` for the modules watched."""
    return [(path, mod, path in ins, path in outs) for path, mod in named.items() if path in ins or path in outs]


def _run(api, module, args, kwargs, loss, params, hooked, recorder) -> tuple:
    """The forward pass with the recorder's hooks on, then backward with them off: ``(loss, grads)``,
    ``grads`` of ``params`` first (``None`` when the loss does not depend on anything)."""
    frozen = [p for p in params.values() if not p.requires_grad and (p.is_floating_point() or p.is_complex())]
    handles = []
    try:
        for p in frozen:
            p.requires_grad_(True)
        for path, mod, watch_inputs, watch_outputs in hooked:
            pre_hook, hook = recorder.hooks(path, watch_inputs, watch_outputs)
            handles.append(mod.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(mod.register_forward_hook(hook, prepend=True, with_kwargs=True))
        with torch.enable_grad():
            fresh: list = []  # leaves made for the floating tensors among the arguments
            call_args = [map_leaves(lambda x: _as_leaf(x, fresh), a) for a in args]
            call_kwargs = {k: map_leaves(lambda x: _as_leaf(x, fresh), v) for k, v in (kwargs or {}).items()}
            output = module(*call_args, **call_kwargs)
            value = _scalar_loss(api, output, loss)
            # The forward pass is over: its hooks come off before backward, where activation
            # checkpointing (torch.utils.checkpoint, Hugging Face's gradient_checkpointing_enable)
            # runs parts of it again to rebuild saved tensors; those runs are not calls.
            for h in handles:
                h.remove()
            handles.clear()
            _refuse_reentrant_checkpoint(api, value)
            wrt = [*params.values(), *fresh, *recorder.wrt]
            grads = torch.autograd.grad(value.reshape(()), wrt, allow_unused=True) if value.requires_grad else None
    finally:
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(False)
    return value, grads


def _as_leaf(x, fresh: list):
    """A floating tensor that does not require grad, differentiated through a new leaf (added to
    ``fresh``); what the module gets is a copy of the leaf, so in-place ops in forward stay legal."""
    if is_float_tensor(x) and not x.requires_grad:
        leaf = x.detach().requires_grad_(True)
        fresh.append(leaf)
        return leaf.clone()
    return x


def _scalar_loss(api: str, output, loss: Callable | None):
    """``loss(output)`` (or the output), which must be a scalar floating tensor."""
    value = output if loss is None else loss(output)
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and is_float_tensor(value)):
        raise ValueError(
            f"{api} needs a scalar floating loss; "
            + (
                f"the module returned {describe(output)}. Pass loss=, a function of the output "
                "that returns a scalar tensor."
                if loss is None
                else f"loss returned {describe(value)}."
            )
        )
    return value


def _refuse_reentrant_checkpoint(api: str, value) -> None:
    """An error if the autograd graph of ``value`` has a reentrant checkpoint's node (its backward
    runs a separate backward pass, which ``torch.autograd.grad``'s inputs are not part of)."""
    if not value.requires_grad:
        return
    seen, stack = set(), [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            raise ValueError(
                f"{api}: the forward pass ran torch.utils.checkpoint with use_reentrant=True (Hugging "
                "Face: gradient_checkpointing_kwargs={'use_reentrant': True}), whose parameters "
                "torch.autograd.grad cannot reach: their gradients would be zeros or an error. Pass "
                "use_reentrant=False (activation_checkpointing_enable({'use_reentrant': False}) in "
                "Hugging Face), or turn checkpointing off for the check."
            )
        stack.extend(n for n, _ in node.next_functions)
