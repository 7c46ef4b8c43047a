"""Two JAX processes (jax.distributed on loopback, gloo CPU collectives, 4 devices each): a
data- and model-parallel jitted step with jt.value_and_grad and jt.stats on a global 8-device
mesh, every process's shards checked against a single-process reference; and jt.find_nonfinite
on that step with a NaN at scan step 3 of example 5, whose report every process prints the same,
naming the step, the entry and the shard (examples/multihost.py)."""

import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.long  # two JAX processes for a minute or more: run with --long (.ci/run does)


@pytest.mark.skipif(
    "jax_cpu_collectives_implementation" not in jax.config.values,
    reason=f"JAX {jax.__version__} has no CPU collectives for multi-process runs",
)
def test_two_processes_agree_with_one():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "multihost.py"), "--processes", "2", "--check", "--timeout", "240"],
        capture_output=True,
        text=True,
        timeout=300,  # the launcher stops its workers at 240 s; this never hangs CI
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("  CHECK OK") == 2, out.stdout
    assert "process 1 of 2: 4 local devices of 8" in out.stdout
    assert out.stdout.count("NONFINITE CHECK OK") == 2, out.stdout
    reports = [line for line in out.stdout.splitlines() if line.startswith("  REPORT: ")]
    assert len(reports) == 2 and reports[0] == reports[1], reports  # every process says the same
    # the scan's input at step 3, example 5 (a row of 'state'); 2 rows per 'data' shard
    assert "not at 'state' (multihost.py:" in reports[0] and "scan step 3, entry [5, 2] (on the shard data=2" in reports[0], reports[0]
