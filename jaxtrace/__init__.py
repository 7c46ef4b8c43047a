"""jaxtrace: gradients (and values) at intermediate values of JAX programs.

Mark values with ``jaxtrace.tag(x, "name")``; ``jaxtrace.grad``,
``value_and_grad`` and ``vjp`` return the gradients at those marks beside the
ordinary gradients, under ``jax.jit``, ``jax.vmap``, ``lax.scan`` and friends.
"""

import importlib
from typing import TYPE_CHECKING

from ._ad import grad as grad
from ._ad import jacrev as jacrev
from ._ad import value_and_grad as value_and_grad
from ._ad import vjp as vjp
from ._compare import Comparison as Comparison
from ._compare import compare as compare
from ._forward import capture as capture
from ._forward import jvp as jvp
from ._forward import patch as patch
from ._patch_grad import patch_grad as patch_grad
from ._per_example import clipped_grad as clipped_grad
from ._per_example import per_example_norms as per_example_norms
from ._sites import TagError as TagError
from ._tag import tag as tag
from . import _vmap_cond  # noqa: F401  (teaches jax.vmap of lax.cond to mask the tags in its branches)
from . import stats as stats
from ._version import __version__ as __version__

if TYPE_CHECKING:  # loaded on first use by __getattr__ below; listed here for type checkers
    from ._equinox import filter_grad as filter_grad
    from ._equinox import filter_value_and_grad as filter_value_and_grad
    from ._equinox import HookPoint as HookPoint
    from ._equinox import tag_modules as tag_modules

# Public names whose module imports an optional dependency (equinox), loaded on
# first use so that ``import jaxtrace`` costs plain-JAX and Flax users nothing.
_LAZY = {
    "filter_grad": "._equinox",
    "filter_value_and_grad": "._equinox",
    "tag_modules": "._equinox",
    "HookPoint": "._equinox",
}


def __getattr__(name: str):  # PEP 562: called only for names not (yet) in the module
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups, and vars(jaxtrace), see it directly
    return value


def __dir__() -> list:
    return sorted({*globals(), *_LAZY})
