"""Shared fixtures, and the ``--long`` option.

The default run (``python -m pytest -q -n auto tests``, the README's command) checks the contract in
about five minutes on two cores: the tests listed in ``heavy_tests.txt`` (each 2 s or more there) run
with ``--long`` or ``JAXTRACE_HEAVY=1``, as ``.ci/run`` does. ``--long`` (one cell of ``.ci/run`` passes it) adds what takes long: tests
marked ``long`` or ``slow`` (the examples, the two-process run), the eager variant of tests
marked ``long_eager`` (the heaviest models, whose jit variant always runs), and the property tests' long profile
(100 random programs instead of 15; ``JAXTRACE_HYPOTHESIS_PROFILE`` still picks one by name).
"""

import os

import jax
import pytest

jax.config.update("jax_enable_x64", True)


def pytest_addoption(parser):
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the long tests: the examples, the multi-process run, 100 property programs",
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
    for item in items:
        if "long" in item.keywords or "slow" in item.keywords or ("long_eager" in item.keywords and _is_eager(item)):
            item.add_marker(skip)
        elif item.nodeid in heavy:
            item.add_marker(skip_heavy)


def _is_eager(item) -> bool:
    """The variant of a test that runs without ``jax.jit``: ``maybe_jit="eager"`` or ``jit=False``."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("maybe_jit") == "eager" or params.get("jit") is False


@pytest.fixture(params=["eager", "jit"])
def maybe_jit(request):
    """Run a test's transformed function as is and under jax.jit."""
    return (lambda f: f) if request.param == "eager" else jax.jit

