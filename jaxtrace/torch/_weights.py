"""``jaxtrace.torch.load_weights`` / ``named_grads``: torch parameters into an equinox model and back.

Matched by path (a Flax NNX model: ``_nnx``); ``named_grads`` puts the model's gradients under torch's names."""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

from .._frameworks import is_nnx_module
from ._rules import Assign, PlanError, follow, full_name, identity, is_hf_conv1d, rule_for, show_steps
from ._tensors import to_numpy

__all__ = ["load_weights", "named_grads"]

API = "jaxtrace.torch.load_weights"


@contextlib.contextmanager
def errors_named(api: str):
    """Prefixes a ``PlanError`` raised inside with ``api``, the public function called."""
    try:
        yield
    except PlanError as error:
        error.args = (f"{api}: {error.args[0]}", *error.args[1:])
        raise


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
            raise PlanError(
                f"the torch module has {what} at {path!r}, but the equinox model has "
                f"nothing called {part!r} at {show_steps(steps)} (a {type(obj).__name__}). Build the equinox "
                "model with the same attribute names and list indices as the torch module's "
                "named_modules() paths."
            )
        steps.extend(new)
        obj = follow(obj, new)
    return tuple(steps)


def _plan(model, module, *, grads: bool = False, unplaced: list | None = None) -> list[Assign]:
    """How each array of ``model`` is made from ``module``'s parameters.

    With ``grads=True``, ``model`` is a gradient tree: arrays that are ``None``
    there (no gradient) are skipped instead of being an error. BatchNorm running
    statistics bound for an ``eqx.nn.State`` are planned by ``_plan_state``.
    Persistent floating buffers with no field of their name are appended to ``unplaced``.
    """
    plan: list[Assign] = []
    seen: set = set()
    consumed: set = set()  # parameters a layer rule planned (MultiheadAttention's out_proj too)
    first_name = {id(p): n for n, p in module.named_parameters()}  # a tied parameter's torch name
    for path, mod in module.named_modules():
        own = list(mod.named_parameters(recurse=False))
        direct = [(n, p) for n, p in own if id(p) not in seen]
        # Tied parameters (GPT-2's lm_head.weight is transformer.wte.weight): the same tensor
        # again under another path. They fill the port's field there too, if it has one.
        tied = [(n, p) for n, p in own if id(p) in seen and id(p) not in consumed]
        buffers = [
            (n, b)
            for n, b in mod.named_buffers(recurse=False)
            if not grads and id(b) not in seen and b.is_floating_point() and n not in mod._non_persistent_buffers_set
        ]
        seen.update(id(p) for _, p in direct)
        if not direct and not buffers:
            if tied:
                plan.extend(_plan_tied(model, path, mod, tied, first_name))
            continue
        kind = type(mod).__name__
        base = _steps_to(model, path, f"a {kind}")
        target = follow(model, base)
        # Floating buffers (BatchNorm running statistics) go into fields of their name where the
        # equinox module has one (eqx.nn.BatchNorm keeps them in its State instead: _plan_state).
        direct += [(n, b) for n, b in buffers if hasattr(target, n)]
        if unplaced is not None and not isinstance(target, eqx.nn.BatchNorm):  # its statistics: _plan_state
            unplaced += [full_name(path, n) for n, b in buffers if not hasattr(target, n)]
        seen.update(id(b) for _, b in buffers)
        if not direct:
            continue
        if isinstance(mod, torch.nn.Embedding) and mod.max_norm is not None:
            raise PlanError(
                f"the Embedding at {path!r} has max_norm={mod.max_norm}: torch renormalises the "
                "rows it looks up, in place, which eqx.nn.Embedding does not. Build it without max_norm (or "
                "renormalise the weight yourself) before porting."
            )
        rule = rule_for(mod)
        if rule is not None:
            whole = {id(p) for p in mod.parameters()}  # a rule plans the whole layer (MHA's out_proj too)
            seen.update(whole)
            consumed.update(whole)
            new = rule(path, mod, base, target)
            plan.extend(a for a in new if not grads or follow(model, a.steps) is not None)
            continue
        for name, p in direct:
            full = full_name(path, name)
            if not hasattr(target, name):
                raise PlanError(
                    f"the torch {kind} at {path!r} has the parameter {name!r}, but the "
                    f"equinox {type(target).__name__} at {show_steps(base)} has no field {name!r}."
                )
            leaf = getattr(target, name)
            if grads and leaf is None:
                continue
            _check_leaf(full, base, name, target, leaf)
            plan.append(Assign(base + (("attr", name),), (full,), _layout(full, mod, name, p, base, target, leaf)))
        for name, p in tied:
            assign = _tied_assign(path, mod, name, p, first_name, base, target)
            if assign is not None:
                plan.append(assign)
    return plan


def _check_leaf(full, base, name, target, leaf):
    if not (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):
        raise PlanError(
            f"the torch parameter {full!r} has no array to go into: the equinox "
            f"{type(target).__name__} at {show_steps(base)} has {name} = {leaf!r}"
            + (" (built with use_bias=False?)." if leaf is None else ".")
        )


def _layout(full, mod, name, p, base, target, leaf) -> Callable:
    """The map from torch's array to the equinox one (identity, transpose, reshape), or a shape error."""
    conv = isinstance(mod, torch.nn.modules.conv._ConvNd)
    shape, eshape = tuple(p.shape), tuple(leaf.shape)
    if conv and mod.transposed and name == "weight":
        fn = _conv_transpose_weight(mod.groups)  # torch (in, out/g, *k) -> equinox (out, in/g, *k), flipped
    elif is_hf_conv1d(mod) and name == "weight" and isinstance(target, eqx.nn.Linear):
        fn = _transpose  # Conv1D keeps (in, out); eqx.nn.Linear (out, in), as torch.nn.Linear
    elif shape == eshape:
        fn = identity
    elif conv and name == "bias" and eshape == shape + (1,) * (len(eshape) - len(shape)):
        fn = _reshaper(eshape)  # equinox keeps conv biases as (out, 1, 1)
    else:
        fn = None
    if fn is None or tuple(jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, leaf.dtype)).shape) != eshape:
        hint = "Build the equinox layer with the same sizes."
        if len(shape) == 2 and shape == eshape[::-1] and shape != eshape:
            hint = (
                "The sizes are the same but the layouts are each other's transpose: this torch layer keeps its "
                f"weight as {shape} and the equinox array is {eshape}. A layer that stores (in, out), such as "
                "transformers' Conv1D, goes into an eqx.nn.Linear (load_weights transposes a Conv1D's weight), "
                "or into your own module whose field has torch's shape."
            )
        raise PlanError(
            f"the torch parameter {full!r} has shape {shape}, but the equinox "
            f"array at {show_steps(base + (('attr', name),))} has shape {eshape}. {hint}"
        )
    return fn


def _tied_assign(path, mod, name, p, first_name, base, target) -> Assign | None:
    """The port's field for a tied parameter at ``path``: filled from the parameter's first name."""
    leaf = getattr(target, name, None)
    if leaf is None or not (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):
        return None  # the port reads the tied array from its first place, as torch does
    source = first_name[id(p)]
    fn = _layout(full_name(path, name) + f" (tied to {source!r})", mod, name, p, base, target, leaf)
    return Assign(base + (("attr", name),), (source,), fn)


def _plan_tied(model, path, mod, tied, first_name) -> list:
    """Tied parameters of a module with no parameters of its own (GPT-2's ``lm_head``)."""
    base = _try_steps(model, path)
    if base is None:
        return []  # the port has no module there: it reuses the tied array (self.wte.weight.T)
    target = follow(model, base)
    plan = []
    for name, p in tied:
        assign = _tied_assign(path, mod, name, p, first_name, base, target)
        if assign is not None:
            plan.append(assign)
    return plan


def _try_steps(model, path):
    try:
        return _steps_to(model, path, "a module")
    except ValueError:
        return None


def _transpose(x):
    return x.T


def _unfilled(model, plan) -> tuple[list, list]:
    """Paths of the model's arrays no assignment fills: ``(abstract ones, concrete ones)``."""
    filled = {show_steps(a.steps) for a in plan}
    abstract, concrete = [], []
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))[0]
    for path, leaf in flat:
        where = jax.tree_util.keystr(path)
        if where in filled:
            continue
        if isinstance(leaf, jax.ShapeDtypeStruct):
            abstract.append(where or "the model itself")
        elif eqx.is_array(leaf):
            concrete.append(where or "the model itself")
    return abstract, concrete


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


def _plan_state(model, module, state) -> list[tuple]:
    """``[(steps to an eqx.nn.BatchNorm, torch path)]`` whose running statistics go into ``state``.

    An ``eqx.nn.BatchNorm`` under a torch BatchNorm that tracks running statistics needs a ``State``.
    """
    out = []
    for path, mod in module.named_modules():
        if not (isinstance(mod, torch.nn.modules.batchnorm._NormBase) and mod.running_mean is not None):
            continue
        base = _steps_to(model, path, f"a {type(mod).__name__}")
        target = follow(model, base)
        if not isinstance(target, eqx.nn.BatchNorm):
            continue  # a hand-written batch norm: its fields of the buffers' names are filled by _plan
        if state is None:
            raise ValueError(
                f"{API}: the torch {type(mod).__name__} at {path!r} has running statistics, which the "
                f"eqx.nn.BatchNorm at {show_steps(base)} keeps in an eqx.nn.State. Pass it: "
                "`model, state = load_weights(model, module, state=state)` (from eqx.nn.make_with_state)."
            )
        if target.mode != "ema":
            raise ValueError(
                f"{API}: the eqx.nn.BatchNorm at {show_steps(base)} was built with mode={target.mode!r}; "
                f"only mode='ema' keeps running statistics as torch does (the torch {type(mod).__name__} at "
                f"{path!r}). Build it with mode='ema' (and momentum = 1 - torch's momentum)."
            )
        out.append((base, path))
    return out


def load_weights(model, module: "torch.nn.Module", *, state=None):
    """A copy of the equinox (or Flax NNX) ``model`` with ``module``'s parameters in it, matched by path.

    Each torch parameter ``"<path>.<name>"`` goes into the array found by
    following ``<path>`` in ``model`` (attributes, list indices, the ``layers``
    of an ``eqx.nn.Sequential``: torch ``"seq.0"`` is ``model.seq.layers[0]``)
    and then the field ``<name>``. Values and dtypes come from torch. Most
    layers copy as they are (equinox keeps PyTorch's ``(out, in)`` layout);
    conv biases, transposed-conv kernels, ``GRUCell`` / ``LSTMCell``, ``GRU`` /
    ``LSTM``, ``MultiheadAttention`` and ``BatchNorm`` are converted, and an NNX
    model gets Flax's layouts: the guides *PyTorch weights into equinox* and *Flax models* list each
    conversion. Persistent floating buffers go into fields of their names (one
    with no such field is left, with a warning that names it).

    Args:
        model: the equinox model (or ``nnx.Module``) to fill; it may be abstract
            (``eqx.filter_eval_shape`` of its constructor), so a large port
            skips its random init. It is not changed.
        module: the ``torch.nn.Module`` the values come from.
        state: the ``eqx.nn.State`` (from ``eqx.nn.make_with_state``) that the
            running statistics of ``eqx.nn.BatchNorm(..., mode="ema")`` layers go into.

    Returns:
        The filled copy of ``model``; with ``state``, ``(model, state)``.

    Raises:
        ValueError: if a parameter has no place to go (no module or field at its
            path, a different shape), or a layer has no equinox counterpart
            (``nn.RNN``, attention with ``add_bias_kv``); the message names the path.
        TypeError: if ``state`` is not an ``eqx.nn.State``, or is given for an NNX model.

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
            f"{API}: state= must be an eqx.nn.State (from eqx.nn.make_with_state), got {type(state).__name__}."
        )
    if is_nnx_module(model):
        if state is not None:
            raise TypeError(
                f"{API}: state= is for equinox models; an nnx model keeps its BatchNorm statistics "
                "itself, so call load_weights(model, module) without state=."
            )
        from ._nnx import load_weights as load_nnx_weights  # imports Flax, which an nnx model has loaded

        return load_nnx_weights(model, module)
    unplaced: list = []
    with errors_named(API):
        plan = _plan(model, module, unplaced=unplaced)
        batch_norms = _plan_state(model, module, state)
    _check_filled(model, plan, unplaced)
    values = {n: jnp.asarray(to_numpy(p)) for n, p in [*module.named_parameters(), *module.named_buffers()]}
    if plan:
        new = [a.fn(*(values[n] for n in a.names)) for a in plan]
        model = eqx.tree_at(lambda m: [follow(m, a.steps) for a in plan], model, new)
    if state is None:
        return model
    return model, _fill_state(model, state, batch_norms, values)


def _check_filled(model, plan: list, unplaced: list) -> None:
    """Warnings for the torch buffers with no place (``unplaced``) and the concrete arrays of
    ``model`` that ``plan`` leaves as they are; an error for the abstract arrays it leaves."""
    if unplaced:
        warnings.warn(
            f"{API} did not copy the torch buffer(s) {', '.join(map(repr, unplaced))}: the equinox "
            "modules there have no field of that name. Buffers that hold constants (masks, fill values) are "
            "usually rebuilt by the port and can be left; give the module a field of the buffer's name to copy one.",
            stacklevel=3,
        )
    abstract, concrete = _unfilled(model, plan)
    if abstract:
        raise ValueError(
            f"{API}: the abstract model has arrays that no torch parameter or buffer goes into: "
            f"{', '.join(abstract)}. They would stay jax.ShapeDtypeStructs and fail later. Give each a torch "
            "counterpart at the same path, or build them concretely (eqx.tree_at after load_weights, or a "
            "concrete model)."
        )
    if concrete:
        warnings.warn(
            f"{API} left these arrays of the equinox model as they were (no torch parameter or buffer "
            f"goes into them): {', '.join(concrete)}. If one is a weight, it keeps its random init; a torch "
            "parameter tied to another (GPT-2's lm_head.weight) fills every field at its paths.",
            stacklevel=3,
        )


def _fill_state(model, state, batch_norms: list, values: dict):
    """``state`` with the running statistics of the torch BatchNorms at ``batch_norms`` (from
    ``_plan_state``) in the ``eqx.nn.BatchNorm`` layers of the filled ``model``."""
    if not batch_norms:
        return state
    norms = [follow(model, steps) for steps, _ in batch_norms]

    def where(s):
        out = []
        for bn in norms:
            mean, var = s.get(bn.ema_state_index)
            out += [mean, var, s.get(bn.ema_first_time_index)]
        return out

    new = []
    for _, path in batch_norms:
        # Not the first call any more: training goes on from torch's statistics.
        new += [values[full_name(path, "running_mean")], values[full_name(path, "running_var")], jnp.array(False)]
    return eqx.tree_at(where, state, new)


def named_grads(grads, module: "torch.nn.Module") -> dict:
    """The gradients of an equinox model under ``module``'s ``named_parameters()`` names.

    The adjoint of ``load_weights``: where one torch parameter feeds several
    equinox arrays (a ``GRUCell``'s ``bias_hh``) the gradients are summed, and a
    reshaped conv bias is reshaped back, so the result is the gradient with
    respect to the torch parameters and compares one to one with
    ``jaxtrace.torch.grad``'s ``param_grads``.

    Args:
        grads: gradients with the equinox model's structure (from
            ``eqx.filter_grad``, ``jt.filter_grad``, ...).
        module: the ``torch.nn.Module`` whose names to use.

    Returns:
        ``{torch parameter name: NumPy array}``; parameters whose equinox
        arrays have no gradient in ``grads`` (``None``) are left out.

    Raises:
        ValueError: if ``grads`` does not have the structure ``load_weights``
            would fill from ``module``.

    Example:
        >>> import torch, jax, equinox as eqx, jaxtrace.torch as jtt
        >>> net = torch.nn.Conv2d(1, 2, 3)
        >>> model = jtt.load_weights(eqx.nn.Conv2d(1, 2, 3, key=jax.random.key(0)), net)
        >>> model.bias.shape, jtt.named_grads(model, net)["bias"].shape
        ((2, 1, 1), (2,))
    """
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    out: dict = {}
    with errors_named("jaxtrace.torch.named_grads"):
        plan = _plan(grads, module, grads=True)
    for a in plan:
        ct = follow(grads, a.steps)
        if ct is None:
            continue
        ct = jnp.asarray(ct)
        primals = [jnp.zeros(shapes[n], ct.dtype) for n in a.names]
        _, pullback = jax.vjp(a.fn, *primals)
        for n, g in zip(a.names, pullback(ct)):
            out[n] = g if n not in out else out[n] + g
    return {n: np.asarray(out[n]) for n in shapes if n in out}
