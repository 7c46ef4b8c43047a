"""One call of a watched module: its tensors' shapes, gradients and values; repeated calls stacked."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from ._tensors import flatten

__all__ = ["Call", "stack_calls"]


@dataclasses.dataclass
class Call:
    """One call of one hooked site: the tensors' shapes and, after backward, their gradients."""

    unflatten: Callable  # rebuilds the nest with plain containers (dict for a ModelOutput)
    shapes: list  # per leaf: (shape, numpy dtype) or None when the leaf has no gradient
    grads: list  # per leaf: np.ndarray once its hook fired
    values: list = dataclasses.field(default_factory=list)  # with_values: per leaf, a copy at the call
    # (leaf j, output Call, its leaf i): an input the module returned as it is (nn.Identity); the
    # uses of the returned tensor are uses inside the call, read at the output's watch.
    links: list = dataclasses.field(default_factory=list)

    def leaf(self, i: int):
        info, g = self.shapes[i], self.grads[i]
        if info is None:
            return None
        g = g if g is not None else np.zeros(info[0], info[1])
        for j, other, k in self.links:
            if j == i:
                g = g + other.leaf(k)
        return g

    def result(self) -> Any:
        return self.unflatten([self.leaf(i) for i in range(len(self.shapes))])

    def value(self) -> Any:
        return self.unflatten([None if info is None else v for info, v in zip(self.shapes, self.values)])


def stack_calls(api: str, name: str, calls: list, values: list):
    """The results of a module's repeated calls stacked on a new leading axis, in call order.

    Args:
        api: the public function called, which the error names.
        name: the module's path.
        calls: its ``Call`` records.
        values: one result per call (gradients or values), nests of NumPy arrays or ``None``.

    Returns:
        One nest of the calls' structure, each array with the calls on a new leading axis.

    Raises:
        ValueError: if the calls' shapes or structures differ.
    """
    first = calls[0]
    structure = jax.tree_util.tree_structure(values[0])
    for c, v in zip(calls[1:], values[1:]):
        if c.shapes != first.shapes or jax.tree_util.tree_structure(v) != structure:
            shapes = "; ".join(str([s[0] if s else None for s in cc.shapes]) for cc in calls)
            raise ValueError(
                f"{api}: the module {name!r} was called {len(calls)} times with different "
                f"output shapes or structures ({shapes}), so its calls cannot be stacked. Leave it out "
                "with where=, or give each call its own module."
            )
    leaves = [flatten(v)[0] for v in values]
    stacked = [None if first.shapes[i] is None else np.stack([lv[i] for lv in leaves]) for i in range(len(leaves[0]))]
    return flatten(values[0])[1](stacked)
