"""Timers: samples of one variant's work, interleaved with the others', and the medians of them.

Every figure the benchmarks report is the median over rounds of a per-round ratio (a variant's
time over the plain program's, taken in the same round), because absolute times on a shared
machine drift from one minute to the next. Trace + lower is single-threaded Python, so its
process CPU time is the figure that the machine's load disturbs least; XLA compiles on several
threads, so compile times (wall or CPU) are noisier.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any, Callable

import jax
import numpy as np

PHASES = ("trace", "compile", "total")
FIGURES = (*PHASES, *(f"{p}_cpu" for p in PHASES))


def interleave(runs: dict[str, Callable[[], dict]], rounds: int, seed: int = 0) -> dict[str, list[dict]]:
    """Call every ``run`` once per round, in a random order; each returns ``{figure: seconds}``."""
    rng = np.random.default_rng(seed)
    names = list(runs)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            out[names[i]].append(runs[names[i]]())
    return out


def median(samples: list[dict], figure: str) -> float:
    return float(np.median([s[figure] for s in samples]))


def median_ratio(samples: dict[str, list[dict]], name: str, figure: str, base: str | tuple) -> float:
    """Median over rounds of ``name``'s figure over ``base``'s (the smaller of several bases, per round)."""
    bases = (base,) if isinstance(base, str) else base
    ratios = [s[figure] / min(samples[b][i][figure] for b in bases) for i, s in enumerate(samples[name])]
    return float(np.median(ratios))


def block(tree):
    return jax.block_until_ready(tree)


def timed(fn: Callable, repeats: int) -> Callable[[], dict]:
    """A sample of the steady-state step: ``fn()`` run ``repeats`` times, seconds per run."""

    def run():
        t, c = time.perf_counter(), time.process_time()
        for _ in range(repeats):
            fn()
        return {"step": (time.perf_counter() - t) / repeats, "step_cpu": (time.process_time() - c) / repeats}

    return run


def trace_and_compile(lower: Callable[[], Any], compile: bool = True, pause_gc: bool = False) -> Callable[[], dict]:
    """A sample of ``lower()`` (trace and lower to StableHLO, on a fresh function each round so
    that nothing is cached) and of compiling its result: wall and CPU seconds of each and both.

    ``pause_gc`` pauses Python's cyclic GC while tracing, as ``timeit`` does: a full collection
    walks every live object, so with it on, times of large traces jump by whole collections and
    hide how the tracing itself scales.
    """

    def run():
        gc.collect()
        if pause_gc:
            gc.disable()
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            lowered = lower()
            t1, c1 = time.perf_counter(), time.process_time()
        finally:
            gc.enable()
        if compile:
            lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
        return {"trace": t1 - t0, "compile": t2 - t1, "total": t2 - t0,
                "trace_cpu": c1 - c0, "compile_cpu": c2 - c1, "total_cpu": c2 - c0}

    return run


def fit_exponent(ns, ts) -> float:
    """Least-squares slope of log(time) vs log(n): 1 is linear, 2 quadratic."""
    return float(np.polyfit(np.log(ns), np.log(ts), 1)[0])


def nbytes(tree) -> int:
    return sum(math.prod(l.shape) * np.dtype(l.dtype).itemsize for l in jax.tree_util.tree_leaves(tree))


def synchronized(step: Callable[[], Any], sync: Callable[[], None] | None = None) -> Callable[[], dict]:
    """A sample of one ``step()``, in wall seconds, timed between two ``sync()`` calls.

    On a GPU a step returns once its kernels are queued: without ``sync`` (``torch.cuda.synchronize``
    for torch on CUDA) the clock would stop before the work is done, and the kernels of the step
    before would run into this one's time. JAX steps block on their results themselves
    (``jax.block_until_ready``), so they need no ``sync``.
    """

    def run():
        if sync is not None:
            sync()
        t = time.perf_counter()
        step()
        if sync is not None:
            sync()
        return {"step": time.perf_counter() - t}

    return run


def torch_sync(device) -> Callable[[], None] | None:
    """``torch.cuda.synchronize`` for a CUDA device, else None (a CPU step is done when it returns)."""
    import torch

    return torch.cuda.synchronize if torch.device(device).type == "cuda" else None


def cuda_peak_bytes(step: Callable[[], Any]) -> float:
    """The CUDA allocator's peak over one ``step()``, above what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - before)


def device() -> str:
    """What the benchmarks ran on, for their first line: ``"gpu (NVIDIA H200) x1"``, ``"cpu (cpu) x1"``."""
    devices = jax.devices()
    return f"{devices[0].platform} ({devices[0].device_kind}) x{len(devices)}"
