"""The split: trace a function once, find its tags, and re-run it with the selected tags opened.

``Split`` traces ``fun`` to a jaxpr (``Program``: its sites), selects the sites that ``tags=``
asks for (``_selection``), and on each call evaluates the program again with a ``ProgramEvaluator``,
applying a site function at each selected tag and handing out the values at the output sites,
laid out as documented (``_sites.assemble``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

from ._arrays import is_array  # re-exported: the transforms read array leaves from here
from ._leaves import check_array_leaves
from ._program import Program
from ._selection import report_evaluated, select
from ._sites import Site, assemble
from ._evaluator import ProgramEvaluator, per_leaf, whole_call
from ._stateful import lift
from ._tag import evaluated_tags

__all__ = ["Split", "STATE", "is_array", "keep"]

# The key, among a call's site outputs, of the NNX state the call changed (no site has leaf -1):
# it leaves the transform's trace with the values at the tags, and ``Split.write_back`` sets it.
STATE = ("", -1)


def _always(leaf) -> bool:
    return True


def _as_array(value):
    """A program output read from a literal (a JAX-internal scalar type) as an array."""
    return value if isinstance(value, jax.Array) else jnp.asarray(value)


def keep(site: Site, x, _):
    """The site function that leaves the value as it is (the tag stays in place)."""
    return x


@contextlib.contextmanager
def _explain_tracer_errors(fun):
    """Say why Python control flow on a value fails, and what to do, when ``fun`` is traced."""
    try:
        yield
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError) as e:
        name = getattr(fun, "__qualname__", repr(fun))
        e.add_note(
            f"jaxtrace traces {name} once into a program (as jax.jit does), even when it is called "
            "without jax.jit, so Python control flow (if/while/bool()/int()) cannot depend on the value of "
            "an array argument. Use jnp.where, lax.cond or lax.select for value-dependent choices, or pass "
            "the value as a Python number (jaxtrace keeps Python numbers static)."
        )
        raise
    except Exception as e:
        if type(e).__name__ != "TraceContextError" or not type(e).__module__.startswith("flax"):
            raise
        name = getattr(fun, "__qualname__", repr(fun))
        e.add_note(
            f"jaxtrace traces {name} into a program, even when it is called without jax.jit, and Flax lets an "
            "NNX object change (an RNG count, batch statistics) only in the trace that made it. jaxtrace moves "
            "the NNX objects it is given into its trace and writes their changes back, but not one that the "
            "function closes over: pass the model (or nnx.Rngs) as an argument, jt.capture(lambda m, x: m(x))"
            "(model, x), or the module itself as the function, jt.capture(model)(x)."
        )
        raise


class Split:
    """``fun`` traced once at ``args``, with the sites that ``tags`` selects.

    The leaves of the arguments in ``argnums`` for which ``dynamic(leaf)``
    holds become the program's inputs; everything else is closed over as is
    (so Python numbers stay static, as with ``jax.grad``'s other arguments).
    Calling it re-runs the program on new values of those inputs, applying
    ``site_fn`` at each selected tag and handing out the values at the sites
    in ``outputs``.

    NNX objects among ``fun`` and its arguments are lifted into the trace (``_stateful``), except
    in the positions ``keep`` (default: ``argnums``), which are traced as pytrees; the state the
    call changes is handed out under ``STATE`` with the site outputs, for ``write_back``.
    """

    def __init__(self, fun, args, kwargs, argnums, tags, *, dynamic=_always, purpose="reverse", keep=None):
        args = tuple(args)
        for a in argnums:
            if not -len(args) <= a < len(args):
                raise TypeError(
                    f"argnums={a} is out of range: the function was called with {len(args)} positional "
                    "argument(s)."
                )
        argnums = tuple(a % len(args) for a in argnums)
        self.lift = lift(fun, args, kwargs, keep=argnums if keep is None else keep)
        if self.lift is not None:
            fun, args, kwargs = self.lift.fun, self.lift.args, self.lift.kwargs
        self.args = tuple(args[i] for i in argnums)
        if dynamic is _always:  # every leaf is traced: a clear error for functions, strings
            check_array_leaves(self.args, argnums)
        leaves, tree = jax.tree_util.tree_flatten(self.args)
        mask = [dynamic(leaf) for leaf in leaves]

        def flat_fun(*dynamic_leaves):
            it = iter(dynamic_leaves)
            chosen = jax.tree_util.tree_unflatten(tree, [next(it) if m else leaf for leaf, m in zip(leaves, mask)])
            full = list(args)
            for i, a in zip(argnums, chosen):
                full[i] = a
            out = fun(*full, **kwargs)
            changed = None
            if self.lift is not None:
                out, changed = out
            out_leaves, self.out_tree = jax.tree_util.tree_flatten(out)
            state_leaves, self._state_tree = jax.tree_util.tree_flatten(changed)
            # Leaves that are not arrays (strings, Python numbers in an aux output) pass through as they are.
            self._static = {i: leaf for i, leaf in enumerate(out_leaves) if not is_array(leaf)}
            return [leaf for leaf in out_leaves if is_array(leaf)] + state_leaves

        self._mask = mask
        self.out_tree: Any = None
        self._state_tree: Any = None
        self._static: dict = {}
        with jax.disable_jit(False), _explain_tracer_errors(fun), evaluated_tags() as evaluated:
            # Traced as under jit even inside jax.disable_jit(): a scan stays one scan, so a tag in
            # its body is one site, laid out as it is under jit.
            jaxpr = jax.make_jaxpr(flat_fun)(*[l for l, m in zip(leaves, mask) if m])
        self.program = Program(jaxpr)
        report_evaluated(evaluated, self.program.sites, tags)
        self.sites = select(self.program.sites, tags, purpose)

    def __call__(self, args, site_fn, inputs: dict, outputs=(), call_fn=None) -> tuple[Any, dict]:
        """``fun(*args)`` (for the traced arguments) split at the selected sites: ``site_fn(site,
        value, input)`` at each leaf, or ``call_fn(sites, values)`` at each ``jt.tag`` call's leaves
        at once."""
        leaves = [leaf for leaf, m in zip(jax.tree_util.tree_leaves(args), self._mask) if m]
        at_sites = whole_call(call_fn) if call_fn is not None else per_leaf(site_fn)
        outs, site_outputs = ProgramEvaluator(self.program, self.sites, at_sites, outputs)(leaves, inputs)
        it = iter(map(_as_array, outs))
        site_outputs = {k: _as_array(v) for k, v in site_outputs.items()}
        out_leaves = [self._static[i] if i in self._static else next(it) for i in range(self.out_tree.num_leaves)]
        if self.lift is not None:
            site_outputs[STATE] = jax.tree_util.tree_unflatten(self._state_tree, list(it))
        return jax.tree_util.tree_unflatten(self.out_tree, out_leaves), site_outputs

    def write_back(self, outputs: dict) -> None:
        """Leaves the NNX objects of the call as one plain call leaves them, from the site outputs
        of a call (``outputs[STATE]``) once they are out of the transform's trace."""
        if self.lift is not None:
            self.lift.write_back(outputs[STATE])

    @property
    def keys(self) -> list:
        return [site.key for site in self.sites]

    def tag_tree(self, values: dict, lead: tuple = ()) -> dict:
        """``{name: pytree}`` in the documented layout, from per-site values (after ``lead`` axes)."""
        return assemble(self.sites, values, lead)
