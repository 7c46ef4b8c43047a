"""What does capturing gradients at tags cost? One entry point for every figure.

    python benchmarks/run.py            # everything (over an hour on 2 cores: the large model, the compile sweep)
    python benchmarks/run.py --quick    # smaller models, fewer rounds (CI; a few minutes)
    python benchmarks/run.py --models none --no-scaling --sweep 10,100,1000   # one part only

Prints a table and writes JSON (to benchmarks/results/, or --out). All variants
of a model run in one process, interleaved in a random order each round;
every figure is the median over rounds of the per-round ratio to plain
``jax.value_and_grad`` of the untagged function, because absolute times on
shared machines drift from one minute to the next.

The files: ``timers.py`` (samples, interleaving, medians), ``models.py`` (every
model, written once with a ``tag`` argument), ``large.py`` (the equinox
transformer), ``drivers.py`` (the variants, one function each, and the one
skeleton that measures them), ``report.py`` (the table and the targets).
Variants: see ``drivers.py``; ``torch hooks`` is PyTorch eager with
``register_hook`` on the same model, when torch is installed (``torch plain``
the same without hooks).

Parts: the benchmark models (step, memory, trace + lower and compile); the
scaling of tracing with tags and scan length; the large model (``large.py``,
every submodule tagged by ``jt.tag_modules``); the compile sweep (trace + lower
and compile against the number of tags, 10 to 5,000, a weight per layer and 4
shared weights).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

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

import drivers as D  # noqa: E402
import jaxtrace as jt  # noqa: E402
import models as M  # noqa: E402
import report  # noqa: E402
from drivers import ALL, HAND, HOOK, ONE, PLAIN, RECIPE  # noqa: E402
from timers import block, fit_exponent, interleave, median, median_ratio, nbytes, timed  # noqa: E402

try:
    import torch
except ImportError:  # torch is optional
    torch = None

TORCH, TORCH_PLAIN = "torch hooks", "torch plain"


# --- one model ------------------------------------------------------------------------


def torch_step(model: M.Model, hooks: bool):
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


def check_agreement(bench: D.Bench, compiled: dict) -> dict:
    """Every variant computes the same gradients (jaxtrace's against plain's, hand's, the recipe's
    logs and the hook-style port's host copies); returns jt all's and jt one's tag gradients."""
    store = bench.store
    v0, g0 = compiled[PLAIN](*bench.args(PLAIN))
    v1, (g1, tag_grads) = compiled[ALL](*bench.args(ALL))
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)  # noqa: E731
    np.testing.assert_allclose(v0, v1, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1), strict=True):
        close(a, b)
    mismatched = {}
    for other in (HAND, RECIPE):  # the hand-written program and the recipe's logs agree
        if other in compiled:
            _, (_, theirs) = compiled[other](*bench.args(other))
            for name, ours in tag_grads.items():
                shapes = [jnp.shape(a) for a in jax.tree_util.tree_leaves((ours, theirs[name]))]
                if len(set(shapes)) > 1:  # the recipe under vmap: a batch-independent value's log is batched
                    mismatched.setdefault(other, []).append(name)
                else:
                    jax.tree_util.tree_map(close, ours, theirs[name])
    if HOOK in compiled:
        compiled[HOOK](*bench.args(HOOK))
        jax.effects_barrier()
        if bench.model.name == "large":  # repeated module tags: one host copy per leaf and call
            assert set(store.values) == set(tag_grads), (sorted(store.values), sorted(tag_grads))
        else:
            for name in tag_grads:  # the hook-style alternative sees the same cotangents
                calls = store.values[name]
                if len(calls) > 1:  # a scan: the backward pass visits the steps last to first
                    calls = calls[::-1]
                close(np.stack(calls).reshape(tag_grads[name].shape), tag_grads[name])
        store.clear()
    _, (_, one_grads) = compiled[ONE](*bench.args(ONE))
    return {ALL: tag_grads, ONE: one_grads, HAND: tag_grads, "mismatched": mismatched,
            "n_base_outputs": len(jax.tree_util.tree_leaves((v0, g0)))}


def memory(bench: D.Bench, compiled: dict, grads: dict) -> dict:
    out = {}
    for name, c in compiled.items():
        mem = c.memory_analysis()
        out[name] = {"temp_bytes": int(mem.temp_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes)}
    base_out = out[PLAIN]["output_bytes"]
    for name in (ALL, ONE, HAND):
        if name not in out:
            continue
        v = out[name]
        v["captured_bytes"] = nbytes(grads[name])
        v["output_excess_bytes"] = v["output_bytes"] - base_out - v["captured_bytes"]
        # XLA:CPU counts the output tuple's table of pointers (8 bytes an entry) in output bytes.
        n_extra = len(jax.tree_util.tree_leaves(grads[name]))
        v["output_tuple_entries_extra"] = n_extra
        v["output_excess_beyond_tuple_table"] = v["output_excess_bytes"] - 8 * n_extra
    for v in out.values():
        v["temp_ratio"] = v["temp_bytes"] / max(out[PLAIN]["temp_bytes"], 1)
    return out


def bench_model(model: M.Model, args, *, rounds=None, compile_rounds=None, steps=True) -> dict:
    names = [PLAIN, ALL, ONE, HAND, RECIPE] + ([HOOK] if model.hook else [])
    bench = D.Bench(model, names)
    result: dict = {"describe": model.describe, "variants": {}}
    if steps:
        compiled = bench.compile_all()
        grads = check_agreement(bench, compiled) if model.check else None
        if grads is not None:
            result["n_base_outputs"] = grads.pop("n_base_outputs")
            result["shape_mismatches"] = grads.pop("mismatched")
            result["variants"] = memory(bench, compiled, grads)
        timing = D.measure_steps(bench, compiled, rounds or args.rounds, args.min_time)
        result["step_repeats"] = timing.pop("repeats")
        for name, v in timing.items():
            result["variants"].setdefault(name, {}).update(v)
        if torch is not None and not args.no_torch and model.torch_loss is not None:
            torch.set_num_threads(max(os.cpu_count() or 1, 1))
            base = bench.call(compiled, PLAIN)
            runs = {PLAIN: base, TORCH: torch_step(model, hooks=True), TORCH_PLAIN: torch_step(model, hooks=False)}
            for fn in runs.values():
                fn()
            samples = interleave({n: timed(fn, result["step_repeats"]) for n, fn in runs.items()},
                                 max(3, args.rounds // 3))
            for name in (TORCH, TORCH_PLAIN):
                result["variants"][name] = {"step_ms": 1e3 * median(samples[name], "step"),
                                            "step_ratio": median_ratio(samples, name, "step", PLAIN)}
        del compiled
    # Trace + lower and compile, fresh function objects every round (the hook-style port too).
    build = D.measure_build(bench, compile_rounds or args.compile_rounds, names=[*D.BUILD, HOOK])
    for name, v in build.items():
        result["variants"].setdefault(name, {}).update(v)
    return result


# --- scaling of tracing ----------------------------------------------------------------


def bench_scaling(make, ns, rounds) -> dict:
    """Trace + lower (CPU time, GC paused) of plain, hand, recipe and jt all against ``n``."""
    out: dict = {"n": list(ns), "variants": {}}
    for n in ns:
        bench = D.Bench(make(n), D.BUILD)
        build = D.measure_build(bench, rounds, names=(PLAIN, HAND, RECIPE, ALL), seed=n, compile=False, pause_gc=True)
        for name, v in build.items():
            for fig, value in v.items():
                out["variants"].setdefault(name, {}).setdefault(fig, []).append(value)
    k = len(ns) // 2  # the slope over the upper half of the sizes (fixed costs dominate the smallest ones)
    for name, v in out["variants"].items():
        v["exponent"] = fit_exponent(ns[k:], v["trace_cpu_ms"][k:])
    return out


def bench_scan_steps(lengths) -> dict:
    """Step time of the scan-scaling model (a tag per step): jt all and hand, x plain."""
    out: dict = {"n": list(lengths), "variants": {}}
    for n in lengths:
        bench = D.Bench(M.looped(n), (PLAIN, ALL, HAND))
        timing = D.measure_steps(bench, bench.compile_all(), 9, 0.01)
        for name in (PLAIN, ALL, HAND):
            for fig in ("step_ms", "step_ratio"):
                out["variants"].setdefault(name, {}).setdefault(fig, []).append(timing[name][fig])
    k = len(lengths) // 2
    out["jt_step_exponent"] = fit_exponent(lengths[k:], out["variants"][ALL]["step_ms"][k:])
    return out


# --- the compile sweep -----------------------------------------------------------------


def bench_compile_sweep(ns, rounds, shared=None) -> dict:
    """Trace + lower and compile of ``jax.jit(...)`` vs the number of tags: plain, hand ``+ eps``,
    recipe, jt all, jt one (the first tag)."""
    out: dict = {"n": list(ns), "shared": shared, "variants": {}}
    for n in ns:
        bench = D.Bench(M.chain(n, shared=shared), D.BUILD)
        build = D.measure_build(bench, rounds if n <= 2000 else 1, seed=n)  # 5,000 tags: minutes per compile
        for name, v in build.items():
            for fig, value in v.items():
                out["variants"].setdefault(name, {}).setdefault(fig, []).append(value)
        D.log(f"compile sweep{f' ({shared} shared weights)' if shared else ''}: {n} tags done")
    return out


def retrace_check() -> dict:
    """How often the user's Python function runs over three calls under ``jax.jit``."""
    counts = {PLAIN: 0, ALL: 0}

    def make(name, tag):
        def f(w, x):
            counts[name] += 1
            return jnp.sum(tag(jnp.tanh(x @ w), "h") ** 2)

        return f

    w, x = jnp.ones((8, 8)), jnp.ones((2, 8))
    funs = {PLAIN: jax.jit(jax.value_and_grad(make(PLAIN, M.identity))),
            ALL: jax.jit(jt.value_and_grad(make(ALL, jt.tag)))}
    for _ in range(3):
        for fun in funs.values():
            block(fun(w, x))
    return {"calls": 3, "traces": counts}


def machine() -> dict:
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or __import__("jaxlib").__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "torch": getattr(torch, "__version__", None),
        "recipe": None if M.HAS_LOGS else M.NO_LOGS_NOTE,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, few rounds (CI; a few minutes)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<mode>-<time>.json)")
    parser.add_argument("--models", help="comma-separated subset of mlp,rnn,attention,cnn,chain... ('none': no models)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds for step times (default 40; quick 8)")
    parser.add_argument("--compile-rounds", type=int, help="interleaved rounds for trace+compile times (default 7; quick 1)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch variants")
    parser.add_argument("--no-scaling", action="store_true", help="skip the tag and scan scaling figures")
    parser.add_argument("--no-large", action="store_true", help="skip the large equinox model")
    parser.add_argument("--sweep", help="comma-separated tag counts for the compile sweep "
                        "(default 10,100,1000,2000,5000; quick 200); 'none' skips it")
    parser.add_argument("--shared-sweep", help="tag counts for the sweep with 4 shared weights "
                        "(default 10,100,1000,2000,5000; quick: none, the chain model has them); 'none' skips it")
    parser.add_argument("--sweep-rounds", type=int, help="interleaved rounds per sweep point (default 3; quick 2)")
    parser.add_argument("--large-layers", type=int, help="blocks of the large model (default 24; quick 2)")
    parser.add_argument("--large-compile-rounds", type=int,
                        help="interleaved trace+compile rounds of the large model (default --compile-rounds; quick 1)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (8 if args.quick else 40)  # quick: a smoke run for CI; its ratios are rough
    args.explicit_rounds = args.compile_rounds is not None
    args.compile_rounds = args.compile_rounds or (1 if args.quick else 7)
    args.min_time = 0.01 if args.quick else 0.02  # seconds per timed sample, at least

    t_start = time.perf_counter()
    results = {"quick": args.quick, "machine": machine(), "models": {}}
    out = args.out or os.path.join(HERE, "results", time.strftime(f"{'quick' if args.quick else 'full'}-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def save():  # after each part, so that a long run that stops keeps what it measured
        with open(out, "w") as f:
            json.dump(results, f, indent=1)

    if not M.HAS_LOGS:
        D.log(f"note: {M.NO_LOGS_NOTE}")
    wanted = set(args.models.split(",")) if args.models else None
    chosen = [m for m in M.models(args.quick) if not wanted or m.name in wanted]
    for name in sorted((wanted or set()) - {m.name for m in chosen}):
        if name.startswith("chain") and name[5:].replace("/", "").isdigit():  # e.g. chain500/4
            n, _, shared = name[5:].partition("/")
            chosen.append(M.chain(int(n), shared=int(shared) if shared else None))
    for model in chosen:
        t = time.perf_counter()
        results["models"][model.name] = bench_model(model, args)
        save()
        D.log(f"{model.name}: {time.perf_counter() - t:.0f} s")
    if not args.no_scaling:
        ns = (10, 100, 1000) if args.quick else (10, 100, 1000, 10000)
        results["tag_scaling"] = bench_scaling(M.sin_chain, ns, rounds=3)
        lengths = (10, 100, 1000) if args.quick else (10, 100, 1000, 10000)
        results["scan_scaling"] = bench_scaling(M.looped, lengths, rounds=3 if args.quick else 5)
        results["scan_steps"] = bench_scan_steps(lengths)
        save()
        D.log("scaling done")
    if not args.no_large:
        import large as L

        t = time.perf_counter()
        results["large"] = bench_model(L.model(args.quick, args.large_layers), args, rounds=5 if args.quick else args.rounds,
                                       compile_rounds=args.large_compile_rounds or (
                                           args.compile_rounds if args.explicit_rounds or not args.quick else 1))
        save()
        D.log(f"large model: {time.perf_counter() - t:.0f} s")
    for key, option, shared in (("compile_sweep", args.sweep, None), ("compile_sweep_shared", args.shared_sweep, 4)):
        sweep = option or (("none" if shared else "200") if args.quick else "10,100,1000,2000,5000")
        if sweep != "none":
            t = time.perf_counter()
            results[key] = bench_compile_sweep([int(n) for n in sweep.split(",")],
                                               args.sweep_rounds or (2 if args.quick else 3), shared)
            save()
            D.log(f"{key}: {time.perf_counter() - t:.0f} s")
    results["retrace"] = retrace_check()
    results["targets"] = report.check_targets(results)
    results["seconds"] = time.perf_counter() - t_start

    save()
    print(report.table(results))
    print(f"\n{results['seconds']:.0f} s; JSON written to {out}")
    return results


if __name__ == "__main__":
    main()
