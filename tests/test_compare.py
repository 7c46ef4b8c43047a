"""jaxtrace.compare: matching, mismatch detection, one-sided names, layouts. Needs no torch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrace as jt
from jaxtrace._compare import named_leaves


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_equal_dicts_pass_and_print_a_table():
    a = {"layers.0": _rng().normal(size=(2, 3)), "layers.1": _rng(1).normal(size=(4,))}
    b = {k: v.copy() for k, v in a.items()}
    result = jt.compare(a, b, labels=("jax", "torch"))
    assert result.ok and bool(result)
    result.assert_ok()
    text = str(result)
    assert "layers.0" in text and "layers.1" in text and "(2, 3)" in text
    assert "OK: 2/2" in text


def test_mismatch_is_detected_with_its_errors():
    x = _rng().normal(size=(3, 4))
    y = x.copy()
    y[1, 2] += 1e-3
    result = jt.compare({"h": x}, {"h": y}, rtol=1e-6, atol=0.0)
    assert not result.ok
    assert result.failed == ["h"]
    (row,) = result.rows
    assert row.max_abs == pytest.approx(1e-3, rel=1e-6)
    assert row.max_rel == pytest.approx(1e-3 / np.max(np.abs(y)), rel=1e-6)
    with pytest.raises(AssertionError, match="FAIL"):
        result.assert_ok("layer check")
    # The same error passes under a looser tolerance.
    assert jt.compare({"h": x}, {"h": y}, rtol=1e-2).ok


def test_tolerance_is_relative_to_the_scale_of_b():
    y = np.array([1000.0, 1e-9])
    x = y + np.array([1e-3, 1e-9])  # 1e-6 relative to max |y|, huge elementwise at the second entry
    assert jt.compare({"g": x}, {"g": y}, rtol=1e-5, atol=0.0).ok
    assert not jt.compare({"g": x}, {"g": y}, rtol=1e-7, atol=0.0).ok


def test_zeros_and_nan():
    assert jt.compare({"z": np.zeros(3)}, {"z": np.zeros(3)}, rtol=0.0, atol=0.0).ok
    assert not jt.compare({"z": np.array([0.0, 1e-3])}, {"z": np.zeros(2)}, atol=1e-6).ok
    result = jt.compare({"n": np.array([np.nan, 1.0])}, {"n": np.array([np.nan, 1.0])})
    assert not result.ok and "nan" in str(result)


def test_shape_mismatch_is_reported_not_raised():
    result = jt.compare({"h": np.ones((2, 3))}, {"h": np.ones((3, 2))})
    assert not result.ok and result.failed == ["h"]
    assert "(2, 3) vs (3, 2)" in str(result) and "shape" in str(result)


def test_one_sided_names_are_listed():
    a = {"both": np.ones(2), "mine": np.ones(1)}
    b = {"both": np.ones(2), "theirs": np.ones(1), "also": np.ones(1)}
    result = jt.compare(a, b, labels=("jax", "torch"))
    assert result.only_a == ("mine",) and result.only_b == ("theirs", "also")
    assert result.failed == [] and not result.ok
    text = str(result)
    assert "only in jax: mine" in text and "only in torch: theirs, also" in text
    assert jt.compare(a, b, strict=False).ok


def test_layout_named_transforms():
    x = _rng().normal(size=(2, 3, 4, 5))  # NCHW
    nhwc = np.transpose(x, (0, 2, 3, 1))
    assert jt.compare({"c": nhwc}, {"c": x}, layout={"c": "NCHW->NHWC"}).ok
    assert jt.compare({"c": x}, {"c": nhwc}, layout={"c": "NHWC->NCHW"}).ok
    assert not jt.compare({"c": nhwc}, {"c": x}).ok  # shapes differ without the layout
    # Leading axes (repeated calls, loop steps) pass through.
    stacked = np.stack([x, 2 * x])
    assert jt.compare({"c": np.transpose(stacked, (0, 1, 3, 4, 2))}, {"c": stacked}, layout={"c": "NCHW->NHWC"}).ok
    w = _rng(1).normal(size=(4, 3))  # torch Linear (out, in)
    assert jt.compare({"fc.weight": w.T}, {"fc.weight": w}, layout={"fc.weight": "transpose"}).ok
    bias = _rng(2).normal(size=(4,))
    assert jt.compare({"conv.bias": bias[:, None, None]}, {"conv.bias": bias}, layout={"conv.bias": "reshape"}).ok


def test_layout_patterns_and_callables():
    w1, w2 = _rng(1).normal(size=(4, 3)), _rng(2).normal(size=(2, 4))
    a = {"l1.weight": w1.T, "l2.weight": w2.T, "l1.bias": np.ones(4)}
    b = {"l1.weight": w1, "l2.weight": w2, "l1.bias": np.ones(4)}
    assert jt.compare(a, b, layout={"*.weight": "transpose"}).ok
    assert jt.compare(a, b, layout={"*.weight": lambda v: v.T}).ok
    assert jt.compare(a, b, layout=lambda name, v: v.T if name.endswith("weight") else v).ok
    result = jt.compare(a, b, layout={"l1.*": "transpose"})  # l2 is left as is; a 1-d bias cannot be transposed
    assert result.failed == ["l2.weight", "l1.bias"]
    assert "FAIL (layout: " in str(result)
    with pytest.raises(ValueError, match="unknown layout 'NCWH'"):
        jt.compare(a, b, layout={"l1.weight": "NCWH"})


def test_pytree_values_and_pytrees_of_params():
    a = {"attn": (jnp.ones((2, 3)), jnp.zeros(4)), "d": {"k": jnp.ones(1)}, "skip": None}
    flat = named_leaves(a)
    assert list(flat) == ["attn[0]", "attn[1]", "d['k']"]

    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.Sequential([eqx.nn.Linear(2, 3, key=jax.random.key(0)), eqx.nn.Lambda(jnp.tanh)])
    params = eqx.filter(mlp, eqx.is_inexact_array)
    assert list(named_leaves(params)) == ["layers.0.weight", "layers.0.bias"]
    b = {"layers.0.weight": np.asarray(params.layers[0].weight), "layers.0.bias": np.asarray(params.layers[0].bias)}
    jt.compare(params, b).assert_ok()


def test_float0_leaves_count_as_no_gradient():
    zero = np.zeros((2,), dtype=jax.dtypes.float0)
    result = jt.compare({"i": zero, "g": np.ones(2)}, {"g": np.ones(2)})
    assert result.ok and result.only_a == ()


def test_jax_arrays_of_different_dtypes():
    x = jnp.linspace(0.0, 1.0, 5, dtype=jnp.float32)
    assert jt.compare({"x": x}, {"x": np.asarray(x, np.float64)}, rtol=1e-7).ok


def test_infinities_match_in_position_and_sign_and_nan_only_if_asked():
    scores = np.array([[0.3, -np.inf], [1.2, 0.7]])  # attention scores with a masked position
    assert jt.compare({"s": scores}, {"s": scores.copy()}).ok
    assert not jt.compare({"s": np.array([5.0, 0.0])}, {"s": np.array([1.0, np.inf])}).ok  # an inf elsewhere
    assert not jt.compare({"s": np.array([1.0, np.inf])}, {"s": np.array([1.0, -np.inf])}).ok  # the sign
    result = jt.compare({"s": np.array([1.5, -np.inf])}, {"s": np.array([1.0, -np.inf])}, rtol=0.1)
    assert not result.ok and result.rows[0].max_abs == 0.5  # the error and scale are over finite entries
    with_nan = {"s": np.array([1.0, np.nan])}
    assert not jt.compare(with_nan, {"s": np.array([1.0, np.nan])}).ok
    assert jt.compare(with_nan, {"s": np.array([1.0, np.nan])}, equal_nan=True).ok
    assert not jt.compare(with_nan, {"s": np.array([np.nan, 1.0])}, equal_nan=True).ok


def test_per_name_tolerances():
    x = {"blocks.0.attn.hook_pattern": np.ones(3), "blocks.1.attn.hook_pattern": np.ones(3), "embed": np.ones(2)}
    y = {k: v + 1e-6 for k, v in x.items()}
    assert jt.compare(x, y).ok  # 1e-6 <= 1e-8 + 1e-5 * 1
    tight = jt.compare(x, y, rtol={"blocks.0.attn.hook_pattern": 1e-8})
    assert tight.failed == ["blocks.0.attn.hook_pattern"]
    row = tight.rows[0]
    assert (row.rtol, row.atol) == (1e-8, 1e-8) and tight.rows[2].rtol == 1e-5
    assert "held to their own tolerances: blocks.0.attn.hook_pattern (rtol=1e-08" in str(tight)
    # Patterns, an exact name winning over a pattern, "*" as the default, atol as a mapping.
    both = jt.compare(x, y, rtol={"blocks.*": 1e-8, "blocks.1.attn.hook_pattern": 1e-3})
    assert both.failed == ["blocks.0.attn.hook_pattern"]
    default = jt.compare(x, y, rtol={"*": 0.0, "embed": 1e-3}, atol=0.0)
    assert default.failed == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"] and default.rtol == 0.0
    assert jt.compare(x, y, rtol=0.0, atol={"*": 2e-6}).ok
    assert not jt.compare(x, y, rtol=0.0, atol={"embed": 2e-6}).ok


def test_per_name_tolerance_with_an_unknown_name_lists_the_names():
    x = {"blocks.0.attn.hook_z": np.ones(2), "tuple": (np.ones(1), np.ones(1))}
    with pytest.raises(
        ValueError, match=r"rtol= names 'blocks\.0\.attn\.hook_q'.*'blocks\.0\.attn\.hook_z', 'tuple\[0\]'"
    ):
        jt.compare(x, x, rtol={"blocks.0.attn.hook_q": 1e-8})
    with pytest.raises(ValueError, match=r"atol= names 'nothing\*'"):
        jt.compare(x, x, atol={"nothing*": 1e-8})
    assert jt.compare(x, x, rtol={"tuple[[]0]": 0.0}).ok  # fnmatch's escape for "["


def test_summary_says_what_failed():
    """The verdict names the failures: numbers over the tolerance, shapes, nan, and one-sided names."""
    a = {"x": np.ones(3), "y": np.ones((2, 3)), "n": np.array([np.nan]), "same": np.zeros(2)}
    b = {"x": 1.1 * np.ones(3), "y": np.ones((3, 2)), "n": np.array([np.nan]), "same": np.zeros(2), "w": np.ones(1)}
    text = str(jt.compare(a, b, rtol=1e-10, atol=0, labels=("jax", "torch")))
    assert "FAILED: 1/4 names match jax vs torch, 1 name only in torch (pass:" in text
    assert "x (max abs err 1.00e-01 > 1.10e-10 allowed)" in text
    assert "y (shape (2, 3) vs (3, 2))" in text and "n (nan" in text


def test_summary_when_only_one_sided_names_fail():
    """All common names agree but a name is missing on one side: the verdict says so, not only '1/1 match'."""
    result = jt.compare({"z": np.zeros(2)}, {"z": np.zeros(2), "q": np.ones(1), "r": np.ones(1)}, labels=("jax", "torch"))
    text = str(result)
    assert not result.ok
    assert "FAILED: 1/1 names match jax vs torch, 2 names only in torch (strict=False ignores names on one side)" in text
    assert "failed:" not in text
    relaxed = jt.compare({"z": np.zeros(2)}, {"z": np.zeros(2), "q": np.ones(1)}, strict=False)
    assert relaxed.ok and "OK: 1/1 names match a vs b (pass:" in str(relaxed)


def test_nothing_in_common_is_no_pass_and_says_how_to_name_the_sides():
    """Issue 50.8: with no name on both sides, strict=False would pass on nothing; the verdict says to name
    the sides alike, and for torch gradients how (jaxtrace.torch.named_grads)."""
    grads = {"layers": [{"weight": np.ones((2, 3)), "bias": np.ones(2)}]}  # an equinox model's, as a pytree
    unnamed = [np.ones((2, 3)), np.ones(2)]  # [p.grad for p in module.parameters()]: named "0", "1"
    for strict in (True, False):
        result = jt.compare(grads, unnamed, labels=("jax", "torch"), strict=strict)
        assert not result.ok and not result.rows
        text = str(result)
        assert "FAILED: 0/0 names match jax vs torch, 2 names only in jax, 2 names only in torch (no name is on both sides" in text
        assert "strict=False" not in text and "named_grads" not in text  # no torch tensor here
    assert jt.compare({}, {}).ok  # nothing on either side: nothing to fail
    torch = pytest.importorskip("torch")
    text = str(jt.compare(grads, [torch.ones(2, 3), torch.ones(2)], strict=False))
    assert "nothing was compared: give both sides the same names; for an equinox model's parameter gradients" in text
    assert "jt.compare(jaxtrace.torch.named_grads(grads, module), {name: p.grad for name, p in module.named_parameters()})" in text
