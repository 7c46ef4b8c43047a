"""capture / jvp / patch / with_values, against values computed directly and
functions rewritten by hand."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import assert_close
from jax import lax

import jaxtrace as jt

W = jax.random.normal(jax.random.PRNGKey(0), (4, 4)) / 2
X = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
XS = jax.random.normal(jax.random.PRNGKey(2), (5, 4))


def model(w, x, mark=None):
    """``mark(value, name, step)`` is an explicit hook for the oracles; jt.tag by default."""
    mark = mark or (lambda v, n, i=None: jt.tag(v, n))
    h = mark(jnp.tanh(x @ w), "h", None)

    def step(c, inp):
        xi, i = inp
        c = mark(jnp.sin(c @ w + xi), "s", i)
        return c, jnp.sum(c)

    c, ys = lax.scan(step, h[0], (XS, jnp.arange(len(XS))))
    return jnp.sum(ys) + jnp.sum(h**2) + jnp.sum(c)


def direct_values(w, x):
    h = jnp.tanh(x @ w)
    states, c = [], h[0]
    for xi in XS:
        c = jnp.sin(c @ w + xi)
        states.append(c)
    return {"h": h, "s": jnp.stack(states)}


def test_capture_values(maybe_jit):
    out, values = maybe_jit(jt.capture(model))(W, X)
    assert_close(out, model(W, X))
    assert_close(values, direct_values(W, X))
    _, only_h = maybe_jit(jt.capture(model, tags="h"))(W, X)
    assert set(only_h) == {"h"}


def test_capture_keeps_static_arguments():
    def f(x, n):
        for i in range(n):
            x = jt.tag(x * 2.0, f"x{i}")
        return x

    out, values = jt.capture(f)(jnp.ones(2), 3)
    assert_close(values, {"x0": 2 * jnp.ones(2), "x1": 4 * jnp.ones(2), "x2": 8 * jnp.ones(2)})


def test_capture_without_tags_says_so_where_a_name_is_read(maybe_jit):
    """Issue 50.8: capture of an untagged model gave {} and the next line a bare KeyError."""
    out, values = maybe_jit(jt.capture(lambda x: jnp.tanh(2.0 * x)))(jnp.ones(2))
    assert values == {} and not jax.tree_util.tree_leaves(values)
    with pytest.raises(KeyError, match=r"^jaxtrace\.capture found no tags in the function it ran, so it has nothing named 'layers\.0'\. .*jt\.tag_modules\(model\)") as caught:
        values["layers.0"]
    assert isinstance(caught.value, jt.TagError)
    # A function with tags, none of them selected, is no such case: a plain dict, as before.
    _, none_selected = maybe_jit(jt.capture(lambda x: jt.tag(x, "h"), tags=lambda name: False))(jnp.ones(2))
    assert type(none_selected) is dict and none_selected == {}


def test_capture_cond_branch_not_taken_gives_zeros(maybe_jit):
    def f(x, pred):
        return lax.cond(pred, lambda v: jt.tag(v * 2.0, "yes"), lambda v: jt.tag(v - 1.0, "no"), x)

    x = jnp.arange(3.0)
    _, values = maybe_jit(jt.capture(f))(x, True)
    assert_close(values, {"yes": 2 * x, "no": jnp.zeros(3)})
    _, values = maybe_jit(jt.capture(f))(x, False)
    assert_close(values, {"yes": jnp.zeros(3), "no": x - 1.0})


def test_capture_under_vmap_and_vmap_inside(maybe_jit):
    _, values = maybe_jit(jax.vmap(jt.capture(model), in_axes=(None, 0)))(W, jnp.stack([X, X + 1]))
    assert values["s"].shape == (2, 5, 4)
    assert_close(values["s"][1], direct_values(W, X + 1)["s"])

    def batched(x):
        return jax.vmap(lambda r: jt.tag(jnp.sin(r), "r"))(x)

    _, values = maybe_jit(jt.capture(batched))(X)
    assert_close(values["r"], jnp.sin(X))


def while_model(x, scale=None, trips=3):
    """A while loop whose body tags 'w'; ``scale`` replaces the tag by ``scale * w`` (the oracle)."""

    def body(c):
        w = jnp.sin(c[1]) * 1.5
        w = jt.tag(w, "w") if scale is None else scale * w
        return c[0] + 1, w

    return lax.while_loop(lambda c: c[0] < trips, body, (0, x))[1]


@pytest.mark.parametrize("trips", [3, 0])
def test_while_loop_forward_sees_the_last_iteration(maybe_jit, trips):
    x, t = jnp.array([0.3, 0.6]), jnp.array([1.0, -2.0])
    out, values = maybe_jit(jt.capture(lambda x: while_model(x, trips=trips)))(x)
    assert_close(out, while_model(x, 1.0, trips))
    assert_close(values["w"], while_model(x, 1.0, trips) if trips else jnp.zeros(2))  # zero trips: zeros
    out, out_dot, tangents = maybe_jit(lambda x, t: jt.jvp(lambda x: while_model(x, trips=trips), (x,), (t,)))(x, t)
    want, want_dot = jax.jvp(lambda x: while_model(x, 1.0, trips), (x,), (t,))
    assert_close((out, out_dot), (want, want_dot))
    assert_close(tangents["w"], want_dot if trips else jnp.zeros(2))
    patched = maybe_jit(jt.patch(lambda x: while_model(x, trips=trips), {"w": lambda w: 0.5 * w}))(x)
    assert_close(patched, while_model(x, 0.5, trips))
    replaced = maybe_jit(jt.patch(lambda x: while_model(x, trips=trips), {"w": jnp.array([2.0, 3.0])}))(x)
    assert_close(replaced, jnp.array([2.0, 3.0]) if trips else x)


def test_while_loop_gradient_is_refused_with_the_reason():
    with pytest.raises(jt.TagError, match=r"gradient at the tag 'w'.*`while` of body.*reverse mode.*lax.scan"):
        jt.grad(lambda x: jnp.sum(while_model(x)))(jnp.ones(2))


def custom_model(x, kind):
    """``sin(tag(2x))`` inside a custom_jvp or custom_vjp function whose rule scales the tangent by 10."""
    if kind == "jvp":

        @jax.custom_jvp
        def g(x):
            return jnp.sin(jt.tag(2.0 * x, "inside"))

        g.defjvp(lambda p, t: (g(p[0]), 10.0 * t[0]))
    else:

        @jax.custom_vjp
        def g(x):
            return jnp.sin(jt.tag(2.0 * x, "inside"))

        g.defvjp(lambda x: (g(x), None), lambda _, ct: (10.0 * ct,))
    return jnp.sum(g(x) * x)


@pytest.mark.parametrize("kind", ["jvp", "vjp"])
def test_custom_derivative_tags_can_be_read_and_the_rule_still_applies(maybe_jit, kind):
    x = jnp.array([0.3, -0.8])
    out, values = maybe_jit(jt.capture(lambda x: custom_model(x, kind)))(x)
    assert_close(out, jnp.sum(jnp.sin(2 * x) * x))
    assert_close(values["inside"], 2 * x)
    # The captured function is still differentiated with the custom rule (10, not 2 cos(2x)).
    got = jax.grad(lambda x: jt.capture(lambda x: custom_model(x, kind))(x)[0])(x)
    assert_close(got, jnp.sin(2 * x) + 10.0 * x)
    for refused in (
        lambda f: jt.jvp(f, (x,), (x,)),
        lambda f: jt.patch(f, {"inside": lambda v: v})(x),
        lambda f: jt.grad(f)(x),
    ):
        with pytest.raises(jt.TagError, match=r"'inside'.*custom_.*own rule.*capture can read them"):
            refused(lambda x: custom_model(x, kind))


def test_jvp_tangents_at_tags(maybe_jit):
    t_w = jax.random.normal(jax.random.PRNGKey(3), W.shape)
    t_x = jax.random.normal(jax.random.PRNGKey(4), X.shape)
    out, out_dot, tag_dots = maybe_jit(lambda *a: jt.jvp(model, a[:2], a[2:]))(W, X, t_w, t_x)
    expected_out, expected_dot = jax.jvp(model, (W, X), (t_w, t_x))
    _, expected_tags = jax.jvp(direct_values, (W, X), (t_w, t_x))
    assert_close((out, out_dot), (expected_out, expected_dot))
    assert_close(tag_dots, expected_tags)


def test_patch_constant_replacement_matches_hand_rewrite(maybe_jit):
    h_new = jnp.full((3, 4), 0.3)
    patched = maybe_jit(jt.patch(model, {"h": h_new}))
    expected = model(W, X, lambda v, n, i: h_new if n == "h" else v)
    assert_close(patched(W, X), expected)
    # A constant cuts the gradient upstream of the tag: w only reaches the loss through the scan.
    grads = jax.grad(jt.patch(model, {"h": h_new}))(W, X)
    assert_close(grads, jax.grad(lambda w: model(w, X, lambda v, n, i: h_new if n == "h" else v))(W))


def test_patch_stacked_replacement_in_scan(maybe_jit):
    s_new = jnp.linspace(0, 1, 20).reshape(5, 4)

    def by_hand(w, x):
        h = jnp.tanh(x @ w)
        ys = jnp.sum(s_new, axis=1)
        return jnp.sum(ys) + jnp.sum(h**2) + jnp.sum(s_new[-1])

    assert_close(maybe_jit(jt.patch(model, {"s": s_new}))(W, X), by_hand(W, X))


def test_patch_callable_keeps_gradient(maybe_jit):
    patched = jt.patch(model, {"h": lambda v: 0.5 * v})
    by_hand = lambda w, x: model(w, x, lambda v, n, i: 0.5 * v if n == "h" else v)  # noqa: E731
    assert_close(maybe_jit(patched)(W, X), by_hand(W, X))
    assert_close(maybe_jit(jax.grad(patched))(W, X), jax.grad(by_hand)(W, X))


def test_patch_composes_with_jt_grad_capture_and_vmap(maybe_jit):
    h_new = jnp.full((3, 4), 0.3)
    patched = jt.patch(model, {"h": h_new})
    # Patched tags stay in place: jt.grad sees the new value and the other tags.
    grads, tag_grads = maybe_jit(jt.grad(patched))(W, X)

    def oracle(w, eps):
        return model(w, X, lambda v, n, i: (h_new if n == "h" else v) + (eps[n] if i is None else eps[n][i]))

    zeros = {"h": jnp.zeros((3, 4)), "s": jnp.zeros((5, 4))}
    expected_w, expected_tags = jax.grad(oracle, argnums=(0, 1))(W, zeros)
    assert_close((grads, tag_grads), (expected_w, expected_tags))
    _, values = maybe_jit(jt.capture(patched))(W, X)
    assert_close(values["h"], h_new)
    # Batched replacements under vmap.
    hs = jnp.stack([h_new, 2 * h_new])
    outs = maybe_jit(jax.vmap(lambda h, x: jt.patch(model, {"h": h})(W, x), in_axes=(0, None)))(hs, X)
    assert_close(outs, jnp.stack([jt.patch(model, {"h": h})(W, X) for h in hs]))


def test_patch_wrong_shape_or_dtype_is_a_clear_error():
    with pytest.raises(jt.TagError, match=r"tag 'h'.*shape \(2, 4\).*shape \(3, 4\)"):
        jt.patch(model, {"h": jnp.zeros((2, 4))})(W, X)
    with pytest.raises(jt.TagError, match=r"tag 'h'.*dtype int32"):
        jt.patch(model, {"h": jnp.zeros((3, 4), jnp.int32)})(W, X)
    with pytest.raises(jt.TagError, match=r"tag 's'.*shape \(4, 4\)"):
        jt.patch(model, {"s": lambda v: jnp.zeros((4, 4))})(W, X)
    with pytest.raises(jt.TagError, match="No tag named 'nope'"):
        jt.patch(model, {"nope": 0.0})(W, X)


def test_with_values_same_pass(maybe_jit):
    value, (grads, tag_grads), values = maybe_jit(jt.value_and_grad(model, with_values=True))(W, X)
    assert_close(values, direct_values(W, X))
    assert_close(value, model(W, X))
    grads2, tag_grads2, values2 = maybe_jit(jt.grad(model, with_values=True))(W, X)
    assert_close((grads2, tag_grads2, values2), (grads, tag_grads, values))
    (grads3, tag_grads3), aux, values3 = jt.grad(lambda w, x: (model(w, x), 1.0), has_aux=True, with_values=True)(W, X)
    assert_close((grads3, values3), (grads, values))
    out, vjp_fn, values4 = jt.vjp(model, W, X, with_values=True)
    assert_close(values4, values)


def _count(op, fun, *args):
    text = jax.jit(fun).lower(*args).compile().as_text()
    return len(re.findall(rf"= \S+ {op}\(", text))


def test_with_values_does_not_run_the_forward_twice():
    """The compiled program is the one a user would write by returning h as aux."""

    def f(w, x):
        return jnp.sum(jnp.tanh(jt.tag(jnp.sin(x @ w), "h")) ** 2)

    def by_hand(w, x):
        h = jnp.sin(x @ w)
        return jnp.sum(jnp.tanh(h) ** 2), h

    by_hand_step = jax.value_and_grad(by_hand, has_aux=True)
    with_values = jt.value_and_grad(f, with_values=True)
    for op in ("sine", "tanh", "dot"):
        assert _count(op, with_values, W, X) == _count(op, by_hand_step, W, X), op
    assert _count("dot", with_values, W, X) == _count("dot", jax.value_and_grad(f), W, X)


def test_vmap_over_vjp_fn_gives_one_saliency_map_per_class(maybe_jit):
    def classifier(x):
        feats = jt.tag(jnp.tanh(x @ W), "features")
        return feats @ W[:, :3]  # 3 classes

    x = X[0]
    _, vjp_fn = jt.vjp(classifier, x)
    (x_rows,), tag_rows = maybe_jit(jax.vmap(vjp_fn))(jnp.eye(3))
    feats = jnp.tanh(x @ W)
    assert_close(tag_rows["features"], W[:, :3].T)
    assert_close(x_rows, jax.jacrev(classifier)(x))
    assert np.all(np.isfinite(feats))


def test_vmap_and_jit_around_while_loop_capture():
    xs = jnp.array([[0.3, 0.6], [-0.2, 1.1], [0.9, 0.0]])
    _, values = jax.jit(jax.vmap(jt.capture(while_model)))(xs)
    assert_close(values["w"], jax.vmap(lambda x: while_model(x, 1.0))(xs))
