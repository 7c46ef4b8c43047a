"""What a telemetry step costs: ``jt.stats.value_and_grad`` against the ``jt.value_and_grad`` step.

    python benchmarks/stats_step.py [--rounds 30] [--models mlp,rnn,attention,cnn,chain]
    python benchmarks/stats_step.py --models mlp,rnn --layouts "data parallel,fsdp,tensor parallel 4x2,shard_map"

Issue 36's target: the stats step within 1.05x of the ``jt.value_and_grad`` step on the
benchmark models; issue 52's: within 1.05x of the same statistics written by hand, the range
guards included, on one device and sharded. ``--layouts`` also runs the MLP and the RNN sharded
(``layout``) on 8 simulated CPU devices (``--xla_force_host_platform_device_count=8``, set
before JAX starts: one process, the same cores). For each model of ``models.py`` (the same sizes as ``run.py``), jitted and
interleaved round by round (each round times every variant once, in a random order):

- ``jt.value_and_grad`` returning every tag's cotangent (the base),
- ``jt.stats.value_and_grad(stats="norm")`` (one number per tag and loop step),
- ``jt.stats.value_and_grad`` with every statistic (``norm``, ``rms``, ``mean_abs``,
  ``max_abs``, ``nonfinite``),
- the same two written by hand on the base step's cotangents (``sqrt(sum(g**2))`` etc., what
  one would write without jaxtrace),
- the norm and the five by hand with ``jt.stats``' guarantees (the sums also at fixed power-of-two
  scales, each scaled entry capped after its multiply as ``jt.stats`` writes it, so a norm past
  float32's square range is still right under jit): the same results, each sum its own ``jnp.sum``,

and prints the median per-round ratio to the base and, for the statistics steps, to the unguarded
hand-written step with the same statistics (x hand; "best": the ratio of the two variants' fastest
rounds, what the machine's load added least to), and the reduce ops in each compiled step (a
count the machine's load does not change). Process CPU time is beside wall time: XLA:CPU runs a
step on every core, so on a shared machine wall time moves with the load.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = ("data parallel", "fsdp", "tensor parallel 4x2", "shard_map")
if any(a.startswith("--layouts") for a in sys.argv):  # JAX fixes its device count when it starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtrace as jt  # noqa: E402
import models as M  # noqa: E402
from timers import device  # noqa: E402

ALL = ("norm", "rms", "mean_abs", "max_abs", "nonfinite")


def by_hand(tag_grads, stats, loops):
    """The statistics written by hand on full cotangents, keeping ``loops[name]`` leading axes
    (a scan's steps), as ``jt.stats`` does."""

    def one(g, loops):
        axes = tuple(range(loops, g.ndim))
        out = {}
        if "norm" in stats:
            out["norm"] = jnp.sqrt(jnp.sum(g * g, axis=axes))
        if "rms" in stats:
            out["rms"] = jnp.sqrt(jnp.mean(g * g, axis=axes))
        if "mean_abs" in stats:
            out["mean_abs"] = jnp.mean(jnp.abs(g), axis=axes)
        if "max_abs" in stats:
            out["max_abs"] = jnp.max(jnp.abs(g), axis=axes)
        if "nonfinite" in stats:
            out["nonfinite"] = jnp.sum(~jnp.isfinite(g), axis=axes)
        return out

    return {n: one(g, loops[n]) for n, g in tag_grads.items()}


def by_hand_guarded(tag_grads, loops, stats=ALL):
    """All five written by hand with the guarantees ``jt.stats`` gives: the sums of squares (and of
    ``|g|``) also taken at fixed power-of-two scales, the one in range picked after the sums, so
    that a norm above ``sqrt(float32 max)`` or below ``sqrt(float32 tiny)`` is still right; each
    sum a plain ``jnp.sum`` (XLA's vectorised reduction), not one pass."""

    def scaled(g, k, cap):
        """min(|g * 2**k|, cap): capped after the multiply, so XLA cannot fold 2**k into the square
        (square(g * 2**k) -> square(g) * 2**(2k), 0 * inf in float32), as jt.stats writes it."""
        return jnp.minimum(jnp.abs(g * jnp.asarray(2.0**k, g.dtype)), jnp.asarray(cap, g.dtype))

    def one(g, loops):
        axes = tuple(range(loops, g.ndim))
        info = jnp.finfo(g.dtype)
        e = info.maxexp
        down, up, tiny = 3 * e // 4, e // 2, 2.0 ** -(e // 2 - 4)
        entries = (g, scaled(g, -down, info.max), scaled(g, up, 2.0 ** (e // 2 - 2)))
        mid, hi, lo = (jnp.sum(jnp.square(s), axis=axes) for s in entries)
        use_hi, use_lo = jnp.isinf(mid), mid < tiny
        sq = jnp.where(use_hi, hi, jnp.where(use_lo, lo, mid))
        scale = jnp.where(use_hi, 2.0**down, jnp.where(use_lo, 2.0**-up, 1.0))
        if stats == ("norm",):
            return {"norm": scale * jnp.sqrt(sq)}
        n = math.prod(g.shape[loops:])
        s_abs, s_abs_hi = jnp.sum(jnp.abs(g), axis=axes), jnp.sum(jnp.abs(g * 2.0 ** -up), axis=axes)
        return {
            "norm": scale * jnp.sqrt(sq),
            "rms": scale * jnp.sqrt(sq / n),
            "mean_abs": jnp.where(jnp.isinf(s_abs), (s_abs_hi / n) * 2.0**up, s_abs / n),
            "max_abs": jnp.where(jnp.isnan(mid), jnp.nan, jnp.max(jnp.abs(g), axis=axes)),
            "nonfinite": jnp.sum(~jnp.isfinite(g), axis=axes) / n,
        }

    return {n: one(g, loops[n]) for n, g in tag_grads.items()}


def variants(model, params, x, wrap=lambda loss: loss):
    """The steps, keyed by name; ``wrap`` turns the tagged loss into the layout's (a shard_map)."""
    loss = wrap(lambda p, x: model.loss(p, x, jt.tag))
    norms = jax.eval_shape(lambda p, x: jt.stats.value_and_grad(loss, stats="norm")(p, x)[1][1], params, x)
    loops = {n: len(v["norm"].shape) for n, v in norms.items()}

    def base(p, x):
        return jt.value_and_grad(loss)(p, x)

    def stats_norm(p, x):
        return jt.stats.value_and_grad(loss, stats="norm")(p, x)

    def stats_all(p, x):
        return jt.stats.value_and_grad(loss, stats=ALL)(p, x)

    def hand_norm(p, x):
        value, (grads, tag_grads) = base(p, x)
        return value, (grads, by_hand(tag_grads, ("norm",), loops))

    def hand_all(p, x):
        value, (grads, tag_grads) = base(p, x)
        return value, (grads, by_hand(tag_grads, ALL, loops))

    def hand_guarded(p, x):
        value, (grads, tag_grads) = base(p, x)
        return value, (grads, by_hand_guarded(tag_grads, loops))

    def hand_norm_guarded(p, x):
        value, (grads, tag_grads) = base(p, x)
        return value, (grads, by_hand_guarded(tag_grads, loops, ("norm",)))

    return {
        "jt.value_and_grad (base)": base,
        'stats="norm"': stats_norm,
        "hand norm": hand_norm,
        "hand norm, range-guarded": hand_norm_guarded,
        "all five stats": stats_all,
        "hand, all five": hand_all,
        "hand, all five, range-guarded": hand_guarded,
    }


HAND_OF = {
    'stats="norm"': "hand norm",
    "hand norm, range-guarded": "hand norm",
    "all five stats": "hand, all five",
    "hand, all five, range-guarded": "hand, all five",
}
"""The unguarded hand-written step each statistics step is compared with (the x hand column)."""


BATCH_AXIS = {"mlp": 0, "rnn": 1}
"""The models ``--layouts`` shards, and the axis of their input that holds the batch."""


def layout(model, name):
    """``(params, x, wrap)`` for a sharded layout of the MLP or the RNN on 8 (simulated) devices.

    ``data parallel``: the batch over 8 devices, the parameters replicated. ``fsdp``: the batch and
    every weight over the same 8 devices (the weight's first axis). ``tensor parallel 4x2``: the
    batch over 4, the weights Megatron-style over 2 (the first of each pair split by columns, the
    second by rows). ``shard_map``: the loss written per shard (batch over 8) and averaged."""
    batch_axis = BATCH_AXIS[model.name]
    devices = jax.devices()
    if len(devices) != 8:
        raise SystemExit(f"--layouts needs 8 devices, JAX has {len(devices)}: run it on the CPU (JAX_PLATFORMS=cpu)")
    two_d = name == "tensor parallel 4x2"
    names = ("data", "model") if two_d else ("data",)
    mesh = jax.make_mesh((4, 2) if two_d else (8,), names, axis_types=(AxisType.Auto,) * len(names))
    on = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    leaves, tree = jax.tree.flatten(model.params)
    specs = {
        "data parallel": [P()] * len(leaves),
        "fsdp": [P("data") for _ in leaves],
        "tensor parallel 4x2": [P(None, "model") if i % 2 == 0 else P("model", None) for i in range(len(leaves))],
        "shard_map": [P()] * len(leaves),
    }[name]
    params = jax.tree.unflatten(tree, [jax.device_put(jnp.asarray(a), on(s)) for a, s in zip(leaves, specs)])
    x_spec = P(*[None] * batch_axis, "data")
    x = jax.device_put(jnp.asarray(model.x), on(x_spec))
    if name != "shard_map":
        return params, x, lambda loss: loss

    def wrap(loss):
        body = lambda p, x: jax.lax.pmean(loss(p, x), "data")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), x_spec), out_specs=P(), check_vma=False)

    return params, x, wrap


def measure(model, rounds, where=None, min_time=0.2):
    """``{variant: (ms, x base wall, x base cpu, x hand wall, x hand cpu, x hand best, reduce ops)}``:
    medians of per-round ratios, and the ratio of the fastest rounds; ``where`` is a sharded
    layout's name (one device when ``None``)."""
    if where is None:
        params, x, wrap = jax.tree.map(jnp.asarray, model.params), jnp.asarray(model.x), lambda loss: loss
    else:
        params, x, wrap = layout(model, where)
    steps = {}
    for name, f in variants(model, params, x, wrap).items():
        step = jax.jit(f).lower(params, x).compile()
        jax.block_until_ready(step(params, x))
        t = time.perf_counter()
        jax.block_until_ready(step(params, x))
        repeats = max(1, int(min_time / max(time.perf_counter() - t, 1e-6)))
        steps[name] = (step, repeats, len(re.findall(r"\sreduce\(", step.as_text())))
    # the guarded hand-written statistics are jt.stats' own: the same numbers (float32 rounding apart)
    for ours, hand in (('stats="norm"', "hand norm, range-guarded"), ("all five stats", "hand, all five, range-guarded")):
        a, b = (jax.tree.leaves(steps[k][0](params, x)[1][1]) for k in (ours, hand))
        off = max(float(jnp.max(jnp.abs(u - v) / jnp.maximum(jnp.abs(v), 1e-30))) for u, v in zip(a, b, strict=True))
        assert off < 1e-4, f"{model.name}: {ours} and {hand} differ by {off:.1e} (relative)"
    n = min(r for _, r, _ in steps.values())
    samples = {k: [] for k in steps}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(steps)
        rng.shuffle(order)
        for name in order:
            step = steps[name][0]
            t, c = time.perf_counter(), time.process_time()
            for _ in range(n):
                out = step(params, x)
            jax.block_until_ready(out)
            samples[name].append(((time.perf_counter() - t) / n, (time.process_time() - c) / n))

    def ratio(name, to, i):
        return statistics.median(a[i] / b[i] for a, b in zip(samples[name], samples[to]))

    def best(name, to):  # the fastest round of each: what the load added least to
        return min(a[0] for a in samples[name]) / min(b[0] for b in samples[to])

    rows = {}
    for name, s in samples.items():
        hand = HAND_OF.get(name)
        by_hand = (ratio(name, hand, 0), ratio(name, hand, 1), best(name, hand)) if hand else (None, None, None)
        base = "jt.value_and_grad (base)"
        rows[name] = (1e3 * statistics.median(a[0] for a in s), ratio(name, base, 0), ratio(name, base, 1), *by_hand, steps[name][2])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--models", default="mlp,rnn,attention,cnn,chain")
    parser.add_argument("--layouts", default="", help=f"sharded layouts of --models mlp,rnn, on 8 simulated CPU devices: {','.join(LAYOUTS)}")
    args = parser.parse_args()
    makers = {"mlp": M.mlp, "rnn": M.rnn, "attention": M.attention, "cnn": M.cnn, "chain": lambda: M.chain(500, shared=4)}
    print(f"JAX {jax.__version__}, {device()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the start, "
          f"{args.rounds} interleaved rounds")
    print()
    print("| model | layout | variant | step (ms) | x base (wall) | x base (cpu) | x hand (wall) | x hand (cpu) | x hand (best) "
          "| reduce ops |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cell = lambda r: "" if r is None else f"{r:.3f}"  # noqa: E731
    for key in args.models.split(","):
        model = makers[key]()
        sharded = [w for w in args.layouts.split(",") if w] if key in BATCH_AXIS else []
        for where in [None, *sharded]:
            for name, (ms, wall, cpu, hand_wall, hand_cpu, hand_best, reduces) in measure(model, args.rounds, where).items():
                print(f"| {model.name} | {where or 'one device'} | {name} | {ms:.2f} | {wall:.3f} | {cpu:.3f} | "
                      f"{cell(hand_wall)} | {cell(hand_cpu)} | {cell(hand_best)} | {reduces} |", flush=True)
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
