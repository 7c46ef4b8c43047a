"""``jt.per_example_audit``: per leaf, the path ``per_example_norms`` took and its distance from the definition.

The definition is ``jax.jacrev`` of the losses vector; a LoRA model (the class Opacus users found
silently corrupted under ghost clipping) is audited in both forms users write it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrace as jt
from jaxtrace._per_example import _pass


class LoRALinear(eqx.Module):
    """A frozen-size base Linear plus a rank-``r`` update, written as the LoRA papers write it."""

    base: eqx.nn.Linear
    a: jax.Array
    b: jax.Array
    merged: bool = eqx.field(static=True)

    def __init__(self, d_in, d_out, rank, key, merged):
        k1, k2, k3 = jax.random.split(key, 3)
        self.base = eqx.nn.Linear(d_in, d_out, key=k1)
        self.a = jax.random.normal(k2, (d_in, rank)) / d_in
        self.b = jax.random.normal(k3, (rank, d_out)) / rank
        self.merged = merged

    def __call__(self, x):
        if self.merged:  # the update added to the weight: the layer multiplies W + (A B)^T, not a leaf
            return (self.base.weight + (self.a @ self.b).T) @ x + self.base.bias
        return self.base(x) + (x @ self.a) @ self.b


class Model(eqx.Module):
    lora: LoRALinear
    head: eqx.nn.Linear

    def __init__(self, key, merged):
        k1, k2 = jax.random.split(key)
        self.lora = LoRALinear(5, 6, 2, k1, merged)
        self.head = eqx.nn.Linear(6, 3, key=k2)

    def __call__(self, x):
        return self.head(jnp.tanh(self.lora(x)))


def losses(model, x, y):
    return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)


def batch(n=4):
    x = jax.random.normal(jax.random.key(1), (n, 5))
    return x, jnp.sin(x[:, :3])


@pytest.mark.parametrize("merged", [False, True])
def test_lora_audit_passes_and_names_each_leaf_path(merged):
    model = Model(jax.random.key(0), merged)
    audit = jt.per_example_audit(losses)(model, *batch())
    assert audit.passed and audit.examples == 4 and audit.dtype == "float64", str(audit)
    paths = {leaf.name: leaf.path for leaf in audit.leaves}
    assert paths["head.weight"] == "factors"
    if merged:  # A and B reach the layer through a product: the exact path, with the reason
        assert paths["lora.a"] == paths["lora.b"] == paths["lora.base.weight"] == "exact", paths
        assert all(leaf.why for leaf in audit.leaves if leaf.path == "exact")
    else:
        assert paths["lora.a"] == paths["lora.b"] == paths["lora.base.weight"] == "factors", paths
    assert audit.max_relative_difference < 1e-12
    record = audit.as_dict()
    assert record["passed"] and len(record["leaves"]) == len(jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    assert "lora.a" in str(audit)


def test_audit_numbers_are_the_definitions():
    # the audit's reference against jacrev computed here, leaf by leaf
    model = Model(jax.random.key(0), False)
    x, y = batch(3)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    jac = jax.jacrev(lambda p: losses(eqx.combine(p, static), x, y))(params)
    want = {jax.tree_util.keystr(k): np.sqrt(np.sum(np.asarray(j).reshape(3, -1) ** 2, 1))
            for k, j in jax.tree_util.tree_leaves_with_path(jac)}
    _, got = jt.per_example_norms(losses)(model, x, y)
    got = {jax.tree_util.keystr(k): np.sqrt(np.asarray(g)) for k, g in jax.tree_util.tree_leaves_with_path(got)}
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-14)


def test_audit_fails_where_the_fast_path_is_off(monkeypatch):
    # a fast path 10% off on one leaf must be reported, on that leaf
    sq_norms = _pass.Call.sq_norms

    def off(self):
        out = sq_norms(self)
        return [out[0] * 1.21, *out[1:]]  # the first leaf's norms 10% high

    monkeypatch.setattr(_pass.Call, "sq_norms", off)
    audit = jt.per_example_audit(losses)(Model(jax.random.key(0), False), *batch())
    assert not audit.passed and "FAILED" in str(audit)
    first, *rest = audit.leaves
    assert abs(first.relative_difference - 0.1) < 1e-9 and all(leaf.relative_difference < 1e-12 for leaf in rest)


def test_audit_of_one_example_and_its_tolerance():
    model = Model(jax.random.key(0), False)
    x, y = batch(1)
    audit = jt.per_example_audit(losses, tolerance=0.0)(model, x, y)
    assert {leaf.path for leaf in audit.leaves} == {"batch of one"} and audit.tolerance == 0.0
    x32, y32, m32 = jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, (x, y, model))
    audit = jt.per_example_audit(losses)(m32, x32, y32)
    assert audit.dtype == "float32" and audit.tolerance == 1e-4 and audit.passed
