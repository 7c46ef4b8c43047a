"""The proof's forward walk: which leaf each layer's parameter is, what depends on a leaf, which ints are positions.

The plan tags each covered layer's parameters as ``"<path>:params:<attribute>"`` when it is
called; the operand of that tag is the leaf itself, one scan step's slice of a leaf (a stacked
layer), or something computed from leaves (then not the leaf: its gradient takes the exact
path). ``Forward`` walks the program once, in program order (``_walker``), and records each
layer's calls (``Occurrence``), whether each var depends on a differentiated leaf (``dep``), and
the integer arrays that hold their own position along an axis (``iota``: ``arange`` and what jnp
indexing builds from it, so that ``x[arange(B), labels]`` reads each example's own row).

A value of the walk is ``(origin, depends on a leaf)``; ``origin`` is an ``Origin`` where the
var is a leaf (or one scan step's slice of one), else None. What leaves a loop, a branch or a
custom derivative rule's call (JAX differentiates it by its rule) is no leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import numpy as np

from .. import _compat, _higher_order
from .._tag import tag_p
from .._walker import Walker, loop_depth
from ._owners import shape_of
from ._plan import TagKind

__all__ = ["Forward", "Occurrence", "Origin"]


class Origin(NamedTuple):
    """Where a layer's parameter comes from: leaf ``leaf`` itself, or (``depth`` set) one step's
    slice of it, sliced by the enclosing scan at ``depth`` (0: the outermost) of a stack in ``lax.scan``."""

    leaf: int
    depth: Optional[int] = None

    @property
    def stepped(self) -> bool:
        return self.depth is not None


@dataclasses.dataclass(frozen=True)
class Occurrence:
    """One call of a covered layer, as the program has it (``out`` filled in by ``_proof.prove`` from the
    backward walk)."""

    ctx: tuple  # the equations (calls, loops) that hold it, outermost first
    eqn: Any  # the output tag's equation
    out: Any = None  # ownership of its output (Axis / Every / None)
    params: dict = dataclasses.field(default_factory=dict)  # attribute -> Origin | None
    steps: int = 0  # enclosing scans
    inputs: tuple = ()  # its input tags' equations (one per leaf of the inputs), in the same body

    @property
    def order(self) -> tuple:
        """The axes of the output var (the program's layout) in the order of the value jaxtrace gives
        for the tag: the ``jax.vmap`` axes (``batch_axes``) first, then the others. A vmapped Linear
        without bias has its output as ``(features, positions)`` in the program, ``(positions,
        features)`` as a value."""
        batch_axes = tuple(int(a) for a in self.eqn.params.get("batch_axes", ()))
        return (*batch_axes, *(i for i in range(len(shape_of(self.eqn.outvars[0]))) if i not in batch_axes))


class Forward(Walker):
    """The forward walk (see the module docstring). ``by_rules``: custom derivative calls are read as
    JAX differentiates them (by their rules: what leaves them is no leaf)."""

    bottom = (None, False)
    enters = frozenset({*_higher_order.CALL_LIKE, _higher_order.COND, _higher_order.SCAN})

    def __init__(self, roles: dict, by_rules: bool = True):
        self.roles = roles  # tag name -> TagRole (``Plan.roles``): what each covered layer's tag marks
        self.by_rules = by_rules
        self.occurrences: dict = {}  # layer path -> [Occurrence] in program order
        self.by_eqn: dict = {}  # (ctx, id(eqn)) -> Occurrence
        self.pending: dict = {}  # (ctx, path) -> params seen since that layer's last call
        self.inputs: dict = {}  # (ctx, path) -> input tag equations seen since that layer's last call
        self.dep: dict = {}  # (ctx, var) -> depends on a leaf
        self.iota: dict = {}  # (ctx, var) -> ("iota", dim) | ("false",) | ("components", dim, {k: dim})

    def join(self, a, b):
        return (a[0] if a[0] == b[0] else None, a[1] or b[1])

    def record(self, ctx: tuple, var, value) -> None:
        self.dep[(ctx, var)] = value[1]

    def into_loop(self, eqn, role: str, value, ctx: tuple):
        origin, dep = value
        if role == "carry":
            return (None, dep)
        if role == "xs":  # one step's slice of a leaf: the stack's layer at this depth
            return (Origin(origin.leaf, loop_depth(ctx)) if isinstance(origin, Origin) and not origin.stepped else None, dep)
        return value

    def out_of_body(self, eqn, value, ctx: tuple):
        kind = _higher_order.kind(eqn)
        as_is = kind in (_higher_order.CALL, _higher_order.REMAT) or kind == _higher_order.CUSTOM and not self.by_rules
        return value if as_is else (None, value[1])

    def equation(self, eqn, ins: list, ctx: tuple) -> list:
        _iota_rule(self.iota, eqn, ctx)
        return [(None, any(d for _, d in ins))] * len(eqn.outvars)

    def tag(self, eqn, ins: list, ctx: tuple) -> list:
        name, origin = eqn.params["name"], ins[0][0]
        role = self.roles.get(name)
        if role is not None and role.kind is TagKind.PARAM:
            self.pending.setdefault((ctx, role.layer), {})[role.attribute] = origin
        elif role is not None and role.kind is TagKind.INPUT:
            self.inputs.setdefault((ctx, role.layer), []).append(eqn)
        elif role is not None and role.kind is TagKind.OUTPUT:
            inputs = tuple(self.inputs.pop((ctx, name), ()))
            if (ctx, id(eqn)) in self.by_eqn:  # a loop body read again (its carries' fixed point)
                self.pending.pop((ctx, name), None)
            else:
                occ = Occurrence(ctx, eqn, params=self.pending.pop((ctx, name), {}), steps=loop_depth(ctx), inputs=inputs)
                self.occurrences.setdefault(name, []).append(occ)
                self.by_eqn[(ctx, id(eqn))] = occ
        return [(origin, any(d for _, d in ins))]

    rules = {tag_p.name: tag}


def _iota_rule(iota: dict, eqn, ctx: tuple) -> None:
    """Integer arrays that hold their own position along an axis (``arange`` and what jnp indexing
    builds from it), so that ``x[arange(B), labels]`` reads each example's own row."""
    name, get = eqn.primitive.name, lambda a: None if isinstance(a, _compat.Literal) else iota.get((ctx, a))
    out = None
    if name == "iota":
        out = ("iota", eqn.params["dimension"])
    elif name in ("convert_element_type", "copy") and get(eqn.invars[0]):
        out = get(eqn.invars[0])
    elif name == "lt" and _is_iota(get(eqn.invars[0])) and _literal_is(eqn.invars[1], 0):
        out = ("false",)
    elif name == "select_n" and get(eqn.invars[0]) == ("false",):
        out = get(eqn.invars[1])
    elif name == "broadcast_in_dim" and _is_iota(get(eqn.invars[0])):
        dims = eqn.params["broadcast_dimensions"]
        d = get(eqn.invars[0])[1]
        if shape_of(eqn.invars[0])[d] == shape_of(eqn.outvars[0])[dims[d]]:
            out = ("iota", int(dims[d]))
    elif name == "concatenate":
        dim = eqn.params["dimension"]
        comps, k = {}, 0
        for a in eqn.invars:
            info = get(a)
            if _is_iota(info) and info[1] != dim:
                comps[k] = info[1]
            k += shape_of(a)[dim]
        out = ("components", dim, comps) if comps else None
    if out is not None:
        iota[(ctx, eqn.outvars[0])] = out


def _is_iota(info) -> bool:
    return bool(info) and info[0] == "iota"


def _literal_is(atom, value) -> bool:
    return isinstance(atom, _compat.Literal) and np.ndim(atom.val) == 0 and atom.val == value
