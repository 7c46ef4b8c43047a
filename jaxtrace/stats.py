"""Gradient statistics computed inside the jitted step, and a host-side history.

A training step that returns full cotangents at every tag moves (and keeps in
memory) one array per activation per step. Usually a few numbers per tag are
enough to watch gradient health: :func:`summarize` reduces each tag's
gradient to

- ``"norm"``: the L2 norm, ``sqrt(sum(g**2))``,
- ``"mean_abs"``: the mean of ``|g|``,
- ``"max_abs"``: the largest ``|g|``,
- ``"nonfinite"``: the fraction of entries that are ``nan`` or ``inf``,
- ``"rms"`` (on request, not in ``STATS``): ``sqrt(mean(g**2))``,

inside the traced function, each a sum or a max over the entries with no data-dependent
scaling before it: reductions of one array that XLA may fuse into one loop (XLA:CPU runs
them one after another) and, when sharded, one all-reduce round (XLA combines the sums with
the gradients' own all-reduces), so under ``jax.jit`` the full cotangents are
never outputs of the compiled program (XLA drops them). A pytree-valued tag
is summarised as one vector of all its leaves. :func:`value_and_grad` does
the differentiation and the summary in one call and keeps each tag's loop
axes, so a tag in a ``lax.scan`` of length ``T`` gives ``T`` values per
statistic (one per step). :class:`History` collects the summaries on the
host across steps as NumPy arrays, for logging and ``jaxtrace.plot``.

Example:
    >>> import jax, jax.numpy as jnp, jaxtrace as jt
    >>> def loss(w, x):
    ...     h = jt.tag(jnp.tanh(x @ w), "hidden")
    ...     return jnp.sum(h ** 2)
    >>> step = jax.jit(jt.stats.value_and_grad(loss))
    >>> value, (grads, tag_stats) = step(jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> sorted(tag_stats["hidden"])
    ['max_abs', 'mean_abs', 'nonfinite', 'norm']
    >>> history = jt.stats.History()
    >>> history.append(0, tag_stats, loss=value)
    >>> history["hidden"]["norm"].shape, history.scalar("loss").shape
    ((1,), (1,))
"""

from ._history import History
from ._stats_grad import jacrev, value_and_grad
from ._summary import STATS, format_paths, summarize, term_name

__all__ = ["STATS", "History", "format_paths", "jacrev", "summarize", "term_name", "value_and_grad"]
