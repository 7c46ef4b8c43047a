"""Flax models without editing them: gradients at every submodule's output.

- **NNX**: ``jaxtrace.tag_modules(model)`` takes an ``nnx.Module`` and returns
  a tagged copy (see its docstring). ``jaxtrace.flax.grad`` and
  ``value_and_grad`` are ``nnx.grad`` / ``nnx.value_and_grad`` that also
  return the gradients at the tags, and write changed state (RNG counts,
  batch statistics) back into the model as ``nnx.grad`` does;
  ``jaxtrace.flax.jacrev`` is ``jaxtrace.jacrev`` (which loss term reaches
  which layer) on the same terms.
- **Linen**: ``jaxtrace.flax.tag_modules()`` is a context manager (and a
  decorator) built on ``flax.linen.intercept_methods``: while it is active,
  every selected Linen module's ``__call__`` output is tagged under the
  module's path, the names of its parameter collection joined by ``/``
  (``"Dense_0"``, ``"encoder/layers_1"``; the root module is ``""``), as
  ``flax.traverse_util.flatten_dict(params, sep="/")`` names them.

Tags are identities: nothing changes outside a jaxtrace transform, and
nothing has to be initialised, declared in ``variable_axes`` of ``nn.scan`` or
``nn.vmap``, or sized to a batch (what Flax's ``perturb`` needs). Inside
``nn.scan`` / ``nnx.scan`` the tags are stacked per step, inside ``nn.vmap``
per example, as ``jaxtrace.tag`` in ``lax.scan`` / ``jax.vmap`` are.

Needs Flax (``pip install flax``, or ``pip install -e ".[flax]"`` in a jaxtrace
checkout); ``import jaxtrace`` never imports it.

Example (NNX):
    >>> import jax, jax.numpy as jnp, jaxtrace as jt
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(2, 4, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    >>> tagged = jt.tag_modules(model)  # model itself is unchanged
    >>> grads, tag_grads = jt.grad(lambda m, x: jnp.sum(m(x)))(tagged, jnp.ones((3, 2)))
    >>> {name: g.shape for name, g in tag_grads.items()}
    {'0': (3, 4), '2': (3, 1), '': (3, 1)}
"""

try:
    import flax.linen  # noqa: F401
    import flax.nnx  # noqa: F401
except ImportError as _error:  # pragma: no cover - exercised where flax is not installed
    raise ImportError(
        "jaxtrace.flax needs Flax, which is not installed. Install it with `pip install flax`, or with "
        '`pip install -e ".[flax]"` run in the root of your jaxtrace checkout (jaxtrace is installed from '
        'its checkout; the package index has no "jaxtrace[flax]").'
    ) from _error

from ._linen import tag_modules as tag_modules
from ._nnx_grad import grad as grad
from ._nnx_grad import jacrev as jacrev
from ._nnx_grad import value_and_grad as value_and_grad

__all__ = ["tag_modules", "grad", "value_and_grad", "jacrev"]
