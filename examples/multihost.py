"""A jaxtrace training step across processes: jax.distributed on loopback, a global 8-device mesh.

Run:  python examples/multihost.py --processes 2        [--check]

The launcher starts ``--processes`` workers on this machine (each a JAX process
with 4 simulated CPU devices, CPU collectives through gloo, joined by
``jax.distributed.initialize`` on a free loopback port), as one would start
one process per host. Every worker runs the same jitted step on a global mesh
``(data=4, model=2)``:

- a data-parallel batch (sharded over ``data``) through a model-parallel layer
  (its weight sharded over ``model``), tagged ``"hidden"``;
- a ``lax.scan`` over time steps whose state is tagged ``"state"`` (one
  gradient per step);
- ``jt.value_and_grad(..., with_values=True)`` for the leaf and tag gradients
  and the tag values, and ``jt.stats.summarize`` for per-tag statistics;
- ``jt.find_nonfinite`` on the same step with a NaN in the scan's input at
  step 3 of example 5: each process prints the report (the tag, the step, the
  entry and the shard that held it), the same on every process.

Tag gradients are global ``jax.Array``s, sharded as a plain output of the
tagged value would be; each process holds (and prints) its addressable
shards. The statistics and the report's integers are replicated scalars. With
``--check`` every worker also computes the same step in one process,
unsharded, and checks each of its shards against the matching slice of that
reference, and the report's tag, steps and entry against that process's.
"""

import argparse
import os
import pathlib
import socket
import subprocess
import sys

DEVICES_PER_PROCESS = 4
B, D, H, T = 8, 6, 8, 5


def launch(processes: int, check: bool, timeout: float) -> int:
    """Start the workers on loopback, wait for them (killing all on a timeout), relay their output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = pathlib.Path(__file__).resolve()
    root = str(here.parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, str(here), "--worker", "", "--processes", str(processes), "--port", str(port)]
    workers = []
    for i in range(processes):
        cmd = [*args[:3], str(i), *args[4:], *(["--check"] if check else [])]
        workers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    status = 0
    try:
        outputs = [w.communicate(timeout=timeout)[0] for w in workers]
    except subprocess.TimeoutExpired:
        for w in workers:
            w.kill()
        outputs = [w.communicate()[0] for w in workers]
        print(f"the workers did not finish within {timeout:.0f} s and were stopped")
        status = 124
    for i, (w, out) in enumerate(zip(workers, outputs)):
        lines = [line for line in out.splitlines() if "[Gloo]" not in line and "peer ranks" not in line]
        print(f"--- process {i} (exit {w.returncode})")
        print("\n".join(lines[-40:]))
        status = status or w.returncode
    return status


def worker(index: int, processes: int, port: int, check: bool) -> None:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    )
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=processes, process_id=index, initialization_timeout=60
    )
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxtrace as jt

    auto = (jax.sharding.AxisType.Auto,) * 2  # shardings chosen by the compiler, as most training code does
    mesh = jax.make_mesh((processes * DEVICES_PER_PROCESS // 2, 2), ("data", "model"), axis_types=auto)
    rng = np.random.default_rng(0)  # every process makes the same global data, and keeps its part
    w1 = rng.normal(size=(D, H)) / np.sqrt(D)
    wr = rng.normal(size=(H, H)) / np.sqrt(H)
    x = rng.normal(size=(B, D))
    xs = rng.normal(size=(T, B, H)) * 0.1

    def loss(params, x, xs):
        hidden = jt.tag(jnp.tanh(x @ params["w1"]), "hidden")  # model-parallel: w1 is sharded over "model"

        def step(h, x_t):
            h = jt.tag(jnp.tanh(h @ params["wr"] + x_t), "state")
            return h, None

        h, _ = lax.scan(step, hidden, xs)
        return jnp.mean(h**2)

    def train_step(params, x, xs):
        value, (grads, tag_grads), tag_values = jt.value_and_grad(loss, with_values=True)(params, x, xs)
        stats = jt.stats.summarize(tag_grads, loop_axes={"state": 1}, stats=("norm", "max_abs"))
        new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        return new, value, tag_grads, tag_values, stats

    def put(array, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    params = {"w1": put(w1, P(None, "model")), "wr": put(wr, P())}
    gx, gxs = put(x, P("data")), put(xs, P(None, "data"))
    new, value, tag_grads, tag_values, stats = jax.jit(train_step)(params, gx, gxs)

    me = jax.process_index()
    print(f"process {me} of {jax.process_count()}: {jax.local_device_count()} local devices of {jax.device_count()}")
    print(f"  loss {float(value):.6f}; statistics (replicated): state norm per step "
          f"{np.round(np.asarray(stats['state']['norm']), 5).tolist()}")
    for name in ("hidden", "state"):
        g = tag_grads[name]
        print(f"  tag_grads[{name!r}]: global {g.shape}, sharding {g.sharding.spec}, "
              f"{len(g.addressable_shards)} shards here, e.g. {g.addressable_shards[0].index}")

    if check:
        cpu0 = jax.local_devices()[0]
        ref = jax.jit(train_step)(
            jax.device_put({"w1": w1, "wr": wr}, cpu0), jax.device_put(x, cpu0), jax.device_put(xs, cpu0)
        )
        checked = 0
        sharded = jax.tree_util.tree_leaves((value, tag_grads, tag_values, stats))
        for got, want in zip(sharded, jax.tree_util.tree_leaves(ref[1:])):
            for shard in got.addressable_shards:
                np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=1e-12, atol=1e-14)
                checked += 1
        for got, want in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(ref[0])):
            for shard in got.addressable_shards:
                np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=1e-12, atol=1e-14)
                checked += 1
        print(f"  CHECK OK: {checked} addressable shards match the single-process reference")

    poisoned = xs.copy()
    poisoned[3, 5, 2] = np.nan  # the scan's input at step 3, example 5
    report = jax.jit(jt.find_nonfinite(loss))(params, gx, put(poisoned, P(None, "data")))
    print(f"  REPORT: {report}")
    if check:
        one = jax.jit(jt.find_nonfinite(loss))(*jax.device_put(({"w1": w1, "wr": wr}, x, poisoned), cpu0))
        for side in ("first_value", "first_gradient"):
            got, want = getattr(report, side), getattr(one, side)
            fields = lambda at: (at.name, at.steps, at.examples, at.entry, at.kind)  # noqa: E731
            assert fields(got) == fields(want), f"{side}: {fields(got)}, one process: {fields(want)}"
            assert want.shard is None and got.shard["data"] == got.entry[0] // (B // mesh.shape["data"]), got
        print("  NONFINITE CHECK OK: the report's tags, steps and entries are the single-process report's")
    jax.distributed.shutdown()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="check every shard against a one-process run")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before the workers are stopped")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry with the other examples")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        sys.exit(launch(args.processes, args.check, args.timeout))
    worker(args.worker, args.processes, args.port, args.check)


if __name__ == "__main__":
    main()
