"""What does capturing gradients at tags cost? One entry point for every figure.

    python benchmarks/run.py            # everything (about half an hour on 2 cores: the compile sweep)
    python benchmarks/run.py --quick    # smaller models, fewer rounds (CI; a few minutes)
    python benchmarks/run.py --models none --no-scaling --sweep 10,100,1000   # one part only

Prints a table and writes JSON (to benchmarks/results/, or --out). All variants
of a model run in one process, interleaved in a random order each round;
every figure is the median over rounds of the per-round ratio to the baseline
(plain ``jax.value_and_grad`` of the untagged function), because absolute times
on shared machines drift from one minute to the next.

Variants: ``baseline``; ``jt all`` (``jaxtrace.value_and_grad``, every tag);
``jt one`` (one tag); ``hand eps`` (the program one writes by hand for the same
gradients: explicit ``+ eps`` at every tag, plain ``jax.value_and_grad``; the
limit jaxtrace aims at); ``hook`` (the hook-style JAX alternative: an identity
``custom_vjp`` whose backward sends the cotangent to the host with
``io_callback``); ``torch hooks`` (PyTorch eager with ``register_hook`` on the
same model, when torch is installed; ``torch plain`` is the same without hooks).

Two more parts: the large model (``large.py``: an equinox transformer whose
every submodule ``jt.tag_modules`` tags, against the untagged model and a
hook-style port), and the compile sweep (trace + compile time against the
number of tags, plain / hand-written ``+ eps`` / jaxtrace, 10 to 5,000 tags).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
# PyTorch's OpenMP threads spin after each op by default, taking cores from XLA.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, HERE)
try:
    import jaxtrace  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jaxtrace as jt  # noqa: E402
import models as M  # noqa: E402

try:
    import torch
except ImportError:  # torch is optional
    torch = None

BASE, ALL, ONE, HAND, HOOK = "baseline", "jt all", "jt one", "hand eps", "hook"
TORCH, TORCH_PLAIN = "torch hooks", "torch plain"

# The targets of issue 6 (ratios vs the baseline unless said otherwise).
TARGETS = {
    "step": 1.02,  # step time, all tags captured
    "trace_compile": 1.15,  # trace + compile time
    "vs_hook": 1.3,  # hook-style time / jaxtrace time, at least
    "scaling_exponent": 1.15,  # fitted exponent of tracing time vs tags / steps, at most
    # Issue 17: trace + compile over the tag-count sweep.
    "sweep_vs_plain": 1.2,
    "sweep_vs_hand": 1.1,
    "sweep_one": 1.05,
}


# --- measurement helpers --------------------------------------------------------


def interleave(runs: dict[str, Callable[[], dict]], rounds: int, seed: int = 0) -> dict[str, list[dict]]:
    """Call every ``run`` once per round, in a random order; each returns ``{figure: seconds}``."""
    rng = np.random.default_rng(seed)
    names = list(runs)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            out[names[i]].append(runs[names[i]]())
    return out


def median_ratio(samples: dict[str, list[dict]], name: str, figure: str, base: str = BASE) -> float:
    return float(np.median([s[figure] / b[figure] for s, b in zip(samples[name], samples[base])]))


def median(samples: list[dict], figure: str) -> float:
    return float(np.median([s[figure] for s in samples]))


def block(tree):
    return jax.block_until_ready(tree)


def timed(fn: Callable, repeats: int) -> Callable[[], dict]:
    def run():
        t, c = time.perf_counter(), time.process_time()
        for _ in range(repeats):
            fn()
        return {"step": (time.perf_counter() - t) / repeats, "step_cpu": (time.process_time() - c) / repeats}

    return run


def trace_and_compile(lower: Callable[[], Any]) -> Callable[[], dict]:
    """A sample of ``lower()`` (trace and lower to StableHLO, on a fresh function each round so
    that nothing is cached) and of compiling its result: wall and CPU seconds of each and both."""

    def run():
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        lowered = lower()
        t1, c1 = time.perf_counter(), time.process_time()
        lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
        return {"trace": t1 - t0, "compile": t2 - t1, "total": t2 - t0,
                "trace_cpu": c1 - c0, "compile_cpu": c2 - c1, "total_cpu": c2 - c0}

    return run


def nbytes(tree) -> int:
    return sum(math.prod(l.shape) * np.dtype(l.dtype).itemsize for l in jax.tree_util.tree_leaves(tree))


# --- one model ------------------------------------------------------------------------


def jax_builders(model: M.Model, store: M.HookStore, eps_shapes: dict) -> dict[str, Callable]:
    """Fresh (uncached) function objects for each JAX variant: ``build() -> fun(params, x)``."""
    loss = model.loss

    def hand():
        def fun(params, x):
            eps = {n: jnp.zeros(s.shape, s.dtype) for n, s in eps_shapes.items()}
            return jax.value_and_grad(lambda p, e: loss(p, x, M.identity, e), argnums=(0, 1))(params, eps)

        return fun

    return {
        BASE: lambda: jax.value_and_grad(functools.partial(loss, tag=M.identity)),
        ALL: lambda: jt.value_and_grad(functools.partial(loss, tag=jt.tag)),
        ONE: lambda: jt.value_and_grad(functools.partial(loss, tag=jt.tag), tags=model.one_tag),
        HAND: hand,
        HOOK: lambda: jax.value_and_grad(functools.partial(loss, tag=store.tag)),
    }


def torch_step(model: M.Model, hooks: bool) -> Callable:
    params = jax.tree_util.tree_map(lambda a: torch.from_numpy(np.array(a)).requires_grad_(True), model.params)
    leaves = jax.tree_util.tree_leaves(params)
    x = torch.from_numpy(np.array(model.x))
    store: dict = {}

    def hook(name):
        return lambda g: store.setdefault(name, []).append(g)

    def step():
        store.clear()
        for p in leaves:
            p.grad = None
        loss = model.torch_loss(params, x, hook if hooks else None)
        loss.backward()
        return loss.item(), [p.grad for p in leaves], store

    return step


def bench_model(model: M.Model, args) -> dict:
    store = M.HookStore()
    params = jax.tree_util.tree_map(jnp.asarray, model.params)
    x = jnp.asarray(model.x)
    eps_shapes = jax.eval_shape(jt.value_and_grad(functools.partial(model.loss, tag=jt.tag)), params, x)[1][1]
    builders = jax_builders(model, store, eps_shapes)
    result: dict = {"describe": model.describe, "variants": {}}

    # Compiled programs, memory, and a check that every variant computes the same thing.
    compiled = {}
    for name, build in builders.items():
        c = jax.jit(build()).lower(params, x).compile()
        compiled[name] = c
        mem = c.memory_analysis()
        result["variants"][name] = {"temp_bytes": int(mem.temp_size_in_bytes),
                                    "output_bytes": int(mem.output_size_in_bytes)}
    (v0, g0) = compiled[BASE](params, x)
    v1, (g1, tag_grads) = compiled[ALL](params, x)
    np.testing.assert_allclose(v0, v1, rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6), g0, g1)
    _, (_, hand_grads) = compiled[HAND](params, x)  # the hand-written +eps program agrees
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-7), tag_grads, hand_grads)
    compiled[HOOK](params, x)
    jax.effects_barrier()
    for name in tag_grads:  # the hook-style alternative sees the same cotangents
        calls = store.values[name]
        if len(calls) > 1:  # a scan: the backward pass visits the steps last to first
            calls = calls[::-1]
        hooked = np.stack(calls).reshape(tag_grads[name].shape)
        np.testing.assert_allclose(hooked, tag_grads[name], rtol=2e-3, atol=1e-7)
    store.clear()
    _, (_, one_grads) = compiled[ONE](params, x)
    captured = {ALL: nbytes(tag_grads), ONE: nbytes(one_grads), HAND: nbytes(tag_grads)}
    base_out = result["variants"][BASE]["output_bytes"]
    n_base_out = len(jax.tree_util.tree_leaves((v0, g0)))
    for name in (ALL, ONE, HAND):
        v = result["variants"][name]
        v["captured_bytes"] = captured[name]
        v["output_excess_bytes"] = v["output_bytes"] - base_out - captured[name]
        n_extra = len(jax.tree_util.tree_leaves(one_grads if name == ONE else tag_grads))
        # XLA:CPU counts the output tuple's table of pointers (8 bytes an entry) in output bytes.
        v["output_tuple_entries_extra"] = n_extra
        v["output_excess_beyond_tuple_table"] = v["output_excess_bytes"] - 8 * n_extra
    for name in result["variants"]:
        v = result["variants"][name]
        v["temp_ratio"] = v["temp_bytes"] / max(result["variants"][BASE]["temp_bytes"], 1)
    result["n_base_outputs"] = n_base_out

    # Steady-state step time: the JAX variants interleaved with each other; then
    # PyTorch interleaved with the baseline only (its thread pool would otherwise
    # disturb whichever JAX variant runs next).
    def call(name):
        c = compiled[name]
        if name == HOOK:
            return lambda: (block(c(params, x)), jax.effects_barrier(), store.clear())
        return lambda: block(c(params, x))

    steps = {name: call(name) for name in compiled}
    for fn in steps.values():  # warm up
        fn()
    t = time.perf_counter()
    steps[BASE]()
    repeats = max(1, int(args.min_time / max(time.perf_counter() - t, 1e-6)))
    samples = interleave({n: timed(fn, repeats) for n, fn in steps.items()}, args.rounds)
    for name in steps:
        v = result["variants"][name]
        v["step_ms"] = 1e3 * median(samples[name], "step")
        v["step_ratio"] = median_ratio(samples, name, "step")
        v["step_cpu_ratio"] = median_ratio(samples, name, "step_cpu")
    result["step_repeats"] = repeats
    for name in (ALL, ONE):
        result["variants"][name]["hook_over_jt"] = median_ratio(samples, HOOK, "step", base=name)
    result["variants"][ALL]["step_over_hand"] = median_ratio(samples, ALL, "step", base=HAND)
    if torch is not None and not args.no_torch:
        torch.set_num_threads(max(os.cpu_count() or 1, 1))
        steps = {BASE: steps[BASE], TORCH: torch_step(model, hooks=True), TORCH_PLAIN: torch_step(model, hooks=False)}
        for fn in steps.values():
            fn()
        samples = interleave({n: timed(fn, repeats) for n, fn in steps.items()}, max(3, args.rounds // 3))
        for name in (TORCH, TORCH_PLAIN):
            result["variants"][name] = {"step_ms": 1e3 * median(samples[name], "step"),
                                        "step_ratio": median_ratio(samples, name, "step")}

    # Trace + compile time, fresh function objects every round.
    samples = interleave({n: trace_and_compile(lambda n=n: jax.jit(builders[n]()).lower(params, x))
                          for n in builders}, args.compile_rounds, seed=1)
    for name in builders:
        v = result["variants"][name]
        for fig in ("trace", "compile", "total", "trace_cpu", "compile_cpu", "total_cpu"):
            v[f"{fig}_ms"] = 1e3 * median(samples[name], fig)
            v[f"{fig}_ratio"] = median_ratio(samples, name, fig)
    result["variants"][ALL]["total_over_hand"] = median_ratio(samples, ALL, "total", base=HAND)
    return result


# --- scaling of tracing ----------------------------------------------------------------


def chain(n: int, tag) -> Callable:
    def f(x):
        for i in range(n):
            x = tag(lax.sin(x), f"t{i}")
        return jnp.sum(x)

    return f


def chain_eps(n: int) -> Callable:
    """``chain`` written by hand for the same gradients: ``+ eps`` at every tag."""

    def f(x):
        def g(x, eps):
            for e in eps:
                x = lax.sin(x) + e
            return jnp.sum(x)

        return jax.value_and_grad(g, argnums=(0, 1))(x, [jnp.zeros_like(x)] * n)

    return f


def looped(length: int, tag) -> Callable:
    def f(w, h):
        def step(h, _):
            return tag(jnp.tanh(h @ w), "h"), None

        h, _ = lax.scan(step, h, None, length=length)
        return jnp.sum(h)

    return f


def looped_eps(length: int) -> Callable:
    """``looped`` written by hand for the same gradients: ``+ eps`` per step, eps as the scan's xs."""

    def f(w, h):
        def g(w, eps):
            out, _ = lax.scan(lambda h, e: (jnp.tanh(h @ w) + e, None), h, eps)
            return jnp.sum(out)

        return jax.value_and_grad(g, argnums=(0, 1))(w, jnp.zeros((length, *h.shape), h.dtype))

    return f


def fit_exponent(ns, ts) -> float:
    """Least-squares slope of log(time) vs log(n): 1 is linear, 2 quadratic."""
    return float(np.polyfit(np.log(ns), np.log(ts), 1)[0])


def paused_gc(fn: Callable) -> float:
    """CPU seconds of ``fn()`` with Python's cyclic GC paused, as ``timeit`` does.

    A full collection walks every live object, so with it on, times of large
    traces jump by whole collections and hide how the tracing itself scales.
    """
    gc.collect()
    gc.disable()
    try:
        t = time.process_time()
        fn()
        return time.process_time() - t
    finally:
        gc.enable()


def bench_tag_scaling(ns, rounds) -> dict:
    x = jnp.ones(4)
    out = {"n": list(ns), "baseline_ms": [], "jt_ms": [], "hand_ms": [], "ratio": [], "ratio_vs_hand": []}
    for n in ns:
        runs = {}
        for name, make in ((BASE, lambda: jax.value_and_grad(chain(n, M.identity))),
                           (ALL, lambda: jt.value_and_grad(chain(n, jt.tag))),
                           (HAND, lambda: chain_eps(n))):
            def run(make=make):
                fun = make()
                return {"trace": paused_gc(lambda: jax.make_jaxpr(fun)(x))}

            runs[name] = run
        samples = interleave(runs, rounds, seed=n)
        out["baseline_ms"].append(1e3 * median(samples[BASE], "trace"))
        out["jt_ms"].append(1e3 * median(samples[ALL], "trace"))
        out["hand_ms"].append(1e3 * median(samples[HAND], "trace"))
        out["ratio"].append(median_ratio(samples, ALL, "trace"))
        out["ratio_vs_hand"].append(median_ratio(samples, ALL, "trace", base=HAND))
    # The slope over the upper half of the sizes (fixed costs dominate the smallest ones).
    k = len(ns) // 2
    out["jt_exponent"] = fit_exponent(ns[k:], out["jt_ms"][k:])
    out["baseline_exponent"] = fit_exponent(ns[k:], out["baseline_ms"][k:])
    return out


def bench_scan_scaling(lengths, rounds, width=16) -> dict:
    w = jnp.eye(width) * 0.5
    h = jnp.ones((4, width))
    out = {"length": list(lengths), "baseline_trace_ms": [], "jt_trace_ms": [], "trace_ratio": [],
           "baseline_step_ms": [], "jt_step_ms": [], "step_ratio": [], "hand_step_ratio": []}
    for n in lengths:
        makers = {BASE: lambda: jax.value_and_grad(looped(n, M.identity)),
                  ALL: lambda: jt.value_and_grad(looped(n, jt.tag)),
                  HAND: lambda: looped_eps(n)}
        runs = {}
        for name, make in makers.items():
            def run(make=make):
                fun = jax.jit(make())
                return {"trace": paused_gc(lambda: fun.lower(w, h))}

            runs[name] = run
        samples = interleave(runs, rounds, seed=n)
        out["baseline_trace_ms"].append(1e3 * median(samples[BASE], "trace"))
        out["jt_trace_ms"].append(1e3 * median(samples[ALL], "trace"))
        out["trace_ratio"].append(median_ratio(samples, ALL, "trace"))
        compiled = {name: jax.jit(make()).lower(w, h).compile() for name, make in makers.items()}
        for c in compiled.values():
            block(c(w, h))
        t = time.perf_counter()
        block(compiled[BASE](w, h))
        repeats = max(1, int(0.01 / max(time.perf_counter() - t, 1e-6)))
        samples = interleave({name: timed(lambda c=c: block(c(w, h)), repeats) for name, c in compiled.items()},
                             3 * rounds, seed=n)
        out["baseline_step_ms"].append(1e3 * median(samples[BASE], "step"))
        out["jt_step_ms"].append(1e3 * median(samples[ALL], "step"))
        out["step_ratio"].append(median_ratio(samples, ALL, "step"))
        out["hand_step_ratio"].append(median_ratio(samples, HAND, "step"))
    k = len(lengths) // 2
    out["jt_trace_exponent"] = fit_exponent(lengths[k:], out["jt_trace_ms"][k:])
    out["jt_step_exponent"] = fit_exponent(lengths[k:], out["jt_step_ms"][k:])
    return out


def chain_layers(n: int, tag, width: int = 64) -> Callable:
    """The compile-sweep model: ``n`` layers ``tanh(h @ w_i)``, a tag on each (issue 17's chain)."""

    def f(ws, h):
        for i in range(n):
            h = tag(jnp.tanh(h @ ws[i]), f"l{i}")
        return jnp.sum(h)

    return f


def chain_layers_eps(n: int) -> Callable:
    """``chain_layers`` written by hand for the same gradients: ``+ eps`` at every layer."""

    def f(ws, h):
        def g(ws, eps):
            x = h
            for w, e in zip(ws, eps):
                x = jnp.tanh(x @ w) + e
            return jnp.sum(x)

        return jax.value_and_grad(g, argnums=(0, 1))(ws, [jnp.zeros_like(h)] * n)

    return f


def bench_compile_sweep(ns, rounds, width=64, batch=8) -> dict:
    """Trace + compile time of ``jax.jit(...)`` vs the number of tags: plain, hand ``+ eps``, jt all, jt one."""
    out: dict = {"n": list(ns), "width": width, "batch": batch, "variants": {}}
    for n in ns:
        ws = [jnp.eye(width) * 0.5 for _ in range(n)]
        h = jnp.ones((batch, width))
        makers = {BASE: lambda: jax.value_and_grad(chain_layers(n, M.identity)),
                  HAND: lambda: chain_layers_eps(n),
                  ALL: lambda: jt.value_and_grad(chain_layers(n, jt.tag)),
                  ONE: lambda: jt.value_and_grad(chain_layers(n, jt.tag), tags="l0")}

        r = rounds if n <= 2000 else 1  # 5,000 tags: minutes per compile
        samples = interleave({name: trace_and_compile(lambda make=make: jax.jit(make()).lower(ws, h))
                              for name, make in makers.items()}, r, seed=n)
        for name in makers:
            v = out["variants"].setdefault(name, {})
            for fig in ("trace", "compile", "total", "total_cpu"):
                v.setdefault(f"{fig}_s", []).append(median(samples[name], fig))
            v.setdefault("total_ratio", []).append(median_ratio(samples, name, "total"))
            v.setdefault("total_cpu_ratio", []).append(median_ratio(samples, name, "total_cpu"))
            v.setdefault("total_over_hand", []).append(median_ratio(samples, name, "total", base=HAND))
        print(f"[compile sweep: {n} tags done]", file=sys.stderr, flush=True)
    return out


def bench_large(args) -> dict:
    """The large-model row: an equinox transformer tagged by ``jt.tag_modules`` (every submodule)."""
    import equinox as eqx

    import large as L

    model, tokens, targets = (L.transformer(layers=2, d=64, seq=16, batch=2) if args.quick
                              else L.transformer())
    tagged = jt.tag_modules(model)
    params, static = eqx.partition(model, eqx.is_array)
    tagged_params, tagged_static = eqx.partition(tagged, eqx.is_array)
    n_tags = L.count_tags(model, tokens, targets)
    one = "blocks.0.mlp"
    store = M.HookStore()

    def loss_of(static):
        return lambda p, t, y: L.loss(eqx.combine(p, static), t, y)

    builders = {
        BASE: (lambda: jax.value_and_grad(loss_of(static)), params),
        ALL: (lambda: jt.value_and_grad(loss_of(tagged_static)), tagged_params),
        ONE: (lambda: jt.value_and_grad(loss_of(tagged_static), tags=one), tagged_params),
        HOOK: (lambda: jax.value_and_grad(loss_of(tagged_static)), tagged_params),
    }

    def lower(name):
        build, p = builders[name]
        ctx = L.hooked(store) if name == HOOK else contextlib.nullcontext()
        with ctx:
            return jax.jit(build()).lower(p, tokens, targets)

    result: dict = {"describe": f"equinox transformer: {len(model.blocks)} blocks, d {model.ln_f.shape[0]}, "
                                f"tokens {tokens.shape}; jt.tag_modules on every submodule",
                    "tags": n_tags, "variants": {}}
    compiled = {name: lower(name).compile() for name in builders}
    for name, c in compiled.items():
        mem = c.memory_analysis()
        result["variants"][name] = {"temp_bytes": int(mem.temp_size_in_bytes)}
    v0, g0 = compiled[BASE](params, tokens, targets)
    v1, (g1, tag_grads) = compiled[ALL](tagged_params, tokens, targets)
    np.testing.assert_allclose(v0, v1, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)
    compiled[HOOK](tagged_params, tokens, targets)
    jax.effects_barrier()
    assert len(store.values) == n_tags, (len(store.values), n_tags)
    store.clear()

    def call(name):
        c, p = compiled[name], builders[name][1]
        if name == HOOK:
            return lambda: (block(c(p, tokens, targets)), jax.effects_barrier(), store.clear())
        return lambda: block(c(p, tokens, targets))

    steps = {name: call(name) for name in compiled}
    for fn in steps.values():
        fn()
    samples = interleave({n: timed(fn, 1) for n, fn in steps.items()}, 5 if args.quick else args.rounds)
    for name in steps:
        v = result["variants"][name]
        v["step_ms"] = 1e3 * median(samples[name], "step")
        v["step_ratio"] = median_ratio(samples, name, "step")
        v["temp_ratio"] = v["temp_bytes"] / max(result["variants"][BASE]["temp_bytes"], 1)

    samples = interleave({n: trace_and_compile(lambda n=n: lower(n)) for n in builders},
                         1 if args.quick else args.compile_rounds, seed=2)
    for name in builders:
        v = result["variants"][name]
        v["total_s"] = median(samples[name], "total")
        v["trace_s"] = median(samples[name], "trace")
        v["total_ratio"] = median_ratio(samples, name, "total")
        v["total_cpu_ratio"] = median_ratio(samples, name, "total_cpu")
    return result


def retrace_check() -> dict:
    """How often the user's Python function runs over three calls under ``jax.jit``."""
    counts = {BASE: 0, ALL: 0}

    def make(name, tag):
        def f(w, x):
            counts[name] += 1
            return jnp.sum(tag(jnp.tanh(x @ w), "h") ** 2)

        return f

    w, x = jnp.ones((8, 8)), jnp.ones((2, 8))
    funs = {BASE: jax.jit(jax.value_and_grad(make(BASE, M.identity))),
            ALL: jax.jit(jt.value_and_grad(make(ALL, jt.tag)))}
    for _ in range(3):
        for fun in funs.values():
            block(fun(w, x))
    return {"calls": 3, "traces": counts}


# --- report ------------------------------------------------------------------------------


def machine() -> dict:
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or __import__("jaxlib").__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "torch": getattr(torch, "__version__", None),
    }


def _fmt_bytes(b) -> str:
    return f"{b / 2**20:.2f} MiB" if abs(b) >= 2**20 else f"{b / 2**10:.1f} KiB" if abs(b) >= 2**10 else f"{b} B"


def table(results: dict) -> str:
    lines = []
    m = results["machine"]
    lines.append(f"jaxtrace benchmarks ({'quick' if results['quick'] else 'full'}): JAX {m['jax']} on "
                 f"{m['backend']} ({m['device']}, {m['cpu_count']} CPU cores), torch {m['torch']}")
    lines.append("Ratios are medians over interleaved rounds of (variant time / baseline time).")
    cols = ["model", "variant", "step ms", "step x", "(cpu time)", "trace+compile x", "(cpu time)", "temp memory vs base",
            "output bytes beyond base + captured"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    for mname, r in results["models"].items():
        for vname, v in r["variants"].items():
            row = [mname, vname, f"{v['step_ms']:.2f}", f"{v['step_ratio']:.3f}"]
            row.append(f"{v['step_cpu_ratio']:.3f}" if "step_cpu_ratio" in v else "")
            row.append(f"{v['total_ratio']:.2f}" if "total_ratio" in v else "")
            row.append(f"{v['total_cpu_ratio']:.2f}" if "total_cpu_ratio" in v else "")
            if "temp_bytes" in v:
                d = v["temp_bytes"] - r["variants"][BASE]["temp_bytes"]
                row.append(f"{v['temp_ratio']:.2f}x ({'+' if d >= 0 else '-'}{_fmt_bytes(abs(d))})")
            else:
                row.append("")
            row.append(f"{v['output_excess_bytes']} B" if "output_excess_bytes" in v else "")
            lines.append("| " + " | ".join(row) + " |")
    lines.append("Output bytes beyond base + captured: compiled output bytes - baseline's - the captured "
                 "gradients' bytes; XLA:CPU counts 8 bytes per output for the output tuple's table.")
    if "tag_scaling" in results:
        s = results["tag_scaling"]
        lines.append("")
        lines.append("Tracing time vs number of tags (a chain of sin, a tag on each; CPU time of make_jaxpr of "
                     "value_and_grad, GC paused):")
        lines.append("| tags | baseline (untagged) ms | hand-written +eps ms | jaxtrace ms | jt / baseline | jt / hand |")
        lines.append("|---|---|---|---|---|---|")
        for row in zip(s["n"], s["baseline_ms"], s["hand_ms"], s["jt_ms"], s["ratio"], s["ratio_vs_hand"]):
            lines.append("| {} | {:.1f} | {:.1f} | {:.1f} | {:.2f} | {:.2f} |".format(*row))
        lines.append(f"fitted exponent (time ~ n^k, upper half): jaxtrace {s['jt_exponent']:.2f}, "
                     f"baseline {s['baseline_exponent']:.2f}")
        s = results["scan_scaling"]
        lines.append("")
        lines.append("Scan with a tag per step vs length (trace = CPU time of jit(...).lower, GC paused; "
                     "step = compiled run):")
        lines.append("| steps | trace ms base | trace ms jt | trace x | step ms base | step ms jt | step x | "
                     "hand-written +eps step x |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for row in zip(s["length"], s["baseline_trace_ms"], s["jt_trace_ms"], s["trace_ratio"],
                       s["baseline_step_ms"], s["jt_step_ms"], s["step_ratio"], s["hand_step_ratio"]):
            lines.append("| {} | {:.1f} | {:.1f} | {:.2f} | {:.3f} | {:.3f} | {:.2f} | {:.2f} |".format(*row))
        lines.append(f"fitted exponents (upper half): tracing {s['jt_trace_exponent']:.2f}, "
                     f"step {s['jt_step_exponent']:.2f}")
    if "large" in results:
        r = results["large"]
        lines.append("")
        lines.append(f"Large model ({r['describe']}; {r['tags']} tags):")
        lines.append("| variant | step ms | step x | trace + compile s | trace + compile x | (cpu time) | temp memory x |")
        lines.append("|---|---|---|---|---|---|---|")
        for vname, v in r["variants"].items():
            lines.append(f"| {vname} | {v['step_ms']:.1f} | {v['step_ratio']:.3f} | {v['total_s']:.1f} | "
                         f"{v['total_ratio']:.2f} | {v['total_cpu_ratio']:.2f} | {v['temp_ratio']:.2f} |")
    if "compile_sweep" in results:
        s = results["compile_sweep"]
        v = s["variants"]
        lines.append("")
        lines.append(f"Trace + compile vs number of tags (chain of tanh(h @ w_i), width {s['width']}, batch "
                     f"{s['batch']}; wall seconds, median of interleaved rounds; x = ratio to plain):")
        lines.append("| tags | plain s | hand +eps s | jt all s | jt one s | jt all x | jt all / hand | jt one x |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for i, n in enumerate(s["n"]):
            lines.append(f"| {n} | {v[BASE]['total_s'][i]:.2f} | {v[HAND]['total_s'][i]:.2f} | "
                         f"{v[ALL]['total_s'][i]:.2f} | {v[ONE]['total_s'][i]:.2f} | {v[ALL]['total_ratio'][i]:.2f} | "
                         f"{v[ALL]['total_over_hand'][i]:.2f} | {v[ONE]['total_ratio'][i]:.2f} |")
    r = results["retrace"]
    lines.append("")
    lines.append(f"Retrace check: over {r['calls']} jitted calls the function was traced "
                 f"{r['traces'][ALL]} time(s) by jaxtrace, {r['traces'][BASE]} by the baseline.")
    lines.append("")
    lines.append("Targets:")
    for t in results["targets"]:
        lines.append(f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['measured']}")
    return "\n".join(lines)


def check_targets(results: dict) -> list[dict]:
    out = []

    def add(target, measured, met):
        out.append({"target": target, "measured": measured, "met": bool(met)})

    if results["models"]:
        _model_targets(results["models"], add)
    _scaling_targets(results, add)
    return out


def _model_targets(models: dict, add) -> None:
    steps = {m: (r["variants"][ALL]["step_ratio"], r["variants"][ALL]["step_cpu_ratio"]) for m, r in models.items()}
    add(f"step time with all tags <= {TARGETS['step']}x baseline",
        ", ".join(f"{m} {w:.3f}x (cpu time {c:.3f}x)" for m, (w, c) in steps.items()),
        all(w <= TARGETS["step"] for w, _ in steps.values()))
    hands = {m: r["variants"][ALL]["step_over_hand"] for m, r in models.items()}
    add("(for reference) step time of jt all / the hand-written +eps program",
        ", ".join(f"{m} {v:.3f}x" for m, v in hands.items()), True)
    tcs = {m: (r["variants"][ALL]["total_ratio"], r["variants"][ALL]["total_cpu_ratio"]) for m, r in models.items()}
    add(f"trace+compile time <= {TARGETS['trace_compile']}x baseline",
        ", ".join(f"{m} {w:.2f}x (cpu time {c:.2f}x)" for m, (w, c) in tcs.items()),
        all(w <= TARGETS["trace_compile"] for w, _ in tcs.values()))
    temps = {m: (r["variants"][ALL]["temp_bytes"] - r["variants"][BASE]["temp_bytes"],
                 r["variants"][ALL]["temp_bytes"] - r["variants"][HAND]["temp_bytes"]) for m, r in models.items()}
    add("compiled temp memory <= baseline",
        ", ".join(f"{m} {'+' if d >= 0 else '-'}{_fmt_bytes(abs(d))} (vs hand-written: "
                  f"{'+' if h >= 0 else '-'}{_fmt_bytes(abs(h))})" for m, (d, h) in temps.items()),
        all(d <= 0 for d, _ in temps.values()))
    excess = {m: (r["variants"][ALL]["output_excess_bytes"], r["variants"][ALL]["output_excess_beyond_tuple_table"])
              for m, r in models.items()}
    add("output bytes = baseline + captured",
        ", ".join(f"{m} +{a} B ({b} B beyond the 8-byte tuple-table entries)" for m, (a, b) in excess.items()),
        all(b == 0 for _, b in excess.values()))
    hooks = {m: r["variants"][ALL]["hook_over_jt"] for m, r in models.items()}
    add(f"hook-style alternative >= {TARGETS['vs_hook']}x slower than jaxtrace",
        ", ".join(f"{m} {v:.2f}x" for m, v in hooks.items()), all(v >= TARGETS["vs_hook"] for v in hooks.values()))


def _scaling_targets(results: dict, add) -> None:
    if "tag_scaling" in results:
        s, l = results["tag_scaling"], results["scan_scaling"]
        add(f"tracing linear in tags (exponent <= {TARGETS['scaling_exponent']})",
            f"{s['jt_exponent']:.2f} (baseline {s['baseline_exponent']:.2f}); jaxtrace/baseline "
            + ", ".join(f"{r:.2f}x at {n}" for n, r in zip(s["n"], s["ratio"])),
            s["jt_exponent"] <= TARGETS["scaling_exponent"])
        add(f"tracing linear (or better) in scan length (exponent <= {TARGETS['scaling_exponent']})",
            f"{l['jt_trace_exponent']:.2f}", l["jt_trace_exponent"] <= TARGETS["scaling_exponent"])
    if "compile_sweep" in results:
        v, ns = results["compile_sweep"]["variants"], results["compile_sweep"]["n"]
        add(f"trace+compile of jt all <= {TARGETS['sweep_vs_plain']}x plain, at every tag count",
            ", ".join(f"{r:.2f}x at {n}" for n, r in zip(ns, v[ALL]["total_ratio"])),
            all(r <= TARGETS["sweep_vs_plain"] for r in v[ALL]["total_ratio"]))
        add(f"trace+compile of jt all <= {TARGETS['sweep_vs_hand']}x the hand-written +eps program",
            ", ".join(f"{r:.2f}x at {n}" for n, r in zip(ns, v[ALL]["total_over_hand"])),
            all(r <= TARGETS["sweep_vs_hand"] for r in v[ALL]["total_over_hand"]))
        add(f"trace+compile with one tag selected <= {TARGETS['sweep_one']}x plain",
            ", ".join(f"{r:.2f}x at {n}" for n, r in zip(ns, v[ONE]["total_ratio"])),
            all(r <= TARGETS["sweep_one"] for r in v[ONE]["total_ratio"]))
    r = results["retrace"]["traces"]
    add("no retrace on repeated jitted calls", f"traced {r[ALL]} time(s) in {results['retrace']['calls']} calls",
        r[ALL] == 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, few rounds (CI; well under 2 min)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<mode>-<time>.json)")
    parser.add_argument("--models", help="comma-separated subset of mlp,rnn,attention,cnn ('none': no models)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds for step times")
    parser.add_argument("--compile-rounds", type=int, help="interleaved rounds for trace+compile times")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch variants")
    parser.add_argument("--no-scaling", action="store_true", help="skip the tag and scan scaling figures")
    parser.add_argument("--no-large", action="store_true", help="skip the large equinox model")
    parser.add_argument("--sweep", help="comma-separated tag counts for the compile sweep "
                        "(default 10,100,1000,2000,5000; quick 10,200); 'none' skips it")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (15 if args.quick else 40)
    args.compile_rounds = args.compile_rounds or (3 if args.quick else 7)
    args.min_time = 0.01 if args.quick else 0.02  # seconds per timed sample, at least

    t_start = time.perf_counter()
    results = {"quick": args.quick, "machine": machine(), "models": {}}
    wanted = set(args.models.split(",")) if args.models else None
    for model in M.models(args.quick):
        if wanted and model.name not in wanted:
            continue
        t = time.perf_counter()
        results["models"][model.name] = bench_model(model, args)
        print(f"[{model.name}: {time.perf_counter() - t:.0f} s]", file=sys.stderr, flush=True)
    if not args.no_scaling:
        ns = (10, 100, 1000) if args.quick else (10, 100, 1000, 10000)
        results["tag_scaling"] = bench_tag_scaling(ns, rounds=3)
        lengths = (10, 100, 1000) if args.quick else (10, 100, 1000, 10000)
        results["scan_scaling"] = bench_scan_scaling(lengths, rounds=3 if args.quick else 5)
    if not args.no_large:
        t = time.perf_counter()
        results["large"] = bench_large(args)
        print(f"[large model: {time.perf_counter() - t:.0f} s]", file=sys.stderr, flush=True)
    sweep = args.sweep or ("200" if args.quick else "10,100,1000,2000,5000")
    if sweep != "none":
        t = time.perf_counter()
        results["compile_sweep"] = bench_compile_sweep([int(n) for n in sweep.split(",")],
                                                       rounds=2 if args.quick else 3)
        print(f"[compile sweep: {time.perf_counter() - t:.0f} s]", file=sys.stderr, flush=True)
    results["retrace"] = retrace_check()
    results["targets"] = check_targets(results)
    results["seconds"] = time.perf_counter() - t_start

    out = args.out or os.path.join(HERE, "results", time.strftime(f"{'quick' if args.quick else 'full'}-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"\n{results['seconds']:.0f} s; JSON written to {out}")
    return results


if __name__ == "__main__":
    main()
