"""Side-by-side checks against PyTorch: gradients at module outputs, and weights into equinox or Flax NNX.

``jaxtrace.torch.grad(module, *args, loss=...)`` runs a ``torch.nn.Module``
and returns ``(param_grads, module_grads)`` as NumPy arrays: the parameter
gradients by ``named_parameters()`` names, and the gradient at each selected
module's output (and, on request, input) by ``named_modules()`` paths, the
names ``jt.tag`` / ``jt.tag_modules`` use on the JAX side. ``load_weights``
copies a torch module's parameters into the matching equinox model, and
``named_grads`` renames that model's gradients back to torch's names, so that
``jaxtrace.compare`` can put the two side by side.

Naming and layout of ``module_grads`` (the same conventions as ``jt.tag``):

- ``"<path>"``: the gradient at the module's output; ``"<path>:in"``: at its
  positional inputs (one argument: that argument; several: a tuple). The root
  module's path is ``""``.
- A module that returns a tuple, list or dict gets a gradient of the same
  structure, as a JAX tag on that pytree does; ``jaxtrace.compare`` names the
  leaves ``"attn[0]"``, ``"attn[1]"``, ``"enc['h']"``. Leaves that are not
  floating-point tensors (indices, ``None``, Python numbers) have no gradient:
  ``None`` in their place.
- A module called several times (weight sharing, a cell stepped in a Python
  loop) fires once per call; the calls are stacked on a new leading axis in
  call order, as ``jt.tag(..., repeated=True)`` or a tag in a ``lax.scan``
  body stacks them. A module called once has no extra axis.
- A module output that does not affect the loss gets zeros, not ``None``.
- The gradient at an output counts the uses of the returned value from the
  point the module returns; at an input, the uses inside that call. These are
  ``register_full_backward_hook``'s ``grad_output`` and ``grad_input``, and
  what ``jt.tag`` gives at the same places: the JAX port tags a module's
  return value and, for ``":in"``, the arguments it receives. (A hook on the
  tensor object would also count other uses of the same tensor: attention
  probabilities used inside the module and also returned, a module's input
  that a residual branch also reads.)

Needs PyTorch (a CPU build is enough: ``pip install torch --index-url https://download.pytorch.org/whl/cpu``).
"""

from __future__ import annotations

try:
    import torch
except ImportError as _error:  # pragma: no cover - exercised by a test that hides torch
    raise ImportError(
        "jaxtrace.torch needs PyTorch, which is not installed. A CPU build is enough, and much smaller than "
        "the default CUDA build on Linux: `pip install torch --index-url https://download.pytorch.org/whl/cpu` "
        '(or `pip install -e ".[torch]"` from a jaxtrace checkout, which takes the default build).'
    ) from _error

import dataclasses
import sys
import warnings
from typing import Any, Callable, Iterable, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["grad", "value_and_grad", "load_weights", "named_grads"]

Where = Union[None, str, Iterable[str], Callable[[str, "torch.nn.Module"], bool]]

_IN = ":in"


# --- small pytrees of tensors (tuples, lists, dicts) --------------------------


def _flatten(obj) -> tuple[list, Callable[[list], Any]]:
    """Leaves of a tuple / list / dict nest, and a function that rebuilds it."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        parts = [_flatten(v) for v in obj]
        return _join_parts(parts, lambda vs: type(obj)(*vs))
    if isinstance(obj, (tuple, list)):
        parts = [_flatten(v) for v in obj]
        return _join_parts(parts, type(obj))
    if isinstance(obj, dict):
        keys = list(obj)
        parts = [_flatten(obj[k]) for k in keys]
        return _join_parts(parts, lambda vs: dict(zip(keys, vs)))
    return [obj], lambda leaves: leaves[0]


def _join_parts(parts, build):
    leaves, sizes = [], []
    for sub_leaves, _ in parts:
        leaves.extend(sub_leaves)
        sizes.append(len(sub_leaves))

    def unflatten(new_leaves):
        out, i = [], 0
        for (_, sub_unflatten), n in zip(parts, sizes):
            out.append(sub_unflatten(new_leaves[i : i + n]))
            i += n
        return build(out)

    return leaves, unflatten


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _np_dtype(dtype: "torch.dtype") -> np.dtype:
    return np.dtype("float32") if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().copy()


# --- recording the gradients at module outputs and inputs ----------------------


@dataclasses.dataclass
class _Call:
    """One call of one hooked site: the tensors' shapes and, after backward, their gradients."""

    unflatten: Callable
    shapes: list  # per leaf: (shape, numpy dtype) or None when the leaf has no gradient
    grads: list  # per leaf: np.ndarray once its hook fired

    def result(self) -> Any:
        leaves = []
        for info, g in zip(self.shapes, self.grads):
            if info is None:
                leaves.append(None)
            else:
                leaves.append(g if g is not None else np.zeros(info[0], info[1]))
        return self.unflatten(leaves)


class _Recorder:
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

    def __init__(self, patch_grads: dict | None = None):
        self.patch_grads = dict(patch_grads or {})  # name -> fn: the hook returns fn(g), as jt.patch_grad
        self.calls: dict[str, list[_Call]] = {}
        self.wrt: list = []  # extra inputs of autograd.grad: leaves made for constants, gradient edges
        self._frames: dict[int, list] = {}  # per module: the calls in progress (a stack, for recursion)
        self._edge = getattr(getattr(torch.autograd, "graph", None), "get_gradient_edge", None)

    def _watch(self, name: str, value, in_place: Callable = lambda t: False) -> tuple[Any, list]:
        """Hook every floating tensor in ``value``; returns the value to use and ``[(old, new)]``."""
        leaves, unflatten = _flatten(value)
        call = _Call(unflatten, [None] * len(leaves), [None] * len(leaves))
        swaps = []
        new_leaves = list(leaves)
        for i, leaf in enumerate(leaves):
            if not _is_float_tensor(leaf):
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
            call.shapes[i] = (tuple(alias.shape), _np_dtype(alias.dtype))
            alias.register_hook(_store(call, i, self.patch_grads.get(name)))
            new_leaves[i] = alias
        self.calls.setdefault(name, []).append(call)
        return (unflatten(new_leaves) if swaps else value), swaps

    def hooks(self, path: str, inputs: bool, outputs: bool) -> tuple[Callable, Callable]:
        """A forward pre-hook and a forward hook for the module at ``path``."""

        def pre_hook(module, args):
            swaps, new_args = [], None
            if inputs:
                value = args[0] if len(args) == 1 else tuple(args)
                new, swaps = self._watch(path + _IN, value)
                if swaps:
                    new_args = (new,) if len(args) == 1 else tuple(new)
            seen = {id(t): (t, t._version) for t in _flatten(list(new_args or args))[0] if isinstance(t, torch.Tensor)}
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

    def results(self) -> dict:
        out = {}
        for name, calls in self.calls.items():
            values = [c.result() for c in calls]
            out[name] = values[0] if len(values) == 1 else _stack_calls(name, calls, values)
        return out


def _store(call: _Call, i: int, fn: Callable | None = None):
    def hook(g):
        call.grads[i] = _to_numpy(g)  # the hook fires once, with the total gradient (as it arrives)
        if fn is not None:
            new = fn(g)
            if not (isinstance(new, torch.Tensor) and new.shape == g.shape and new.dtype == g.dtype):
                raise ValueError(
                    f"jaxtrace.torch: a patch_grads function returned {_describe(new)} for a gradient of "
                    f"{_describe(g)}. Return a tensor of the same shape and dtype."
                )
            return new
        return None

    return hook


def _stack_calls(name: str, calls: list, values: list):
    first = calls[0]
    for c in calls[1:]:
        if c.shapes != first.shapes:
            shapes = "; ".join(str([s[0] if s else None for s in cc.shapes]) for cc in calls)
            raise ValueError(
                f"jaxtrace.torch: the module {name!r} was called {len(calls)} times with different "
                f"output shapes or structures ({shapes}), so its calls cannot be stacked. Leave it out "
                "with where=, or give each call its own module."
            )
    leaves = [_flatten(v)[0] for v in values]
    stacked = [None if first.shapes[i] is None else np.stack([lv[i] for lv in leaves]) for i in range(len(leaves[0]))]
    return _flatten(values[0])[1](stacked)


# --- selection ----------------------------------------------------------------


def _select(named: dict, where: Where, inputs: bool) -> tuple[set, set, list]:
    """(paths whose outputs are watched, paths whose inputs are, names asked for explicitly)."""
    if where is None:
        outs = set(named)
        explicit: list = []
    elif callable(where):
        outs = {p for p, m in named.items() if where(p, m)}
        explicit = []
    else:
        explicit = [where] if isinstance(where, str) else list(where)
        bad = [n for n in explicit if not isinstance(n, str)]
        if bad:
            raise TypeError(
                f"where= must be None, a path, a sequence of paths or a predicate (path, module) -> bool; "
                f"got {bad[0]!r} of type {type(bad[0]).__name__} in the sequence."
            )
        unknown = [n for n in explicit if n.removesuffix(_IN) not in named]
        if unknown:
            known = ", ".join(repr(p) for p in named)
            raise ValueError(
                f"jaxtrace.torch: no module at {', '.join(repr(n) for n in unknown)}. The module's "
                f"named_modules() paths are: {known} (the root is ''; add ':in' for a module's input)."
            )
        outs = {n for n in explicit if not n.endswith(_IN)}
        ins = {n.removesuffix(_IN) for n in explicit if n.endswith(_IN)}
        return outs, ins | (outs if inputs else set()), explicit
    return outs, (set(outs) if inputs else set()), explicit


# --- the public functions -----------------------------------------------------


def value_and_grad(
    module: "torch.nn.Module",
    *args,
    loss: Callable | None = None,
    where: Where = None,
    inputs: bool = False,
    kwargs: dict | None = None,
    patch_grads: dict | None = None,
) -> tuple[float, tuple[dict, dict]]:
    """Run ``module(*args)``, then ``loss`` on its output; return the loss and the gradients.

    Returns ``(value, (param_grads, module_grads))``: ``value`` is the loss as
    a Python float; ``param_grads`` is ``{named_parameters() name: array}``;
    ``module_grads`` is ``{named_modules() path: gradient at the output}``
    (see the module docstring for tuples, repeated calls and ``":in"``), all
    NumPy arrays in the module's dtype.

    ``loss`` maps the module's output to a scalar tensor (default: the output
    is the scalar). ``where`` selects modules: ``None`` (all, the root ``""``
    too), a path or a list of paths (``"name:in"`` asks for an input; an
    explicitly named module that is never called is an error), or a predicate
    ``(path, module) -> bool``. ``inputs=True`` adds the inputs of the selected
    modules. ``kwargs`` are keyword arguments for ``module``.

    ``patch_grads={path: fn}`` changes the gradient there, as ``register_hook``
    returning a new gradient does and as ``jaxtrace.patch_grad`` does on the
    JAX side: ``fn(g)`` (a tensor function, applied to each floating tensor of
    that output, or input for ``"path:in"``) replaces the gradient ``g`` that
    arrives there. ``module_grads`` reports ``g`` as it arrives, as
    ``jaxtrace.grad`` does at a patched tag; upstream sees ``fn(g)``.

    Gradients are taken with ``torch.autograd.grad`` (the ``.grad`` fields are
    not touched) with respect to every floating parameter, frozen ones
    included, and with respect to the floating tensors among ``args`` (which
    are not changed). The module runs in its current mode: call ``.eval()``
    (or remove dropout) on both sides for a parity check. The hooks are
    forward hooks that register a tensor hook on a copy of each output tensor
    (an identity for autograd), which works with in-place operations
    (``ReLU(inplace=True)``) where ``register_full_backward_hook`` does not.

    Example:
        >>> import torch, jaxtrace.torch as jtt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 1))
        >>> value, (params, modules) = jtt.value_and_grad(net, torch.ones(2, 3), loss=lambda y: y.sum())
        >>> sorted(modules), modules["2"].tolist(), params["0.weight"].shape
        (['', '0', '1', '2'], [[1.0], [1.0]], (4, 3))
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"jaxtrace.torch needs a torch.nn.Module, got {type(module).__name__}.")
    named = dict(module.named_modules())
    outs, ins, explicit = _select(named, where, inputs)
    patch_grads = dict(patch_grads or {})
    unknown = [p for p in patch_grads if p.removesuffix(_IN) not in named]
    if unknown:
        raise ValueError(
            f"jaxtrace.torch: patch_grads names no module at {', '.join(map(repr, unknown))}. The module's "
            f"named_modules() paths are: {', '.join(map(repr, named))} (add ':in' for a module's input)."
        )
    outs |= {p for p in patch_grads if not p.endswith(_IN)}
    ins |= {p.removesuffix(_IN) for p in patch_grads if p.endswith(_IN)}
    recorder = _Recorder(patch_grads)
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
                if _is_float_tensor(x) and not x.requires_grad:
                    leaf = x.detach().requires_grad_(True)
                    fresh.append(leaf)
                    return leaf.clone()  # not the leaf itself, so in-place ops in forward stay legal
                return x

            call_args = [_map_leaves(as_leaf, a) for a in args]
            call_kwargs = {k: _map_leaves(as_leaf, v) for k, v in (kwargs or {}).items()}
            output = module(*call_args, **call_kwargs)
            value = output if loss is None else loss(output)
            if not (isinstance(value, torch.Tensor) and value.numel() == 1 and _is_float_tensor(value)):
                raise ValueError(
                    "jaxtrace.torch needs a scalar floating loss; "
                    + (
                        f"the module returned {_describe(output)}. Pass loss=, a function of the output "
                        "that returns a scalar tensor."
                        if loss is None
                        else f"loss returned {_describe(value)}."
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
        param_grads[name] = _to_numpy(g) if g is not None else np.zeros(tuple(p.shape), _np_dtype(p.dtype))
    module_grads = recorder.results()
    missing = [n for n in explicit if n not in module_grads]
    if missing:
        raise ValueError(
            f"jaxtrace.torch: {', '.join(repr(n) for n in missing)} was selected but never called in this "
            "forward pass, so it has no gradient. Leave it out of where=."
        )
    return float(value.detach().reshape(()).real), (param_grads, module_grads)


def grad(
    module: "torch.nn.Module",
    *args,
    loss: Callable | None = None,
    where: Where = None,
    inputs: bool = False,
    kwargs: dict | None = None,
    patch_grads: dict | None = None,
) -> tuple[dict, dict]:
    """``(param_grads, module_grads)`` of ``loss(module(*args))``; see ``value_and_grad``.

    The order mirrors ``jaxtrace.grad``'s ``(grads, tag_grads)``.

    Example:
        >>> import torch, jaxtrace.torch as jtt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
        >>> params, modules = jtt.grad(net, torch.ones(2, 3), loss=lambda y: y.sum(), where=["0", "0:in"])
        >>> list(modules), modules["0:in"].shape
        (['0:in', '0'], (2, 3))
    """
    _, grads = value_and_grad(
        module, *args, loss=loss, where=where, inputs=inputs, kwargs=kwargs, patch_grads=patch_grads
    )
    return grads


def _map_leaves(fn, obj):
    leaves, unflatten = _flatten(obj)
    return unflatten([fn(x) for x in leaves])


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


# --- weights from torch into equinox, and gradients back ----------------------


@dataclasses.dataclass(frozen=True)
class _Assign:
    """One equinox array made from torch parameters by a linear map."""

    steps: tuple  # how to reach the array in the equinox model
    names: tuple  # the torch parameter names it is made from
    fn: Callable  # (*torch arrays) -> the equinox array; linear


def _get(tree, steps):
    for kind, key in steps:
        tree = getattr(tree, key) if kind == "attr" else tree[key]
    return tree


def _show(steps) -> str:
    out = ""
    for kind, key in steps:
        out += f".{key}" if kind == "attr" else f"[{key!r}]"
    return out or "the model itself"


def _steps_to(model, path: str, what: str) -> tuple:
    obj, steps = model, []
    for part in path.split(".") if path else []:
        if isinstance(obj, dict) and part in obj:
            new = [("item", part)]
        elif isinstance(obj, (list, tuple)) and part.isdigit() and int(part) < len(obj):
            new = [("item", int(part))]
        elif isinstance(obj, eqx.nn.Sequential) and part.isdigit() and int(part) < len(obj.layers):
            new = [("attr", "layers"), ("item", int(part))]
        elif not part.isdigit() and hasattr(obj, part):
            new = [("attr", part)]
        else:
            raise ValueError(
                f"load_weights: the torch module has {what} at {path!r}, but the equinox model has "
                f"nothing called {part!r} at {_show(steps)} (a {type(obj).__name__}). Build the equinox "
                "model with the same attribute names and list indices as the torch module's "
                "named_modules() paths."
            )
        steps.extend(new)
        obj = _get(obj, new)
    return tuple(steps)


def _full(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _plan(model, module, *, grads: bool = False, unplaced: list | None = None) -> list[_Assign]:
    """How each array of ``model`` is made from ``module``'s parameters.

    With ``grads=True``, ``model`` is a gradient tree: arrays that are ``None``
    there (no gradient) are skipped instead of being an error. BatchNorm running
    statistics bound for an ``eqx.nn.State`` are planned by ``_plan_state``.
    Persistent floating buffers with no field of their name are appended to ``unplaced``.
    """
    plan: list[_Assign] = []
    seen: set = set()
    for path, mod in module.named_modules():
        direct = [(n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
        buffers = [
            (n, b)
            for n, b in mod.named_buffers(recurse=False)
            if not grads and id(b) not in seen and b.is_floating_point() and n not in mod._non_persistent_buffers_set
        ]
        seen.update(id(p) for _, p in direct)
        if not direct and not buffers:
            continue
        kind = type(mod).__name__
        base = _steps_to(model, path, f"a {kind}")
        target = _get(model, base)
        # Floating buffers (BatchNorm running statistics) go into fields of their name where the
        # equinox module has one (eqx.nn.BatchNorm keeps them in its State instead: _plan_state).
        direct += [(n, b) for n, b in buffers if hasattr(target, n)]
        if unplaced is not None and not isinstance(target, eqx.nn.BatchNorm):  # its statistics: _plan_state
            unplaced += [_full(path, n) for n, b in buffers if not hasattr(target, n)]
        seen.update(id(b) for _, b in buffers)
        if not direct:
            continue
        if isinstance(mod, torch.nn.Embedding) and mod.max_norm is not None:
            raise ValueError(
                f"load_weights: the Embedding at {path!r} has max_norm={mod.max_norm}: torch renormalises the "
                "rows it looks up, in place, which eqx.nn.Embedding does not. Build it without max_norm (or "
                "renormalise the weight yourself) before porting."
            )
        special = _SPECIAL.get(type(mod)) or next((f for t, f in _SPECIAL.items() if isinstance(mod, t)), None)
        if special is not None:
            if isinstance(mod, torch.nn.MultiheadAttention):
                seen.update(id(p) for p in mod.out_proj.parameters())
            new = special(path, mod, base, target)
            plan.extend(a for a in new if not grads or _get(model, a.steps) is not None)
            continue
        conv = isinstance(mod, torch.nn.modules.conv._ConvNd)
        for name, p in direct:
            full = _full(path, name)
            if not hasattr(target, name):
                raise ValueError(
                    f"load_weights: the torch {kind} at {path!r} has the parameter {name!r}, but the "
                    f"equinox {type(target).__name__} at {_show(base)} has no field {name!r}."
                )
            leaf = getattr(target, name)
            if grads and leaf is None:
                continue
            _check_leaf(full, base, name, target, leaf)
            shape, eshape = tuple(p.shape), tuple(leaf.shape)
            if conv and mod.transposed and name == "weight":
                fn = _conv_transpose_weight(mod.groups)  # torch (in, out/g, *k) -> equinox (out, in/g, *k), flipped
            elif shape == eshape:
                fn = _identity
            elif conv and name == "bias" and eshape == shape + (1,) * (len(eshape) - len(shape)):
                fn = _reshaper(eshape)  # equinox keeps conv biases as (out, 1, 1)
            else:
                fn = None
            if fn is None or tuple(jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, leaf.dtype)).shape) != eshape:
                raise ValueError(
                    f"load_weights: the torch parameter {full!r} has shape {shape}, but the equinox "
                    f"array at {_show(base + (('attr', name),))} has shape {eshape}. Build the equinox "
                    "layer with the same sizes."
                )
            plan.append(_Assign(base + (("attr", name),), (full,), fn))
    return plan


def _check_leaf(full, base, name, target, leaf):
    if not (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):
        raise ValueError(
            f"load_weights: the torch parameter {full!r} has no array to go into: the equinox "
            f"{type(target).__name__} at {_show(base)} has {name} = {leaf!r}"
            + (" (built with use_bias=False?)." if leaf is None else ".")
        )


def _identity(x):
    return x


def _reshaper(shape):
    return lambda x: x.reshape(shape)


def _conv_transpose_weight(groups: int):
    def fn(w):
        # torch keeps a transposed convolution's kernel as (in, out / groups, *k) and applies it as
        # the transpose of a convolution; equinox runs a dilated convolution with an (out, in / groups,
        # *k) kernel: swap the channel axes within each group and flip the kernel in space.
        cin, cout_g, *k = w.shape
        w = w.reshape(groups, cin // groups, cout_g, *k).swapaxes(1, 2).reshape(groups * cout_g, cin // groups, *k)
        return jnp.flip(w, axis=tuple(range(2, w.ndim)))

    return fn


def _need(path, mod, base, target, cls, checks: dict):
    """An error unless ``target`` is an instance of ``cls`` with ``checks`` {what: (torch, equinox)} equal."""
    kind = type(mod).__name__
    if not isinstance(target, cls):
        raise ValueError(
            f"load_weights: the torch {kind} at {path!r} needs an {cls.__module__.split('.')[0]}.nn."
            f"{cls.__name__} there, but the equinox model has a {type(target).__name__} at {_show(base)}."
        )
    bad = {k: v for k, v in checks.items() if v[0] != v[1]}
    if bad:
        raise ValueError(
            f"load_weights: the {kind} at {path!r} and the equinox {cls.__name__} at {_show(base)} differ: "
            + "; ".join(f"{k} is {t} in torch but {e} in equinox" for k, (t, e) in bad.items())
            + ". Build the equinox layer to match."
        )


def _plan_gru(path, mod, base, target) -> list[_Assign]:
    _need(
        path,
        mod,
        base,
        target,
        eqx.nn.GRUCell,
        {
            "input_size": (mod.input_size, target.input_size),
            "hidden_size": (mod.hidden_size, target.hidden_size),
            "bias (use_bias)": (mod.bias, target.use_bias),
        },
    )
    return _gru_cell(path, base, mod.hidden_size, mod.bias, "")


def _gru_cell(path, base, h, bias, suffix) -> list[_Assign]:
    name = lambda n: _full(path, n + suffix)  # noqa: E731
    at = lambda n: base + (("attr", n),)  # noqa: E731
    plan = [
        _Assign(at("weight_ih"), (name("weight_ih"),), _identity),
        _Assign(at("weight_hh"), (name("weight_hh"),), _identity),
    ]
    if bias:
        # torch: r, z = sigmoid(W_i x + b_i + W_h h + b_h) and n = tanh(W_in x + b_in + r * (W_hn h + b_hn));
        # equinox: one bias on the input side and bias_n inside the reset product.
        plan.append(
            _Assign(
                at("bias"),
                (name("bias_ih"), name("bias_hh")),
                lambda b_ih, b_hh: b_ih + jnp.concatenate([b_hh[: 2 * h], jnp.zeros_like(b_hh[2 * h :])]),
            )
        )
        plan.append(_Assign(at("bias_n"), (name("bias_hh"),), lambda b_hh: b_hh[2 * h :]))
    return plan


def _lstm_cell(path, base, bias, suffix) -> list[_Assign]:
    name = lambda n: _full(path, n + suffix)  # noqa: E731
    at = lambda n: base + (("attr", n),)  # noqa: E731
    plan = [
        _Assign(at("weight_ih"), (name("weight_ih"),), _identity),
        _Assign(at("weight_hh"), (name("weight_hh"),), _identity),
    ]
    if bias:  # the same gate order (i, f, g, o); equinox has one bias where torch has two
        plan.append(_Assign(at("bias"), (name("bias_ih"), name("bias_hh")), _add))
    return plan


def _add(a, b):
    return a + b


def _plan_lstm_cell(path, mod, base, target) -> list[_Assign]:
    _need(
        path,
        mod,
        base,
        target,
        eqx.nn.LSTMCell,
        {
            "input_size": (mod.input_size, target.input_size),
            "hidden_size": (mod.hidden_size, target.hidden_size),
            "bias (use_bias)": (mod.bias, target.use_bias),
        },
    )
    return _lstm_cell(path, base, mod.bias, "")


def _plan_rnn(path, mod, base, target) -> list[_Assign]:
    """``nn.GRU`` / ``nn.LSTM``: a list of layers, each a cell or a list of cells (forward, reverse)."""
    kind = type(mod).__name__
    cell_cls = eqx.nn.GRUCell if isinstance(mod, torch.nn.GRU) else eqx.nn.LSTMCell
    layout = f"a list of {mod.num_layers} layers, each " + (
        f"a list [forward, reverse] of eqx.nn.{cell_cls.__name__}"
        if mod.bidirectional
        else f"an eqx.nn.{cell_cls.__name__}"
    )
    if getattr(mod, "proj_size", 0):
        raise ValueError(
            f"load_weights: the LSTM at {path!r} has proj_size={mod.proj_size}, which eqx.nn.LSTMCell does not "
            "have. Port it with your own cell (its weight_hr_l* projects the hidden state)."
        )
    if not isinstance(target, (list, tuple)) or len(target) != mod.num_layers:
        raise ValueError(
            f"load_weights: the torch {kind} at {path!r} goes into {layout} (torch's layer k, direction d is "
            f"[k][d]), but the equinox model has {_describe_tree(target)} at {_show(base)}."
        )
    directions = 2 if mod.bidirectional else 1
    plan: list[_Assign] = []
    for k, layer in enumerate(target):
        cells = layer if isinstance(layer, (list, tuple)) else [layer]
        if len(cells) != directions:
            raise ValueError(
                f"load_weights: the torch {kind} at {path!r} goes into {layout}, but layer {k} at "
                f"{_show(base + (('item', k),))} is {_describe_tree(layer)}."
            )
        for d, cell in enumerate(cells):
            steps = base + (("item", k),) + ((("item", d),) if isinstance(layer, (list, tuple)) else ())
            where = f"{path!r} (layer {k}{', reverse' if d else ''})"
            input_size = mod.input_size if k == 0 else directions * mod.hidden_size
            _need(
                where,
                mod,
                steps,
                cell,
                cell_cls,
                {
                    "input_size": (input_size, getattr(cell, "input_size", None)),
                    "hidden_size": (mod.hidden_size, getattr(cell, "hidden_size", None)),
                    "bias (use_bias)": (mod.bias, getattr(cell, "use_bias", None)),
                },
            )
            suffix = f"_l{k}" + ("_reverse" if d else "")
            if cell_cls is eqx.nn.GRUCell:
                plan.extend(_gru_cell(path, steps, mod.hidden_size, mod.bias, suffix))
            else:
                plan.extend(_lstm_cell(path, steps, mod.bias, suffix))
    return plan


def _describe_tree(x) -> str:
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}: [{', '.join(type(v).__name__ for v in x)}]"
    return f"a {type(x).__name__}"


def _plan_elman(path, mod, base, target) -> list[_Assign]:
    raise ValueError(
        f"load_weights: the torch {type(mod).__name__} at {path!r} has no equinox counterpart (equinox has "
        "GRUCell and LSTMCell, not a tanh/ReLU RNN cell). Port it with a Linear pair of your own, or use "
        "nn.GRU / nn.LSTM."
    )


def _plan_mha(path, mod, base, target) -> list[_Assign]:
    """``nn.MultiheadAttention`` onto ``eqx.nn.MultiheadAttention``: in_proj split into q, k, v."""
    e, heads = mod.embed_dim, mod.num_heads
    if mod.bias_k is not None or mod.add_zero_attn:
        raise ValueError(
            f"load_weights: the MultiheadAttention at {path!r} was built with "
            + ("add_bias_kv=True" if mod.bias_k is not None else "add_zero_attn=True")
            + ", which eqx.nn.MultiheadAttention does not have. Port it with your own attention module."
        )
    has_bias = mod.in_proj_bias is not None
    out_bias = mod.out_proj.bias is not None
    _need(
        path,
        mod,
        base,
        target,
        eqx.nn.MultiheadAttention,
        {
            "num_heads": (heads, getattr(target, "num_heads", None)),
            "embed_dim (query_size)": (e, getattr(target, "query_size", None)),
            "kdim (key_size)": (mod.kdim, getattr(target, "key_size", None)),
            "vdim (value_size)": (mod.vdim, getattr(target, "value_size", None)),
            "embed_dim (output_size)": (e, getattr(target, "output_size", None)),
            "head_dim (qk_size)": (e // heads, getattr(target, "qk_size", None)),
            "head_dim (vo_size)": (e // heads, getattr(target, "vo_size", None)),
            "bias (use_query_bias, use_key_bias, use_value_bias)": (
                (has_bias,) * 3,
                tuple(getattr(target, f"use_{n}_bias", None) for n in ("query", "key", "value")),
            ),
            "out_proj bias (use_output_bias)": (out_bias, getattr(target, "use_output_bias", None)),
        },
    )
    at = lambda proj, n: base + (("attr", proj), ("attr", n))  # noqa: E731
    plan = []
    for i, proj in enumerate(("query_proj", "key_proj", "value_proj")):
        if mod._qkv_same_embed_dim:
            plan.append(_Assign(at(proj, "weight"), (_full(path, "in_proj_weight"),), _rows(i * e, (i + 1) * e)))
        else:
            own = ("q", "k", "v")[i] + "_proj_weight"
            plan.append(_Assign(at(proj, "weight"), (_full(path, own),), _identity))
        if has_bias:
            plan.append(_Assign(at(proj, "bias"), (_full(path, "in_proj_bias"),), _rows(i * e, (i + 1) * e)))
    plan.append(_Assign(at("output_proj", "weight"), (_full(path, "out_proj.weight"),), _identity))
    if out_bias:
        plan.append(_Assign(at("output_proj", "bias"), (_full(path, "out_proj.bias"),), _identity))
    return plan


def _rows(start: int, stop: int):
    return lambda x: x[start:stop]


_SPECIAL: dict = {
    torch.nn.GRUCell: _plan_gru,
    torch.nn.LSTMCell: _plan_lstm_cell,
    torch.nn.GRU: _plan_rnn,
    torch.nn.LSTM: _plan_rnn,
    torch.nn.RNN: _plan_elman,
    torch.nn.RNNCell: _plan_elman,
    torch.nn.MultiheadAttention: _plan_mha,
}


def _plan_state(model, module, state) -> list[tuple]:
    """``[(steps to an eqx.nn.BatchNorm, torch path)]`` whose running statistics go into ``state``.

    An ``eqx.nn.BatchNorm`` under a torch BatchNorm that tracks running statistics needs a ``State``.
    """
    out = []
    for path, mod in module.named_modules():
        if not (isinstance(mod, torch.nn.modules.batchnorm._NormBase) and mod.running_mean is not None):
            continue
        base = _steps_to(model, path, f"a {type(mod).__name__}")
        target = _get(model, base)
        if not isinstance(target, eqx.nn.BatchNorm):
            continue  # a hand-written batch norm: its fields of the buffers' names are filled by _plan
        if state is None:
            raise ValueError(
                f"load_weights: the torch {type(mod).__name__} at {path!r} has running statistics, which the "
                f"eqx.nn.BatchNorm at {_show(base)} keeps in an eqx.nn.State. Pass it: "
                "`model, state = load_weights(model, module, state=state)` (from eqx.nn.make_with_state)."
            )
        if target.mode != "ema":
            raise ValueError(
                f"load_weights: the eqx.nn.BatchNorm at {_show(base)} was built with mode={target.mode!r}; "
                f"only mode='ema' keeps running statistics as torch does (the torch {type(mod).__name__} at "
                f"{path!r}). Build it with mode='ema' (and momentum = 1 - torch's momentum)."
            )
        out.append((base, path))
    return out


def load_weights(model, module: "torch.nn.Module", *, state=None):
    """A copy of the equinox ``model`` with ``module``'s parameters in it, matched by path.

    Each torch parameter ``"<path>.<name>"`` goes into the equinox array found
    by following ``<path>`` in ``model`` (attributes; list indices; the
    ``layers`` of an ``eqx.nn.Sequential``, so torch ``"seq.0"`` is
    ``model.seq.layers[0]``) and then the field ``<name>``. ``Linear``,
    ``Embedding``, ``LayerNorm``, ``GroupNorm`` and the like copy as they are
    (equinox keeps PyTorch's ``(out, in)`` weight layout); ``Conv1d/2d/3d``
    and ``ConvTranspose1d/2d/3d`` biases are reshaped to equinox's
    ``(out, 1, ...)``, and a transposed convolution's kernel is rearranged to
    equinox's ``(out, in / groups, ...)`` and flipped. Layers whose equinox
    counterpart is laid out differently:

    - ``GRUCell`` / ``LSTMCell`` onto ``eqx.nn.GRUCell`` / ``eqx.nn.LSTMCell``
      (``bias_ih`` and ``bias_hh`` are folded into equinox's biases).
    - ``GRU`` / ``LSTM`` (any ``num_layers``, ``bidirectional``) onto a list
      with one entry per layer: a cell, or with ``bidirectional=True`` a list
      ``[forward, reverse]`` of cells; torch's ``weight_ih_l1_reverse`` goes
      into ``[1][1].weight_ih``. Layer ``k > 0`` takes ``directions *
      hidden_size`` inputs. Running the cells (a scan per layer and direction)
      is yours to write; the guide ``docs/guides/pytorch-weights.md`` has one.
    - ``MultiheadAttention`` onto ``eqx.nn.MultiheadAttention`` with the same
      ``num_heads`` and sizes: ``in_proj_weight`` / ``in_proj_bias`` are split
      into ``query_proj``, ``key_proj``, ``value_proj``; ``out_proj`` goes into
      ``output_proj``.
    - ``BatchNorm1d/2d/3d`` onto ``eqx.nn.BatchNorm(..., mode="ema")``: the
      weight and bias into the module, the running statistics into ``state``
      (an ``eqx.nn.State``, from ``eqx.nn.make_with_state``), and then the
      result is ``(model, state)``. Onto a hand-written batch norm, floating
      persistent buffers go into fields of their names.

    Parameters of your own modules copy by attribute name when the shapes
    agree, and so do floating persistent buffers where the equinox module has
    a field of the buffer's name (integer buffers such as
    ``num_batches_tracked`` are not copied; a persistent floating buffer with
    no such field is not copied either, with a warning that names it). ``model`` (and ``state``) may be
    abstract (``eqx.filter_eval_shape`` of its constructor: arrays as
    ``jax.ShapeDtypeStruct``), so a large port skips its random init. Values
    and dtypes come from torch. A parameter with no place to go, or a layer
    equinox cannot express (``nn.RNN``, attention with ``add_bias_kv``), is an
    error that names its path.

    ``model`` may also be a Flax NNX model (an ``nnx.Module``), matched by the
    names ``jaxtrace.tag_modules`` gives its modules; it returns a clone with
    the weights in Flax's layouts: ``Linear.weight`` transposed into
    ``kernel``, a conv weight ``(out, in, *k)`` as ``kernel (*k, in, out)``,
    ``Embedding.weight`` into ``embedding``, a norm's ``weight`` into
    ``scale``, ``BatchNorm``'s running statistics into ``mean`` / ``var``.

    Example:
        >>> import torch, jax, equinox as eqx, jaxtrace.torch as jtt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> key1, key2 = jax.random.split(jax.random.key(0))
        >>> model = eqx.nn.Sequential([eqx.nn.Linear(3, 4, key=key1), eqx.nn.Lambda(jax.numpy.tanh),
        ...                            eqx.nn.Linear(4, 2, key=key2)])
        >>> model = jtt.load_weights(model, net)
        >>> bool((model.layers[2].weight == net[2].weight.detach().numpy()).all())
        True
        >>> bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="ema")
        >>> bn, state = jtt.load_weights(bn, torch.nn.BatchNorm1d(4), state=state)
        >>> state.get(bn.ema_state_index)[1].tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    if state is not None and not isinstance(state, eqx.nn.State):
        raise TypeError(
            f"load_weights: state= must be an eqx.nn.State (from eqx.nn.make_with_state), got {type(state).__name__}."
        )
    flax_nnx = sys.modules.get("flax.nnx")  # never imported here: an nnx model means Flax is loaded
    if flax_nnx is not None and isinstance(model, flax_nnx.Module):
        if state is not None:
            raise TypeError(
                "load_weights: state= is for equinox models; an nnx model keeps its BatchNorm statistics "
                "itself, so call load_weights(model, module) without state=."
            )
        from ._torch_nnx import load_weights as load_nnx_weights

        return load_nnx_weights(model, module, _to_numpy)
    unplaced: list = []
    plan = _plan(model, module, unplaced=unplaced)
    if unplaced:
        warnings.warn(
            f"load_weights did not copy the torch buffer(s) {', '.join(map(repr, unplaced))}: the equinox "
            "modules there have no field of that name. Buffers that hold constants (masks, fill values) are "
            "usually rebuilt by the port and can be left; give the module a field of the buffer's name to copy one.",
            stacklevel=2,
        )
    batch_norms = _plan_state(model, module, state)
    values = {n: jnp.asarray(_to_numpy(p)) for n, p in [*module.named_parameters(), *module.named_buffers()]}
    if plan:
        new = [a.fn(*(values[n] for n in a.names)) for a in plan]
        model = eqx.tree_at(lambda m: [_get(m, a.steps) for a in plan], model, new)
    if state is None:
        return model
    if batch_norms:
        norms = [_get(model, steps) for steps, _ in batch_norms]

        def where(s):
            out = []
            for bn in norms:
                mean, var = s.get(bn.ema_state_index)
                out += [mean, var, s.get(bn.ema_first_time_index)]
            return out

        new = []
        for _, path in batch_norms:
            # Not the first call any more: training goes on from torch's statistics.
            new += [values[_full(path, "running_mean")], values[_full(path, "running_var")], jnp.array(False)]
        state = eqx.tree_at(where, state, new)
    return model, state


def named_grads(grads, module: "torch.nn.Module") -> dict:
    """The gradients of an equinox model, under ``module``'s ``named_parameters()`` names.

    ``grads`` has the equinox model's structure (as from ``eqx.filter_grad``,
    ``jt.grad`` of a partitioned model, ...). This is the adjoint of
    ``load_weights``: where one torch parameter feeds several equinox arrays
    (a ``GRUCell``'s ``bias_hh``) the gradients are summed, and a reshaped
    conv bias is reshaped back, so the result is the gradient with respect to
    the torch parameters and compares one to one with
    ``jaxtrace.torch.grad``'s ``param_grads``. Parameters whose equinox arrays
    have no gradient in ``grads`` (``None``) are left out.

    Example:
        >>> import torch, jax, equinox as eqx, jaxtrace.torch as jtt
        >>> net = torch.nn.Conv2d(1, 2, 3)
        >>> model = jtt.load_weights(eqx.nn.Conv2d(1, 2, 3, key=jax.random.key(0)), net)
        >>> model.bias.shape, jtt.named_grads(model, net)["bias"].shape
        ((2, 1, 1), (2,))
    """
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    out: dict = {}
    for a in _plan(grads, module, grads=True):
        ct = _get(grads, a.steps)
        if ct is None:
            continue
        ct = jnp.asarray(ct)
        primals = [jnp.zeros(shapes[n], ct.dtype) for n in a.names]
        _, pullback = jax.vjp(a.fn, *primals)
        for n, g in zip(a.names, pullback(ct)):
            out[n] = g if n not in out else out[n] + g
    return {n: np.asarray(out[n]) for n in shapes if n in out}
