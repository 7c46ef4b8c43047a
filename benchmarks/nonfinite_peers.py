"""Where a NaN began, side by side: jt.find_nonfinite against jax_debug_nans, checkify and equinox.

    python benchmarks/nonfinite_peers.py [--rounds N] [--no-torch]

Four programs that make a NaN or an inf (the traps of tests/test_nonfinite.py, at a size where
the step is not only dispatch), each written once with a tagger ``t(value, name)`` at the same
places, and run on the failing input by:

- ``plain``: ``jax.jit(jax.value_and_grad(f))``, no tool (the base of the ratios);
- ``jax_debug_nans``: the same under ``jax.debug_nans(True)``: JAX checks the outputs of the jitted
  function and, on a NaN, runs it again op by op (de-optimized) to raise at the first NaN;
- ``checkify``: ``jax.jit(checkify.checkify(jax.value_and_grad(f), errors=checkify.nan_checks))``;
- ``eqx backward_nan``: ``t`` is ``eqx.debug.backward_nan(value, name=name)``, under
  ``eqx.filter_jit``: it prints every marked value and its cotangent in every backward pass and
  raises on the first NaN cotangent;
- ``find_nonfinite``: ``t`` is ``jt.tag``, ``jax.jit(jt.find_nonfinite(f))``, the report's sentences;
- ``torch detect_anomaly`` (two programs ported to PyTorch, when torch is installed): the forward
  and ``backward()`` under ``torch.autograd.detect_anomaly()``, against the same without it.

For each it prints what the tool says (the message, cut to its first lines; the ``file:line`` it
names in this file), the seconds of the first call (trace, compile, run, report) and, per round
with the tools in a random order, the time of a call once compiled over ``plain``'s in the same
round (medians over rounds). The machine's load is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import time
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

HERE = os.path.abspath(__file__)
if os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(HERE)), "jaxtrace")):
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # run from a checkout: this tree's jaxtrace

import jaxtrace as jt  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))
from timers import device  # noqa: E402


# --- the programs: t(value, name) marks the places a tool looks at -------------------------------


def where_trap(w, x, t):
    h = t(x * w["scale"], "h")
    y = t(jnp.where(h > 0, jnp.log(h), 0.0), "y")  # the FAQ's trap: log's derivative at 0 reaches h
    return jnp.sum(y)


def self_distance(w, x, t):
    x = x * w
    diff = x[:, None, :] - x[None, :, :]
    sq = t(jnp.sum(diff**2, axis=-1), "sq")  # zero on the diagonal: a point's distance to itself
    return jnp.sum(t(jnp.sqrt(sq), "dist"))


def cross_entropy(w, x, labels, t):
    def one(x, label):
        logits = t(x @ w, "logits")
        probs = t(jax.nn.softmax(logits), "probs")
        logp = t(jnp.log(probs), "logp")  # log(0): the label's probability underflowed
        return -logp[label]

    return jnp.mean(jax.vmap(one)(x, labels))


def backward_only(ws, xs, t):
    def layer(h, w):
        pre = t(h @ w, "pre")
        size = jnp.sqrt(jnp.sum(pre[:2] ** 2))  # the norm of two units: finite at 0, its derivative 0/0
        return t(jnp.tanh(pre) + 0.1 * size, "post"), None

    def one(x):
        return jnp.sum(jax.lax.scan(layer, x, ws)[0])

    return jnp.mean(jax.vmap(one)(xs))


def programs():
    """name -> (program, params, other arguments, where the trap is)."""
    k = jax.random.split(jax.random.key(0), 6)
    x = jnp.abs(jax.random.normal(k[0], (1 << 16,))) + 0.1
    out = {"where(x > 0, log(x), 0)": (where_trap, {"scale": jnp.float32(1.0)}, (x.at[40000].set(0.0),),
                                       "x[40000] = 0: log's derivative there, in the backward pass only")}
    points = jax.random.normal(k[1], (256, 16))
    out["sqrt of a zero squared distance"] = (self_distance, jnp.float32(1.0), (points,),
                                              "each point's distance to itself: sqrt'(0), backward only")
    w = jax.random.normal(k[2], (64, 1000)) / 8.0
    xs = jax.random.normal(k[3], (128, 64)).at[37].multiply(400.0)  # example 37: logits far apart
    labels = jnp.argmax(xs @ w, axis=-1).at[37].set(jnp.argmin(xs[37] @ w))  # its label the least likely
    out["log(0) in a cross-entropy"] = (cross_entropy, w, (xs, labels), "example 37: log of an underflowed probability")
    ws = jax.random.normal(k[4], (8, 64, 64)) / 8.0
    ws = ws.at[3, :, :2].set(0.0)  # layer 3's units 0 and 1: pre-activations exactly 0 for every example
    out["NaN only in backward (scan of 8 layers, vmap)"] = (backward_only, ws, (jax.random.normal(k[5], (32, 64)),),
                                                            "scan step 3, every example: the gradient of a norm at 0")
    return out


# --- the tools: each returns (what it says, a callable that runs it again) ------------------------


class Lazy:
    """A description computed when printed, so that the timed call does not include it."""

    def __init__(self, describe):
        self.describe = describe

    def __str__(self):
        return self.describe()


def identity(value, name):
    return value


def mark_eqx(value, name):
    return eqx.debug.backward_nan(value, name=name)


def short(text: str, lines: int = 3, width: int = 160) -> str:
    text = re.sub(r"/\S*/([\w.]+\.py)", r"\1", str(text))  # paths to file names
    kept = [line.strip()[:width] for line in text.strip().splitlines() if line.strip()][:lines]
    return " / ".join(kept)


def where_in_this_file(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == HERE
              and f.name not in ("run", "call", "again", "<lambda>", "main", "tool_runs")]
    return f"{os.path.basename(HERE)}:{frames[-1].lineno} ({frames[-1].name})" if frames else "no line of the program"


def tool_runs(program, params, args) -> dict:
    """name -> a function that runs the tool once and returns what it reports (a string)."""
    plain_f = lambda p, *a: program(p, *a, identity)  # noqa: E731

    def plain():
        step = jax.jit(jax.value_and_grad(plain_f))

        def call():
            value, grads = jax.block_until_ready(step(params, *args))

            def describe():  # on the host, only when printed: not part of the timed call
                bad = sum(int(np.sum(~np.isfinite(np.asarray(g)))) for g in jax.tree_util.tree_leaves(grads))
                return f"value {float(value):.4g}; {bad} non-finite gradient entries; no place named"

            return Lazy(describe)

        return call

    def debug_nans():
        step = jax.jit(jax.value_and_grad(plain_f))

        def call():
            try:
                with jax.debug_nans(True):
                    jax.block_until_ready(step(params, *args))
            except Exception as e:  # noqa: BLE001 (FloatingPointError, or whatever it raises)
                return f"{type(e).__name__}: {short(e, 2)} [traceback: {where_in_this_file(e)}]"
            return "no error raised"

        return call

    def with_checkify():
        step = jax.jit(checkify.checkify(jax.value_and_grad(plain_f), errors=checkify.nan_checks))

        def call():
            err, out = jax.block_until_ready(step(params, *args))
            message = err.get()
            return short(message, 2) if message else "no error found"

        return call

    def eqx_backward_nan():
        step = eqx.filter_jit(eqx.filter_value_and_grad(lambda p, *a: program(p, *a, mark_eqx)))

        def call():
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    try:
                        jax.block_until_ready(step(params, *args))
                    finally:
                        jax.effects_barrier()
            except Exception as e:  # noqa: BLE001 (EquinoxRuntimeError, or a refusal at trace time)
                said = printed.getvalue()
                names = re.findall(r"^(\w+):$", said, re.M)
                return (f"{type(e).__name__}: {short(e, 1)}; printed {len(said):,} characters"
                        + (f" ({len(names)} values and cotangents, the last '{names[-1]}')" if names else ""))
            said = printed.getvalue()
            return f"no error; printed {len(said):,} characters"

        return call

    def find_nonfinite():
        step = jax.jit(jt.find_nonfinite(lambda p, *a: program(p, *a, jt.tag)))

        def call():
            report = jax.block_until_ready(step(params, *args))
            return " ".join(str(report).replace(os.path.basename(HERE) + ":", "line ").split())

        return call

    return {"plain": plain, "jax_debug_nans": debug_nans, "checkify (nan_checks)": with_checkify,
            "eqx backward_nan": eqx_backward_nan, "find_nonfinite": find_nonfinite}


# --- PyTorch ------------------------------------------------------------------------------------


def torch_runs() -> dict:
    """Two traps ported to PyTorch: program -> {"plain": call, "torch detect_anomaly": call}."""
    import torch
    import warnings

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)

    def torch_where(x):
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x)).sum()

    def torch_distance(x):
        diff = x[:, None, :] - x[None, :, :]
        return torch.sqrt((diff**2).sum(-1)).sum()

    x = np.abs(rng.standard_normal(1 << 16)).astype(np.float32) + 0.1
    x[40000] = 0.0
    cases = {"where(x > 0, log(x), 0)": (torch_where, torch.tensor(x)),
             "sqrt of a zero squared distance": (torch_distance, torch.tensor(rng.standard_normal((256, 16)), dtype=torch.float32))}
    out = {}
    for name, (fn, data) in cases.items():
        def plain(fn=fn, data=data):
            def call():
                leaf = data.clone().requires_grad_(True)
                fn(leaf).backward()
                return Lazy(lambda: f"{int((~torch.isfinite(leaf.grad)).sum())} non-finite gradient entries; no place named")
            return call

        def anomaly(fn=fn, data=data):
            def call():
                leaf = data.clone().requires_grad_(True)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        with torch.autograd.detect_anomaly():
                            fn(leaf).backward()
                    except RuntimeError as e:
                        lines = [m for w in caught for m in re.findall(r'File "([^"]+)", line (\d+), in (\w+)', str(w.message))
                                 if os.path.abspath(m[0]) == HERE]
                        at = f" [forward traceback: {os.path.basename(HERE)}:{lines[-1][1]} ({lines[-1][2]})]" if lines else ""
                        return f"RuntimeError: {short(e, 1)}{at}"
                return "no error raised"
            return call

        out[name] = {"plain (torch)": plain, "torch detect_anomaly": anomaly}
    return out


# --- timing ---------------------------------------------------------------------------------------


def first_and_again(runs: dict, rounds: int, base: str, seed: int = 0):
    """What each says, its first call's seconds, and the median over rounds of its time over ``base``'s."""
    said, first, calls = {}, {}, {}
    for name, make in runs.items():
        print(f"  ({name}: first call)", flush=True)  # so that a tool that aborts the process is named in the log
        call = make()
        t = time.perf_counter()
        out = call()
        first[name] = time.perf_counter() - t
        said[name] = str(out)
        calls[name] = call
    repeats = {}
    for name, call in calls.items():  # each sample at least ~20 ms
        t = time.perf_counter()
        call()
        repeats[name] = max(1, min(50, int(0.02 / max(time.perf_counter() - t, 1e-6))))
    rng = np.random.default_rng(seed)
    names = list(calls)
    samples = {n: [] for n in names}
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            name = names[i]
            t = time.perf_counter()
            for _ in range(repeats[name]):
                calls[name]()
            samples[name].append((time.perf_counter() - t) / repeats[name])
    again = {n: float(np.median(samples[n])) for n in names}
    ratio = {n: float(np.median(np.array(samples[n]) / np.array(samples[base]))) for n in names}
    return said, first, again, ratio


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--only", default="", help="run the programs whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the programs' names, one a line, and stop")
    args = parser.parse_args()
    if args.list:
        print("\n".join(programs()))
        return
    start = time.perf_counter()
    print(f"JAX {jax.__version__}, equinox {eqx.__version__}, {device()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f} (1 min) at the start, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    try:
        torch_cases = {} if args.no_torch else torch_runs()
    except ImportError:
        torch_cases = {}
        print("torch is not installed: no detect_anomaly column")
    rows = []
    for name, (program, params, rest, trap) in programs().items():
        if args.only not in name:
            continue
        print(f"\n## {name}: {trap}")
        said, first, again, ratio = first_and_again(tool_runs(program, params, rest), args.rounds, "plain")
        for tool in said:
            print(f"- {tool}: {said[tool]}")
            rows.append((name, tool, first[tool], again[tool], ratio[tool]))
        if name in torch_cases:
            said, first, again, ratio = first_and_again(torch_cases[name], args.rounds, "plain (torch)")
            for tool in said:
                print(f"- {tool}: {said[tool]}")
                rows.append((name, tool, first[tool], again[tool], ratio[tool]))
        sys.stdout.flush()
    print("\n| program | tool | first call (s) | again (ms) | x plain |")
    print("|---|---|---|---|---|")
    for name, tool, f, a, r in rows:
        print(f"| {name} | {tool} | {f:.2f} | {a * 1e3:.2f} | {r:.2f} |")
    print(f"\n{args.rounds} rounds; load {os.getloadavg()[0]:.1f} (1 min) at the end; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
