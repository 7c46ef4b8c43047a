"""Side-by-side checks against PyTorch: gradients at module outputs, and weights into equinox or Flax NNX.

``jaxtrace.torch.grad(module, *args, loss=...)`` runs a ``torch.nn.Module``
and returns ``(param_grads, module_grads)`` as NumPy arrays: the parameter
gradients by ``named_parameters()`` names, and the gradient at each selected
module's output (and, on request, input) by ``named_modules()`` paths, the
names ``jt.tag`` / ``jt.tag_modules`` use on the JAX side. ``load_weights``
copies a torch module's parameters into the matching equinox model, and
``named_grads`` renames that model's gradients back to torch's names, so that
``jaxtrace.compare`` can put the two side by side.

Naming and layout of ``module_grads`` (the same conventions as ``jt.tag``):

- ``"<path>"``: the gradient at the module's output; ``"<path>:in"``: at its
  positional inputs (one argument: that argument; several: a tuple), as
  ``jt.tag_modules`` tags them; a call with keyword arguments only (Hugging
  Face's ``attn(hidden_states=h)``) gives a dict ``{keyword: gradient}``. Keyword
  arguments of a call that also has positional ones are not watched. The root
  module's path is ``""``.
- A module that returns a tuple, list or dict gets a gradient of the same
  structure, as a JAX tag on that pytree does; ``jaxtrace.compare`` names the
  leaves ``"attn[0]"``, ``"attn[1]"``, ``"enc['h']"``. Leaves that are not
  floating-point tensors (indices, ``None``, Python numbers) have no gradient:
  ``None`` in their place.
- A module called several times (weight sharing, a cell stepped in a Python
  loop) fires once per call; the calls are stacked on a new leading axis in
  call order, as ``jt.tag(..., repeated=True)`` or a tag in a ``lax.scan``
  body stacks them. A module called once has no extra axis.
- A module output that does not affect the loss gets zeros, not ``None``.
- The gradient at an output counts the uses of the returned value from the
  point the module returns; at an input, the uses inside that call. These are
  ``register_full_backward_hook``'s ``grad_output`` and ``grad_input``, and
  what ``jt.tag`` gives at the same places: the JAX port tags a module's
  return value and, for ``":in"``, the arguments it receives. (A hook on the
  tensor object would also count other uses of the same tensor: attention
  probabilities used inside the module and also returned, a module's input
  that a residual branch also reads.) The oracle is a forward hook registered
  with ``prepend=True`` that returns ``output + eps``.
- jaxtrace never changes what the model computes. Its forward hooks run before
  hooks others registered (``prepend=True``), so Hugging Face's output
  recorders (``output_attentions``, ``output_hidden_states``) and a user's hook
  that stores the output see the watched tensor, on every call. An output that
  shares memory with an input (``nn.Identity``, ``Dropout`` in eval, the view
  ``nn.Flatten`` returns) is passed on as a view of the same memory, so an
  in-place op made on it later reaches the input as without jaxtrace. If the
  model changes that memory in place after the module returned (``out =
  self.shortcut(x); out += y``), the gradient counts every later use of it,
  through any reference, as for an in-place module's output (the oracle: a
  forward hook that adds ``eps`` in place); where the output is a view of its
  input (``nn.Flatten``), that case is an error naming the module. A module
  returned as it is with ``":in"`` watched (``nn.Identity``) has the output's
  gradient at its input.
- A module called under ``torch.no_grad()`` (a teacher, an EMA target) runs as
  it is; its gradients are zeros. Activation checkpointing
  (``torch.utils.checkpoint(..., use_reentrant=False)``, Hugging Face's
  ``activation_checkpointing_enable``) works: the hooks come off before
  backward, so the recompute is not a call; the reentrant variant is an error. Gradients and values come in the module's
  dtype: bfloat16 (and float8) as ``ml_dtypes`` arrays, the types JAX uses.

Needs PyTorch. A CPU build is enough: ``pip install torch --index-url
https://download.pytorch.org/whl/cpu`` (installed first, ``pip install
"jaxtrace[torch]"`` keeps it; alone, the extra takes PyPI's default build,
CUDA on Linux).
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as _error:  # pragma: no cover - exercised by a test that hides torch
    raise ImportError(
        "jaxtrace.torch needs PyTorch, which is not installed. A CPU build is enough: "
        "`pip install torch --index-url https://download.pytorch.org/whl/cpu` (PyTorch's CPU index; installed "
        'first, it is the torch that `pip install -e ".[torch]"` keeps, while the extra alone, like a plain '
        "`pip install torch`, takes PyPI's default build, a multi-GB CUDA one on Linux)."
    ) from _error

from ._grad import grad as grad
from ._grad import value_and_grad as value_and_grad
from ._weights import load_weights as load_weights
from ._weights import named_grads as named_grads

__all__ = ["grad", "value_and_grad", "load_weights", "named_grads"]
