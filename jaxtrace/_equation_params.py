"""How each JAX version spells a higher-order equation's params: readers that give what jaxtrace needs.

``scan_params``, ``while_params``, ``cond_branches``, ``call_body``, ``custom_primal``,
``shard_map_params`` and the rest read one equation's params, whatever the JAX version calls
them, and raise ``UnknownLayoutError`` (naming the JAX version) on a spelling they do not know.
They read only public params; the internals themselves stay in ``_compat``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ._compat import unknown_layout

__all__ = [
    "ScanParams",
    "ShardMapParams",
    "WhileParams",
    "call_body",
    "call_shardings",
    "cond_branches",
    "custom_primal",
    "remat_options",
    "scan_params",
    "shard_map_params",
    "while_params",
]


@dataclasses.dataclass(frozen=True)
class ScanParams:
    body: Any  # closed or open jaxpr: consts, carry, xs -> carry, ys
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan_params(eqn) -> ScanParams:
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:  # JAX <= 0.10
        num_consts, num_carry = p["num_consts"], p["num_carry"]
    elif "ft_in" in p:  # JAX 0.11: flat trees (consts, carry, xs) -> (carry, ys)
        num_consts, num_carry, _ = map(len, p["ft_in"].unpack())
    else:
        raise unknown_layout("the `scan` primitive's params " + str(sorted(p)))
    return ScanParams(p["jaxpr"], num_consts, num_carry, p["length"], p["reverse"], p.get("unroll", 1))


@dataclasses.dataclass(frozen=True)
class WhileParams:
    cond: Any  # closed jaxpr: cond consts, carry -> bool
    body: Any  # closed jaxpr: body consts, carry -> carry
    cond_nconsts: int
    body_nconsts: int


def while_params(eqn) -> WhileParams:
    p = eqn.params
    try:
        return WhileParams(p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"])
    except KeyError:
        raise unknown_layout("the `while` primitive's params " + str(sorted(p))) from None


def custom_primal(eqn) -> Any:
    """The primal function of a ``custom_jvp_call`` / ``custom_vjp_call``: a jaxpr of all its operands."""
    body = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
    if body is None:
        raise unknown_layout(f"the `{eqn.primitive.name}` primitive's params " + str(sorted(eqn.params)))
    return body


def cond_branches(eqn) -> tuple:
    try:
        return tuple(eqn.params["branches"])
    except KeyError:
        raise unknown_layout("the `cond` primitive's params " + str(sorted(eqn.params))) from None


def call_body(eqn) -> Any:
    """The body of a call-like equation (jit, closed_call, core_call, remat)."""
    for key in ("jaxpr", "call_jaxpr"):
        if key in eqn.params:
            return eqn.params[key]
    raise unknown_layout(f"the `{eqn.primitive.name}` primitive's params " + str(sorted(eqn.params)))


def call_shardings(eqn) -> tuple | None:
    """``(in_shardings, out_shardings)`` of a ``jax.jit`` equation, or None if it has none.

    Unspecified entries are None, which ``jax.jit`` reads as unspecified.
    """
    p = eqn.params
    if "in_shardings" not in p and "out_shardings" not in p:
        return None
    spec = lambda s: s if isinstance(s, jax.sharding.Sharding) else None  # noqa: E731
    ins = tuple(map(spec, p.get("in_shardings", ())))
    outs = tuple(map(spec, p.get("out_shardings", ())))
    if all(s is None for s in (*ins, *outs)):
        return None
    return ins or None, outs or None


def remat_options(eqn) -> dict:
    return dict(prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy"))


@dataclasses.dataclass(frozen=True)
class ShardMapParams:
    body: Any  # the per-shard jaxpr
    mesh: Any  # Mesh or AbstractMesh
    in_specs: tuple
    out_specs: tuple
    axes: tuple  # the mesh axes the body is manual over, in mesh order
    check_vma: bool

    def varying_axes(self, aval) -> frozenset:
        """The axes among ``axes`` over which a value of the body can differ between shards.

        Without ``check_vma`` JAX does not track this, and every value may differ.
        """
        if not self.check_vma:
            return frozenset(self.axes)
        mat = getattr(aval, "mat", None)  # JAX 0.10: a ManualAxisType
        vma = mat.varying if mat is not None else getattr(aval, "vma", None)  # JAX 0.7: a frozenset
        if vma is None:
            raise unknown_layout("a shard_map body value's varying axes (`aval.vma`)")
        return frozenset(vma) & frozenset(self.axes)


def shard_map_params(eqn) -> ShardMapParams:
    p = eqn.params
    try:
        mesh, body, in_specs, out_specs = p["mesh"], p["jaxpr"], p["in_specs"], p["out_specs"]
        check_vma = p["check_vma"] if "check_vma" in p else p["check_rep"]
    except KeyError:
        raise unknown_layout("the `shard_map` primitive's params " + str(sorted(p))) from None
    if "newly_manual_axes" in p:  # JAX 0.10
        manual = p["newly_manual_axes"]
    elif "manual_axes" in p:  # JAX 0.7.2
        manual = p["manual_axes"]
    elif "auto" in p:  # older: the complement
        manual = frozenset(mesh.axis_names) - frozenset(p["auto"])
    else:
        raise unknown_layout("the `shard_map` primitive's params " + str(sorted(p)))
    axes = tuple(a for a in mesh.axis_names if a in manual)
    return ShardMapParams(body, mesh, tuple(in_specs), tuple(out_specs), axes, bool(check_vma))
