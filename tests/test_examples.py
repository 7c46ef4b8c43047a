"""The examples run in --quick mode and write the pictures they promise (as .ci/run runs them)."""

import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.long  # a minute or more each: run with --long (.ci/run does)

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
    "layer_flow.py": ["layer_flow.png"],
    "dp_sgd.py": [],  # prints the falling loss; asserts that it trains
}


TORCH_TWINS = {"guided_backprop.py", "loss_paths.py"}  # they also check a torch twin where torch is installed


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.needs_torch) if s in TORCH_TWINS else s for s in sorted(EXAMPLES)])
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


def test_transformerlens_port():
    """Needs transformer_lens 3.x (HookedTransformer, removed in 4.0); .ci/run installs it in no cell yet."""
    pytest.importorskip("torch")
    pytest.importorskip(
        "transformer_lens", reason='transformer_lens is not installed (pip install "transformer-lens>=3.9,<4")'
    )
    if int(importlib.metadata.version("transformer_lens").split(".")[0]) >= 4:
        pytest.skip('TransformerLens 4 removed HookedTransformer: pip install "transformer-lens>=3.9,<4"')
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", str(ROOT / "examples" / "transformerlens_port.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "OK: 40/40 names match jaxtrace vs TransformerLens" in out.stdout  # activations and gradients
    assert out.stdout.count(": OK (38 hook points)") == 2  # attribution patching, both ways
    assert "all agree to 1e-10" in out.stdout


def test_transformerlens_port_without_transformer_lens_says_how_to_install():
    # Runs the script with transformer_lens hidden from importlib.util.find_spec: it explains and exits 0.
    code = (
        "import importlib.util, sys; importlib.util.find_spec = (lambda f: lambda n, *a: None if n == "
        "'transformer_lens' else f(n, *a))(importlib.util.find_spec); sys.argv = ['x']; "
        f"exec(compile(open({str(ROOT / 'examples' / 'transformerlens_port.py')!r}).read(), 'port', 'exec'), "
        "{'__name__': '__main__'})"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pip install" in out.stdout and '"transformer-lens>=3.9,<4"' in out.stdout


def test_hf_gpt2_port():
    """examples/hf_gpt2_port.py: GPT-2 from a config, every block / attention / MLP output and parameter to 1e-10."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_gpt2_port.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("OK: 8/8 names match jax vs torch") == 2  # activations and their gradients
    assert "OK: 28/28 names match jax vs torch" in out.stdout  # every parameter
    assert "all agree to 1e-10" in out.stdout
