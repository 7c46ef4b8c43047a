"""``jaxtrace.torch.value_and_grad`` / ``grad``: the gradients at a torch module's outputs and inputs.

Forward hooks put a tensor hook on a copy of each watched value (see ``Recorder``);
``torch.autograd.grad`` then fills them in. The naming and layout of the results
are described in the ``jaxtrace.torch`` package docstring.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch

from .._module_tags import INPUT_SUFFIX, Where, parse_where
from ._tensors import describe, flatten, is_float_tensor, map_leaves, np_dtype, to_numpy


@dataclasses.dataclass
class Call:
    """One call of one hooked site: the tensors' shapes and, after backward, their gradients."""

    unflatten: Callable  # rebuilds the nest with plain containers (dict for a ModelOutput)
    shapes: list  # per leaf: (shape, numpy dtype) or None when the leaf has no gradient
    grads: list  # per leaf: np.ndarray once its hook fired
    values: list = dataclasses.field(default_factory=list)  # with_values: per leaf, a copy at the call

    def result(self) -> Any:
        leaves = []
        for info, g in zip(self.shapes, self.grads):
            if info is None:
                leaves.append(None)
            else:
                leaves.append(g if g is not None else np.zeros(info[0], info[1]))
        return self.unflatten(leaves)

    def value(self) -> Any:
        return self.unflatten([None if info is None else v for info, v in zip(self.shapes, self.values)])


class Recorder:
    """Forward hooks that register tensor hooks, and the tensors autograd must reach.

    Where the hook goes decides which uses of a value count. The gradient at a module's
    output must count the uses of the value the module returned, from the point where it
    returned, and the gradient at its input the uses inside that call: what
    ``register_full_backward_hook`` calls ``grad_output`` and ``grad_input``, and what a
    ``jt.tag`` at the same place gives. A tensor hook on the tensor object itself would
    also count its other uses (attention probabilities used inside the module and also
    returned; a module's input also read by a residual branch). So each watched tensor is
    replaced by a copy (``clone``, an identity for autograd; not a view, since in-place
    operations on a view drop the hooks on it, which is also why full backward hooks fail
    on an in-place ReLU) and the hook goes on the copy. A tensor hook registered before an
    in-place operation sees the gradient at the value before it, as wanted.

    In-place modules get special care so that code relying on the in-place change keeps
    working and its effect is counted: an output that is one of the call's inputs, changed
    in place during the call, is hooked as it is (every later use of that tensor, through
    any reference, is a use of this output); an input copy that the module changed in place
    is written back into the caller's tensor (recorded by autograd).
    """

    def __init__(self, api: str, patch_grads: dict | None = None, with_values: bool = False):
        self.api = api  # the public function called, which the error messages name
        self.with_values = with_values  # keep a NumPy copy of each watched tensor as the module saw it
        self.patch_grads = dict(patch_grads or {})  # name -> fn: the hook returns fn(g), as jt.patch_grad
        self.calls: dict[str, list[Call]] = {}
        self.wrt: list = []  # extra inputs of autograd.grad: leaves made for constants, gradient edges
        self._frames: dict[int, list] = {}  # per module: the calls in progress (a stack, for recursion)
        self._edge = getattr(getattr(torch.autograd, "graph", None), "get_gradient_edge", None)

    def _watch(self, name: str, value, in_place: Callable = lambda t: False) -> tuple[Any, list]:
        """Hook every floating tensor in ``value``; returns the value to use and ``[(old, new)]``."""
        leaves, unflatten = flatten(value)  # keeps ModelOutput, NamedTuple, dataclass types
        call = Call(flatten(value, plain=True)[1], [None] * len(leaves), [None] * len(leaves), [None] * len(leaves))
        swaps = []
        new_leaves = list(leaves)
        for i, leaf in enumerate(leaves):
            if not is_float_tensor(leaf):
                continue
            if leaf.requires_grad and in_place(leaf):
                alias = leaf
            elif leaf.requires_grad:
                alias = leaf.clone()
                swaps.append((leaf, alias))
            else:
                # A constant (made inside forward, or an input without requires_grad):
                # differentiate it through a fresh leaf.
                fresh = leaf.detach().requires_grad_(True)
                self.wrt.append(fresh)
                alias = fresh.clone()
                swaps.append((leaf, alias))
            if self._edge is not None and alias.requires_grad:
                # Make autograd run the node that feeds this hook even when it lies on no path
                # to a parameter or an input (a value that depends only on some other leaf).
                self.wrt.append(self._edge(alias))
            call.shapes[i] = (tuple(alias.shape), np_dtype(alias.dtype))
            if self.with_values:  # a copy now: a later in-place op on the tensor does not change it
                call.values[i] = to_numpy(alias)
            alias.register_hook(_store(call, i, self.api, self.patch_grads.get(name)))
            new_leaves[i] = alias
        self.calls.setdefault(name, []).append(call)
        return (unflatten(new_leaves) if swaps else value), swaps

    def hooks(self, path: str, inputs: bool, outputs: bool) -> tuple[Callable, Callable]:
        """A forward pre-hook and a forward hook for the module at ``path``."""

        def pre_hook(module, args):
            swaps, new_args = [], None
            if inputs:
                value = args[0] if len(args) == 1 else tuple(args)
                new, swaps = self._watch(path + INPUT_SUFFIX, value)
                if swaps:
                    new_args = (new,) if len(args) == 1 else tuple(new)
            seen = {id(t): (t, t._version) for t in flatten(list(new_args or args))[0] if isinstance(t, torch.Tensor)}
            self._frames.setdefault(id(module), []).append((seen, [(old, a, a._version) for old, a in swaps]))
            return new_args

        def hook(module, args, output):
            seen, swaps = self._frames[id(module)].pop()

            def in_place(t):
                old = seen.get(id(t))
                return old is not None and old[0] is t and t._version != old[1]

            # Input copies the module changed in place: the caller's tensor gets the change.
            for old, alias, version in swaps:
                if alias._version != version:
                    old.copy_(alias)
            if outputs:
                new, changed = self._watch(path, output, in_place)
                return new if changed else None
            return None

        return pre_hook, hook

    def results(self, values: bool = False) -> dict:
        """``{name: gradient}``, or with ``values=True`` ``{name: value}``, calls stacked."""
        out = {}
        for name, calls in self.calls.items():
            per_call = [c.value() if values else c.result() for c in calls]
            out[name] = per_call[0] if len(per_call) == 1 else _stack_calls(self.api, name, calls, per_call)
        return out


def _store(call: Call, i: int, api: str, fn: Callable | None = None):
    def hook(g):
        call.grads[i] = to_numpy(g)  # the hook fires once, with the total gradient (as it arrives)
        if fn is not None:
            new = fn(g)
            if not (isinstance(new, torch.Tensor) and new.shape == g.shape and new.dtype == g.dtype):
                raise ValueError(
                    f"{api}: a patch_grads function returned {describe(new)} for a gradient of "
                    f"{describe(g)}. Return a tensor of the same shape and dtype."
                )
            return new
        return None

    return hook


def _stack_calls(api: str, name: str, calls: list, values: list):
    first = calls[0]
    for c in calls[1:]:
        if c.shapes != first.shapes:
            shapes = "; ".join(str([s[0] if s else None for s in cc.shapes]) for cc in calls)
            raise ValueError(
                f"{api}: the module {name!r} was called {len(calls)} times with different "
                f"output shapes or structures ({shapes}), so its calls cannot be stacked. Leave it out "
                "with where=, or give each call its own module."
            )
    leaves = [flatten(v)[0] for v in values]
    stacked = [None if first.shapes[i] is None else np.stack([lv[i] for lv in leaves]) for i in range(len(leaves[0]))]
    return flatten(values[0])[1](stacked)


# --- selection ----------------------------------------------------------------


def _select(named: dict, where: Where, inputs: bool, api: str) -> tuple[set, set, list]:
    """(paths whose outputs are watched, paths whose inputs are, names asked for explicitly)."""
    explicit, selected = parse_where(where, api)
    if explicit is None:
        outs = {p for p, m in named.items() if selected(p, m)}
        return outs, (set(outs) if inputs else set()), []
    unknown = [n for n in explicit if n.removesuffix(INPUT_SUFFIX) not in named]
    if unknown:
        known = ", ".join(repr(p) for p in named)
        raise ValueError(
            f"{api}: no module at {', '.join(repr(n) for n in unknown)}. The module's "
            f"named_modules() paths are: {known} (the root is ''; add ':in' for a module's input)."
        )
    outs = {n for n in explicit if not n.endswith(INPUT_SUFFIX)}
    ins = {n.removesuffix(INPUT_SUFFIX) for n in explicit if n.endswith(INPUT_SUFFIX)}
    return outs, ins | (outs if inputs else set()), explicit


# --- the public functions -----------------------------------------------------


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
    Forward hooks put a tensor hook on a copy of each output (an identity for
    autograd), which works with in-place modules (``ReLU(inplace=True)``) where
    ``register_full_backward_hook`` does not. Names, tuples, repeated calls and
    ``":in"`` are described in the ``jaxtrace.torch`` package docstring. A
    module output of a dict subclass (Hugging Face's ``ModelOutput``),
    NamedTuple or dataclass keeps its type in the forward pass, so the code
    that reads it runs as without hooks; its gradient is a plain ``dict`` of its
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
        gradient at the output}``; NumPy arrays in the module's dtypes.
        ``with_values=True`` appends ``module_values``, as ``jaxtrace.value_and_grad`` does.

    Raises:
        TypeError: if ``module`` is not a ``torch.nn.Module`` or ``where`` is
            none of the forms above.
        ValueError: if ``loss`` (or the output) is not a scalar floating tensor,
            or a path in ``where`` / ``patch_grads`` names no module or a module
            that this forward pass never called.

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


def _value_and_grad(api, module, args, loss, where, inputs, kwargs, patch_grads, with_values=False) -> Any:
    """What ``value_and_grad`` and ``grad`` do; ``api`` is the one called, which the errors name."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{api} needs a torch.nn.Module, got {type(module).__name__}.")
    named = dict(module.named_modules())
    outs, ins, explicit = _select(named, where, inputs, api)
    patch_grads = dict(patch_grads or {})
    unknown = [p for p in patch_grads if p.removesuffix(INPUT_SUFFIX) not in named]
    if unknown:
        raise ValueError(
            f"{api}: patch_grads names no module at {', '.join(map(repr, unknown))}. The module's "
            f"named_modules() paths are: {', '.join(map(repr, named))} (add ':in' for a module's input)."
        )
    outs |= {p for p in patch_grads if not p.endswith(INPUT_SUFFIX)}
    ins |= {p.removesuffix(INPUT_SUFFIX) for p in patch_grads if p.endswith(INPUT_SUFFIX)}
    recorder = Recorder(api, patch_grads, bool(with_values))
    params = dict(module.named_parameters())
    frozen = [p for p in params.values() if not p.requires_grad and (p.is_floating_point() or p.is_complex())]
    handles = []
    try:
        for p in frozen:
            p.requires_grad_(True)
        for path, mod in named.items():
            if path in ins or path in outs:
                pre_hook, hook = recorder.hooks(path, path in ins, path in outs)
                handles.append(mod.register_forward_pre_hook(pre_hook))
                handles.append(mod.register_forward_hook(hook))
        with torch.enable_grad():
            fresh = []

            def as_leaf(x):
                if is_float_tensor(x) and not x.requires_grad:
                    leaf = x.detach().requires_grad_(True)
                    fresh.append(leaf)
                    return leaf.clone()  # not the leaf itself, so in-place ops in forward stay legal
                return x

            call_args = [map_leaves(as_leaf, a) for a in args]
            call_kwargs = {k: map_leaves(as_leaf, v) for k, v in (kwargs or {}).items()}
            output = module(*call_args, **call_kwargs)
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
            wrt = [*params.values(), *fresh, *recorder.wrt]
            grads = torch.autograd.grad(value.reshape(()), wrt, allow_unused=True) if value.requires_grad else None
    finally:
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(False)
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
