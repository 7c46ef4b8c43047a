"""Which framework a model comes from (equinox, Flax NNX or Linen, PyTorch), without importing any.

Read from the classes and ``sys.modules``: a Flax or torch model means Flax or torch is loaded, so
asking never imports them. It imports nothing of jaxtrace, so every module can use it.
"""

from __future__ import annotations

import sys

__all__ = ["from_flax", "is_equinox_module", "is_nnx_module", "is_linen_module", "is_torch_module"]


def from_flax(model, package: str) -> bool:
    """Whether ``model``'s class comes from ``flax.<package>`` (``"nnx"``, ``"linen"``)."""
    return any(cls.__module__.startswith(f"flax.{package}.") for cls in type(model).__mro__)


def is_nnx_module(model) -> bool:
    """Whether ``model`` is a Flax ``nnx.Module`` (not an ``nnx.Variable``, ``nnx.State``, ``nnx.Rngs``)."""
    if not from_flax(model, "nnx"):  # no class of flax.nnx in its MRO (and maybe Flax not imported)
        return False
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def is_linen_module(model) -> bool:
    """Whether ``model`` is a Flax Linen module (an instance, not a class)."""
    if not from_flax(model, "linen"):
        return False
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(model, linen.Module)


def is_equinox_module(x) -> bool:
    """Whether ``x`` is an ``equinox.Module``."""
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def is_torch_module(x) -> bool:
    """Whether ``x`` is a ``torch.nn.Module``."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)
