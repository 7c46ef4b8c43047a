"""What ``import jaxtrace`` imports: equinox only once an equinox helper is used.

Each check runs in a fresh interpreter, since this test session has long
imported equinox (other test files use it).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def run_python(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_equinox_is_imported_only_when_an_equinox_helper_is_used():
    pytest.importorskip("equinox")
    run_python(
        """
        import sys

        import jax.numpy as jnp
        import jaxtrace as jt

        assert "equinox" not in sys.modules, "import jaxtrace imported equinox"
        import jaxtrace.stats
        assert "equinox" not in sys.modules, "import jaxtrace.stats imported equinox"

        grads, tag_grads = jt.grad(lambda x: jnp.sum(jt.tag(2.0 * x, "h") ** 2))(jnp.ones(3))
        assert tag_grads["h"].tolist() == [4.0, 4.0, 4.0]
        _, (_, tag_stats) = jt.stats.value_and_grad(lambda x: jnp.sum(jt.tag(x, "h")))(jnp.ones(3))
        assert "equinox" not in sys.modules, "jt.grad or jt.stats imported equinox"

        names = dir(jt)
        for name in ("filter_grad", "filter_value_and_grad", "tag_modules", "HookPoint"):
            assert name in names, name
        assert "equinox" not in sys.modules, "dir(jaxtrace) imported equinox"

        tag_modules = jt.tag_modules
        assert "equinox" in sys.modules
        """
    )


def test_lazy_names_are_the_equinox_helpers():
    pytest.importorskip("equinox")
    run_python(
        """
        from jaxtrace import filter_value_and_grad, tag_modules
        import jaxtrace as jt
        import jaxtrace._equinox as impl

        assert tag_modules is impl.tag_modules and filter_value_and_grad is impl.filter_value_and_grad
        assert jt.filter_grad is impl.filter_grad
        from jaxtrace import HookPoint
        assert HookPoint is impl.HookPoint and ">>>" in HookPoint.__doc__
        assert jt.tag_modules.__doc__ == impl.tag_modules.__doc__ and ">>>" in jt.tag_modules.__doc__
        assert "tag_modules" in vars(jt)  # cached after the first access

        try:
            jt.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("jt.no_such_name did not raise AttributeError")
        """
    )
