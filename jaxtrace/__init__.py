"""jaxtrace: gradients (and values) at intermediate values of JAX programs.

Mark values with ``jaxtrace.tag(x, "name")``; ``jaxtrace.grad``,
``value_and_grad`` and ``vjp`` return the gradients at those marks beside the
ordinary gradients, under ``jax.jit``, ``jax.vmap``, ``lax.scan`` and friends.
"""

from typing import TYPE_CHECKING

from ._ad import grad as grad
from ._ad import value_and_grad as value_and_grad
from ._ad import vjp as vjp
from ._forward import capture as capture
from ._forward import jvp as jvp
from ._forward import patch as patch
from ._sites import TagError as TagError
from ._tag import tag as tag

__version__ = "0.1.0"

# Equinox helpers (``_equinox.py``), imported on first use so that the core
# does not need equinox installed to be imported.
if TYPE_CHECKING:
    from ._equinox import filter_grad as filter_grad
    from ._equinox import filter_value_and_grad as filter_value_and_grad
    from ._equinox import tag_modules as tag_modules

_EQUINOX_NAMES = ("filter_grad", "filter_value_and_grad", "tag_modules")


def __getattr__(name: str):
    if name in _EQUINOX_NAMES:
        from . import _equinox

        return getattr(_equinox, name)
    raise AttributeError(f"module 'jaxtrace' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EQUINOX_NAMES])
