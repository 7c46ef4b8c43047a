"""Per-example gradient norms and clipped gradients from one pass (DP-SGD, ghost clipping).

For a layer ``y = layer(x)`` whose parameter gradient is a sum of outer products of a
function of its input and the gradient at its output, each example's parameter gradient
is ``sum_k a_k (x) b_k`` over that example's positions ``k`` (sequence steps, pixels,
repeated calls). Its squared norm is either

- ``sum_{k,l} <a_k, a_l> <b_k, b_l>`` (the Gram, or "ghost norm", form: memory ``K**2``
  per example), or
- ``|sum_k a_k b_k^T|**2`` (the per-example gradient of that layer: memory ``dA * dB``),

whichever is smaller, picked per leaf from the shapes, as Opacus's fast gradient clipping
does. One ``jt.vjp(..., with_values=True)`` pass over a model tagged by ``jt.tag_modules``
gives every covered layer's input and output gradient; ``RULES`` says, per module class,
which ``(a, b)`` factors each parameter gets, and ``READS``, per primitive, those of a leaf
read without its module (``table[ids]``, ``h @ W.T``). A leaf used by several layers (tied weights,
a module called several times) gets the factors of all its uses, so the cross terms are in
its norm. Leaves no rule covers (or whose factors the traced program does not prove exact)
take the exact path, the pullback of the losses vector against each example's basis vector,
for those leaves alone (``fallback="vmap"``), or are refused (``fallback="error"``).

The package, one concept a file: ``_factors`` (the factors ``Use`` / ``Index`` and the
squared-norm arithmetic), ``_rules`` (the per-layer rules, one function a kind of layer for
both frameworks), ``_plan`` (the model's differentiated leaves and which layer uses which:
one plan, a small adapter per framework), ``_owners`` (which example's loss each
element reaches: the per-primitive rules), ``_proof`` (the factorisation's conditions read
from the traced program: ``_proof_forward``, which leaf each layer multiplies, ``_proof_backward``,
which loss each element reaches, ``_shared_uses``, where a shared value meets the examples), ``_reads`` (leaves read by one primitive outside any layer:
``table[ids]``, ``table[:n]``, ``h @ W.T``), ``_uses`` (leaves used outside their layers), ``_meetings``
(the program replayed with a tag where a shared value meets the examples, and each example's gradient
back from it), ``_conv`` (a convolution's per-example gradient), ``_leaf_sums`` (a leaf's norm and
weighted sum from its uses, scan steps included), ``_traced`` (``fun`` traced once on the tagged
model), ``_contributions`` (one record per contribution to a leaf's gradient: a layer's calls, a read,
a whole leaf; and the factors each gives), ``_find`` (those contributions found in the program and
proven), ``_pass`` (the one pass and the norms from it, one loop over the contributions),
``_transforms`` (the public functions), ``_audit`` (the fast path checked against the definition).
Every analysis of the traced program is a table of rules on the one walk (``jaxtrace._walker``).
"""

from ._audit import LeafAudit as LeafAudit
from ._audit import PerExampleAudit as PerExampleAudit
from ._audit import per_example_audit as per_example_audit
from ._transforms import clip_weights as clip_weights
from ._transforms import clipped_grad as clipped_grad
from ._transforms import per_example_norms as per_example_norms
from ._transforms import value_grad_and_norms as value_grad_and_norms

__all__ = ["LeafAudit", "PerExampleAudit", "clip_weights", "clipped_grad", "per_example_audit", "per_example_norms", "value_grad_and_norms"]
