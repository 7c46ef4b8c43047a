"""Forward hooks that watch the selected modules' outputs and inputs without changing a value."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._module_tags import INPUT_SUFFIX
from ._calls import Call, stack_calls
from ._memory import Alias, can_mark, mark, storage
from ._tensors import describe, flatten, is_float_tensor, np_dtype, to_numpy

__all__ = ["Recorder"]


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
      through any reference, counts instead, read at an in-place identity node (``_memory.mark``)
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
        self.aliases: list = []  # (name, Alias) of outputs that share memory with an input
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
            elif leaf.requires_grad and ((inputs and can_mark(leaf)) or (shared and storage(leaf) in shared)):
                # Two watchers, one read: the view handed on (its uses), or, if the memory is
                # changed in place (after the output returned; during the input's call), the
                # in-place identity node on the memory (every later use, through any reference).
                entry = Alias(leaf, leaf._version)
                entry.marked = mark(leaf, _store(call, i, self.api, patch, entry.changed))
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
            shared = {storage(t) for t in tensors} | {storage(old) for old, *_ in swaps}
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
            out[name] = per_call[0] if len(per_call) == 1 else stack_calls(self.api, name, calls, per_call)
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
