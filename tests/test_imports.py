"""What ``import jaxtrace`` imports: equinox (a dependency), never Flax, torch or matplotlib.

Each check runs in a fresh interpreter, since this test session has long
imported Flax and torch (other test files use them).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def run_python(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_import_jaxtrace_imports_no_optional_dependency():
    """equinox is a dependency, imported with jaxtrace; Flax, torch and matplotlib only by their modules."""
    run_python(
        """
        import sys

        import jax.numpy as jnp
        import jaxtrace as jt
        import jaxtrace.stats

        grads, tag_grads = jt.grad(lambda x: jnp.sum(jt.tag(2.0 * x, "h") ** 2))(jnp.ones(3))
        assert tag_grads["h"].tolist() == [4.0, 4.0, 4.0]
        for name in ("flax", "torch", "matplotlib"):
            assert name not in sys.modules, f"import jaxtrace imported {name}"
        for name in ("filter_grad", "filter_value_and_grad", "filter_jacrev", "tag_modules", "HookPoint"):
            assert name in vars(jt) and name in dir(jt), name
        """
    )


def test_equinox_helpers_are_their_implementations():
    run_python(
        """
        from jaxtrace import filter_value_and_grad, tag_modules
        import jaxtrace as jt
        import jaxtrace._equinox as impl
        import jaxtrace._equinox_grad as transforms
        import jaxtrace._tag_modules as module_tags

        assert tag_modules is module_tags.tag_modules and filter_value_and_grad is transforms.filter_value_and_grad
        assert jt.filter_grad is transforms.filter_grad and jt.filter_jacrev is transforms.filter_jacrev
        from jaxtrace import HookPoint
        assert HookPoint is impl.HookPoint and ">>>" in HookPoint.__doc__
        assert ">>>" in jt.tag_modules.__doc__

        try:
            jt.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("jt.no_such_name did not raise AttributeError")
        """
    )


# --- the core's import graph ------------------------------------------------------------------

# The core, lowest first: each module imports only modules before it in this list (the split's
# rules reach the program and the splitter through their arguments, never by import).
CORE = (
    "_arrays",
    "_frameworks",
    "_stateful",
    "_paths",
    "_errors",
    "_checks",
    "_version",
    "_compat",
    "_equation_params",
    "_higher_order",
    "_walker",
    "_leaves",
    "_sites",
    "_stacking",
    "_selection",
    "_fused_runs",
    "_tag",
    "_higher_order_rules",
    "_program",
    "_evaluator",
    "_split",
    "_vmap_cond",
)


def _jaxtrace_imports(module: str) -> set[str]:
    """The ``jaxtrace`` modules that ``jaxtrace/<module>.py`` imports, anywhere in the file."""
    import ast
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "jaxtrace" / f"{module}.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
    return found


@pytest.mark.parametrize("module", CORE)
def test_core_modules_import_only_modules_below_them(module):
    below = set(CORE[: CORE.index(module)])
    assert _jaxtrace_imports(module) <= below, f"jaxtrace.{module} imports {_jaxtrace_imports(module) - below}"


def test_public_namespaces_list_their_names():
    """``__all__`` is what each public namespace offers; helpers it imports are not in it."""
    import jaxtrace as jt

    assert set(jt.stats.__all__) == {"STATS", "History", "format_paths", "jacrev", "summarize", "term_name", "value_and_grad"}
    for name in ("cast", "check_callable", "check_tags"):
        assert not hasattr(jt.stats, name), name
    for name in jt.__all__:
        assert hasattr(jt, name), name
    assert jt.stats.History.__module__ == "jaxtrace.stats"


def test_tag_error_is_named_where_users_import_it():
    """``jaxtrace.TagError`` in tracebacks and reprs, and a pickle of one loads back as the same class."""
    import pickle
    import traceback

    import jax.numpy as jnp
    import jaxtrace as jt

    assert jt.TagError.__module__ == "jaxtrace" and repr(jt.TagError("x")) == "TagError('x')"
    with pytest.raises(jt.TagError) as caught:
        jt.grad(lambda x: jnp.sum(jt.tag(x, "h")), tags="nope")(jnp.ones(2))
    assert "jaxtrace.TagError: " in "".join(traceback.format_exception(caught.value))
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is jt.TagError and str(again) == str(caught.value)
