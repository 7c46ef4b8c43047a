"""``tag``: an identity that marks a value as a capture site.

``tag`` binds the ``jaxtrace_tag`` primitive once per leaf. Outside a jaxtrace
transform the primitive is free: it lowers to its operand, its JVP returns the
tangent untagged, and ``jax.jit(jax.grad(f))`` of a tagged ``f`` compiles to the
same program as the untagged one. Inside ``jaxtrace.grad`` and friends, the
traced program is split at these marks (see ``_split.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import sys
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat

__all__ = ["MODULE_TAGS", "evaluated_tags", "is_tag", "module_tag", "new_scope", "open_scopes", "opened", "scoped", "site_value", "tag", "tag_p", "visible"]

T = TypeVar("T")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_line() -> str:
    """``file:line`` of the first caller outside jaxtrace and JAX."""
    frame = sys._getframe(1)
    jax_dir = os.path.dirname(os.path.abspath(jax.__file__))
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_PACKAGE_DIR, jax_dir)):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


# ``tag_p`` takes the tagged value ``x`` and, under a ``jax.vmap`` of a ``lax.cond`` with a
# per-example predicate, a second operand ``active`` (bool, ``x``'s shape): where the example
# took the branch holding the tag (see ``_vmap_cond.py``). Every rule is an identity on ``x``.


def _impl(x, *active, **params):
    return x


def _abstract_eval(x, *active, **params):
    return x


def _jvp(primals, tangents, **params):
    x, *active = primals
    # The tangent is not tagged. The primal is marked: a derivative was taken through this
    # value, so a later jt.patch of it would not reach that derivative (and says so).
    return tag_p.bind(x, *active, **{**params, "differentiated": True}), tangents[0]


def _linearize(nonzeros, x, *active, **params):
    out = tag_p.bind(x, *active, **{**params, "differentiated": True})
    return out, nonzeros[0], (), lambda _, x_dot, *active_dot: x_dot


def _batch(args, dims, *, batch_axes, **params):
    (x, *active), (d, *active_dims) = args, dims
    if active and not all(a is _compat.not_mapped for a in (d, *active_dims)):
        x, active, d = _align_active(x, active[0], d, active_dims[0])
    if d is _compat.not_mapped:
        return tag_p.bind(x, *active, batch_axes=batch_axes, **params), d
    # Keep the batch axis where it is (no transpose in the program); record
    # where it is, outer vmap first, so results can be laid out batch-first.
    shifted = tuple(a + (a >= d) for a in batch_axes)
    return tag_p.bind(x, *active, batch_axes=(d, *shifted), **params), d


def _align_active(x, active, d, da):
    """``x`` and its ``active`` mask batched along the same axis, the mask of ``x``'s shape."""
    if d is _compat.not_mapped:  # per-example masks need a per-example value
        x = jnp.broadcast_to(jnp.expand_dims(x, da), active.shape)
        return x, [active], da
    if da is _compat.not_mapped:
        return x, [jnp.broadcast_to(jnp.expand_dims(active, d), x.shape)], d
    return x, [_compat.moveaxis_batched(active, da, d)], d


def _transpose(ct, x, *active, **params):
    return [ct, *(None for _ in active)]  # an identity transposes to an identity, untagged


def _jet(primals, series, **params):
    (x, *active), (terms, *_) = primals, series
    return tag_p.bind(x, *active, **params), terms


def _lowering(ctx, x, *active, **params):
    return [x]


tag_p = _compat.define_primitive(
    "jaxtrace_tag",
    impl=_impl,
    abstract_eval=_abstract_eval,
    jvp=_jvp,
    batch=_batch,
    lowering=_lowering,
    linearize=_linearize,
    transpose=_transpose,
    jet=_jet,
)

_CALLS = itertools.count()

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def tag(value: T, name: str, *, repeated: bool = False) -> T:
    """Marks ``value`` (any pytree of arrays) as a capture site called ``name``.

    ``jaxtrace.grad`` and friends return the gradient at every tagged value in a
    dict keyed by ``name``, with the value's pytree structure, shapes and dtypes.
    Each name marks one site. A tag in a loop (``lax.scan``, ``fori_loop``,
    ``lax.map``) is one site with a leading axis per loop.

    Args:
        value: the value to mark.
        name: the site's name, the key of its entry in the results.
        repeated: the same tagged code runs several times on purpose (a shared
            block in a Python loop): the calls are stacked on a leading axis in
            call order, as a scan would stack them.

    Returns:
        ``value``, unchanged.

    A Python ``float`` is tagged as a scalar array (its gradient is the
    derivative with respect to that constant); an integer or boolean array
    gets ``float0`` zeros under differentiation, as ``jax.grad(allow_int=True)``
    gives; a Python ``int`` or ``bool`` is an error, since it is a constant with
    no derivative: tag the array it goes into.

    Raises:
        TypeError: if ``name`` is not a string, or a leaf of ``value`` is not an
            array (a Python ``int`` or ``bool`` included).
        ValueError: if ``value`` holds no arrays.

    Example:
        >>> import jax.numpy as jnp, jaxtrace as jt
        >>> def loss(w, x):
        ...     h = jt.tag(jnp.tanh(w * x), "h")
        ...     return jnp.sum(h ** 2)
        >>> grads, tag_grads = jt.grad(loss)(2.0, jnp.array([0.1, 0.2]))
        >>> tag_grads["h"].shape
        (2,)
    """
    if not isinstance(name, str):
        raise TypeError(
            f"jaxtrace.tag needs a string name, but got {name!r} of type {type(name).__name__} "
            f"at {_user_line()}. Pass a name such as jt.tag(x, \"hidden\")."
        )
    leaves, tree = jax.tree_util.tree_flatten(value)
    if not leaves:
        raise ValueError(
            f"jaxtrace.tag(..., {name!r}) at {_user_line()} got a value with no arrays in it "
            f"({value!r}). Tag an array or a pytree of arrays."
        )
    for leaf in leaves:
        if isinstance(leaf, (bool, int)) and not isinstance(leaf, np.generic):
            kind = type(leaf).__name__
            raise TypeError(
                f"jaxtrace.tag(..., {name!r}) at {_user_line()} got the Python {kind} {leaf!r}: a constant "
                f"of the program, and an integer, whose gradient would be only a float0 placeholder (no "
                f"derivative). Tag the array the number goes into (jt.tag(x * {leaf!r}, {name!r})), or a "
                f"float array (jnp.asarray({float(leaf)!r})) for the derivative with respect to that constant; "
                f"jnp.asarray({leaf!r}) marks an integer on purpose (float0 zeros under jt.grad, as integer arrays)."
            )
        if not isinstance(leaf, _ARRAY_TYPES) or isinstance(leaf, (str, bytes)):
            raise TypeError(
                f"jaxtrace.tag(..., {name!r}) at {_user_line()} got a leaf of type "
                f"{type(leaf).__name__}, which is not an array. Tag only arrays (or pytrees of "
                "arrays); mark other leaves static, e.g. with equinox.partition."
            )
    call = next(_CALLS)  # one identity per call: JAX's copies of this equation keep it
    scope = _SCOPE.get()
    extra = ({} if scope is None else {"scope": scope}) | ({} if _ORIGIN.get() is None else {"origin": _ORIGIN.get()})
    tagged = [
        tag_p.bind(jnp.asarray(leaf), name=name, leaf=i, tree=tree, repeated=bool(repeated), batch_axes=(), call=call, **extra)
        for i, leaf in enumerate(leaves)
    ]
    lost = _EVALUATED.get()
    if lost is not None and not any(isinstance(t, _compat.Tracer) for t in tagged):
        lost.setdefault(name, _user_line())  # evaluated now, not staged: see ``evaluated_tags``
    return jax.tree_util.tree_unflatten(tree, tagged)


_EVALUATED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxtrace_evaluated", default=None)

# --- scopes: tags a jaxtrace transform places for its own use -----------------------
#
# A transform that tags the model itself (the per-example plan: every covered layer's input,
# output and parameters) binds those tags in a scope of its own. Only a transform running
# while that scope is open finds them; any other, around it or after it, sees the program
# as the user wrote it, with the user's tags only.

MODULE_TAGS = "tag_modules"  # ``params["origin"]`` of the tags ``jt.tag_modules`` puts
_ORIGIN: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxtrace_tag_origin", default=None)


def module_tag(value, name: str, *, repeated: bool = False):
    """``tag``, for the tags ``jt.tag_modules`` puts: their equations say so (``params["origin"]`` is
    ``MODULE_TAGS``), so an analysis reads it there instead of guessing from source lines."""
    token = _ORIGIN.set(MODULE_TAGS)
    try:
        return tag(value, name, repeated=repeated)
    finally:
        _ORIGIN.reset(token)


_SCOPES = itertools.count(1)
_SCOPE: contextvars.ContextVar[int | None] = contextvars.ContextVar("jaxtrace_tag_scope", default=None)
_OPEN: contextvars.ContextVar[frozenset] = contextvars.ContextVar("jaxtrace_open_scopes", default=frozenset())


def new_scope() -> int:
    """A scope of its own, for ``scoped`` and ``opened``."""
    return next(_SCOPES)


@contextlib.contextmanager
def scoped(scope: int | None):
    """The tags ``tag`` binds in this block belong to ``scope`` (``None``: the user's, seen by every transform)."""
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def opened(scope: int):
    """The tags of ``scope`` are found by the transforms that trace in this block."""
    token = _OPEN.set(_OPEN.get() | {scope})
    try:
        yield
    finally:
        _OPEN.reset(token)


def visible(eqn, scopes: frozenset) -> bool:
    """Whether the tag equation ``eqn`` is a site for a transform that traced with ``scopes`` open."""
    scope = eqn.params.get("scope")
    return scope is None or scope in scopes


def open_scopes() -> frozenset:
    return _OPEN.get()


@contextlib.contextmanager
def evaluated_tags():
    """While a jaxtrace transform traces a function: ``{name: line}`` of the tags that were
    evaluated at trace time (``jax.ensure_compile_time_eval``) instead of staged into the program.

    Diagnostics only: it never changes a value.
    """
    found: dict = {}
    token = _EVALUATED.set(found)
    try:
        yield found
    finally:
        _EVALUATED.reset(token)


def is_tag(eqn: Any) -> bool:
    return eqn.primitive is tag_p


def site_value(invals):
    """The value a tag equation holds for a reader: its operand, zeros where ``active`` is False."""
    x, *active = invals
    return x if not active else jnp.where(active[0], x, jnp.zeros_like(x))
