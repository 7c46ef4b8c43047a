"""The error catalogue: one test per bad input or unsupported construct.

Each error must name the tag (and where it is) and say what to do instead.
Where no error is the right answer (integer tags, a tag under
``stop_gradient``), the test checks the documented result.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxtrace as jt

jax.config.update("jax_enable_x64", True)

HERE = os.path.basename(__file__)
X = jnp.array([0.5, -1.0, 2.0])
WRAPS = {"eager": lambda f: f, "jit": jax.jit}


@pytest.fixture(params=list(WRAPS))
def wrap(request):
    return WRAPS[request.param]


def raises(exc, fn, *fragments):
    """Call ``fn``, expect ``exc``, and check that its message contains every fragment."""
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the message:\n{message}"
    return message


# --- bad inputs to jt.tag -------------------------------------------------------------


def test_name_not_a_string():
    def f(x):
        return jt.tag(x, 3).sum()

    raises(TypeError, lambda: jt.grad(f)(X), "needs a string name", "got 3 of type int", HERE, 'jt.tag(x, "hidden")')


def test_leaf_not_an_array():
    def f(x):
        return jt.tag({"a": x, "b": "relu"}, "act")["a"].sum()

    raises(TypeError, lambda: jt.grad(f)(X), "'act'", HERE, "leaf of type str", "not an array", "Tag only arrays")


@pytest.mark.parametrize("number", [3, True])
def test_python_int_or_bool_is_an_error_that_says_what_to_tag(wrap, number):
    """A Python int under jt.grad gave a float0 placeholder with no word; now it says what to tag."""

    def f(x):
        return jnp.sum(x * jt.tag(number, "n"))

    raises(TypeError, lambda: wrap(jt.grad(f))(X), "'n'", HERE, f"Python {type(number).__name__}", "float0",
           f"jt.tag(x * {number!r}, 'n')", "jnp.asarray(")
    raises(TypeError, lambda: jt.tag({"a": X, "steps": 3}, "pair"), "'pair'", "Python int 3")
    # A Python float is a scalar array: its gradient is the derivative with respect to that constant.
    _, tag_grads = wrap(jt.grad(lambda x: jnp.sum(x * jt.tag(3.0, "c"))))(X)
    np.testing.assert_allclose(tag_grads["c"], jnp.sum(X), rtol=1e-12)
    # An integer array marked on purpose keeps the documented float0 zeros.
    _, tag_grads = wrap(jt.grad(lambda x: jnp.sum(x * jt.tag(jnp.asarray(3), "n"))))(X)
    assert tag_grads["n"].dtype == jax.dtypes.float0


def test_value_without_arrays():
    def f(x):
        jt.tag((), "empty")
        return x.sum()

    raises(ValueError, lambda: jt.grad(f)(X), "'empty'", HERE, "no arrays", "Tag an array")


# --- names ------------------------------------------------------------------------------


def test_duplicate_name(wrap):
    def f(x):
        h = jt.tag(x * 2.0, "h")
        return jt.tag(jnp.sin(h), "h").sum()

    message = raises(jt.TagError, lambda: wrap(jt.grad(f))(X), "'h'", "2 sites", "own name", "repeated=True")
    assert message.count(HERE) == 2, message  # both sites, by line


def test_duplicate_name_not_requested_is_not_an_error():
    def f(x):
        h = jt.tag(jt.tag(x, "x") * 2.0, "h")
        return jt.tag(jnp.sin(h), "h").sum()

    _, tag_grads = jt.grad(f, tags="x")(X)
    np.testing.assert_allclose(tag_grads["x"], 2 * np.cos(2 * X), rtol=1e-12)


def test_repeated_with_different_shapes():
    def f(x):
        return jt.tag(x, "r", repeated=True).sum() + jt.tag(x[:2], "r", repeated=True).sum()

    raises(jt.TagError, lambda: jt.grad(f)(X), "'r'", "float64[3]", "float64[2]", "different name for each shape")


def test_cond_branches_with_different_shapes():
    def f(x):
        return lax.cond(x[0] > 0, lambda x: jt.tag(x, "c").sum(), lambda x: jt.tag(x[:2], "c").sum(), x)

    raises(jt.TagError, lambda: jt.grad(f)(X), "'c'", "branches of the cond", HERE, "one name per shape")


@pytest.mark.parametrize("tags", ["hh", ["h", "hh"]])
def test_unknown_requested_name(wrap, tags):
    def f(x):
        return jt.tag(x, "h").sum()

    raises(jt.TagError, lambda: wrap(jt.grad(f, tags=tags))(X), "No tag named 'hh'", "Tags found: 'h'", "Check the name")


def test_unknown_name_without_any_tags():
    raises(jt.TagError, lambda: jt.grad(jnp.sum, tags="h")(X), "No tag named 'h'", "Tags found: none")


def test_tags_selection_of_the_wrong_type():
    raises(TypeError, lambda: jt.grad(lambda x: jt.tag(x, "h").sum(), tags=[1])(X), "tags=", "got 1 of type int")


# --- constructs without a gradient at the tag -------------------------------------------


def test_while_loop(wrap):
    def f(x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jt.tag(c[1] * 2, "w")), (0, x))[1].sum()

    raises(jt.TagError, lambda: wrap(jt.grad(f))(X), "'w'", HERE, "`while`", "reverse mode", "Use lax.scan")


def test_fori_loop_with_traced_bounds():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, c: jt.tag(c * 2, "f"), x).sum()

    raises(jt.TagError, lambda: jax.jit(jt.grad(f))(X, 3), "'f'", HERE, "`while`", "Python-int bounds")
    _, tag_grads = jt.grad(f)(X, 3)  # Python-int bounds: a scan, one entry per iteration
    assert tag_grads["f"].shape == (3, 3)


def test_while_loop_tag_not_requested_is_not_an_error():
    def f(x):
        y0 = lax.stop_gradient(x)  # JAX cannot differentiate through the loop itself
        y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jt.tag(c[1] * 2, "w")), (0, y0))[1]
        return (y * jt.tag(x, "x")).sum()

    _, tag_grads = jt.grad(f, tags="x")(X)
    np.testing.assert_allclose(tag_grads["x"], 8 * X, rtol=1e-12)


def test_custom_jvp(wrap):
    @jax.custom_jvp
    def g(x):
        return jt.tag(jnp.sin(x), "inside")

    g.defjvp(lambda p, t: (g(p[0]), jnp.cos(p[0]) * t[0]))
    raises(
        jt.TagError, lambda: wrap(jt.grad(lambda x: g(x).sum()))(X), "'inside'", HERE, "custom_jvp", "Move the tag outside"
    )


def test_custom_vjp(wrap):
    @jax.custom_vjp
    def g(x):
        return jt.tag(jnp.sin(x), "inside")

    g.defvjp(lambda x: (g(x), x), lambda x, ct: (jnp.cos(x) * ct,))
    raises(
        jt.TagError, lambda: wrap(jt.grad(lambda x: g(x).sum()))(X), "'inside'", HERE, "custom_vjp", "Move the tag outside"
    )


def test_primitive_without_a_rule():
    def f(x):
        a = jnp.diag(jnp.array([2.0, 4.0, 8.0]))
        return lax.custom_linear_solve(lambda v: jt.tag(a @ v, "mv"), x, lambda mv, b: b / jnp.diag(a)).sum()

    raises(jt.TagError, lambda: jt.grad(f)(X), "'mv'", HERE, "`custom_linear_solve`", "Move the tag outside it")


# --- no error: documented results ---------------------------------------------------------


def test_integer_and_boolean_tags_get_float0_zeros(wrap):
    """Like ``jax.grad(allow_int=True)``: integer and boolean tags get float0 zeros, of their shape."""

    def f(x):
        i = jt.tag(jnp.arange(3), "int")
        b = jt.tag(x > 0, "bool")
        mixed = jt.tag({"f": x, "i": jnp.arange(3)}, "mixed")
        return jnp.sum(jnp.where(b, x * i, 0.0) + mixed["f"] ** 2)

    grads, tag_grads = wrap(jt.grad(f))(X)
    for got in (tag_grads["int"], tag_grads["bool"], tag_grads["mixed"]["i"]):
        assert got.dtype == jax.dtypes.float0 and got.shape == (3,)
    np.testing.assert_allclose(tag_grads["mixed"]["f"], 2 * X, rtol=1e-12)
    np.testing.assert_allclose(grads, jax.grad(f)(X), rtol=1e-12)


def test_integer_tag_in_a_loop_gets_float0_zeros_per_iteration():
    def f(x):
        return lax.scan(lambda c, t: (c + x * jt.tag(t, "t"), None), jnp.zeros(3), jnp.arange(4))[0].sum()

    _, tag_grads = jt.grad(f)(X)
    assert tag_grads["t"].dtype == jax.dtypes.float0 and tag_grads["t"].shape == (4,)


def test_tag_under_stop_gradient_gets_zeros(wrap):
    def f(x):
        return jnp.sum(lax.stop_gradient(jt.tag(x * 2.0, "s")) * x)

    grads, tag_grads = wrap(jt.grad(f))(X)
    np.testing.assert_array_equal(tag_grads["s"], np.zeros(3))
    np.testing.assert_allclose(grads, 2 * X, rtol=1e-12)


def test_non_scalar_output_is_an_error_as_in_jax_grad(wrap):
    def f(x):
        return jt.tag(x * 2.0, "s")

    with pytest.raises(TypeError) as theirs:
        jax.grad(f)(X)
    message = raises(TypeError, lambda: wrap(jt.grad(f))(X), "scalar-output", "(3,)")
    assert re.sub(r"\s+", " ", message) == re.sub(r"\s+", " ", str(theirs.value))
    _, vjp_fn = jt.vjp(f, X)  # jt.vjp takes any output
    assert vjp_fn(jnp.ones(3))[1]["s"].shape == (3,)


# --- misuse of the API: wrong argument types ------------------------------------------------


def _tagged(x):
    return jt.tag(x * 2.0, "h").sum()


TAGS_CALLS = {
    "grad": lambda tags: jt.grad(_tagged, tags=tags)(X),
    "value_and_grad": lambda tags: jt.value_and_grad(_tagged, tags=tags)(X),
    "vjp": lambda tags: jt.vjp(_tagged, X, tags=tags),
    "capture": lambda tags: jt.capture(_tagged, tags=tags)(X),
    "jvp": lambda tags: jt.jvp(_tagged, (X,), (X,), tags=tags),
    "stats.value_and_grad": lambda tags: jt.stats.value_and_grad(_tagged, tags=tags)(X),
}


@pytest.mark.parametrize("call", list(TAGS_CALLS))
@pytest.mark.parametrize("tags", [1, True, b"h"], ids=["int", "bool", "bytes"])
def test_tags_of_the_wrong_type(call, tags):
    raises(
        TypeError,
        lambda: TAGS_CALLS[call](tags),
        "tags= must be None (every tag), a tag name, a sequence of names or a predicate on names",
        f"got {tags!r} of type {type(tags).__name__}",
    )


def test_tags_as_bytes_suggests_decoding():
    raises(TypeError, lambda: jt.grad(_tagged, tags=b"h"), "Decode it to a str first: tags='h'")


def test_tags_of_the_wrong_type_fails_when_wrapping():
    for wrapper in (jt.grad, jt.value_and_grad, jt.capture, jt.stats.value_and_grad):
        raises(TypeError, lambda: wrapper(_tagged, tags=1), "tags=", "got 1 of type int")


@pytest.mark.parametrize("result", [lambda y: y, lambda y: (y, 1.0, 2.0)], ids=["scalar", "three"])
def test_has_aux_without_a_pair_is_an_error_as_in_jax_grad(wrap, result):
    def f(x):
        return result(_tagged(x))

    with pytest.raises(TypeError) as theirs:
        jax.grad(f, has_aux=True)(X)
    jax_sentence = str(theirs.value).split(", but got")[0]  # the rest names a tracer
    calls = [
        lambda: wrap(jt.grad(f, has_aux=True))(X),
        lambda: wrap(jt.value_and_grad(f, has_aux=True))(X),
        lambda: jt.vjp(f, X, has_aux=True),
    ]
    for call in calls:
        raises(TypeError, call, jax_sentence, "jaxtrace.grad, value_and_grad or vjp", "drop has_aux=True")


def test_has_aux_accepts_a_list_as_jax_grad_does():
    (grads, tag_grads), aux = jt.grad(lambda x: [_tagged(x), x[0]], has_aux=True)(X)
    assert float(aux) == 0.5
    np.testing.assert_allclose(tag_grads["h"], np.ones(3))


def test_stats_accepts_one_name():
    values = {"h": jnp.array([[3.0, -4.0], [0.0, 1.0]])}
    one = jt.stats.summarize(values, stats="norm", loop_axes=1)
    assert list(one["h"]) == ["norm"]
    np.testing.assert_array_equal(one["h"]["norm"], jt.stats.summarize(values, stats=("norm",), loop_axes=1)["h"]["norm"])
    _, (_, tag_stats) = jt.stats.value_and_grad(_tagged, stats="max_abs")(X)
    assert list(tag_stats["h"]) == ["max_abs"]


def test_stats_of_the_wrong_type():
    raises(TypeError, lambda: jt.stats.summarize({"h": X}, stats=3), "stats=", "got 3 of type int", 'stats="norm"')
    raises(ValueError, lambda: jt.stats.summarize({"h": X}, stats="nrom"), "unknown statistic(s) 'nrom'", "Choose from")


NOT_CALLABLE = {
    "grad": lambda: jt.grad(3.0),
    "value_and_grad": lambda: jt.value_and_grad(3.0),
    "capture": lambda: jt.capture(3.0),
    "patch": lambda: jt.patch(3.0, {"h": 0.0}),
    "vjp": lambda: jt.vjp(3.0, X),
    "jvp": lambda: jt.jvp(3.0, (X,), (X,)),
    "stats.value_and_grad": lambda: jt.stats.value_and_grad(3.0),
    "filter_grad": lambda: jt.filter_grad(3.0),
    "filter_value_and_grad": lambda: jt.filter_value_and_grad(3.0),
}


@pytest.mark.parametrize("name", list(NOT_CALLABLE))
def test_not_a_function_is_an_error_as_in_jax_grad(name):
    """At wrap time, as ``jax.grad(3.0)``; ``vjp`` and ``jvp`` take the primals in the same call."""
    if name.startswith("filter_"):
        pytest.importorskip("equinox")
    with pytest.raises(TypeError) as theirs:
        jax.grad(3.0)
    raises(TypeError, NOT_CALLABLE[name], str(theirs.value), f"jaxtrace.{name} takes the function itself")
