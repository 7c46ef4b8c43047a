"""``jaxtrace.torch.load_weights`` into a Flax NNX model.

The NNX model is matched to the torch module by the names ``jt.tag_modules``
gives it (PyTorch's ``named_modules()`` names: attributes, list indices, an
``nnx.Sequential``'s children by index). Per module kind, torch's parameter
names and layouts become Flax's: ``Linear.weight (out, in)`` is
``kernel (in, out)``, a ``ConvNd`` weight ``(out, in, *k)`` is ``kernel (*k,
in, out)``, ``Embedding.weight`` is ``embedding``, a norm's ``weight`` is
``scale``, ``BatchNorm``'s ``running_mean`` / ``running_var`` are ``mean`` /
``var``; other parameters and floating buffers go to the attribute of their
own name when the shapes agree.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from ..flax._nnx import named_modules
from ._tensors import to_numpy


def _layout(module: torch.nn.Module, name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """The Flax attribute name and array for torch's ``module.<name>``."""
    if isinstance(module, torch.nn.Linear) and name == "weight":
        return "kernel", value.T
    if _is_hf_conv1d(module) and name == "weight":  # transformers' Conv1D keeps (in, out): Flax's kernel
        return "kernel", value
    if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) and name == "weight":
        return "kernel", np.transpose(value, (*range(2, value.ndim), 1, 0))
    if isinstance(module, torch.nn.Embedding) and name == "weight":
        return "embedding", value
    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm)
    if isinstance(module, norms) and name == "weight":
        return "scale", value
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and name in ("running_mean", "running_var"):
        return {"running_mean": "mean", "running_var": "var"}[name], value
    return name, value


def _is_hf_conv1d(mod) -> bool:
    return type(mod).__name__ == "Conv1D" and type(mod).__module__.startswith("transformers") and hasattr(mod, "nf")


def load_weights(model: nnx.Module, module: torch.nn.Module) -> nnx.Module:
    """A clone of ``model`` with ``module``'s parameters and floating buffers in Flax's layouts.

    A tied parameter (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) fills the
    variable at each of its paths that the model has; an ``nnx.Param`` no torch tensor goes
    into is a warning that names it.
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
        variable.value = jnp.asarray(value)
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
