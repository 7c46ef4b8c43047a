"""``jaxtrace.torch.value_and_grad`` / ``grad``: the gradients at a torch module's outputs and inputs.

Forward hooks put a tensor hook on a copy or a view of each watched value (see ``Recorder``),
leaving every value the model computes as it is; ``torch.autograd.grad`` then fills them in. The naming and layout of the results
are described in the ``jaxtrace.torch`` package docstring.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
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
    # (leaf j, output Call, its leaf i): an input the module returned as it is (nn.Identity); the
    # uses of the returned tensor are uses inside the call, read at the output's watch.
    links: list = dataclasses.field(default_factory=list)

    def leaf(self, i: int):
        info, g = self.shapes[i], self.grads[i]
        if info is None:
            return None
        g = g if g is not None else np.zeros(info[0], info[1])
        for j, other, k in self.links:
            if j == i:
                g = g + other.leaf(k)
        return g

    def result(self) -> Any:
        return self.unflatten([self.leaf(i) for i in range(len(self.shapes))])

    def value(self) -> Any:
        return self.unflatten([None if info is None else v for info, v in zip(self.shapes, self.values)])


class _Mark(torch.autograd.Function):
    """An identity applied in place (``mark_dirty``): from here on every use of the tensor's memory,
    through any reference, sends its gradient through this node, whose ``backward`` reports it."""

    @staticmethod
    def forward(ctx, x, report):
        ctx.mark_dirty(x)
        ctx.report = report
        return x

    @staticmethod
    def backward(ctx, g):
        new = ctx.report(g)
        return (g if new is None else new), None


# Marking writes nothing, so the version counter that autograd checks saved tensors against is put
# back (without it, a tensor that an earlier op saved, a tanh's output, would fail at backward).
_preserve_version = getattr(torch.autograd.grad_mode, "_unsafe_preserve_version_counter", None)


def _can_mark(t) -> bool:
    # Views are left out: in-place on a view rebases its base, and a view whose version is put back
    # keeps a stale history (autograd then crashes on a later register_hook).
    return _preserve_version is not None and t.requires_grad and not t.is_leaf and not t._is_view()


def _mark(t, report: Callable) -> bool:
    if not _can_mark(t):
        return False
    try:
        with _preserve_version(t):
            _Mark.apply(t, report)
    except RuntimeError:  # a tensor autograd refuses to change in place: keep the view alone
        return False
    return True


def _storage(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, some tensor subclasses)
        return None


@dataclasses.dataclass
class _Alias:
    """A watched output that shares memory with one of the module's inputs."""

    tensor: Any  # the module's own output tensor (for an input: the caller's tensor)
    version: int  # its memory's version when the module returned (was called)
    marked: bool = False  # an in-place identity node watches the memory itself
    frozen: bool | None = None  # for an input: whether the call changed it, once it returned

    def changed(self) -> bool:
        """Whether the memory was changed in place after the module returned (for an input:
        during the call)."""
        return self.frozen if self.frozen is not None else self.tensor._version != self.version


class Recorder:
    """Forward hooks that register tensor hooks, and the tensors autograd must reach.

    Where the hook goes decides which uses of a value count. The gradient at a module's
    output must count the uses of the value the module returned, from the point where it
    returned, and the gradient at its input the uses inside that call: what
    ``register_full_backward_hook`` calls ``grad_output`` and ``grad_input``, and what a
    ``jt.tag`` or a forward hook returning ``output + eps`` gives at the same place. A tensor
    hook on the tensor object itself would also count its other uses (attention probabilities
    used inside the module and also returned; a module's input also read by a residual
    branch). Three cases, none of which changes a value the model computes:

    - A fresh output (memory shared with none of the call's inputs) is replaced by a copy
      (``clone``, an identity for autograd; not a view, since in-place operations on a view
      drop the hooks on it) and the hook goes on the copy. A tensor hook registered before an
      in-place operation (``out += identity``) sees the gradient at the value before it.
    - An output that shares memory with an input (``nn.Identity``, ``Dropout`` in eval, a
      view such as ``nn.Flatten``'s) is not copied, since an in-place change made later
      through either must reach the other: the caller gets a view of the same memory, hooked.
      If that memory is changed in place after the module returned, every later use of it,
      through any reference, counts instead, read at an in-place identity node (``_Mark``)
      put on the memory when the module returned (for a view output, where autograd cannot
      take one, that case is an error that names the module).
    - In-place modules: an output that is one of the call's inputs, changed in place during
      the call, is hooked as it is (every later use of that tensor, through any reference,
      is a use of this output).

    For ``":in"`` the module is handed a view of the caller's tensor, hooked, and the tensor
    is marked in place: if the call changes it in place, the mark is read (every use after
    the call began, which then goes through the change), else the view; an in-place module's
    output goes back as the caller's tensor, and an input returned unchanged (``nn.Identity``)
    also goes on as the caller's tensor, its ``":in"`` gradient adding the output's. A tensor
    autograd cannot mark (a view, a leaf) is handed as a copy instead, which a module that
    changes it in place gets written back into the caller's tensor (recorded by autograd).

    The forward hooks are registered with ``prepend=True``, so they run before hooks others
    registered (Hugging Face's output recorders, a user's hook that stores the output), which
    then see, and pass on, the tensor jaxtrace watches. A module called under
    ``torch.no_grad()`` is not hooked: its values do not reach the loss, its gradient is zeros.
    """

    def __init__(self, api: str, patch_grads: dict | None = None, with_values: bool = False):
        self.api = api  # the public function called, which the error messages name
        self.with_values = with_values  # keep a NumPy copy of each watched tensor as the module saw it
        self.patch_grads = dict(patch_grads or {})  # name -> fn: the hook returns fn(g), as jt.patch_grad
        self.calls: dict[str, list[Call]] = {}
        self.wrt: list = []  # extra inputs of autograd.grad: leaves made for constants, gradient edges
        self.aliases: list = []  # (name, _Alias) of outputs that share memory with an input
        self._frames: dict[int, list] = {}  # per module: the calls in progress (a stack, for recursion)
        self._edge = getattr(getattr(torch.autograd, "graph", None), "get_gradient_edge", None)

    def _watch(
        self, name: str, value, in_place: Callable = lambda t: False, shared: frozenset = frozenset(), inputs=False
    ) -> tuple[Any, list]:
        """Hook every floating tensor in ``value``; returns the value to use and ``[(old, new, entry)]``.

        ``shared``: the storages of the call's inputs (for an output: its leaves that share one
        are aliases, watched without a copy). ``inputs``: ``value`` is what the module is about
        to receive; a tensor autograd can mark is given as a view of itself (``entry`` then
        decides, when the call returns, which watcher is read), any other as a copy (``entry``
        is ``None``).
        """
        leaves, unflatten = flatten(value)  # keeps ModelOutput, NamedTuple, dataclass types
        call = Call(flatten(value, plain=True)[1], [None] * len(leaves), [None] * len(leaves), [None] * len(leaves))
        swaps = []
        new_leaves = list(leaves)
        grad_mode = torch.is_grad_enabled()
        patch = self.patch_grads.get(name)
        for i, leaf in enumerate(leaves):
            if not is_float_tensor(leaf):
                continue
            call.shapes[i] = (tuple(leaf.shape), np_dtype(leaf.dtype))
            if self.with_values:  # a copy now: a later in-place op on the tensor does not change it
                call.values[i] = to_numpy(leaf)
            if not grad_mode:
                continue  # under torch.no_grad(): nothing reaches the loss from here; zeros
            if leaf.requires_grad and in_place(leaf):
                alias = leaf
            elif leaf.requires_grad and ((inputs and _can_mark(leaf)) or (shared and _storage(leaf) in shared)):
                # Two watchers, one read: the view handed on (its uses), or, if the memory is
                # changed in place (after the output returned; during the input's call), the
                # in-place identity node on the memory (every later use, through any reference).
                entry = _Alias(leaf, leaf._version)
                entry.marked = _mark(leaf, _store(call, i, self.api, patch, entry.changed))
                alias = leaf.view_as(leaf)
                if not inputs:
                    self.aliases.append((name, entry))
                swaps.append((leaf, alias, entry, i))
                if self._edge is not None:
                    self.wrt.append(self._edge(alias))
                alias.register_hook(_store(call, i, self.api, patch, lambda e=entry: not e.changed()))
                new_leaves[i] = alias
                continue
            elif leaf.requires_grad:
                alias = leaf.clone()
                swaps.append((leaf, alias, None, i))
            else:
                # A constant (made inside forward, or an input without requires_grad):
                # differentiate it through a fresh leaf.
                fresh = leaf.detach().requires_grad_(True)
                self.wrt.append(fresh)
                alias = fresh.clone()
                swaps.append((leaf, alias, None, i))
            if self._edge is not None and alias.requires_grad:
                # Make autograd run the node that feeds this hook even when it lies on no path
                # to a parameter or an input (a value that depends only on some other leaf).
                self.wrt.append(self._edge(alias))
            alias.register_hook(_store(call, i, self.api, patch))
            new_leaves[i] = alias
        self.calls.setdefault(name, []).append(call)
        return (unflatten(new_leaves) if swaps else value), swaps

    def hooks(self, path: str, inputs: bool, outputs: bool) -> tuple[Callable, Callable]:
        """A forward pre-hook and a forward hook (both ``with_kwargs=True``) for the module at ``path``."""

        def pre_hook(module, args, kwargs):
            swaps, new = [], None
            if inputs:
                # ":in": the positional inputs (one: itself; several: a tuple); a call with keyword
                # arguments only (Hugging Face's hidden_states=): a dict of them.
                value = args[0] if len(args) == 1 else dict(kwargs) if not args and kwargs else tuple(args)
                watched, swaps = self._watch(path + INPUT_SUFFIX, value, inputs=True)
                if swaps:
                    if not args and kwargs:
                        new = (args, {**kwargs, **watched})
                    else:
                        new = ((watched,) if len(args) == 1 else tuple(watched), kwargs)
            call_args, call_kwargs = new if new is not None else (args, kwargs)
            tensors = [t for t in flatten([list(call_args), dict(call_kwargs)])[0] if isinstance(t, torch.Tensor)]
            seen = {id(t): (t, t._version) for t in tensors}
            shared = {_storage(t) for t in tensors} | {_storage(old) for old, *_ in swaps}
            in_call = self.calls[path + INPUT_SUFFIX][-1] if inputs else None
            self._frames.setdefault(id(module), []).append(
                (seen, frozenset(shared - {None}), [(old, a, a._version, e, j, in_call) for old, a, e, j in swaps])
            )
            return new

        def hook(module, args, kwargs, output):
            seen, shared, swaps = self._frames[id(module)].pop()
            for old, alias, version, entry, _, _ in swaps:
                if entry is not None:  # a view of the caller's tensor: did the call change it?
                    entry.frozen = alias._version != version
                elif alias._version != version:  # a copy the module changed: the caller's tensor gets it
                    old.copy_(alias)
            returned, in_place_outputs, links = _back_to_caller(output, swaps)

            def in_place(t):
                if id(t) in in_place_outputs:
                    return True
                old = seen.get(id(t))
                return old is not None and old[0] is t and t._version != old[1]

            if not outputs and not links:
                return None if returned is output else returned
            if links and path + INPUT_SUFFIX in self.patch_grads:
                raise ValueError(
                    f"{self.api}: patch_grads has {path + INPUT_SUFFIX!r}, but {path!r} returns its input "
                    "as it is (like nn.Identity), so the gradient at that input also arrives through the "
                    f"output's later uses and cannot be patched in one place. Patch {path!r} instead."
                )
            # An input returned as it is needs the output's watch for its ":in" gradient, even
            # when the output itself was not asked for (then it is not reported).
            new, changed = self._watch(path, returned, in_place, shared)
            if outputs:
                out_call = self.calls[path][-1]
            else:  # not reported: taken out of the results again
                out_call = self.calls[path].pop()
                if not self.calls[path]:
                    del self.calls[path]
                self.aliases = [(n if n != path else path + INPUT_SUFFIX, e) for n, e in self.aliases]
            for in_call, j, i in links:
                in_call.links.append((j, out_call, i))
            return new if changed else (None if returned is output else returned)

        return pre_hook, hook

    def results(self, values: bool = False) -> dict:
        """``{name: gradient}``, or with ``values=True`` ``{name: value}``, calls stacked."""
        for name, entry in self.aliases:
            if entry.changed() and not entry.marked:
                raise ValueError(
                    f"{self.api}: the output of {name!r} is a view of one of its inputs "
                    f"({describe(entry.tensor)}), and the model changed that memory in place after "
                    f"{name!r} returned, so the gradient at that output cannot be read apart from the "
                    "input's (the forward pass ran as without jaxtrace). Leave it out of where=."
                )
        out = {}
        for name, calls in self.calls.items():
            per_call = [c.value() if values else c.result() for c in calls]
            out[name] = per_call[0] if len(per_call) == 1 else _stack_calls(self.api, name, calls, per_call)
        return out


def _back_to_caller(output, swaps: list) -> tuple[Any, set, list]:
    """``output`` with each leaf that is what jaxtrace handed the module for ``":in"`` replaced by
    the caller's own tensor, as without jaxtrace; the ids of those the call changed in place
    (an in-place module's output: hooked as it is); and ``(input Call, its leaf, output leaf)``
    for those returned unchanged (``nn.Identity``), whose ``":in"`` gradient then adds the
    output's: the uses of the returned tensor are uses of the input inside the call.

    A copy the call changed was written back already and goes on as the module returned it.
    """
    by_id = {id(a): swap for swap in swaps for a in [swap[1]]}
    if not by_id:
        return output, set(), []
    leaves, unflatten = flatten(output)
    replaced, in_place, links = False, set(), []
    for i, leaf in enumerate(leaves):
        hit = by_id.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
        if hit is None:
            continue
        old, alias, version, entry, j, in_call = hit
        if entry is not None and entry.frozen:  # a view of the caller's tensor, changed in place
            leaves[i], replaced = old, True
            in_place.add(id(old))
        elif entry is not None or alias._version == version:  # returned unchanged
            leaves[i], replaced = old, True
            links.append((in_call, j, i))
    return (unflatten(leaves) if replaced else output), in_place, links


def _store(call: Call, i: int, api: str, fn: Callable | None = None, active: Callable = lambda: True):
    """The tensor hook for leaf ``i`` of ``call``; ``active()`` false: this watcher is not the one read."""

    def hook(g):
        if not active():
            return None
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
    structure = jax.tree_util.tree_structure(values[0])
    for c, v in zip(calls[1:], values[1:]):
        if c.shapes != first.shapes or jax.tree_util.tree_structure(v) != structure:
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
    autograd), or, where the output shares memory with an input (``nn.Identity``,
    ``Dropout`` in eval, ``nn.Flatten``), on a view of it, so the model computes
    exactly what it computes without jaxtrace; this works with in-place modules
    (``ReLU(inplace=True)``) where ``register_full_backward_hook`` does not. They
    are registered with ``prepend=True``: hooks others registered (Hugging Face's
    output recorders) run after them and see the watched tensor. A module called
    under ``torch.no_grad()`` runs as it is and gets zeros. The hooks come off
    before backward, so activation checkpointing's recompute is not a call.
    Names, tuples,
    repeated calls, ``":in"`` (keyword-only calls: a dict of the keywords) and
    aliasing outputs are described in the ``jaxtrace.torch`` package docstring. A
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


def _reentrant_checkpoint(value) -> bool:
    """Whether the autograd graph of ``value`` has a reentrant checkpoint's node (its backward
    runs a separate backward pass, which ``torch.autograd.grad``'s inputs are not part of)."""
    seen, stack = set(), [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


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
                handles.append(mod.register_forward_pre_hook(pre_hook, with_kwargs=True))
                handles.append(mod.register_forward_hook(hook, prepend=True, with_kwargs=True))
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
            # The forward pass is over: its hooks come off before backward, where activation
            # checkpointing (torch.utils.checkpoint, Hugging Face's gradient_checkpointing_enable)
            # runs parts of it again to rebuild saved tensors; those runs are not calls.
            for h in handles:
                h.remove()
            handles.clear()
            if value.requires_grad and _reentrant_checkpoint(value):
                raise ValueError(
                    f"{api}: the forward pass ran torch.utils.checkpoint with use_reentrant=True (Hugging "
                    "Face: gradient_checkpointing_kwargs={'use_reentrant': True}), whose parameters "
                    "torch.autograd.grad cannot reach: their gradients would be zeros or an error. Pass "
                    "use_reentrant=False (activation_checkpointing_enable({'use_reentrant': False}) in "
                    "Hugging Face), or turn checkpointing off for the check."
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
