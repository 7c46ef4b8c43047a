"""Which device held an entry, for ``find_nonfinite``: the shardings the compiler chose, and the mesh.

Under a sharded ``jax.jit`` the program is global (an index is the index into the whole array),
and which device holds which block of an intermediate value is the compiler's choice, known only
once XLA has partitioned the program. ``probe(*arrays)`` asks for it without running anything on
the host: its lowering puts ``jax.debug.inspect_array_sharding`` on each array, which the
partitioner answers while it compiles (the call leaves no trace in the compiled program), and
returns a number that names that lowering, a constant of the program. So a report read later
finds the shardings of the very executable that made it, even when one trace is compiled for
several input layouts (the trace is shared; the lowerings are not). Called outside ``jax.jit``,
the arrays are concrete and their shardings are read at once.

``shard_at(probe id, operand, index)`` then names the device(s) that hold one entry, as mesh
coordinates.
"""

from __future__ import annotations

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from . import _compat

__all__ = ["probe", "shard_at"]

_KEPT = 4096  # the records of the last lowerings (and eager calls) kept: a report older than that says less
_RECORDS: collections.OrderedDict = collections.OrderedDict()  # probe id -> [(shape, sharding or None)]
_IDS = itertools.count(1)


def _new_record(shapes) -> int:
    key = next(_IDS)
    _RECORDS[key] = [[tuple(s), None] for s in shapes]
    while len(_RECORDS) > _KEPT:
        _RECORDS.popitem(last=False)
    return key


def _impl(*arrays):
    key = _new_record(np.shape(a) for a in arrays)
    for slot, a in zip(_RECORDS[key], arrays):
        slot[1] = getattr(a, "sharding", None)
    return jnp.asarray(key, jnp.int32)


def _abstract_eval(*avals):
    return jax.core.ShapedArray((), jnp.int32)


def _lowering(ctx, *operands):
    key = _new_record(aval.shape for aval in ctx.avals_in)
    record = _RECORDS[key]

    def keep(i):
        return lambda sharding: record[i].__setitem__(1, sharding)

    def inspect(*arrays):
        for i, a in enumerate(arrays):
            jax.debug.inspect_array_sharding(a, callback=keep(i))
        return jnp.asarray(key, jnp.int32)

    return mlir.lower_fun(inspect, multiple_results=False)(ctx, *operands)


def _jvp(primals, tangents):
    return probe_p.bind(*primals), np.zeros((), _compat.float0)


def _batch(args, dims):
    moved = [a if d is _compat.not_mapped or d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    return probe_p.bind(*moved), _compat.not_mapped


probe_p = _compat.define_primitive(
    "jaxtrace_sharding_probe", impl=_impl, abstract_eval=_abstract_eval, jvp=_jvp, batch=_batch, lowering=_lowering
)
_compat.needs_devices_when_lowered(probe_p)


def probe(*arrays) -> jax.Array:
    """An int32 scalar that names the shardings the compiler gives ``arrays`` (read them with
    ``shard_at``); no operation of the compiled program."""
    return probe_p.bind(*arrays)


def shard_at(key: int, operand: int, index: tuple) -> tuple[dict, tuple] | None:
    """``({mesh axis: coordinate}, replicated axes)`` of the device(s) that hold entry ``index`` of
    the ``operand``-th array of probe ``key``: every mesh axis with the lowest coordinate of a
    device holding it; ``replicated`` the axes along which every device holds a copy. None on one
    device, or where the compiler's sharding was not recorded (an executable loaded from a cache
    without compiling, or a record older than the last 4096 lowerings)."""
    record = _RECORDS.get(int(key))
    if record is None or operand >= len(record):
        return None
    shape, sharding = record[operand]
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.num_devices <= 1:
        return None
    mesh = sharding.mesh
    where = {device: position for position, device in np.ndenumerate(mesh.devices)}
    holders = [
        where[device]
        for device, slices in sharding.devices_indices_map(shape).items()
        if all(_holds(s, i, n) for s, i, n in zip(slices, index, shape))
    ]
    if not holders:  # pragma: no cover - every entry is held somewhere
        return None
    coordinates, replicated = {}, []
    for axis, name in enumerate(mesh.axis_names):
        seen = {int(h[axis]) for h in holders}
        coordinates[name] = min(seen)
        if len(seen) > 1:
            replicated.append(name)
    return coordinates, tuple(replicated)


def _holds(block: slice, i: int, n: int) -> bool:
    start, stop, _ = block.indices(n)
    return start <= i < stop
