"""Collectives of a per-example step under FSDP: jaxtrace against the plain step and vmap(grad).

    python benchmarks/per_example_collectives.py [--devices 8]

Issue 33's target: under FSDP sharding, ``jt.clipped_grad`` has no more collectives than the
plain gradient step plus one all-reduce of the ``B`` norms. This script places the two models of
``per_example.py`` (an MLP and a 2-block transformer with its positions inside the model) and
the CNN of ``per_example_peers.py`` (three 3x3 convolutions with max pooling, two Linear) on
``--devices`` CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``, set here
before JAX starts), FSDP style: the batch and every parameter sharded over one mesh axis (each
parameter on its first axis divisible by the device count, replicated where none is). It
compiles, under ``jax.jit`` with those shardings:

- plain ``eqx.filter_grad`` of the summed loss (the floor),
- ``jt.clipped_grad`` and ``jt.per_example_norms(total=True)``,
- ``vmap(grad)`` + clip-and-sum (what one writes today),

and prints, from the compiled HLO (deterministic: no timing), each variant's collectives by
kind with the bytes they move. Nothing is timed: the CPU devices share two cores.

Last run (JAX 0.12.0.1; the table in docs/performance.md): on the transformer ``clipped_grad``
has the plain step's collectives (+1.6% bytes) and ``per_example_norms`` none beyond them; on
the MLP ``per_example_norms`` adds one all-reduce, ``clipped_grad`` +4 all-gathers and +2
all-reduces of ``(B,)`` and ``(B, 10)`` arrays (+1.5% bytes; +61% before the weighted sum was
formed as the plain backward forms the weight gradient); on the CNN ``per_example_norms`` has
fewer collectives than the plain step, ``clipped_grad`` +3 all-gathers (+0.3% bytes: the weights,
the last layer's weighted gradient; +4 and +22% before the weighted sum read the first Linear's
input as the forward's own array instead of a reshaped view, which XLA gathered a second time).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import per_example as PE
    import per_example_peers as PP

    n = args.devices
    assert len(jax.devices()) == n, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def fsdp(a):
        if not eqx.is_array(a):
            return None
        axis = next((i for i, s in enumerate(a.shape) if s % n == 0), None)
        spec = P() if axis is None else P(*([None] * axis), "fsdp")
        return NamedSharding(mesh, spec)

    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    models = {
        "MLP 256-512-512-10, B=64": (
            eqx.nn.MLP(256, 10, 512, 2, key=k1),
            (jax.random.normal(k2, (64, 256)), jax.random.randint(k3, (64,), 0, 10)),
            PE.mlp_losses,
        ),
        "transformer d=128, 2 blocks, T=32, B=16": (
            PE.Transformer(512, 128, 4, 2, key=k1),
            (jax.random.randint(k2, (16, 32), 0, 512), jax.random.randint(k3, (16, 32), 0, 512)),
            PE.lm_losses,
        ),
        "CNN 3 convs (32-64-64), 32x32, B=64": (
            PP.CNN(32, (32, 64, 64), 128, 10, k1),
            (jax.random.normal(k2, (64, 3, 32, 32)), jax.random.randint(k3, (64,), 0, 10)),
            PP.classify_losses,
        ),
    }
    names = ("filter_grad (no per-example)", "jt.clipped_grad", "jt.per_example_norms", "vmap(grad) + clip-and-sum")
    print(f"JAX {jax.__version__}, {n} CPU devices, FSDP: batch and parameters sharded over one axis")
    print()
    print("| model | variant | collectives (count by kind) | bytes moved | beyond plain |")
    print("|---|---|---|---|---|")
    for title, (model, batch, losses_fn) in models.items():
        arrays, static = eqx.partition(model, eqx.is_array)
        arrays = jax.device_put(arrays, jax.tree.map(fsdp, arrays))
        batch = tuple(jax.device_put(b, NamedSharding(mesh, P("fsdp"))) for b in batch)
        fns = PE.variants(losses_fn)
        base = None
        for name in names:
            f = fns[name]
            step = jax.jit(lambda a, *b, f=f: f(eqx.combine(a, static), *b))
            text = step.lower(arrays, *batch).compile().as_text()
            kinds, moved = collectives(text)
            if base is None:
                base = (kinds, moved)
            extra = kinds - base[0]
            more = ", ".join(f"+{v} {k}" for k, v in sorted(extra.items())) or "none"
            fewer = base[0] - kinds
            if fewer:
                more += "; " + ", ".join(f"-{v} {k}" for k, v in sorted(fewer.items()))
            print(f"| {title} | {name} | {fmt(kinds)} | {moved:,} | {more} ({moved - base[1]:+,} B) |")


COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
)
SHAPE = re.compile(r"(pred|[sfu]\d+|bf16|c64|c128)\[([\d,]*)\]")
BYTES = {"pred": 1, "bf16": 2}


def collectives(text):
    """``(Counter of collective kinds, bytes of their results)`` of a compiled HLO module."""
    kinds, moved = collections.Counter(), 0
    for m in COLLECTIVE.finditer(text):
        kinds[m.group("op")] += 1
        for dtype, dims in SHAPE.findall(m.group("shape")):
            size = BYTES.get(dtype) or int(re.sub(r"\D", "", dtype)) // 8
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            moved += size * count
    return kinds, moved


def fmt(kinds):
    return ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) or "none"


if __name__ == "__main__":
    main()
