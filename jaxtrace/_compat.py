"""Every JAX-version difference and every ``jax._src`` import, in one place.

The rest of jaxtrace talks to JAX's internals only through the names defined
here. When a JAX release moves something, this is the one file to change; when
it changes a layout we do not know, we fail loudly here, naming the version.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Sequence

import jax
import jax.core
from jax.extend import core as _extend_core
from jax.interpreters import ad as _public_ad
from jax.interpreters import batching as _public_batching
from jax.interpreters import mlir as _public_mlir

# What has no public spelling at both ends of the supported range (JAX 0.7.2 to 0.12).
from jax._src import core as _core  # DropVar: jax.core's until 0.10 (deprecated), jax.extend.core's from 0.11
from jax._src import dispatch as _dispatch  # which primitives need the devices while they are lowered
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import ad as _ad  # the linearize rules and LinearizeTracer
from jax._src.interpreters import batching as _batching  # moveaxis, not_mapped: gone from the public module

__all__ = [
    "COND",
    "CUSTOM_DERIVATIVES",
    "CUSTOM_LINEAR",
    "INLINE_CALLS",
    "INLINE_EARLY",
    "REMAT",
    "SCAN",
    "SHARD_MAP",
    "WHILE",
    "bind_params",
    "construct",
    "define_primitive",
    "float0",
    "has_linearize_rule",
    "is_linearizing",
    "is_zero",
    "jaxpr_and_consts",
    "moveaxis_batched",
    "needs_devices_when_lowered",
    "name_stack_context",
    "not_mapped",
    "read",
    "shard_map",
    "sharding_key",
    "source_context",
    "source_line",
    "sub_jaxprs",
    "unknown_layout",
    "user_lines",
    "with_params",
    "wrap_cond_batching",
    "write",
    "zeros",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "Literal",
    "Primitive",
    "Tracer",
    "UnknownLayoutError",
    "Zero",
]

Primitive = _extend_core.Primitive
Tracer = jax.core.Tracer
Literal = _extend_core.Literal
DropVar = _core.DropVar
Jaxpr = _extend_core.Jaxpr
ClosedJaxpr = _extend_core.ClosedJaxpr  # since JAX 0.11 the same class as Jaxpr
Zero = _public_ad.Zero
not_mapped = getattr(_batching, "not_mapped", None)  # None since JAX 0.4.x
float0 = jax.dtypes.float0

# Frames inside jaxtrace are not the user's code: keep them out of the source
# lines JAX records for equations (so errors point at the user's line).
_source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))


class UnknownLayoutError(NotImplementedError):
    """JAX changed an internal layout that this version of jaxtrace does not know."""


def unknown_layout(what: str) -> UnknownLayoutError:
    return UnknownLayoutError(
        f"jaxtrace does not know the layout of {what} in JAX {jax.__version__}. "
        "Please report this at the jaxtrace issue tracker, with your JAX version; "
        "meanwhile, pin a JAX release that jaxtrace supports (see its pyproject.toml)."
    )


# --- primitives -----------------------------------------------------------


def define_primitive(
    name: str,
    *,
    impl,
    abstract_eval,
    jvp,
    batch,
    lowering,
    linearize=None,
    transpose=None,
    jet=None,
    multiple_results: bool = False,
) -> Primitive:
    """A new primitive with all its rules, registered with JAX.

    ``transpose(ct, *args, **params)`` is its transpose rule where it is
    linear (``jax.linear_transpose``, a custom JVP rule's tangent);
    ``jet(primals, series, **params)`` its ``jax.experimental.jet`` rule.

    ``linearize(nonzeros, *primals, **params) -> (primal_out, nonzero_out,
    residuals, linearized)`` with ``linearized(residuals, *tangents)``: a
    direct rule for ``jax.linearize`` / ``jax.vjp``, written once in this
    version-neutral form and adapted here to the installed JAX's layout.
    Without one JAX traces the JVP rule into a jaxpr and partially evaluates it
    at every bind, which costs far more Python time than the primitive's work.
    """
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    _public_ad.primitive_jvps[prim] = jvp
    if linearize is not None and _LINEARIZE_LAYOUT is not None:
        _LINEARIZATIONS[prim] = _adapt_linearize(linearize, *_LINEARIZE_LAYOUT)
    _public_batching.primitive_batchers[prim] = batch
    # Not cached: a cached lowering is keyed by params, and a tag's params are its own (name,
    # call), so every tag would miss and be emitted as a function and inlined again.
    _public_mlir.register_lowering(prim, lowering, cacheable=False)
    if transpose is not None:
        _public_ad.primitive_transposes[prim] = transpose
    if jet is not None:
        from jax.experimental import jet as _jet  # imported here: only primitives with a jet rule need it

        _jet.jet_rules[prim] = jet
    return prim


def needs_devices_when_lowered(prim: Primitive) -> None:
    """Give ``prim``'s lowering rule the device assignment, as JAX gives it to the primitive of
    ``jax.debug.inspect_array_sharding`` (whose lowering needs the mesh's devices)."""
    registry = getattr(_dispatch, "prim_requires_devices_during_lowering", None)
    if registry is None:
        raise unknown_layout("the primitives that need their devices when lowered (`prim_requires_devices_during_lowering`)")
    registry.add(prim)


def _adapt_linearize(rule, takes_is_vjp: bool, structured: bool):
    """``rule`` in the calling convention of the installed JAX's linearize rules."""
    if structured:  # JAX >= 0.11.1: five results, linearized(residuals, structured, *tangents)

        def five(_is_vjp, nonzeros, *primals, **params):
            out, nz_out, residuals, linearized = rule(nonzeros, *primals, **params)
            return out, nz_out, residuals, None, lambda res, _structured, *t: linearized(res, *t)

        return five
    if takes_is_vjp:  # JAX 0.8 - 0.11.0: rule(is_vjp, nonzeros, *primals, **params)
        return lambda _is_vjp, nonzeros, *primals, **params: rule(nonzeros, *primals, **params)
    return rule  # JAX 0.7


def _linearize_layout() -> tuple[bool, bool] | None:
    """``(takes_is_vjp, structured)``: how the installed JAX calls a linearize rule.

    Read from JAX's own source (the call in ``LinearizeTrace.process_primitive``),
    not guessed from the version number. A layout we do not recognise gives
    None: jaxtrace then registers no linearize rules, and JAX uses the JVP
    rules, which are slower to trace but give the same program.
    """
    import ast
    import textwrap

    trace = getattr(_ad, "LinearizeTrace", None)
    if _LINEARIZATIONS is None or trace is None:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(trace.process_primitive)))
    except (OSError, TypeError, SyntaxError):  # pragma: no cover - no source shipped
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "lin"
            and isinstance(node.targets[0], ast.Tuple)
        ):
            n_results = len(node.targets[0].elts)
            first = node.value.args[0] if node.value.args else None
            takes_is_vjp = isinstance(first, ast.Attribute) and first.attr == "is_vjp"
            if n_results == 5 and takes_is_vjp:
                return True, True
            if n_results == 4:
                return takes_is_vjp, False
            return None
    return None


# Direct linearization (JAX >= 0.5). Both uses below are optimizations: without
# these names, primitives fall back to their JVP rules as before.
_LINEARIZATIONS: dict = getattr(_ad, "primitive_linearizations", None)
_LINEARIZE_TRACER = getattr(_ad, "LinearizeTracer", None)
_LINEARIZE_LAYOUT = _linearize_layout()


def is_zero(tangent) -> bool:
    return isinstance(tangent, Zero)


def zeros(shape: tuple, dtype, aval) -> Any:
    """Zeros of ``shape`` (new leading axes, then ``aval``'s shape) laid out as ``aval`` is.

    Under a mesh with explicit axes (``jax.sharding.AxisType.Explicit``) an
    array's sharding is part of its type, and a cotangent has its primal's:
    zeros of the tagged value's sharding give gradients sharded as the value
    is (plain zeros would be replicated, and so would the gradients).
    """
    spec = _explicit_spec(aval)
    if spec is None:
        return jax.numpy.zeros(shape, dtype)
    lead = (None,) * (len(shape) - len(spec))
    return jax.numpy.zeros(shape, dtype, out_sharding=jax.sharding.PartitionSpec(*lead, *spec))


def sharding_key(aval) -> tuple | None:
    """What, beyond shape and dtype, tells ``zeros`` for two avals apart: their explicit sharding."""
    return _explicit_spec(aval)


def _explicit_spec(aval) -> tuple | None:
    """``aval``'s partition spec over the current mesh's explicit axes, or None if it has none."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if mesh.empty or spec is None:
        return None
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}

    def keep(entry):
        names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in explicit)
        return None if not names else names[0] if len(names) == 1 else names

    kept = tuple(map(keep, spec))
    if all(e is None for e in kept):
        return None
    return kept + (None,) * (len(aval.shape) - len(kept))


def moveaxis_batched(x, src, dst):
    return _batching.moveaxis(x, src, dst)


# --- jaxprs ---------------------------------------------------------------


def jaxpr_and_consts(jaxpr) -> tuple[Any, Sequence[Any]]:
    """``(jaxpr, consts)`` from a closed jaxpr or an open one.

    Since JAX 0.11 ``ClosedJaxpr`` is an alias of ``Jaxpr``, which carries its
    consts and whose ``.jaxpr`` is itself; the first branch covers both.
    """
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    if isinstance(jaxpr, Jaxpr):
        return jaxpr, list(getattr(jaxpr, "consts", ()) or ())
    raise unknown_layout(f"a jaxpr of type {type(jaxpr).__name__}")


def read(env: dict, atom) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def write(env: dict, var, value) -> None:
    if not isinstance(var, DropVar):
        env[var] = value


def with_params(eqn, **params):
    """``eqn`` with ``params`` set (``JaxprEqn.replace`` on every JAX this package supports)."""
    return eqn.replace(params={**eqn.params, **params})


def bind_params(eqn) -> tuple[tuple, dict]:
    """``(subfuns, params)`` to bind ``eqn``'s primitive with (JAX < 0.9.2 gives subfuns apart)."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bind_params, tuple):  # JAX < 0.9.2: (subfuns, params)
        return bind_params
    return (), bind_params


def name_stack_context(name_stack):
    """A context in which new equations get no source line of their own and ``name_stack`` under
    the current one (an equation bound again inside a call: the call gives the line)."""
    return _source_info_util.user_context(None, name_stack=_source_info_util.current_name_stack() + name_stack)


def user_lines(eqn) -> tuple:
    """The user's source lines of an equation (file, function, line of each user frame, innermost
    first): equations with the same lines can be bound as one call without losing a line."""
    return tuple((f.file_name, f.function_name, f.start_line)
                 for f in _source_info_util.user_frames(eqn.source_info.traceback))


def is_linearizing(invals: Sequence[Any]) -> bool:
    """Whether ``jax.vjp`` is differentiating through these values (``jax.linearize``'s tracers)."""
    return _LINEARIZE_TRACER is not None and any(isinstance(v, _LINEARIZE_TRACER) for v in invals)


def has_linearize_rule(primitive) -> bool:
    """Whether JAX linearizes ``primitive`` with a rule of its own (``sin``, ``jit``, ``scan``...)
    rather than by tracing and partially evaluating its JVP rule."""
    return _LINEARIZATIONS is not None and primitive in _LINEARIZATIONS


# Inlined into the jaxpr while tracing. Since JAX 0.12 ``inline=True`` means inlined while
# lowering (``jax.Inline.JAX_LATE``): a call per equation left for the lowering to emit.
INLINE_EARLY = jax.Inline.JAX_EARLY if hasattr(jax, "Inline") else True


def source_context(eqn, name_stack: bool = True):
    """A context in which new equations get ``eqn``'s source line (a re-bound tag keeps its line),
    and its name stack unless ``name_stack`` is False."""
    stack = _source_info_util.current_name_stack() + (eqn.source_info.name_stack if name_stack else
                                                         _source_info_util.NameStack())
    return _source_info_util.user_context(eqn.source_info.traceback, name_stack=stack)


def source_line(eqn) -> str:
    """The user's source line of an equation, e.g. ``model.py:12 (forward)``."""
    try:
        return _source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - best effort only
        return "<unknown>"


def sub_jaxprs(params: dict) -> list[Any]:
    """All jaxprs held in an equation's params (for primitives we do not know)."""
    found = []
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, (Jaxpr, ClosedJaxpr)):
                found.append(item)
    return found


def construct(eqn, bodies=None) -> str:
    """An equation's primitive, the function it wraps where JAX recorded one, and the user's line:
    e.g. ``custom_vjp_call`` of ``_odeint at .../ode.py:193``, at ``model.py:12 (f)``."""
    text = f"`{eqn.primitive.name}`"
    for body in sub_jaxprs(eqn.params) if bodies is None else bodies:
        body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
        src = getattr(getattr(body, "debug_info", None), "func_src_info", None)
        if src:
            text += f" of {src}"
            break
    line = source_line(eqn)
    return f"{text}, at {line}" if line and line != "<unknown>" else text


def shard_map(f, *, mesh, in_specs, out_specs, axis_names, check_vma):
    """The public ``jax.shard_map`` (public since JAX 0.7, our oldest)."""
    if not hasattr(jax, "shard_map"):  # pragma: no cover - JAX < 0.7
        raise unknown_layout("`jax.shard_map` (missing)")
    return jax.shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(axis_names), check_vma=check_vma
    )


def wrap_cond_batching(wrapper) -> None:
    """Route ``jax.vmap`` of ``lax.cond`` through ``wrapper(rule, axis_data, args, dims, **params)``.

    ``rule`` is JAX's own batching rule; the wrapper calls it, with the params
    it was given or with rewritten branches.
    """
    from jax._src.lax.control_flow import conditionals

    batchers = getattr(_batching, "fancy_primitive_batchers", None)
    rule = None if batchers is None else batchers.get(conditionals.cond_p)
    if rule is None or "axis_data" not in inspect.signature(rule).parameters:
        raise unknown_layout("the `cond` primitive's batching rule")
    if getattr(rule, "_jaxtrace_wrapped", False):
        return
    wrapped = functools.partial(wrapper, rule)
    wrapped._jaxtrace_wrapped = True  # type: ignore[attr-defined]
    batchers[conditionals.cond_p] = wrapped


# Primitive names, by role. Several have been renamed across JAX releases.
SCAN = ("scan",)
COND = ("cond",)
INLINE_CALLS = ("jit", "pjit", "closed_call", "core_call", "call", "eval_jaxpr")
REMAT = ("remat2", "checkpoint", "remat")
WHILE = ("while",)
CUSTOM_DERIVATIVES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
CUSTOM_LINEAR = ("custom_lin",)
SHARD_MAP = ("shard_map",)
