"""What the tests share: the ``+ eps`` oracle, reading compiled HLO, and the models several files use.

The ``+ eps`` oracle (docs: DESIGN.md) is the program written by hand with ``value + eps[name]``
where a tag is, ``eps`` a new argument, differentiated with plain ``jax.grad`` at ``eps = 0``:
its gradient with respect to ``eps[name]`` is the gradient at the tag. ``plus_eps`` is the mark a
test's program takes in place of ``jt.tag``; ``eps_oracle`` differentiates it.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "eps_oracle",
    "hlo",
    "hlo_instructions",
    "nnx_stack_by_hand",
    "NnxBlock",
    "NnxStack",
    "plus_eps",
    "zeros_like",
]

# --- the + eps oracle ---------------------------------------------------------------------------


def plus_eps(eps):
    """The oracle's mark: ``mark(value, name)`` is ``value + eps[name]`` (where a test's program,
    with ``mark=jt.tag``, has a tag)."""
    return lambda value, name: value + eps[name]


def zeros_like(tree):
    """Zeros shaped like each array of ``tree``: the ``eps`` at which the oracle is evaluated."""
    return jax.tree_util.tree_map(jnp.zeros_like, tree)


def eps_oracle(program, *args, argnums=0, value=False, has_aux=False, wrap=None):
    """The ``+ eps`` oracle: plain ``jax.grad`` of ``program``, written with explicit ``eps``.

    Args:
        program: the hand-written program; its argument at ``argnums`` (the last, if several)
            is ``eps``, a pytree with one array per tag, added where the tag is.
        *args: its arguments, ``eps`` as zeros (checked where concrete).
        argnums: as ``jax.grad``'s (parameters too: ``(0, 1)``).
        value: ``jax.value_and_grad`` instead.
        has_aux: as ``jax.grad``'s.
        wrap: a transform around the differentiated program (``jax.jit``, a test's ``maybe_jit``).

    Returns:
        What ``jax.grad(program, argnums, has_aux=has_aux)(*args)`` returns (``jax.value_and_grad``
        with ``value=True``): the gradient at each tag where ``eps`` is.
    """
    eps = args[argnums if isinstance(argnums, int) else argnums[-1]]
    for leaf in jax.tree_util.tree_leaves(eps):
        try:
            concrete = np.asarray(leaf)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            continue  # inside a traced test program: zeros by construction
        assert not np.any(concrete), "the + eps oracle is evaluated at eps = 0"
    transform = jax.value_and_grad if value else jax.grad
    differentiated = transform(program, argnums=argnums, has_aux=has_aux)
    return (differentiated if wrap is None else wrap(differentiated))(*args)


# --- compiled HLO -------------------------------------------------------------------------------


def _compiled_text(fun, *args) -> str:
    """``jax.jit(fun)``'s compiled HLO without metadata, file tables or the module's name."""
    text = jax.jit(fun).lower(*args).compile().as_text()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    # XLA:GPU stamps each instruction with a hash of the program before scheduling, names included
    text = re.sub(r'fingerprint_before_lhs="[0-9a-f]*"', 'fingerprint_before_lhs=""', text)
    text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "\n", text)
    return re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)


def hlo(fun, *args, renumber: bool = False) -> str:
    """The compiled program of ``jax.jit(fun)(*args)`` as text, for comparing two programs.

    Args:
        fun: the function to compile.
        *args: its arguments.
        renumber: also name the instructions ``%v0``, ``%v1``, ... in order of appearance, so that
            two programs that differ only in XLA's numbering compare equal.

    Returns:
        The HLO text without metadata, file tables or the module's name.
    """
    text = _compiled_text(fun, *args)
    if not renumber:
        return text
    names: dict = {}
    return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)


def hlo_instructions(fun, *args) -> list:
    """The compiled program's instructions, numbering stripped, in sorted order.

    For loops, where XLA may schedule two independent instructions in either
    order depending on the order they were traced in.
    """
    text = re.sub(r"^HloModule .*$", "", _compiled_text(fun, *args), flags=re.M)
    text = re.sub(r"(%?[A-Za-z_][\w\-]*)\.\d+", r"\1", text)
    text = re.sub(r"(%constant)(_\d+)+", r"\1", text)  # XLA:GPU numbers constants as %constant_22_1
    return sorted(line.strip() for line in text.splitlines() if line.strip())


# --- models several test files use --------------------------------------------------------------


@functools.cache
def _nnx_models() -> dict:
    """The Flax NNX models, defined on first use (importing Flax only for the tests that need it)."""
    from flax import nnx

    class NnxBlock(nnx.Module):
        """``tanh`` of a 3 x 3 float64 ``nnx.Linear``."""

        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs, param_dtype=jnp.float64)

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    class NnxStack(nnx.Module):
        """A scanned layer stack, as the Flax docs build one: ``depth`` blocks made by ``nnx.vmap``,
        run by ``nnx.scan``; the path ``"blocks"`` is each block's output, ``"blocks.lin"`` its Linear's."""

        def __init__(self, rngs, depth=4):
            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return NnxBlock(rngs)

            self.blocks = create(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return block(x)

            return body(x, self.blocks)

    return {"NnxBlock": NnxBlock, "NnxStack": NnxStack}


def __getattr__(name: str):
    if name in ("NnxBlock", "NnxStack"):
        return _nnx_models()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def nnx_stack_by_hand(model, x, eps, eps_lin=None):
    """``NnxStack`` run by hand with ``+ eps[i]`` at block ``i``'s output (and ``+ eps_lin[i]`` at
    its Linear's): ``(output, the blocks' outputs stacked)``."""
    w, b = model.blocks.lin.kernel[...], model.blocks.lin.bias[...]

    def body(x, layer):
        w, b, e, e_lin = layer
        h = x @ w + b
        out = jnp.tanh(h if e_lin is None else h + e_lin) + e
        return out, out

    return lax.scan(body, x, (w, b, eps, eps_lin))
