"""The docstring examples and the README's first example run and say what they claim."""

import doctest
import importlib
import pathlib
import re

import pytest

import jaxtrace

# dir() and getattr, not vars(): the equinox helpers are loaded on first access.
PUBLIC = {name: getattr(jaxtrace, name) for name in dir(jaxtrace)}
MODULES = sorted({obj.__module__ for obj in PUBLIC.values() if getattr(obj, "__module__", "").startswith("jaxtrace")})


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_every_public_function_has_an_example():
    for name, obj in PUBLIC.items():
        if callable(obj) and not name.startswith("_") and not isinstance(obj, type):
            assert ">>>" in (obj.__doc__ or ""), f"jaxtrace.{name} has no example in its docstring"


def test_readme_first_example_runs():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


@pytest.mark.parametrize("section", ["## Changing gradients", "## Gradient statistics"])
def test_readme_section_examples_run(section):
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme[readme.index(section) :], re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_torch_module_docstring_examples():
    pytest.importorskip("torch")
    import jaxtrace.torch

    assert doctest.testmod(jaxtrace.torch, optionflags=doctest.ELLIPSIS).failed == 0
