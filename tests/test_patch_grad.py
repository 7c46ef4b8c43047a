"""jt.patch_grad against hand-written jax.custom_vjp identities at the same points (the oracle),
float64, eager and under jit, through the constructs and entry points users combine."""

import jax
import jax.numpy as jnp
import pytest
from oracles import assert_close
from jax import lax

import jaxtrace as jt

W = jax.random.normal(jax.random.PRNGKey(0), (3, 3)) / 2
X = jnp.arange(3.0) - 0.5
XS = jax.random.normal(jax.random.PRNGKey(1), (4, 3))

FNS = {
    "double": lambda g: 2.0 * g,
    "reverse": lambda g: -g,
    "clip": lambda g: jnp.clip(g, -0.05, 0.05),
    "normalize": lambda g: g / (jnp.linalg.norm(g) + 1e-3),
}


def hook(fn):
    """The oracle: an identity whose backward applies ``fn``, written by hand."""

    @jax.custom_vjp
    def identity(x):
        return x

    identity.defvjp(lambda x: (x, None), lambda _, g: (fn(g),))
    return identity


def model(w, xs, mark):
    """A scan over rows, a vmap over examples, a cond and a checkpoint, each marking 'h'-like sites."""

    def step(c, x):
        c = mark(jnp.tanh(w @ c + x), "c")
        return c, c

    c, cs = lax.scan(step, jnp.zeros(3), xs)
    per = jax.vmap(lambda r: mark(jnp.sin(w @ r), "v"))(xs)
    branch = lax.cond(jnp.sum(c) > -10, lambda c: mark(c * 1.5, "k"), lambda c: c, c)
    remat = jax.checkpoint(lambda b: mark(jnp.tanh(b) * 2, "r"))(branch)
    return jnp.sum(remat**2) + jnp.mean(per**2) + 0.1 * jnp.sum(cs**3)


NAMES = ("c", "v", "k", "r")


@pytest.mark.long_eager
@pytest.mark.parametrize("kind", sorted(FNS))
def test_every_construct_against_custom_vjp(maybe_jit, kind):
    fn = FNS[kind]
    patched = jt.patch_grad(lambda w, xs: model(w, xs, jt.tag), {n: fn for n in NAMES})
    oracle = lambda w, xs: model(w, xs, lambda v, n: hook(fn)(v))  # noqa: E731
    assert_close(maybe_jit(jax.grad(patched, argnums=(0, 1)))(W, XS), jax.grad(oracle, argnums=(0, 1))(W, XS))
    assert_close(patched(W, XS), model(W, XS, lambda v, n: v))  # the forward pass is unchanged


@pytest.mark.long_eager
def test_entry_points(maybe_jit):
    fn = FNS["normalize"]
    patched = jt.patch_grad(lambda w, xs: model(w, xs, jt.tag), {"c": fn, "v": fn})
    oracle = lambda w, xs: model(w, xs, lambda v, n: hook(fn)(v) if n in ("c", "v") else v)  # noqa: E731
    vec = lambda f: (lambda w, xs: jnp.stack([f(w, xs), f(w * 0.5, xs)]))  # noqa: E731
    assert_close(maybe_jit(jax.jacrev(vec(patched)))(W, XS), jax.jacrev(vec(oracle))(W, XS))
    _, pull = jax.vjp(patched, W, XS)
    _, pull_o = jax.vjp(oracle, W, XS)
    assert_close(pull(1.0), pull_o(1.0))
    value, (g, tag_grads) = maybe_jit(jt.value_and_grad(patched))(W, XS)
    assert_close(g, jax.grad(oracle)(W, XS))
    # jt.grad reports, at a patched tag, the cotangent that arrives there (before fn).
    plain = jt.grad(lambda w, xs: model(w, xs, jt.tag))(W, XS)[1]
    assert_close(tag_grads["r"], plain["r"])
    # Per-example vmap around: fn sees one example's cotangent.
    one = lambda w, x: patched(w, x[None])  # noqa: E731
    one_o = lambda w, x: oracle(w, x[None])  # noqa: E731
    assert_close(jax.vmap(jax.grad(one), (None, 0))(W, XS), jax.vmap(jax.grad(one_o), (None, 0))(W, XS))


def test_repeated_pytree_with_values_and_second_order(maybe_jit):
    def f(w, x, mark):
        h = x
        for _ in range(2):
            pair = mark({"a": jnp.tanh(w @ h), "b": w[0]}, "block")
            h = pair["a"] + 0.1 * pair["b"]
        return jnp.sum(h**2)

    fn = lambda g, v: {"a": g["a"] * v["a"], "b": -g["b"]}  # noqa: E731

    def oracle_mark(value, name):
        @jax.custom_vjp
        def ident(t):
            return t

        ident.defvjp(lambda t: (t, t), lambda v, g: (fn(g, v),))
        return ident(value)

    patched = jt.patch_grad(
        lambda w, x: f(w, x, lambda v, n: jt.tag(v, n, repeated=True)), {"block": fn}, with_values=True
    )
    oracle = lambda w, x: f(w, x, oracle_mark)  # noqa: E731
    assert_close(maybe_jit(jax.grad(patched))(W, X), jax.grad(oracle)(W, X))
    # Second order: the gradient of a norm of the patched gradient.
    norm = lambda g: lambda w, x: jnp.sum(jax.grad(g)(w, x) ** 2)  # noqa: E731
    assert_close(maybe_jit(jax.grad(norm(patched)))(W, X), jax.grad(norm(oracle))(W, X), rtol=1e-10)


def test_forward_mode_sees_unchanged_tangents_and_patch_composes():
    f = lambda w, x: model(w, x, jt.tag)  # noqa: E731
    patched = jt.patch_grad(f, {"c": FNS["reverse"]})
    assert_close(jax.jvp(patched, (W, XS), (W, XS)), jax.jvp(f, (W, XS), (W, XS)))
    # With jt.patch in either order: the value is replaced, the gradient hook still applies.
    both = [
        jt.patch(jt.patch_grad(f, {"r": FNS["double"]}), {"r": lambda v: v * 0.5}),
        jt.patch_grad(jt.patch(f, {"r": lambda v: v * 0.5}), {"r": FNS["double"]}),
    ]
    oracle = lambda w, xs: model(w, xs, lambda v, n: hook(FNS["double"])(v) * 0.5 if n == "r" else v)  # noqa: E731
    for g in both:
        assert_close(jax.grad(g)(W, XS), jax.grad(oracle)(W, XS))


def test_errors():
    f = lambda w: jnp.sum(jt.tag(w * 2.0, "h") ** 2)  # noqa: E731
    with pytest.raises(jt.TagError, match=r"'h'.*returned .*float64\[2\].*given is .*float64\[3\]"):
        jax.grad(jt.patch_grad(f, {"h": lambda g: g[:2]}))(jnp.ones(3))
    with pytest.raises(jt.TagError, match="No tag named 'nope'"):
        jt.patch_grad(f, {"nope": lambda g: g})(jnp.ones(3))
    with pytest.raises(TypeError, match="callable"):
        jt.patch_grad(3.0, {})
    with pytest.raises(TypeError, match="functions of the cotangent"):
        jt.patch_grad(f, {"h": 2.0})
    with pytest.raises(jt.TagError, match=r"jax.grad\(jt.patch_grad\(loss"):
        jt.patch_grad(jax.grad(f), {"h": lambda g: g})(jnp.ones(3))


def test_unpatched_tags_cost_nothing():
    f = lambda w, xs: model(w, xs, jt.tag)  # noqa: E731
    text = jax.jit(jax.grad(f)).lower(W, XS).as_text()
    assert "jaxtrace" not in text


@pytest.mark.parametrize("jit", [False, True])
def test_equinox_models_tagged_by_tag_modules(jit):
    import equinox as eqx

    maybe_jit = eqx.filter_jit if jit else (lambda f: f)
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))
    tagged = jt.tag_modules(mlp)
    loss = lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2)  # noqa: E731
    fn = FNS["reverse"]
    patched = jt.patch_grad(loss, {"layers.1": fn})

    # The oracle: the same MLP written out, with a custom_vjp identity after layers[1].
    def oracle(m, x):
        def one(x):
            h = x
            for i, layer in enumerate(m.layers):
                h = layer(h)
                h = hook(fn)(h) if i == 1 else h
                h = m.activation(h) if i < len(m.layers) - 1 else m.final_activation(h)
            return h

        return jnp.sum(jax.vmap(one)(x) ** 2)

    want = eqx.filter_grad(oracle)(mlp, XS)
    for got in (
        maybe_jit(eqx.filter_grad(patched))(tagged, XS),
        maybe_jit(jt.filter_grad(patched))(tagged, XS)[0],
    ):
        assert_close(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))


def test_nested_jit_fori_loop_and_lax_map(maybe_jit):
    fn = FNS["normalize"]

    def f(w, xs, mark):
        inner = jax.jit(lambda r: mark(jnp.tanh(w @ r), "j"))
        mapped = lax.map(inner, xs)
        c = lax.fori_loop(0, 3, lambda i, c: mark(jnp.sin(w @ c) + 0.1, "f"), xs[0])
        return jnp.sum(mapped**2) + jnp.sum(c**2)

    patched = jt.patch_grad(lambda w, xs: f(w, xs, jt.tag), {"j": fn, "f": fn})
    oracle = lambda w, xs: f(w, xs, lambda v, n: hook(fn)(v))  # noqa: E731
    assert_close(maybe_jit(jax.grad(patched))(W, XS), jax.grad(oracle)(W, XS))


def test_checkpoint_around_and_other_transforms_around_patch_grad(maybe_jit):
    fn = FNS["normalize"]
    f = lambda w, xs: model(w, xs, jt.tag)  # noqa: E731
    patched = jt.patch_grad(f, {"c": fn, "r": fn})
    oracle = lambda w, xs: model(w, xs, lambda v, n: hook(fn)(v) if n in ("c", "r") else v)  # noqa: E731
    want = jax.grad(oracle)(W, XS)
    assert_close(maybe_jit(jax.grad(jax.checkpoint(patched)))(W, XS), want)
    # capture around it reads the unchanged forward values; jt.grad around reports arriving cotangents.
    _, values = maybe_jit(jt.capture(patched))(W, XS)
    _, plain_values = jt.capture(f)(W, XS)
    assert_close(values, plain_values)


def test_a_pytree_tag_in_a_vmapped_cond(maybe_jit):
    """The vmapped cond masks each leaf before its tag, so the leaves are not next to each other."""

    def g(x):
        def a(x):
            u, v = jt.tag((x, jnp.sin(x)[:2]), "pair")
            return u * 2 + jnp.sum(v)

        return jnp.sum(lax.cond(jnp.sum(x) > 0, a, jnp.cos, x))

    neg = lambda g: jax.tree_util.tree_map(jnp.negative, g)  # noqa: E731
    xs = jnp.stack([jnp.ones(3), -2 * jnp.ones(3), jnp.arange(3.0)])
    got = maybe_jit(jax.grad(jt.patch_grad(lambda xs: jnp.sum(jax.vmap(g)(xs)), {"pair": neg})))(xs)
    taken = (jnp.sum(xs, axis=1) > 0)[:, None]
    by_hand = -(2 + 3 * jnp.concatenate([jnp.cos(xs[:, :2]), jnp.zeros((3, 1))], axis=1))
    assert_close(got, jnp.where(taken, by_hand, -jnp.sin(xs)))


def test_patch_grad_around_a_function_patch_of_a_pair_tag(maybe_jit):
    """The inner patch computes each leaf's new value before the call's tags, so the outer
    patch_grad finds the leaves together (found by the property grammar)."""

    def f(x):
        for _ in range(2):
            a, b = jt.tag((x, jnp.sin(x)[:2]), "r", repeated=True)
            x = a + 0.5 * jnp.sum(b)
        return jnp.sum(x**2)

    def by_hand(x):
        @jax.custom_vjp
        def hook(a, b):
            return a, b

        hook.defvjp(lambda a, b: ((a, b), None), lambda _, g: (-g[0], -g[1]))
        for _ in range(2):
            a, b = hook(2 * x, 2 * jnp.sin(x)[:2])
            x = a + 0.5 * jnp.sum(b)
        return jnp.sum(x**2)

    neg = lambda g: jax.tree_util.tree_map(jnp.negative, g)  # noqa: E731
    outer = jt.patch_grad(jt.patch(f, {"r": lambda v: 2 * v}), {"r": neg})
    assert_close(maybe_jit(jax.grad(outer))(X), jax.grad(by_hand)(X))
