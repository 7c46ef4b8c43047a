import jax
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)


@pytest.fixture(params=["eager", "jit"])
def maybe_jit(request):
    """Run a test's transformed function as is and under jax.jit."""
    return (lambda f: f) if request.param == "eager" else jax.jit


def assert_trees_close(actual, expected, rtol=1e-12, atol=1e-12):
    actual_leaves, actual_tree = jax.tree_util.tree_flatten(actual)
    expected_leaves, expected_tree = jax.tree_util.tree_flatten(expected)
    assert actual_tree == expected_tree, (actual_tree, expected_tree)
    for a, e in zip(actual_leaves, expected_leaves):
        assert np.shape(a) == np.shape(e), (np.shape(a), np.shape(e))
        assert np.asarray(a).dtype == np.asarray(e).dtype, (np.asarray(a).dtype, np.asarray(e).dtype)
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)
