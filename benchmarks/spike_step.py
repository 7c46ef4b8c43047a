"""What the "Debugging a loss spike" recipe costs on a normal step, against the plain step.

    python benchmarks/spike_step.py [--quick] [--rounds N] [--sizes guide,wide]

The recipe is the guide's own code (docs/guides/training-statistics.md, the block that defines
``forensics``: its definitions run here, its 30-step loop does not). Columns, on normal batches
(the threshold far above the loss, so the ``lax.cond`` takes the cheap branch every time):

- ``plain``: ``eqx.filter_value_and_grad(mean_loss)`` and the optax update, under ``eqx.filter_jit``
  (the step the recipe replaces; the base of the ratios);
- ``recipe``: the guide's ``step`` (the same, plus the threshold, the running average and the
  ``spike`` flag; the forensics are a separate jitted call, on the host's ``if spike:``);
- ``forensics in a lax.cond``: the former recipe, the forensics in the step as the branch of a
  ``lax.cond`` taken on a spike only, a report of ``-1`` from the other branch;
- ``plain (jax.jit)`` and ``in a lax.cond (jax.jit)``: the plain step and the former recipe as ``jax.jit`` of the model's arrays
  (the static part closed over), which takes JAX's C++ dispatch path, so the difference is
  what the compiled programs do rather than the Python work per leaf of ``eqx.filter_jit``.

Sizes: ``guide`` is the guide's MLP (8 -> 3 x 32 -> 1, batch 64, a step of a few tenths of a
millisecond: dispatch is much of it); ``wide`` an MLP 8 -> 3 x 512 -> 1 at batch 256.

Each round calls every column ``repeats`` times in a random order, waiting for each call's
outputs (the latency of one step); a column's figure is the median over rounds of its time over
``plain``'s in the same round (and of ``recipe (jax.jit)`` over ``plain (jax.jit)``). The load
of the machine is printed at the start and the end: on a shared machine read the ratios, not
the milliseconds.

It also reads the compiled program of the former recipe (``jax.jit`` column) and checks that
its normal path (everything outside the ``cond``'s forensics branch) does the work of the plain
step and no more: the same matrix products and no sort (the forensics' medians); the forensics
branch holds the per-example work.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if (ROOT / "jaxtrace").is_dir():
    sys.path.insert(0, str(ROOT))  # run from a checkout: this tree's jaxtrace
sys.path.insert(0, str(ROOT / "benchmarks"))
from timers import device  # noqa: E402
GUIDE = ROOT / "docs" / "guides" / "training-statistics.md"


def recipe_namespace() -> dict:
    """The guide's spike recipe, its definitions only (the block up to the training loop)."""
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S) if "def forensics" in b]
    head, sep, _ = code.partition("\nopt_state = optimizer.init(")
    if not sep:
        raise SystemExit(f"{GUIDE}: the spike recipe no longer starts its loop with 'opt_state = optimizer.init(': update {__file__}")
    namespace: dict = {}
    exec(compile(head, str(GUIDE), "exec"), namespace)
    return namespace


def steps(ns: dict) -> dict:
    """The columns: name -> a function of (model, opt_state, average, x, y) returning its outputs."""
    optimizer, mean_loss = ns["optimizer"], ns["mean_loss"]

    @eqx.filter_jit
    def plain(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(mean_loss)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    forensics = ns["forensics"]

    def no_report(model, x, y):
        shapes = eqx.filter_eval_shape(forensics, model, x, y)
        return jax.tree_util.tree_map(lambda s: jnp.full(s.shape, -1, s.dtype), shapes)

    @eqx.filter_jit
    def in_cond(model, opt_state, average, x, y):
        loss, grads = eqx.filter_value_and_grad(mean_loss)(model, x, y)
        spike = loss > 5.0 * average
        report = jax.lax.cond(spike, lambda: forensics(model, x, y), lambda: no_report(model, x, y))
        updates, opt_state = optimizer.update(grads, opt_state, model)
        average = jnp.where(spike, average, jnp.where(jnp.isinf(average), loss, 0.9 * average + 0.1 * loss))
        return eqx.apply_updates(model, updates), opt_state, average, loss, spike, report

    return {
        "plain": lambda m, o, a, x, y: plain(m, o, x, y),
        "recipe": ns["step"],
        "forensics in a lax.cond": in_cond,
    }


def array_steps(ns: dict, in_cond, model, opt_state, average, x, y):
    """``plain`` and the step with the forensics in a cond as jax.jit of the model's arrays, compiled ahead."""
    params, static = eqx.partition(model, eqx.is_array)
    optimizer, mean_loss = ns["optimizer"], ns["mean_loss"]
    step = in_cond.__wrapped__ if hasattr(in_cond, "__wrapped__") else None
    if step is None:
        raise SystemExit("eqx.filter_jit no longer exposes __wrapped__: update array_steps")

    def plain(params, opt_state, x, y):
        model = eqx.combine(params, static)
        loss, grads = eqx.filter_value_and_grad(mean_loss)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), opt_state, loss

    def recipe(params, opt_state, average, x, y):
        model, *rest = step(eqx.combine(params, static), opt_state, average, x, y)
        return (eqx.filter(model, eqx.is_array), *rest)

    plain_c = jax.jit(plain).lower(params, opt_state, x, y).compile()
    recipe_c = jax.jit(recipe).lower(params, opt_state, average, x, y).compile()
    plain_text = plain_c.as_text()
    columns = {
        "plain (jax.jit)": lambda m, o, a, x, y: plain_c(params, o, x, y),
        "in a lax.cond (jax.jit)": lambda m, o, a, x, y: recipe_c(params, o, a, x, y),
    }
    temps = [c.memory_analysis().temp_size_in_bytes for c in (plain_c, recipe_c)]
    return columns, plain_text, recipe_c.as_text(), f"temporary memory: plain {temps[0]:,} B, in a lax.cond {temps[1]:,} B"


# --- the compiled program: what the normal path computes ---------------------------------------

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\(.*?\)|[^\s(]+)\s+([a-z][\w\-]*)\(")
CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def computations(hlo: str) -> tuple[str, dict]:
    """The entry's name and every computation's instruction lines, from an HLO module's text."""
    entry, comps, name = None, {}, None
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and not line.startswith((" ", "HloModule")):
            head = line.split()
            name = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
            comps[name] = []
            if head[0] == "ENTRY":
                entry = name
        elif line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    if entry is None:
        raise SystemExit("no ENTRY computation in the HLO text: the text format changed; update computations()")
    return entry, comps


def branches_of(line: str) -> list[str]:
    m = BRANCHES.search(line)
    if m:
        return [b.strip().lstrip("%") for b in m.group(1).split(",")]
    pairs = re.findall(r"\b(true|false)_computation=%?([\w.\-]+)", line)
    return [c for _, c in sorted(pairs, key=lambda p: p[0] != "false")]  # false first, as JAX's index 0


def work(comps: dict, start: str, skip: frozenset = frozenset()) -> collections.Counter:
    """Matrix products (by result shape) and sorts reachable from ``start``, not entering ``skip``."""
    seen, todo, found = set(), [start], collections.Counter()
    while todo:
        name = todo.pop()
        if name in seen or name in skip:
            continue
        seen.add(name)
        for line in comps.get(name, []):
            m = INSTRUCTION.match(line)
            if m and (m.group(2) in ("dot", "convolution", "sort") or (m.group(2) == "fusion" and "kind=kCustom" in line)):
                found[(m.group(2), re.sub(r"\{[^}]*\}", "", m.group(1)))] += 1  # a kCustom fusion: a library matmul
            todo.extend(CALLED.findall(line))
            todo.extend(branches_of(line) if " conditional(" in line else [])
    return found


def normal_path_check(plain_text: str, recipe_text: str) -> str:
    """A sentence: the recipe's normal path (outside the cond's forensics branch) against the plain step's work."""
    entry, comps = computations(recipe_text)
    conds = [line for name in comps for line in comps[name] if " conditional(" in line]
    if len(conds) != 1:
        raise SystemExit(f"expected one conditional in the recipe's compiled step, found {len(conds)}")
    branches = branches_of(conds[0])
    sizes = {b: sum(work(comps, b).values()) for b in branches}
    forensics = max(branches, key=sizes.get)
    normal = work(comps, entry, frozenset({forensics}))
    inside = work(comps, forensics)
    plain_entry, plain_comps = computations(plain_text)
    plain = work(plain_comps, plain_entry)
    sorts = sum(n for (op, _), n in normal.items() if op == "sort")
    if normal != plain or sorts:
        return f"the normal path differs from the plain step: extra {dict(normal - plain)}, missing {dict(plain - normal)}, {sorts} sorts"
    return (f"normal path: {sum(normal.values())} matrix products, the plain step's exactly, and no sort; "
            f"the forensics branch (not run on a normal step): {sum(n for (op, _), n in inside.items() if op != 'sort')} "
            f"matrix products and {sum(n for (op, _), n in inside.items() if op == 'sort')} sorts")


# --- timing ------------------------------------------------------------------------------------


def measure(columns: dict, args: tuple, rounds: int, repeats: int, seed: int = 0) -> dict:
    """Seconds per step of each column, per round, the columns in a random order each round."""
    rng = np.random.default_rng(seed)
    names = list(columns)
    for name in names:  # compile and warm up
        for _ in range(3):
            jax.block_until_ready(columns[name](*args))
    out = {n: {"wall": [], "cpu": []} for n in names}
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            fn = columns[names[i]]
            t, c = time.perf_counter(), time.process_time()
            for _ in range(repeats):
                jax.block_until_ready(fn(*args))
            out[names[i]]["wall"].append((time.perf_counter() - t) / repeats)
            out[names[i]]["cpu"].append((time.process_time() - c) / repeats)
    return out


def ratio(samples: dict, name: str, base: str, figure: str) -> tuple[float, float, float]:
    r = np.array(samples[name][figure]) / np.array(samples[base][figure])
    return float(np.median(r)), float(np.percentile(r, 25)), float(np.percentile(r, 75))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few rounds, for a smoke run")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--sizes", default="guide,wide")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    start = time.perf_counter()
    print(f"JAX {jax.__version__}, equinox {eqx.__version__}, {device()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f} (1 min) at the start")
    ns = recipe_namespace()
    sizes = {"guide": (32, 64, 200), "wide": (512, 256, 10)}  # width, batch, repeats per sample
    print("\n| model | column | wall (ms, median) | x plain (median [IQR] of per-round ratios) "
          "| process CPU (ms) | x plain (CPU) |")
    print("|---|---|---|---|---|---|")
    checks = []
    for size in args.sizes.split(","):
        width, batch, repeats = sizes[size]
        if args.quick:
            repeats = max(1, repeats // 10)
        model = eqx.nn.MLP(8, 1, width, 3, key=jax.random.key(0))
        x = jax.random.normal(jax.random.key(1), (batch, 8), jnp.float32)
        y = jnp.sin(x[:, :1])
        opt_state = ns["optimizer"].init(eqx.filter(model, eqx.is_array))
        average = jnp.float32(1e6)  # far above the loss: every step takes the normal branch
        columns = steps(ns)
        spike = columns["recipe"](model, opt_state, average, x, y)[4]
        assert not bool(spike), "the benchmark's batch spiked: the normal path is not what is measured"
        if size == "guide":
            more, plain_text, recipe_text, temps = array_steps(ns, columns["forensics in a lax.cond"], model, opt_state, average, x, y)
            columns.update(more)
            checks.append(f"{size}: " + normal_path_check(plain_text, recipe_text))
            checks.append(f"{size}: {temps}")
        samples = measure(columns, (model, opt_state, average, x, y), rounds, repeats)
        label = f"MLP 8-{width}x3-1, batch {batch}"
        for name in columns:
            base = "plain (jax.jit)" if "jax.jit" in name else "plain"
            cells = []
            for figure in ("wall", "cpu"):
                med, lo, hi = ratio(samples, name, base, figure)
                cells.append(f"{np.median(samples[name][figure]) * 1e3:.3f} | {med:.3f} [{lo:.3f}, {hi:.3f}]")
            print(f"| {label} | {name} | {' | '.join(cells)} |")
    print()
    for line in checks:
        print(line)
    print(f"{rounds} rounds; load {os.getloadavg()[0]:.1f} (1 min) at the end; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
