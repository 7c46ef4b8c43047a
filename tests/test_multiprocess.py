"""Two JAX processes (jax.distributed on loopback, gloo CPU collectives, 4 devices each): a
data- and model-parallel jitted step with jt.value_and_grad and jt.stats on a global 8-device
mesh, every process's shards checked against a single-process reference (examples/multihost.py)."""

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
    assert out.stdout.count("CHECK OK") == 2, out.stdout
    assert "process 1 of 2: 4 local devices of 8" in out.stdout
