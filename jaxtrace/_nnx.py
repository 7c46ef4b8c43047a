"""The old home of Flax NNX tagging, which is now ``jaxtrace.flax._nnx``.

Kept because a pickle of a tagged NNX model names the function that rebuilds it
and the spec it passes: pickles made before the move name ``jaxtrace._nnx._restore``
and ``jaxtrace._nnx._ModuleTag``, and still load.
"""

from ._module_tags import ModuleTag as _ModuleTag  # noqa: F401
from .flax._nnx import restore as _restore  # noqa: F401

__all__: list = []  # nothing public: only the pickled names above
