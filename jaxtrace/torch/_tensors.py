"""Small pytrees of torch tensors (tuples, lists, dicts, dataclasses) and tensors as NumPy arrays."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["describe", "flatten", "is_float_tensor", "map_leaves", "np_dtype", "to_numpy"]


def flatten(obj, plain: bool = False) -> tuple[list, Callable[[list], Any]]:
    """Leaves of a tuple / list / dict / dataclass nest, and a function that rebuilds it.

    The rebuilt nest keeps each container's type (a dict subclass such as Hugging Face's
    ``ModelOutput``, a NamedTuple, a dataclass, a tuple or list subclass), so the code that
    reads a hooked module's output (``out.last_hidden_state``) works as without hooks.
    ``plain=True`` rebuilds with JAX-friendly containers instead, for the NumPy results:
    dict subclasses and dataclasses as ``dict``, other tuple and list subclasses as
    ``tuple`` / ``list``; NamedTuples stay (JAX reads them).
    """
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        parts = [flatten(v, plain) for v in obj]
        return _join_parts(parts, lambda vs: type(obj)(*vs))
    if isinstance(obj, (tuple, list)):
        parts = [flatten(v, plain) for v in obj]
        kind = type(obj)
        if plain or kind in (tuple, list):
            return _join_parts(parts, tuple if isinstance(obj, tuple) else list)
        return _join_parts(parts, lambda vs: _rebuild_sequence(obj, vs))
    if isinstance(obj, dict):
        keys = list(obj)
        parts = [flatten(obj[k], plain) for k in keys]
        if plain or type(obj) is dict:
            return _join_parts(parts, lambda vs: dict(zip(keys, vs)))
        return _join_parts(parts, lambda vs: _rebuild_mapping(obj, keys, vs))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if f.init]
        parts = [flatten(getattr(obj, n), plain) for n in names]
        if plain:
            return _join_parts(parts, lambda vs: dict(zip(names, vs)))
        return _join_parts(parts, lambda vs: dataclasses.replace(obj, **dict(zip(names, vs))))
    return [obj], lambda leaves: leaves[0]


def _rebuild_sequence(obj, values):
    """A tuple / list subclass rebuilt with ``values``: its own type where it takes an iterable."""
    try:
        return type(obj)(values)
    except TypeError:
        return tuple(values) if isinstance(obj, tuple) else list(values)


def _rebuild_mapping(obj, keys, values):
    """A dict subclass (``ModelOutput``, ``OrderedDict``, ``defaultdict``) with new values, same type.

    A shallow copy keeps the type and whatever the constructor set (``default_factory``, a
    ``ModelOutput``'s attributes), and item assignment replaces the values (a ``ModelOutput``
    updates its attribute of the same name with it).
    """
    new = copy.copy(obj)
    for k, v in zip(keys, values):
        new[k] = v
    return new


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


def is_float_tensor(x) -> bool:
    """Whether ``x`` is a floating (or complex) tensor: one that can have a gradient."""
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


# Torch dtypes NumPy has no type of its own for: their ml_dtypes twins (ml_dtypes ships with JAX), read
# through an integer view of the same width, so the bits are kept exactly.
_ML_DTYPES = {
    "bfloat16": ("bfloat16", torch.int16),
    "float8_e4m3fn": ("float8_e4m3fn", torch.uint8),
    "float8_e5m2": ("float8_e5m2", torch.uint8),
    "float8_e4m3fnuz": ("float8_e4m3fnuz", torch.uint8),
    "float8_e5m2fnuz": ("float8_e5m2fnuz", torch.uint8),
}


def _ml_dtype(dtype: "torch.dtype"):
    """``(numpy dtype, integer torch dtype of the same width)`` for a dtype NumPy lacks, else ``None``."""
    entry = _ML_DTYPES.get(str(dtype).removeprefix("torch."))
    if entry is None:
        return None
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, entry[0])), entry[1]


def np_dtype(dtype: "torch.dtype") -> np.dtype:
    """The NumPy dtype of a torch dtype: ``ml_dtypes.bfloat16`` (float8 likewise) where NumPy has none."""
    ml = _ml_dtype(dtype)
    return ml[0] if ml is not None else torch.empty(0, dtype=dtype).numpy().dtype


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy copy of ``t`` in its own dtype (bfloat16 as ``ml_dtypes.bfloat16``, bit for bit)."""
    t = t.detach().cpu()
    ml = _ml_dtype(t.dtype)
    if ml is not None:
        return t.contiguous().view(ml[1]).numpy().view(ml[0]).copy()
    return t.numpy().copy()


def map_leaves(fn, obj):
    """``obj`` with ``fn`` applied to each leaf, its containers kept."""
    leaves, unflatten = flatten(obj)
    return unflatten([fn(x) for x in leaves])


def describe(x) -> str:
    """``x`` in words for an error message: a tensor's shape and dtype, else its type."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"
