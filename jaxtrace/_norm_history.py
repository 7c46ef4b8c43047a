"""``NormHistory``: the last N steps' per-example losses and per-leaf gradient norms, kept on device.

A ring buffer carried in the train state: ``push`` writes one step's losses ``(B,)`` and squared
gradient norms (``value_grad_and_norms``' ``sq_norms``: one ``(B,)`` array per leaf) into the
slot after the last, inside the jitted step; ``report`` reads it on the host when the loss
spikes and names the examples and leaves of that step whose gradient norms are furthest above
their typical value in the other steps held (``SpikeReport``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ._paths import param_path, path_name

__all__ = ["NormHistory", "SpikeReport"]


def _flat(sq_norms) -> tuple[tuple[str, ...], list]:
    """``(names, leaves)`` of a pytree of per-example squared norms, the names its dotted paths."""
    flat, _ = jax.tree_util.tree_flatten_with_path(sq_norms)
    return tuple(path_name(param_path(p)) or "(root)" for p, _ in flat), [leaf for _, leaf in flat]


@dataclasses.dataclass(frozen=True)
class NormHistory:
    """The last ``size`` steps' per-example losses and per-leaf squared gradient norms: a ring buffer.

    A pytree of fixed shapes, carried in the train state through the jitted step: ``push``
    returns a new history with one more step in the slot after the last one written (the oldest
    is overwritten once ``size`` steps are held). Its leaf names are static (part of the pytree
    structure), so ``jax.jit`` traces the step once. On a loss spike, ``report`` (on the host)
    names the examples and leaves of the step that spiked.

    Attributes:
        steps: ``(size,)`` int32, the step held in each slot; ``-1`` where none is.
        losses: ``(size, B)``, each held step's per-example losses.
        sq_norms: ``(size, B, L)``, each held step's squared gradient norms, per example and leaf.
        count: int32 scalar, the number of pushes so far; the next one goes to slot ``count % size``.
        names: the ``L`` leaf names (``"layers.0.weight"``), static.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> def losses(model, x, y):
        ...     return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
        >>> fun = eqx.filter_jit(jt.value_grad_and_norms(losses))
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> losses_, (grads, sq_norms) = fun(model, x, y)
        >>> history = jt.NormHistory.init(8, losses_, sq_norms)   # 8 steps, empty
        >>> history = history.push(losses_, sq_norms)             # step 0, in slot 0
        >>> history.sq_norms.shape, history.steps[:2].tolist(), history.names[:2]
        ((8, 4, 6), [0, -1], ('layers.0.weight', 'layers.0.bias'))
    """

    steps: jax.Array
    losses: jax.Array
    sq_norms: jax.Array
    count: jax.Array
    names: tuple = ()

    @classmethod
    def init(cls, size: int, losses, sq_norms) -> "NormHistory":
        """An empty history of ``size`` steps, shaped after one step's ``losses`` and ``sq_norms``.

        Args:
            size: the number of steps held, ``>= 1``.
            losses: one step's per-example losses, shape ``(B,)``; an array or a
                ``jax.ShapeDtypeStruct`` (what ``jax.eval_shape`` / ``eqx.filter_eval_shape`` of the
                step's ``value_grad_and_norms`` gives, at no cost).
            sq_norms: one step's per-example squared norms, a pytree of ``(B,)`` leaves (arrays or
                shapes), such as ``value_grad_and_norms``' ``sq_norms``.

        Returns:
            A ``NormHistory`` with every slot empty (``steps`` ``-1``, zeros elsewhere).

        Raises:
            ValueError: if ``size < 1`` or the shapes are not one ``(B,)`` per leaf.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"jaxtrace.NormHistory.init: size must be an int >= 1 (the number of steps held), got {size!r}.")
        names, leaves = _flat(sq_norms)
        batch = _batch_of(losses, names, leaves, "jaxtrace.NormHistory.init")
        dtype = jnp.result_type(*[leaf.dtype for leaf in leaves]) if leaves else jnp.float32
        return cls(
            steps=jnp.full((size,), -1, jnp.int32),
            losses=jnp.zeros((size, batch), losses.dtype),
            sq_norms=jnp.zeros((size, batch, len(names)), dtype),
            count=jnp.zeros((), jnp.int32),
            names=names,
        )

    @property
    def size(self) -> int:
        """The number of steps the history holds."""
        return self.steps.shape[0]

    def push(self, losses, sq_norms, step=None) -> "NormHistory":
        """A new history with this step's ``losses`` and ``sq_norms`` in the slot after the last.

        Functional and traceable (a ``dynamic_update_slice`` per array): call it in the jitted
        step. Donate the state to the step (``jax.jit(..., donate_argnums=...)``) and XLA writes
        the slot in place; otherwise the step copies the buffer (``size * B * L`` numbers).

        Args:
            losses: the step's per-example losses, ``(B,)``.
            sq_norms: the step's per-example squared norms, the structure the history was made
                with (its leaf names), each leaf ``(B,)``.
            step: the step's number, an integer scalar (may be traced); ``None``: the number of
                pushes before this one (``count``). Under ``eqx.filter_jit`` pass an array, not a
                Python int, or the step is compiled again for every value.

        Returns:
            The new ``NormHistory``.

        Raises:
            ValueError: if ``sq_norms`` has other leaves, or the shapes another batch size, than
                the history was made with.
        """
        names, leaves = _flat(sq_norms)
        if names != self.names:
            raise ValueError(
                f"jaxtrace.NormHistory.push: the squared norms have the leaves {list(names)}, the history was "
                f"made for {list(self.names)}: make it with NormHistory.init from this step's own sq_norms."
            )
        batch = _batch_of(losses, names, leaves, "jaxtrace.NormHistory.push")
        if batch != self.losses.shape[1]:
            raise ValueError(
                f"jaxtrace.NormHistory.push: a batch of {batch} examples, the history holds {self.losses.shape[1]} "
                "per step. Its shapes are fixed: drop or pad the last, smaller batch, or keep a history per batch size."
            )
        slot = self.count % self.size
        row = jnp.stack([jnp.asarray(leaf, self.sq_norms.dtype) for leaf in leaves], axis=-1) if leaves else self.sq_norms[0]
        step = self.count if step is None else jnp.asarray(step, jnp.int32)
        put = lambda held, value: jax.lax.dynamic_update_index_in_dim(held, jnp.asarray(value, held.dtype), slot, 0)  # noqa: E731
        # (``held.at[slot].set`` is a scatter: XLA:CPU checks its index and builds it, five small kernels more a step)
        return dataclasses.replace(
            self, steps=put(self.steps, step), losses=put(self.losses, losses), sq_norms=put(self.sq_norms, row), count=self.count + 1
        )

    def report(self, step: Optional[int] = None, top: int = 3) -> "SpikeReport":
        """Which examples and leaves of ``step`` have gradient norms furthest above their typical ones.

        On the host (one device-to-host copy of the history). "Typical" is the median over the other
        steps held and all their examples: per leaf, of that leaf's norm; for an example's whole
        gradient, of the whole norm. With no other step held, the medians are over ``step``'s own
        batch. Each ratio is a norm over its typical value (not squared).

        Args:
            step: the step to report, one the history holds; ``None``: the last one pushed.
            top: how many examples (worst first) and, for each, how many leaves to name.

        Returns:
            A ``SpikeReport``; ``print`` it for the summary.

        Raises:
            ValueError: if the history holds no step, or not ``step`` (the message lists those it holds).
        """
        steps, losses, sq, count = (np.asarray(a) for a in jax.device_get((self.steps, self.losses, self.sq_norms, self.count)))
        held = np.flatnonzero(steps >= 0)
        if held.size == 0:
            raise ValueError("jaxtrace.NormHistory.report: the history holds no step yet (push one first).")
        if step is None:
            slot = int((int(count) - 1) % len(steps))
        else:
            at = np.flatnonzero(steps == int(step))
            if at.size == 0:
                raise ValueError(f"jaxtrace.NormHistory.report: step {step} is not held; it holds steps {sorted(steps[held].tolist())}.")
            slot = int(at[-1])
        others = held[held != slot]
        base = sq[others] if others.size else sq[slot][None]
        with warnings.catch_warnings():  # a leaf whose held norms are all nan: its typical norm is nan
            warnings.simplefilter("ignore", RuntimeWarning)
            base_leaf = np.nanmedian(base.reshape(-1, sq.shape[2]), axis=0) if sq.shape[2] else np.zeros(0)
            base_total = np.nanmedian(base.sum(axis=2))
        leaf_ratios = _ratio(sq[slot], base_leaf)
        example_ratios = _ratio(sq[slot].sum(axis=1), base_total)
        order = _worst_first(example_ratios)[: max(int(top), 0)]
        return SpikeReport(
            step=int(steps[slot]),
            loss=float(np.mean(losses[slot])),
            typical_loss=float(np.median(losses[others].mean(axis=1))) if others.size else math.nan,
            examples=tuple(int(i) for i in order),
            leaves=tuple(tuple(self.names[j] for j in _worst_first(leaf_ratios[i])[: max(int(top), 0)]) for i in order),
            losses=losses[slot],
            example_ratios=example_ratios,
            leaf_ratios=leaf_ratios,
            names=self.names,
            compared_with=int(others.size),
        )


jax.tree_util.register_dataclass(NormHistory, data_fields=["steps", "losses", "sq_norms", "count"], meta_fields=["names"])


@dataclasses.dataclass(frozen=True)
class SpikeReport:
    """What ``NormHistory.report`` finds in one step: the examples and leaves furthest above their typical norms.

    Attributes:
        step: the step reported.
        loss: its mean loss.
        typical_loss: the median of the other held steps' mean losses (``nan`` if none is held).
        examples: the batch indices of the ``top`` examples whose whole gradient norm is the largest
            multiple of the typical one, worst first (a non-finite norm first of all).
        leaves: per example of ``examples``, its ``top`` leaves by the same ratio, worst first.
        losses: ``(B,)`` the step's per-example losses.
        example_ratios: ``(B,)`` each example's gradient norm over the typical example's.
        leaf_ratios: ``(B, L)`` each example's gradient norm per leaf over that leaf's typical norm.
        names: the ``L`` leaf names, the columns of ``leaf_ratios``.
        compared_with: the number of other steps the typical norms come from (0: the step's own batch).
    """

    step: int
    loss: float
    typical_loss: float
    examples: tuple
    leaves: tuple
    losses: np.ndarray
    example_ratios: np.ndarray
    leaf_ratios: np.ndarray
    names: tuple
    compared_with: int

    def __str__(self) -> str:
        against = f"the {self.compared_with} other steps held" if self.compared_with else "this step's batch (no other step held)"
        typical = f" (typically {self.typical_loss:.3g})" if not math.isnan(self.typical_loss) else ""
        lines = [f"step {self.step}: loss {self.loss:.3g}{typical}; gradient norms against {against}:"]
        index = {n: j for j, n in enumerate(self.names)}
        for i, leaves in zip(self.examples, self.leaves):
            per_leaf = ", ".join(f"{n} {_times(self.leaf_ratios[i, index[n]])}" for n in leaves)
            lines.append(f"  example {i}: loss {self.losses[i]:.3g}, gradient norm {_times(self.example_ratios[i], ' typical')}; {per_leaf}")
        return "\n".join(lines)


def _times(ratio: float, what: str = "") -> str:
    return "not finite" if math.isnan(ratio) else f"{ratio:.3g}x{what}"


def _batch_of(losses, names, leaves, where: str) -> int:
    shape = tuple(np.shape(losses))
    bad = [n for n, leaf in zip(names, leaves) if tuple(np.shape(leaf)) != shape]
    if len(shape) != 1 or bad:
        raise ValueError(
            f"{where}: takes one step's per-example losses, shape (B,), and squared norms, one (B,) array per "
            f"leaf (value_grad_and_norms' sq_norms); got losses of shape {shape}"
            + (f" and leaves {bad[:3]} of shapes {[tuple(np.shape(leaves[names.index(n)])) for n in bad[:3]]}" if bad else "")
            + "."
        )
    return shape[0]


def _ratio(sq: np.ndarray, typical_sq) -> np.ndarray:
    """``sqrt(sq / typical_sq)``: ``inf`` where the typical norm is 0 and this one is not, 1 where both are 0,
    ``nan`` where ``sq`` is."""
    sq, typical_sq = np.asarray(sq, np.float64), np.broadcast_to(np.asarray(typical_sq, np.float64), np.shape(sq))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.sqrt(sq / typical_sq)
    out = np.where(typical_sq == 0, np.where(sq == 0, 1.0, np.inf), out)
    return np.where(np.isnan(sq), np.nan, out)


def _worst_first(ratios: np.ndarray) -> np.ndarray:
    """Indices by ratio, largest first, ``nan`` (a non-finite norm) before all."""
    key = np.where(np.isnan(ratios), np.inf, ratios)
    return np.argsort(-key, kind="stable")
