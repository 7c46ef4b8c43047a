"""Where jaxtrace's build time goes: phases of ``jax.jit(jt.value_and_grad(f)).lower(...)``.

    python benchmarks/profile_build.py                 # the chain of 500 layers, 4 shared weights
    python benchmarks/profile_build.py --model mlp     # any model of models.py (quick sizes: --quick)

CPU seconds (single-threaded tracing), medians of interleaved rounds, beside plain, hand ``+ eps``
and the recipe: the first ``make_jaxpr`` (the user's function traced once to find the tags), the
site bookkeeping (``Program``: sites, ``stack_calls``; ``select``), the re-evaluation
(``ProgramEvaluator``: each equation bound again, which includes JAX's own linearization of it), the rest
of the trace (JAX's transpose, the tag tree) and the lowering to StableHLO. ``--profile`` adds a
cProfile of one jaxtrace build, sorted by own time, and the share of it spent in jaxtrace's files.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import gc
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import drivers as D  # noqa: E402
import jaxtrace._split as _split  # noqa: E402
import models as M  # noqa: E402

PHASES = ("make_jaxpr", "sites (Program, select)", "ProgramEvaluator (re-evaluation)")


def instrument(acc: dict) -> None:
    """Add the CPU time of jaxtrace's phases to ``acc`` while they run."""

    def timed(fn, label):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] += time.process_time() - t

        return wrapper

    make_jaxpr = jax.make_jaxpr

    def make_jaxpr_timed(fun, *args, **kwargs):
        return timed(make_jaxpr(fun, *args, **kwargs), PHASES[0])

    _split.jax = _Proxy(jax, make_jaxpr=make_jaxpr_timed)
    _split.Program = timed(_split.Program, PHASES[1])
    _split.select = timed(_split.select, PHASES[1])
    _split.ProgramEvaluator.__call__ = timed(_split.ProgramEvaluator.__call__, PHASES[2])


class _Proxy:
    def __init__(self, module, **overrides):
        self._module, self._overrides = module, overrides

    def __getattr__(self, name):
        return self._overrides.get(name) or getattr(self._module, name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="chain500/4", help="a model of models.py, e.g. mlp, chain500/4")
    parser.add_argument("--quick", action="store_true", help="the quick sizes of models.py")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also a cProfile of one jaxtrace build")
    args = parser.parse_args(argv)
    if args.model.startswith("chain"):
        n, _, shared = args.model[5:].partition("/")
        model = M.chain(int(n), shared=int(shared) if shared else None)
    else:
        model = next(m for m in M.models(args.quick) if m.name == args.model)
    bench = D.Bench(model, D.BUILD)
    acc: dict = collections.defaultdict(float)
    instrument(acc)
    samples: dict = collections.defaultdict(list)
    rng = np.random.default_rng(0)
    names = D.available([D.PLAIN, D.HAND, D.RECIPE, D.ALL])
    for _ in range(args.rounds):
        for i in rng.permutation(len(names)):
            name = names[i]
            gc.collect()
            acc.clear()
            fun = jax.jit(D.VARIANTS[name](bench.model, bench.store))
            c0 = time.process_time()
            traced = fun.trace(*bench.args(name))
            c1 = time.process_time()
            traced.lower()
            c2 = time.process_time()
            samples[f"{name}: trace"].append(c1 - c0)
            samples[f"{name}: lower"].append(c2 - c1)
            samples[f"{name}: trace + lower"].append(c2 - c0)
            if name == D.ALL:
                for phase in PHASES:
                    samples[f"  {phase}"].append(acc[phase])
                samples["  rest of the trace (JAX's transpose, ...)"].append(c1 - c0 - sum(acc[p] for p in PHASES))
    print(f"{model.describe}; JAX {jax.__version__}; CPU seconds, medians of {args.rounds} interleaved rounds")
    for label, values in samples.items():
        print(f"{label:48s} {np.median(values):.3f}")
    if args.profile:
        fun = jax.jit(D.VARIANTS[D.ALL](bench.model, bench.store))
        profile = cProfile.Profile()
        profile.runcall(lambda: fun.lower(*bench.args(D.ALL)))
        stats = pstats.Stats(profile)
        total = sum(v[2] for v in stats.stats.values())  # own time of every function
        ours = sum(v[2] for k, v in stats.stats.items() if os.sep + "jaxtrace" + os.sep in k[0])
        print(f"\ncProfile: {total:.2f} s of own time, {ours:.2f} s ({100 * ours / total:.0f}%) in jaxtrace's files")
        stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
