"""Watching a tensor's memory: in-place marks that report every later use, and outputs that alias inputs."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

__all__ = ["Alias", "can_mark", "mark", "storage"]


class _Mark(torch.autograd.Function):
    """An identity applied in place (``mark_dirty``): from here on every use of the tensor's memory,
    through any reference, sends its gradient through this node, whose ``backward`` reports it."""

    @staticmethod
    def forward(ctx, x, report):
        ctx.mark_dirty(x)
        ctx.report = report
        return x

    @staticmethod
    def backward(ctx, g):
        new = ctx.report(g)
        return (g if new is None else new), None


# Marking writes nothing, so the version counter that autograd checks saved tensors against is put
# back (without it, a tensor that an earlier op saved, a tanh's output, would fail at backward).
_preserve_version = getattr(torch.autograd.grad_mode, "_unsafe_preserve_version_counter", None)


def can_mark(t) -> bool:
    """Whether ``mark`` can put an in-place identity node on ``t``: a non-leaf, non-view tensor
    that requires grad, on a torch that can put the version counter back."""
    # Views are left out: in-place on a view rebases its base, and a view whose version is put back
    # keeps a stale history (autograd then crashes on a later register_hook).
    return _preserve_version is not None and t.requires_grad and not t.is_leaf and not t._is_view()


def mark(t, report: Callable) -> bool:
    """Puts an in-place identity node on ``t`` whose backward calls ``report(g)``.

    Args:
        t: the tensor whose memory to watch.
        report: called with the gradient that arrives; a tensor it returns replaces that gradient.

    Returns:
        Whether ``t`` was marked (``False``: autograd cannot mark it; watch a view instead).
    """
    if not can_mark(t):
        return False
    try:
        with _preserve_version(t):
            _Mark.apply(t, report)
    except RuntimeError:  # a tensor autograd refuses to change in place: keep the view alone
        return False
    return True


def storage(t) -> int | None:
    """The address of ``t``'s memory, or ``None`` where it has none (meta, some subclasses)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, some tensor subclasses)
        return None


@dataclasses.dataclass
class Alias:
    """A watched output that shares memory with one of the module's inputs."""

    tensor: Any  # the module's own output tensor (for an input: the caller's tensor)
    version: int  # its memory's version when the module returned (was called)
    marked: bool = False  # an in-place identity node watches the memory itself
    frozen: bool | None = None  # for an input: whether the call changed it, once it returned

    def changed(self) -> bool:
        """Whether the memory was changed in place after the module returned (for an input:
        during the call)."""
        return self.frozen if self.frozen is not None else self.tensor._version != self.version
