"""What kind of leaf a value is: an array, what JAX can trace, an inexact array, a PRNG key.

One home for the leaf checks of the transforms, the module tagging and the argument checks; it
imports nothing of jaxtrace, so every module can use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["is_array", "is_array_like", "is_inexact_array", "is_key"]


def is_array(leaf) -> bool:
    """A JAX or NumPy array (or NumPy scalar); Python numbers are not."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def is_array_like(leaf) -> bool:
    """What JAX can trace as an input: arrays, NumPy scalars, Python numbers and bools."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return True
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype") and hasattr(leaf, "__jax_array__")


def is_inexact_array(leaf) -> bool:
    """A leaf to differentiate, as ``eqx.is_inexact_array`` says: an array of a floating or complex
    dtype. Python numbers are not: a model's ``Dropout(p=0.0)`` keeps its ``p`` a Python float."""
    return is_array(leaf) and jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def is_key(x) -> bool:
    """Whether the array ``x`` holds PRNG keys (never tagged: a key has no gradient)."""
    # jax.dtypes.issubdtype is public; JAX re-exports it without `as`, which the checker reads as private.
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # pyright: ignore[reportPrivateImportUsage]
