"""jaxtrace: gradients (and values) at intermediate values of JAX programs.

Mark values with ``jaxtrace.tag(x, "name")``; ``jaxtrace.grad``,
``value_and_grad`` and ``vjp`` return the gradients at those marks beside the
ordinary gradients, under ``jax.jit``, ``jax.vmap``, ``lax.scan`` and friends.
"""

from ._ad import grad as grad
from ._ad import jacrev as jacrev
from ._ad import value_and_grad as value_and_grad
from ._ad import vjp as vjp
from ._compare import Comparison as Comparison
from ._compare import compare as compare
from ._equinox_grad import filter_grad as filter_grad
from ._equinox_grad import filter_jacrev as filter_jacrev
from ._equinox_grad import filter_value_and_grad as filter_value_and_grad
from ._equinox import HookPoint as HookPoint
from ._forward import capture as capture
from ._forward import jvp as jvp
from ._forward import patch as patch
from ._tag_modules import tag_modules as tag_modules
from ._nonfinite import find_nonfinite as find_nonfinite
from ._norm_history import NormHistory as NormHistory
from ._norm_history import SpikeReport as SpikeReport
from ._nonfinite import NonfiniteReport as NonfiniteReport
from ._patch_grad import patch_grad as patch_grad
from ._per_example import clipped_grad as clipped_grad
from ._per_example import per_example_audit as per_example_audit
from ._per_example import PerExampleAudit as PerExampleAudit
from ._per_example import per_example_norms as per_example_norms
from ._per_example import value_grad_and_norms as value_grad_and_norms
from ._errors import TagError as TagError
from ._tag import tag as tag
from . import _vmap_cond  # noqa: F401  (teaches jax.vmap of lax.cond to mask the tags in its branches)
from . import stats as stats
from ._stateful import register_room as _register_room
from ._version import __version__ as __version__

# NNX state (RNG counts, batch statistics) is lifted into every transform's trace by the Flax room,
# loaded by name when a program first holds an NNX object: the core below names no integration.
_register_room("flax.nnx", lambda: __import__("jaxtrace.flax._state", fromlist=["lift"]))

__all__ = [
    "tag",
    "grad",
    "value_and_grad",
    "vjp",
    "jacrev",
    "capture",
    "jvp",
    "patch",
    "patch_grad",
    "per_example_norms",
    "value_grad_and_norms",
    "NormHistory",
    "SpikeReport",
    "clipped_grad",
    "per_example_audit",
    "PerExampleAudit",
    "find_nonfinite",
    "NonfiniteReport",
    "TagError",
    "compare",
    "Comparison",
    "tag_modules",
    "filter_grad",
    "filter_value_and_grad",
    "filter_jacrev",
    "HookPoint",
    "stats",
]
