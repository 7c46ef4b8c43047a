"""``jaxtrace.torch.load_weights`` into a Flax NNX model.

The NNX model is matched to the torch module by the names ``jt.tag_modules``
gives it (PyTorch's ``named_modules()`` names: attributes, list indices, an
``nnx.Sequential``'s children by index). Per module kind, torch's parameter
names and layouts become Flax's: ``Linear.weight (out, in)`` is
``kernel (in, out)``, a ``ConvNd`` weight ``(out, in, *k)`` is ``kernel (*k,
in, out)``, ``Embedding.weight`` is ``embedding``, a norm's ``weight`` is
``scale``, ``BatchNorm``'s ``running_mean`` / ``running_var`` are ``mean`` /
``var``; other parameters and floating buffers go to the attribute of their
own name when the shapes agree. The conversions are one table, ``LAYOUTS``.
"""

from __future__ import annotations

import warnings
from typing import Callable

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from ..flax._nnx import named_modules
from ._rules import is_hf_conv1d
from ._tensors import to_numpy

__all__ = ["LAYOUTS", "load_weights"]


def _isa(*classes: type) -> Callable[[torch.nn.Module], bool]:
    return lambda module: isinstance(module, classes)


def _keep(value: np.ndarray) -> np.ndarray:
    return value


def _transpose(value: np.ndarray) -> np.ndarray:
    return value.T


def _channels_last(value: np.ndarray) -> np.ndarray:  # torch (out, in, *k) -> Flax (*k, in, out)
    return np.transpose(value, (*range(2, value.ndim), 1, 0))


_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm

# (which modules, torch's name, Flax's attribute, torch's array -> Flax's): the first entry that
# matches a module and a name decides; a name no entry matches keeps its name and array.
LAYOUTS: list[tuple[Callable[[torch.nn.Module], bool], str, str, Callable[[np.ndarray], np.ndarray]]] = [
    (_isa(torch.nn.Linear), "weight", "kernel", _transpose),
    (is_hf_conv1d, "weight", "kernel", _keep),  # transformers' Conv1D keeps (in, out): Flax's kernel
    (_isa(torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d), "weight", "kernel", _channels_last),
    (_isa(torch.nn.Embedding), "weight", "embedding", _keep),
    (_isa(torch.nn.LayerNorm, torch.nn.GroupNorm, _BATCH_NORM), "weight", "scale", _keep),
    (_isa(_BATCH_NORM), "running_mean", "mean", _keep),
    (_isa(_BATCH_NORM), "running_var", "var", _keep),
]


def _layout(module: torch.nn.Module, name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """The Flax attribute name and array for torch's ``module.<name>``, from ``LAYOUTS``."""
    for matches, torch_name, attr, convert in LAYOUTS:
        if name == torch_name and matches(module):
            return attr, convert(value)
    return name, value


def load_weights(model: nnx.Module, module: torch.nn.Module) -> nnx.Module:
    """A clone of ``model`` with ``module``'s parameters and floating buffers in Flax's layouts.

    A tied parameter (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) fills the
    variable at each of its paths that the model has; an ``nnx.Param`` no torch tensor goes
    into is a warning that names it. ``jaxtrace.torch.load_weights`` calls it for an NNX model.

    Args:
        model: the ``nnx.Module`` to fill; it is not changed.
        module: the ``torch.nn.Module`` the values come from.

    Returns:
        The filled clone of ``model``.

    Raises:
        ValueError: if a torch tensor has no module or variable of its shape to go into.
    """
    out = nnx.clone(model)
    named = {name: m for name, _, m in named_modules(out)}
    floating = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    seen: set = set()
    filled: set = set()
    for full, tensor in [*module.named_parameters(remove_duplicate=False), *floating]:
        path, _, name = full.rpartition(".")
        target = named.get(path)
        tied = id(tensor) in seen  # a tied parameter again, under another path
        seen.add(id(tensor))
        if tied:
            attr, _ = _layout(module.get_submodule(path), name, to_numpy(tensor))
            if target is None or not isinstance(getattr(target, attr, None), nnx.Variable):
                continue  # the port reads the tied array from its first place, as torch does
        if target is None:
            raise ValueError(
                f"jaxtrace.torch.load_weights: the torch module has {full!r}, but the nnx model has no module at {path!r}. "
                f"Its modules are: {', '.join(repr(n) for n in named)}. Build the nnx model with the same "
                "attribute names and list indices as the torch module's named_modules() paths."
            )
        attr, value = _layout(module.get_submodule(path), name, to_numpy(tensor))
        variable = getattr(target, attr, None)
        if not isinstance(variable, nnx.Variable) or tuple(np.shape(variable[...])) != value.shape:
            found = (
                f"a variable of shape {tuple(np.shape(variable[...]))}"
                if isinstance(variable, nnx.Variable)
                else "no variable"
            )
            raise ValueError(
                f"jaxtrace.torch.load_weights: torch's {full!r} (shape {tuple(tensor.shape)}) goes to {attr!r} of the nnx "
                f"module at {path!r} as shape {value.shape}, but that module ({type(target).__name__}) has "
                f"{found} there."
            )
        _set(variable, jnp.asarray(value))
        filled.add(id(variable))
    unfilled = [
        f"{path}.{attr}" if path else attr
        for path, m in named.items()
        for attr, v in vars(m).items()
        if isinstance(v, nnx.Param) and id(v) not in filled
    ]
    if unfilled:
        warnings.warn(
            f"load_weights left these nnx.Params as they were (no torch parameter goes into them): "
            f"{', '.join(unfilled)}. If one is a weight, it keeps its random init.",
            stacklevel=3,
        )
    return out


def _set(variable, value) -> None:
    """``variable``'s value replaced by ``value``: ``set_value`` where flax has it (0.12.x later
    releases deprecate the ``.value`` setter), the setter before."""
    set_value = getattr(variable, "set_value", None)
    if set_value is not None:
        set_value(value)
    else:
        variable.value = value
