"""Shared fixtures, and the ``--long`` option.

The default run (``python -m pytest -q -n auto tests``, the README's command) checks the contract in
about five minutes on two cores: the tests listed in ``heavy_tests.txt`` (each 2 s or more there) run
with ``--long`` or ``JAXTRACE_HEAVY=1``, as ``.ci/run`` does. ``--long`` (one cell of ``.ci/run`` passes it) adds what takes long: tests
marked ``long`` or ``slow`` (the examples, the two-process run), the eager variant of tests
marked ``long_eager`` (the heaviest models, whose jit variant always runs), and the property tests' long profile
(100 random programs instead of 15; ``JAXTRACE_HYPOTHESIS_PROFILE`` still picks one by name).
``--long-torch`` adds, of those long and heavy tests, only the ones that use torch (``needs_torch``):
``.ci/run`` runs ``--long`` where torch cannot be installed (Python 3.13, the newest JAX) and
``--long-torch`` beside it where it can (3.11), so that each long test runs once.
"""

import os
import types

import jax
import pytest

jax.config.update("jax_enable_x64", True)


def pytest_addoption(parser):
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the long tests: the examples, the multi-process run, 100 property programs",
    )
    parser.addoption(
        "--long-torch",
        action="store_true",
        help="also run the long and heavy tests that use torch (and no other): beside a --long run without torch",
    )


def pytest_configure(config):
    # Read by tests/test_properties.py at import, which comes after this.
    os.environ.setdefault("JAXTRACE_HYPOTHESIS_PROFILE", "ci" if config.getoption("--long") else "quick")


HEAVY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heavy_tests.txt")


def _heavy_ids() -> set:
    """The tests listed in ``heavy_tests.txt``: those the README's command leaves to ``--long`` for its
    time (``JAXTRACE_HEAVY=1`` runs them without the rest of ``--long``)."""
    with open(HEAVY) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="a long test: run with --long (.ci/run does)")
    heavy = set() if os.environ.get("JAXTRACE_HEAVY") == "1" else _heavy_ids()
    skip_heavy = pytest.mark.skip(reason="a heavy test (tests/heavy_tests.txt): run with --long or JAXTRACE_HEAVY=1")
    long_torch = config.getoption("--long-torch")
    for item in items:
        if long_torch and uses_torch(item):
            continue
        if "long" in item.keywords or "slow" in item.keywords or ("long_eager" in item.keywords and _is_eager(item)):
            item.add_marker(skip)
        elif item.nodeid in heavy:
            item.add_marker(skip_heavy)


def uses_torch(item) -> bool:
    """Whether a test uses torch (or a peer built on it): marked ``needs_torch``, naming torch in its id,
    its module importing it, or its code importing it (``import torch``, ``importorskip("torch")``)."""
    if item.get_closest_marker("needs_torch") or "torch" in item.nodeid.lower():
        return True
    if "torch" in vars(getattr(item, "module", None) or object):
        return True
    code = getattr(getattr(item, "function", None), "__code__", None)
    return code is not None and _names_torch(code)


def _names_torch(code) -> bool:
    return "torch" in code.co_names or "torch" in code.co_consts or any(
        _names_torch(c) for c in code.co_consts if isinstance(c, types.CodeType)
    )


def _is_eager(item) -> bool:
    """The variant of a test that runs without ``jax.jit``: ``maybe_jit="eager"`` or ``jit=False``."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("maybe_jit") == "eager" or params.get("jit") is False


@pytest.fixture(params=["eager", "jit"])
def maybe_jit(request):
    """Run a test's transformed function as is and under jax.jit."""
    return (lambda f: f) if request.param == "eager" else jax.jit

