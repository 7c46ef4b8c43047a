"""The examples run in --quick mode and write the pictures they promise (as .ci/run runs them)."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("optax")

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = {
    "train_step.py": ["grad_flow.png"],
    "gradcam.py": ["gradcam.png"],
    "rnn_vanishing.py": ["rnn_vanishing.png"],
    "attribution_patching.py": ["attribution_patching.png"],
    "loss_paths.py": ["loss_paths.png"],
    "guided_backprop.py": ["guided_backprop.png"],
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_quick(script, tmp_path):
    run_example(script, tmp_path)


def test_train_step_flax_quick(tmp_path):
    pytest.importorskip("flax")
    out = run_example("train_step.py", tmp_path, "--framework", "flax")
    assert "7 tagged layers (0 ... 12)" in out  # the nnx.Sequential's Linear layers, named as in torch


def run_example(script, tmp_path, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--quick", "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for name in EXAMPLES[script]:
        path = tmp_path / name
        assert path.is_file(), f"{script} did not write {name}:\n{out.stdout}"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000  # a real picture, not an empty canvas
        assert f"wrote {path}" in out.stdout  # and it says where
    return out.stdout
