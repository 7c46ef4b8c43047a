"""Small pytrees of torch tensors (tuples, lists, dicts) and tensors as NumPy arrays."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch


def flatten(obj) -> tuple[list, Callable[[list], Any]]:
    """Leaves of a tuple / list / dict nest, and a function that rebuilds it."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        parts = [flatten(v) for v in obj]
        return _join_parts(parts, lambda vs: type(obj)(*vs))
    if isinstance(obj, (tuple, list)):
        parts = [flatten(v) for v in obj]
        return _join_parts(parts, type(obj))
    if isinstance(obj, dict):
        keys = list(obj)
        parts = [flatten(obj[k]) for k in keys]
        return _join_parts(parts, lambda vs: dict(zip(keys, vs)))
    return [obj], lambda leaves: leaves[0]


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
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def np_dtype(dtype: "torch.dtype") -> np.dtype:
    return np.dtype("float32") if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().copy()


def map_leaves(fn, obj):
    leaves, unflatten = flatten(obj)
    return unflatten([fn(x) for x in leaves])


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"
