"""Which long tests ``--long-torch`` runs (``tests/conftest.py``). ``.ci/run`` runs ``--long`` only
where torch cannot be installed, so a long test that uses torch and is not found here runs nowhere."""

import pathlib
import types

import pytest
from conftest import uses_torch

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _item(function, nodeid="tests/test_x.py::test_f", module=None, marked=False):
    return types.SimpleNamespace(
        nodeid=nodeid,
        module=module or types.ModuleType("test_x"),
        function=function,
        get_closest_marker=lambda name: object() if marked and name == "needs_torch" else None,
    )


def test_uses_torch_finds_each_way_a_test_calls_for_torch():
    def imports():
        import torch  # noqa: F401

    def skips():
        pytest.importorskip("torch")

    def nested():
        def inner():
            pytest.importorskip("torch")

        return inner

    def plain():
        return "jax.numpy"

    with_torch = types.ModuleType("test_x")
    with_torch.torch = object()
    assert uses_torch(_item(imports)) and uses_torch(_item(skips)) and uses_torch(_item(nested))
    assert uses_torch(_item(plain, module=with_torch))
    assert uses_torch(_item(plain, nodeid="tests/test_docs.py::test_page[docs/guides/pytorch-weights.md]"))
    assert uses_torch(_item(plain, marked=True))
    assert not uses_torch(_item(plain))


def test_pages_that_require_torch_or_its_peers_are_marked():
    from test_docs import _page_marks

    def names(page):
        return {m.name for m in _page_marks(DOCS / "guides" / page)}

    assert "needs_torch" in names("pytorch-weights.md")
    assert "needs_torch" in names("coming-from-transformerlens.md")  # transformer_lens<4, torch
    assert "needs_torch" in names("coming-from-captum.md")
    assert "needs_torch" not in names("flax.md")  # requires flax: installed in every cell
    assert "needs_torch" not in names("training-statistics.md")  # equinox, optax, matplotlib
