"""A convolution's per-example weight gradient without the patch tensor.

Example ``i``'s weight gradient of a convolution is, for each kernel offset ``k``, the input
shifted by ``k`` (a strided slice of the padded, dilated input) against the output gradient:
``G_i[o, c, k] = sum_t g_i[o, t] x_i[c, t + k]``. ``ConvUse`` holds one call's input and output
gradient and forms ``G_i`` as one block per offset, one batched contraction of the shifted input
(channels last) against ``g`` each, never the ``(B, T, C * prod(k))`` patches
(``conv_general_dilated_patches`` builds them with a one-hot convolution, several times the cost
of the layer on XLA:CPU; on issue 33's CNN one contraction over concatenated patches cost more
than the nine). From the blocks: the squared norm, and the clipped sum ``sum_i w_i G_i`` (the same
blocks, shared by the two in one program). A grouped convolution (``feature_group_count = G``;
depthwise: ``G = C``) contracts each group's output channels with that group's input channels
alone: the leaf is ``(O, C / G, *k)`` and the same contractions run with a group axis. Where the
Gram ("ghost") form takes fewer multiplications (few output positions ``T`` against wide
channels) the norm comes from the patches, built from the same slices, and the clipped sum is the
convolution's own weight gradient of the weighted ``g``.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from ._factors import HIGHEST, Use, example_weights, finite

__all__ = ["ConvUse", "conv_pads", "conv_sq_norm", "conv_weighted_sum"]

FEW_CHANNELS = 8  # below this many input channels a group's offsets share one contraction (``ConvUse.per_offset``)


def conv_pads(spatial: tuple, kernel: tuple, strides: tuple, padding, lhs_dilation: tuple, rhs_dilation: tuple) -> tuple:
    """``padding`` (``"SAME"``, ``"SAME_LOWER"``, ``"VALID"`` or ``(lo, hi)`` pairs) as the pairs
    ``lax.conv_general_dilated`` applies to the dilated input of spatial shape ``spatial``."""
    if isinstance(padding, str):
        dilated = tuple(0 if s == 0 else (s - 1) * d + 1 for s, d in zip(spatial, lhs_dilation))
        window = tuple((k - 1) * d + 1 for k, d in zip(kernel, rhs_dilation))
        padding = jax.lax.padtype_to_pads(dilated, window, strides, padding)
    return tuple((int(lo), int(hi)) for lo, hi in padding)


@dataclasses.dataclass(frozen=True)
class ConvUse:
    """One convolution call's factors: input ``x`` ``(B, L, C, *S)`` and output gradient ``g``
    ``(B, L, O, *S_out)``, channels first; the leaf is ``(O, C / groups, *k)``, or
    ``(*k, C / groups, O)`` where ``out_last`` (NNX's kernel). Output channel ``o`` reads the input
    channels of group ``o // (O / groups)`` (``lax.conv_general_dilated``'s ``feature_group_count``)."""

    x: jax.Array
    g: jax.Array
    kernel: tuple
    strides: tuple
    pads: tuple
    lhs_dilation: tuple
    rhs_dilation: tuple
    out_last: bool
    groups: int = 1

    @property
    def positions(self) -> int:
        """Output positions per example, over its ``L`` calls: the Gram matrices' side."""
        return int(np.prod(self.g.shape[1:2] + self.g.shape[3:], dtype=int))

    def gram(self) -> bool:
        """Whether the norm takes the Gram form: fewer multiplications than ``G_i``'s.

        Per example and group the Gram form costs ``T * T * (C * K + O)`` (the patches' and the
        output gradients' ``T x T`` products), ``G_i`` costs ``T * C * K * O``, so the Gram form only
        where ``T * (C * K + O) < C * K * O``, with ``C`` and ``O`` a group's channels. That is stricter than Opacus's ``T * T < C * K * O``
        (which compares the two's memory, and which it implies): on XLA:CPU a ``(64, 64)`` Gram
        against a ``64 x 576`` patch width was the slower of the two.
        """
        ck = self.x.shape[2] // self.groups * int(np.prod(self.kernel, dtype=int))
        o = self.g.shape[2] // self.groups
        return self.positions * (ck + o) < ck * o

    def _shifted(self, dtype) -> list:
        """The input seen by each kernel offset (C order), channels last: ``(B, L, T, C)`` each.

        Channels last, as XLA:CPU lays out a convolution's operands: each view is then a strided
        copy of whole channel rows of the padded input, and each offset's contraction over ``T`` reads
        its rows as they lie (channels first, every view was a transposing copy).
        """
        b, l, c = self.x.shape[:3]
        xs = jnp.moveaxis(self.x.reshape(b * l, c, *self.x.shape[3:]).astype(dtype), 1, -1)
        config = [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(self.pads, self.lhs_dilation)] + [(0, 0, 0)]
        xp = jax.lax.pad(xs, jnp.zeros((), dtype), config)
        out = self.g.shape[3:]
        views = []
        for offset in np.ndindex(*self.kernel):
            start = [k * d for k, d in zip(offset, self.rhs_dilation)]
            stop = [s + (n - 1) * st + 1 for s, n, st in zip(start, out, self.strides)]
            view = jax.lax.slice(xp, (0, *start, 0), (b * l, *stop, c), (1, *self.strides, 1))
            views.append(view.reshape(b, l, -1, c))
        return views

    def _g(self, dtype):
        """The output gradient ``(B, L, G, O / G, T)``: channels split by group."""
        b, l, o = self.g.shape[:3]
        return self.g.reshape(b, l, self.groups, o // self.groups, -1).astype(dtype)

    def _grouped(self, v) -> jax.Array:
        """A view ``(B, L, T, C)`` -> ``(B, L, T, G, C / G)``: the channels split by group."""
        return v.reshape(*v.shape[:3], self.groups, v.shape[3] // self.groups)

    def per_offset(self, dtype) -> list:
        """``G_i`` in blocks along the kernel offsets (C order), the shifted input against the output
        gradient, one batched contraction per block: one block per offset, ``(B, G, O / G, C / G)``
        each; or, where a group has fewer than ``FEW_CHANNELS`` input channels, one block of every
        offset, ``(B, G, O / G, K * C / G)`` (offset-major: the views side by side). Kept apart, the
        blocks give the squared norm and the weighted sum without a copy of ``G_i`` into the leaf's
        layout. (Nine contractions whose outputs are ``O x 3`` cost XLA:CPU more than one ``O x 27``:
        on the benchmark CNN's first layer 2.2-2.3 ms against 1.7 ms, JAX 0.10.2 and 0.12; from 8
        channels the nine cost the same or less.)"""
        g = self._g(dtype)
        views = [self._grouped(v) for v in self._shifted(dtype)]
        if self.x.shape[2] // self.groups < FEW_CHANNELS:
            views = [jnp.concatenate(views, axis=-1)]
        return [jnp.einsum("bltgc,blgot->bgoc", v, g, precision=HIGHEST) for v in views]

    def leaf_layout(self, blocks: list) -> jax.Array:
        """Blocks of ``per_offset`` (each ``(*lead, G, O / G, n * C / G)``, ``lead`` the examples' axis or
        none) in the leaf's layout: ``(*lead, O, C / G, *k)``, or ``(*lead, *k, C / G, O)`` where ``out_last``."""
        grad = jnp.concatenate(blocks, axis=-1)
        lead = grad.shape[:-3]
        k = int(np.prod(self.kernel, dtype=int))
        grad = jnp.swapaxes(grad.reshape(*lead, self.g.shape[2], k, self.x.shape[2] // self.groups), -1, -2)
        grad = grad.reshape(*lead, self.g.shape[2], self.x.shape[2] // self.groups, *self.kernel)
        axes = (len(lead), len(lead) + 1)
        return jnp.moveaxis(grad, axes, (-1, -2)) if self.out_last else grad

    def per_example(self, dtype) -> jax.Array:
        """``G_i`` for every example, ``(B, *leaf shape)``."""
        return self.leaf_layout(self.per_offset(dtype))

    def weight_grad(self, cotangent, dtype) -> jax.Array:
        """The convolution's own weight gradient (summed over the examples) for an output gradient
        ``cotangent`` shaped like ``g``, in the leaf's layout: XLA's weight-gradient convolution, as the
        plain backward forms it."""
        b, l, c = self.x.shape[:3]
        x = self.x.reshape(b * l, c, *self.x.shape[3:]).astype(dtype)
        kernel = jnp.zeros((self.g.shape[2], c // self.groups, *self.kernel), dtype)

        def conv(w):
            return jax.lax.conv_general_dilated(
                x, w, self.strides, self.pads, self.lhs_dilation, self.rhs_dilation,  # (N, C, *S), (O, I, *k)
                feature_group_count=self.groups, precision=HIGHEST)

        ct = cotangent.reshape(b * l, *cotangent.shape[2:]).astype(dtype)
        grad = jax.vjp(conv, kernel)[1](ct)[0]  # (O, C / G, *k)
        return jnp.moveaxis(grad, (0, 1), (-1, -2)) if self.out_last else grad

    def _patches(self, dtype) -> tuple:
        """Each group's input patches and output gradients at every position: ``(B, G, L * T, C / G * K)``
        (the patch features in the leaf's order, ``(C / G, *k)``, or ``(*k, C / G)`` where ``out_last``)
        and ``(B, G, L * T, O / G)``."""
        b, l, o = self.g.shape[:3]
        p = jnp.stack([self._grouped(v) for v in self._shifted(dtype)], axis=-1)  # (B, L, T, G, C/G, K)
        if self.out_last:
            p = jnp.swapaxes(p, -1, -2)
        p = jnp.moveaxis(p.reshape(b, -1, self.groups, p.shape[4] * p.shape[5]), 2, 1)
        gv = jnp.moveaxis(self._g(dtype), 4, 2)  # (B, L, T, G, O/G)
        gv = jnp.moveaxis(gv.reshape(b, -1, self.groups, o // self.groups), 2, 1)
        return p, gv

    def gram_sq_norm(self, dtype) -> jax.Array:
        """The squared norm per example in the Gram form: per group, the patches' ``T x T`` inner
        products against the output gradients', summed; ``(B,)``."""
        p, gv = self._patches(dtype)
        pp = jnp.einsum("bgtf,bgsf->bgts", p, p, precision=HIGHEST)
        gg = jnp.einsum("bgto,bgso->bgts", gv, gv, precision=HIGHEST)
        return jnp.sum(pp * gg, axis=(1, 2, 3))

    def expand(self, dtype) -> Use:
        """The patch factors (``Use``): the positions' input patches against their output gradients,
        for a weight shared with a use of another kind. Groups: one row per position and group, the
        output gradient zero outside the group's channels (so that groups never meet in the norm)."""
        p, gv = self._patches(dtype)
        b, groups, k = gv.shape[:3]
        if groups > 1:  # (B, G, K, O/G) -> (B, G, K, O), the group's block of O and zeros elsewhere
            gv = jnp.einsum("bgko,gh->bgkho", gv, jnp.eye(groups, dtype=gv.dtype)).reshape(b, groups, k, -1)
        p, gv = p.reshape(b, groups * k, -1), gv.reshape(b, groups * k, -1)
        return Use(p, gv) if self.out_last else Use(gv, p)


jax.tree_util.register_dataclass(
    ConvUse, data_fields=["x", "g"], meta_fields=["kernel", "strides", "pads", "lhs_dilation", "rhs_dilation", "out_last", "groups"]
)


def conv_sq_norm(uses: list, dtype) -> jax.Array:
    """The squared norm per example of a leaf whose uses are all convolution calls, ``(B,)``.

    One call: the Gram form where it is smaller, else ``|G_i|^2``. Several calls of one
    convolution: ``|sum of their G_i|^2``. ``G_i`` block by block (``ConvUse.per_offset``).
    """
    if len(uses) == 1 and uses[0].gram():
        return uses[0].gram_sq_norm(dtype)
    blocks = [sum(parts) for parts in zip(*(u.per_offset(dtype) for u in uses))]
    return sum(jnp.sum(jnp.square(k).reshape(k.shape[0], -1), axis=1) for k in blocks)


def conv_weighted_sum(use: ConvUse, weights, shape: tuple, dtype, nan_safe: bool = False) -> jax.Array:
    """``sum_i weights[i] G_i`` of one convolution call (``weights`` ``None``: every weight 1, the batch
    gradient), in the leaf's ``shape``; with ``nan_safe``, the
    non-finite entries of its input and output gradient read as zeros (``_factors.weighted_sum``).

    From ``G_i``'s blocks (the very contractions the norm forms, so that the two share them in one
    program) where the norm takes that route; else the convolution's own weight gradient of the
    weighted output gradient, as the plain backward forms it.

    ``nan_safe`` on the ``G_i`` route zeroes the non-finite entries of ``G_i``'s blocks, not those of
    ``x`` and ``g`` (which would form ``G_i`` a second time): the same sum. An example whose norm is
    finite has a finite ``G_i``, formed from the same entries either way (a non-finite entry of ``x``
    or ``g`` that enters a product makes ``G_i`` non-finite: ``inf * 0`` is ``nan``); one whose norm
    is not has weight 0, and adds zeros either way. (A ``lax.cond`` that zeroed only where the plain
    sum is not finite was no faster on the CNN, within the noise of XLA:CPU, and its branch held
    an all-reduce of its own under FSDP.)
    """
    if not use.gram():
        zero = finite if nan_safe else (lambda k: k)
        w = example_weights(weights, use.x.shape[0], dtype)
        return jnp.reshape(use.leaf_layout([jnp.tensordot(w, zero(k), 1) for k in use.per_offset(dtype)]), shape)
    if nan_safe:
        use = dataclasses.replace(use, x=finite(use.x), g=finite(use.g))
    g = use.g.astype(dtype)
    if weights is not None:
        g = g * weights.astype(dtype).reshape(-1, *[1] * (use.g.ndim - 1))
    return jnp.reshape(use.weight_grad(g, dtype), shape)
