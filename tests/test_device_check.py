"""The accelerator check (``benchmarks/device_check.sh``) and the GPU timer of the peers benchmark.

The check must run on a machine that reaches no package index and has JAX, equinox and pytest
installed but not jaxtrace: it installs nothing and imports jaxtrace from the checkout it sits in.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import timers  # noqa: E402


def test_device_check_runs_offline_from_the_checkout(tmp_path):
    tree = tmp_path / "checkout"
    shutil.copytree(os.path.join(ROOT, "jaxtrace"), tree / "jaxtrace", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "benchmarks"), tree / "benchmarks", ignore=shutil.ignore_patterns("__pycache__", "results"))
    (tree / "tests").mkdir()
    (tree / "tests" / "test_one.py").write_text(
        "import jax.numpy as jnp, jaxtrace as jt\n\n"
        "def test_tag_gradient():\n"
        "    _, tag_grads = jt.grad(lambda x: jnp.sum(jt.tag(2.0 * x, 'h') ** 2))(jnp.ones(3))\n"
        "    assert tag_grads['h'].tolist() == [4.0, 4.0, 4.0]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PIP_"))}
    env.update(PIP_NO_INDEX="1", PYTHON=sys.executable, PARTS="versions tests", TESTS="tests/test_one.py",
               LOGS=str(tmp_path / "logs"), WORKERS="1")
    done = subprocess.run(["bash", str(tree / "benchmarks" / "device_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    versions = (tmp_path / "logs" / "versions.log").read_text()
    assert f"from {tree / 'jaxtrace'}" in versions, versions  # this checkout's jaxtrace, not an installed one
    assert "1 passed" in (tmp_path / "logs" / "tests.log").read_text()
    summary = (tmp_path / "logs" / "summary.txt").read_text()
    assert "versions" in summary and "tests" in summary and "FAILED" not in summary, summary


def test_device_check_refuses_an_unknown_part(tmp_path):
    env = {**os.environ, "PARTS": "versoins", "LOGS": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "device_check.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "there is no part 'versoins'" in done.stderr


def test_synchronized_timer_syncs_before_and_after_the_step():
    calls = []
    run = timers.synchronized(lambda: calls.append("step"), lambda: calls.append("sync"))
    sample = run()
    assert calls == ["sync", "step", "sync"] and sample["step"] >= 0


def test_synchronized_timer_waits_for_cuda_kernels():
    torch = pytest.importorskip("torch", reason="the CUDA timer needs torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device here: the synchronised timer's CUDA path runs on a GPU machine")
    a = torch.randn(4096, 4096, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def step():
        start.record()
        for _ in range(20):
            a @ a
        end.record()

    seconds = timers.synchronized(step, timers.torch_sync("cuda"))()["step"]
    kernels = start.elapsed_time(end) / 1e3  # what the GPU spent, by its own clock
    assert seconds >= 0.9 * kernels, (seconds, kernels)
    assert timers.cuda_peak_bytes(lambda: a @ a) >= a.numel() * 4  # the product's output, at least
