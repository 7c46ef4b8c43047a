"""Without torch (or Flax), importing jaxtrace.torch (jaxtrace.flax) says how to install it, and the core still imports."""

import importlib
import subprocess
import sys

import pytest


def test_import_without_torch_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail, as if not installed
    monkeypatch.delitem(sys.modules, "jaxtrace.torch", raising=False)
    with pytest.raises(ImportError, match=r"pip install torch --index-url https://download.pytorch.org/whl/cpu.*pip install -e \".\[torch\]\"` keeps"):
        importlib.import_module("jaxtrace.torch")


def test_core_does_not_import_torch():
    code = "import sys, jaxtrace; jaxtrace.compare({}, {}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_without_flax_says_how_to_install_from_the_checkout(monkeypatch):
    """Issue 50.8: the message named `pip install "jaxtrace[flax]"`, which the package index does not have."""
    for name in ("flax", "flax.linen", "flax.nnx"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import flax.linen` fail, as if not installed
    monkeypatch.delitem(sys.modules, "jaxtrace.flax", raising=False)
    with pytest.raises(ImportError, match=r"`pip install flax`, or with `pip install -e \"\.\[flax\]\"` run in the root of your jaxtrace checkout") as caught:
        importlib.import_module("jaxtrace.flax")
    assert '"jaxtrace[flax]"`' not in str(caught.value)
