"""The proof: what the traced program says about examples and weights, read equation by equation.

The Gram ("ghost") factorisation of a covered layer's per-example gradient is exact when
(1) each position of the layer's output reaches the loss of one example only, (2) the
weight the layer multiplies is the differentiated leaf itself (or, in ``lax.scan``, one
step's slice of it), and the factors are read at the layer's own positions. ``prove``
reads both from the jaxpr of ``fun(leaves)``, never from shapes:

- **Which loss each element reaches** (backward, from the losses vector): an element is
  owned by example ``(flat index // unit) % B`` (``Axis(unit)``), or reaches every loss
  (``Every``), or none (``None``). Per-primitive rules in ``OWNERS`` carry ownership from
  outputs to operands; a value that one use gives to one example and another use to every
  example (a batch mean, an in-batch contrastive logit, attention across the batch) is
  where examples interact. Where that value depends on a differentiated leaf, per-example
  gradients are not those of independent examples: ``Proof.mixing`` names the operation
  and its line. A primitive with no rule makes its operands reach every loss ("unknown"):
  never an error, but no factors for the layers before it (they take the exact path).
- **Which leaf each covered layer's parameters are** (forward): the plan tags each
  layer's parameters as ``"<path>:params:<attribute>"`` when it is called; the operand of
  that tag is the leaf itself, one scan step's slice of a leaf (a stacked layer), or
  something computed from leaves (``stop_gradient``, a mask, a LoRA sum, a tie, the output
  of a custom derivative rule, even an identity whose backward pass scales the gradient):
  then not the leaf, and the leaf's gradient takes the exact path.
- **Custom derivative rules**: JAX differentiates a ``custom_jvp``/``custom_vjp`` call by
  its rule, which may mix examples where its primal body does not (a backward pass centred
  over the batch). The body gives each operand's candidate ownership; the call's pullback
  (``jax.vjp`` of the equation, traced) is then read backward from those operand
  cotangents, and each output cotangent must reach only its own example's. A rule that
  fails (or cannot be traced) makes its operands reach every loss ("unknown"): the layers
  before it take the exact path, which runs the rule as ``jacrev`` does. Inside ``jax.vmap``
  over the examples JAX batches the rule itself, and it passes.
- **Shared layer outputs**: a layer applied to a value shared by every example (position
  ids ``arange(T)`` inside ``jax.vmap(model)``) has an output that reaches every loss; it
  meets the examples where an elementwise operation broadcasts it against a per-example
  value, where a broadcast lays it along the examples' axis (a class token concatenated to
  each example's patches), or a ``dot_general`` contracts it with one (``h @ pos.T``). ``Proof.shared`` lists
  those places (at the program's top level or in ``jit`` and ``checkpoint`` bodies, followed into
  and out of them; a meeting inside a loop or branch body is not listed, and the layer's leaves
  take the exact path): the pass tags the broadcast value
  there (for a ``dot_general``, the shared operand broadcast along a new batch axis of the
  product), which gives each example's gradient at the shared output.

Each is a walk of its own module on the one walker (``_walker``): ``_proof_forward`` (the leaves,
in program order), ``_proof_backward`` (the losses each element reaches, and the custom rules),
``_shared_uses`` (the meetings); this module puts their findings together.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, Optional

from .._walker import scan_positions
from ._owners import Axis, Step, axis_of, shape_of
from ._proof_backward import Backward
from ._proof_forward import Forward, Occurrence, Origin
from ._shared_uses import SharedUse, SharedUses

__all__ = ["Occurrence", "Origin", "Proof", "SharedUse", "prove"]


@dataclasses.dataclass(frozen=True)
class Proof:
    """What ``prove`` read from the program, read-only: nothing changes it after ``prove`` returns."""

    occurrences: Mapping[str, tuple]  # layer path -> (Occurrence, ...) in program order
    mixing: Optional[str]  # a sentence naming where examples interact (leaf-dependent), or None
    shared: tuple  # (SharedUse, ...): where shared values meet the examples
    states: Mapping  # (ctx, var) -> ownership

    def axis_at(self, var, batch: int, ctx: tuple = ()) -> Optional[tuple[int, int]]:
        """``(axis, inner)`` of the examples in a var (of the top level, or of the calls ``ctx``), or None."""
        state = self.states.get((ctx, var))
        return axis_of(shape_of(var), state, batch) if isinstance(state, Axis) else None

    def example_axis(self, occurrences: list, value_ndim: int, batch: int) -> Optional[tuple[int, int]]:
        """``(axis, inner)`` of the examples in the stacked value jaxtrace returns for a layer's calls
        ``occurrences`` (one tag name's: loop and repeated-call axes first, vmap axes next), the same for
        every call; else None. In the body of a scan whose steps are the examples (``Step``), the examples'
        axis is that scan's loop axis where every call sits in that one scan: the loops around them come
        first, outermost first, and calls stacked in the body after them."""
        found = set()
        for occ in occurrences:
            if occ.out is None:
                continue
            if isinstance(occ.out, Step):
                scans = scan_positions(occ.ctx)
                found.add((occ.out.level, occ.out.inner, tuple(map(id, occ.ctx[: scans[occ.out.level] + 1]))))
                continue
            if not isinstance(occ.out, Axis):
                return None
            shape = shape_of(occ.eqn.outvars[0])
            where = axis_of(shape, occ.out, batch)
            if where is None:
                return None
            axis, inner = where
            found.add((value_ndim - len(shape) + occ.order.index(axis), inner))
        return found.pop()[:2] if len(found) == 1 else None


def prove(jaxpr, n_leaves: int, batch: int, roles: dict, reads: Optional[dict] = None, in_scans: Optional[dict] = None) -> Proof:
    """Reads ``jaxpr`` (invars: the leaves, then nothing; outvar 0: the losses ``(batch,)``); ``roles``
    maps the tag names of the covered layers to their ``TagRole`` (``Plan.roles``).

    ``reads`` maps a name to ``(var, ctx)``: the output of an equation (in the calls ``ctx``) that
    reads a leaf outside its layers (``_reads``), or a leaf itself; where that value is shared by
    every example, ``Proof.shared`` also lists where it meets the examples, under that name. ``in_scans`` maps a name to ``(scan
    equations, body invar)``: the input of the innermost body of a top-level scan and the scans nested
    in it (one step's slice of a leaf, or the leaf itself), whose meetings with the examples in that
    body are listed the same way.
    """
    forward = Forward(roles)
    forward.forward(jaxpr, [(Origin(i), True) for i in range(n_leaves)] + [forward.bottom] * (len(jaxpr.invars) - n_leaves))
    outs: list = [None] * len(jaxpr.outvars)
    outs[0] = Axis(1)
    backward = Backward(batch, forward)
    backward.backward(jaxpr, outs)
    occurrences = {  # each call with the ownership of its output, as the backward walk found it
        path: tuple(dataclasses.replace(occ, out=backward.layer_outputs.get((occ.ctx, id(occ.eqn)))) for occ in occs)
        for path, occs in forward.occurrences.items()
    }
    shared = SharedUses(backward, occurrences).shared_uses(jaxpr, reads or {}, in_scans or {})
    return Proof(MappingProxyType(occurrences), backward.mixing, tuple(shared), MappingProxyType(backward.state))
