"""jaxtrace in company: inside and around jax.grad / jvp / vmap / checkpoint / disable_jit
and around itself. Every number is checked against the hand-written ``+ eps`` program of
the whole composition (float64), eager and under jit; every refusal is a TagError that
names the construct and the fix."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from oracles import assert_close
from jax import lax

import jaxtrace as jt

W = jax.random.normal(jax.random.PRNGKey(0), (3, 3)) / 2
X = jnp.arange(3.0) - 0.5
Z3 = jnp.zeros(3)


def loss(w, x):
    h = jt.tag(jnp.tanh(w @ x), "h")
    return jnp.sum(jnp.sin(h) ** 2)


def loss_eps(w, x, eps):
    h = jnp.tanh(w @ x) + eps
    return jnp.sum(jnp.sin(h) ** 2)


# --- a jaxtrace transform inside another one (item: the outer one must see the tag) ---------


INNER = {
    "grad": (
        lambda w, x: jnp.sum(jt.grad(loss, argnums=1)(w, x)[0] ** 2),
        lambda w, x, e: jnp.sum(jax.grad(loss_eps, argnums=1)(w, x, e) ** 2),
    ),
    "tag_grad_penalty": (
        lambda w, x: jnp.sum(jt.grad(loss)(w, x)[1]["h"] ** 2),
        lambda w, x, e: jnp.sum(jax.grad(loss_eps, argnums=2)(w, x, e) ** 2),
    ),
    "value_and_grad": (
        lambda w, x: (lambda v, g: v + jnp.sum(g[0] ** 2))(*jt.value_and_grad(loss)(w, x)),
        lambda w, x, e: loss_eps(w, x, e) + jnp.sum(jax.grad(loss_eps)(w, x, e) ** 2),
    ),
    "vjp": (
        lambda w, x: jnp.sum(jt.vjp(loss, w, x)[1](1.0)[0][0] ** 2),
        lambda w, x, e: jnp.sum(jax.grad(loss_eps)(w, x, e) ** 2),
    ),
    "stats": (
        lambda w, x: jt.stats.value_and_grad(loss)(w, x)[0],
        loss_eps,
    ),
}


@pytest.mark.parametrize("inner", sorted(INNER))
def test_outer_jaxtrace_sees_tags_of_an_inner_one(maybe_jit, inner):
    outer, outer_eps = INNER[inner]
    grads, tag_grads = maybe_jit(jt.grad(outer))(W, X)
    assert_close(grads, jax.grad(outer_eps)(W, X, Z3))
    assert_close(tag_grads["h"], jax.grad(outer_eps, argnums=2)(W, X, Z3))
    out, values = maybe_jit(jt.capture(outer))(W, X)
    assert_close(values["h"], jnp.tanh(W @ X))
    assert_close(out, outer(W, X))


def test_jax_grad_around_jt_grad_around_jt_grad(maybe_jit):
    inner = lambda w, x: jnp.sum(jt.grad(loss)(w, x)[1]["h"] ** 2)  # noqa: E731
    outer = lambda w, x: jt.grad(inner)(w, x)[1]["h"].sum()  # noqa: E731
    inner_eps = lambda w, x, e: jnp.sum(jax.grad(loss_eps, argnums=2)(w, x, e) ** 2)  # noqa: E731
    outer_eps = lambda w, x: jax.grad(inner_eps, argnums=2)(w, x, Z3).sum()  # noqa: E731
    assert_close(maybe_jit(jax.grad(outer))(W, X), jax.grad(outer_eps)(W, X), rtol=1e-10)


# --- copies JAX makes of one tag call are one site ----------------------------------------


def remat_step(w, x):
    return jnp.sum(jax.grad(lambda w: jax.checkpoint(loss)(w, x))(w) ** 2)


def remat_step_eps(w, x, e):
    return jnp.sum(jax.grad(lambda w: jax.checkpoint(loss_eps)(w, x, e))(w) ** 2)


@pytest.mark.parametrize("policy", [None, "nothing_saveable", "everything_saveable"])
def test_checkpoint_under_inner_grad_is_one_site(maybe_jit, policy):
    pol = None if policy is None else getattr(jax.checkpoint_policies, policy)

    def step(w, x):
        return jnp.sum(jax.grad(lambda w: jax.checkpoint(loss, policy=pol)(w, x))(w) ** 2)

    def step_eps(w, x, e):
        return jnp.sum(jax.grad(lambda w: jax.checkpoint(loss_eps, policy=pol)(w, x, e))(w) ** 2)

    g, tag_grads, values = maybe_jit(jt.grad(step, with_values=True))(W, X)
    assert_close(g, jax.grad(step_eps)(W, X, Z3))
    assert_close(tag_grads["h"], jax.grad(step_eps, argnums=2)(W, X, Z3))
    assert_close(values["h"], jnp.tanh(W @ X))
    _, captured = maybe_jit(jt.capture(step))(W, X)
    assert_close(captured["h"], jnp.tanh(W @ X))


def _sum_of_grads(fun):
    """``fun(w) -> y`` as ``w -> y + 0.1 * (sum of jt.grad's gradients of sum(y**2))``."""

    def outer(w):
        (gw, tags), y = jt.grad(lambda w: (lambda y: (jnp.sum(y**2), y))(fun(w)), has_aux=True)(w)
        return y + 0.1 * (jnp.sum(gw) + sum(jnp.sum(t) for t in jax.tree_util.tree_leaves(tags)))

    return outer


def _sum_of_grads_eps(fun):
    """The ``+ eps`` program of ``_sum_of_grads``: ``fun(w, eps)``, its own eps at ``e``'s level."""

    def outer(w, eo):
        gw, ge = jax.grad(lambda w, ei: jnp.sum(fun(w, eo + ei) ** 2), argnums=(0, 1))(w, jnp.zeros_like(eo))
        return fun(w, eo) + 0.1 * (jnp.sum(gw) + jnp.sum(ge))

    return outer


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_checkpoint_under_nested_jaxtrace_grads_is_one_site(maybe_jit, depth, policy):
    """Each inner split leaves the tag in the checkpoint body; the differentiation around it
    copies the tag out of the body: the copies are the one call (found by the property tests)."""
    pol = None if policy is None else getattr(jax.checkpoint_policies, policy)
    fun = lambda w: jax.checkpoint(lambda w: jnp.sin(jt.tag(w @ X, "h")), policy=pol)(w)  # noqa: E731
    fun_eps = lambda w, e: jax.checkpoint(lambda w, e: jnp.sin(w @ X + e), policy=pol)(w, e)  # noqa: E731
    for _ in range(depth - 1):
        fun = _sum_of_grads(fun)
        fun_eps = _sum_of_grads_eps(fun_eps)
    ct = jnp.cos(jnp.arange(3.0))
    (gw,), tags = maybe_jit(lambda w: jt.vjp(fun, w)[1](ct))(W)
    _, vjp_eps = jax.vjp(fun_eps, W, Z3)
    want_w, want_e = vjp_eps(ct)
    assert_close(gw, want_w)
    assert_close(tags["h"], want_e)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_one_checkpoint_called_twice_under_nested_jaxtrace_grads_is_two_calls(maybe_jit, depth):
    """jax.checkpoint caches its trace: both calls hold the same jt.tag call. Each inner split
    marks its own evaluation of the body, so the copies of the two calls stay two calls."""
    g = jax.checkpoint(lambda w, x: jnp.sin(jt.tag(w @ x, "h", repeated=True)))
    g_eps = jax.checkpoint(lambda w, x, e: jnp.sin(w @ x + e))
    fun = lambda w: g(w, X) * g(w, 2 * X)  # noqa: E731
    fun_eps = lambda w, e: g_eps(w, X, e[0]) * g_eps(w, 2 * X, e[1])  # noqa: E731
    for _ in range(depth - 1):
        fun, fun_eps = _sum_of_grads(fun), _sum_of_grads_eps(fun_eps)
    ct = jnp.cos(jnp.arange(3.0))
    (gw,), tags = maybe_jit(lambda w: jt.vjp(fun, w)[1](ct))(W)
    want_w, want_e = jax.vjp(fun_eps, W, jnp.zeros((2, 3)))[1](ct)
    assert_close(gw, want_w)
    assert_close(tags["h"], want_e)


def test_capture_of_a_training_step_with_remat_and_scan(maybe_jit):
    def rnn_loss(w, xs):
        def body(c, x):
            c = jt.tag(jnp.tanh(w @ c + x), "c")
            return c, None

        return jnp.sum(lax.scan(jax.checkpoint(body), jnp.zeros(3), xs)[0] ** 2)

    xs = jnp.arange(12.0).reshape(4, 3) / 10
    step = lambda w, xs: jax.grad(rnn_loss)(w, xs)  # noqa: E731
    _, values = maybe_jit(jt.capture(step))(W, xs)
    _, expected = jt.capture(rnn_loss)(W, xs)
    assert values["c"].shape == (4, 3)
    assert_close(values["c"], expected["c"])


def test_repeated_calls_across_a_nested_jit_are_spliced(maybe_jit):
    def f(x):
        a = jax.jit(lambda x: jt.tag(jt.tag(jnp.sin(x), "r", repeated=True) * 3, "r", repeated=True))(x)
        return jnp.sum(jt.tag(jnp.cos(a), "r", repeated=True) ** 2)

    def f_eps(x, e):
        a = (jnp.sin(x) + e[0]) * 3 + e[1]
        return jnp.sum((jnp.cos(a) + e[2]) ** 2)

    e0 = jnp.zeros((3, 3))
    g, tag_grads = maybe_jit(jt.grad(f))(X)
    assert tag_grads["r"].shape == (3, 3)
    assert_close(tag_grads["r"], jax.grad(f_eps, argnums=1)(X, e0))
    assert_close(g, jax.grad(f_eps)(X, e0))
    _, values = maybe_jit(jt.capture(f))(X)
    s = jnp.sin(X)
    assert_close(values["r"], jnp.stack([s, 3 * s, jnp.cos(3 * s)]))


def test_repeated_calls_at_different_loop_depths_name_the_axes():
    def f(x):
        x = jt.tag(x, "r", repeated=True)
        y, _ = lax.scan(lambda c, _: (jt.tag(jnp.sin(c), "r", repeated=True), None), x, None, length=4)
        return jnp.sum(y)

    with pytest.raises(jt.TagError, match=r"leading axes \(4,\)"):
        jt.grad(f)(X)


def test_disable_jit_gives_the_jit_layout():
    def f(w, xs):
        def body(c, x):
            c = jt.tag(jnp.tanh(w @ c + x), "c")
            return c, None

        return jnp.sum(lax.scan(body, jnp.zeros(3), xs)[0] ** 2)

    xs = jnp.arange(12.0).reshape(4, 3) / 10
    expected = jax.jit(jt.grad(f))(W, xs)
    with jax.disable_jit():
        got = jt.grad(f)(W, xs)
        _, values = jt.capture(f)(W, xs)
    assert got[1]["c"].shape == (4, 3)
    assert_close(got, expected)
    assert values["c"].shape == (4, 3)


# --- patch of a function that differentiates the tagged code --------------------------------


@pytest.mark.parametrize(
    "inner",
    [
        lambda f: jax.grad(f),
        lambda f: (lambda w, x: jax.jvp(lambda w: f(w, x), (w,), (jnp.ones_like(w),))[1]),
        lambda f: (lambda w, x: jax.vjp(lambda w: f(w, x), w)[1](1.0)[0]),
        lambda f: (lambda w, x: jt.grad(f)(w, x)[0]),
    ],
    ids=["grad", "jvp", "vjp", "jt.grad"],
)
@pytest.mark.parametrize("replacement", [lambda v: 2 * v, jnp.ones(3)], ids=["callable", "value"])
def test_patch_of_a_function_that_differentiates_the_tag_is_refused(inner, replacement):
    with pytest.raises(jt.TagError, match=r"jax.grad\(jt.patch\(loss"):
        jt.patch(inner(loss), {"h": replacement})(W, X)


@pytest.mark.parametrize("replacement", ["callable", "value"])
def test_grad_of_patch_is_the_patched_program_derivative(maybe_jit, replacement):
    if replacement == "callable":
        patched, oracle = {"h": lambda v: 2 * v}, lambda w, x: jnp.sum(jnp.sin(2 * jnp.tanh(w @ x)) ** 2)
    else:
        v = jnp.array([0.1, -0.2, 0.3])
        patched, oracle = {"h": v}, lambda w, x: jnp.sum(jnp.sin(v + 0 * w[0, 0]) ** 2)
    assert_close(maybe_jit(jax.grad(jt.patch(loss, patched)))(W, X), jax.grad(oracle)(W, X))


def test_patch_of_a_grad_that_does_not_flow_through_the_tag():
    # The tag's value is only a residual of the derivative (no tangent passes it): allowed, exact.
    f = lambda w: jnp.sum(w * jt.tag(X, "h") ** 2)  # noqa: E731
    got = jt.patch(jax.grad(f), {"h": lambda v: 2 * v})(2.0)
    assert_close(got, jnp.sum((2 * X) ** 2))


def test_capture_of_a_function_that_differentiates_inside(maybe_jit):
    out, values = maybe_jit(jt.capture(jax.grad(loss)))(W, X)
    assert_close(out, jax.grad(loss)(W, X))
    assert_close(values["h"], jnp.tanh(W @ X))
    _, tangents = jt.jvp(lambda w: jax.grad(loss)(w, X), (W,), (jnp.ones_like(W),))[1:]
    h_dot = jax.jvp(lambda w: jnp.tanh(w @ X), (W,), (jnp.ones_like(W),))[1]
    assert_close(tangents["h"], h_dot)


# --- a tag is an identity to every JAX transform --------------------------------------------


def test_linear_transpose_of_a_tagged_linear_function():
    f = lambda v: 3.0 * jt.tag(W @ v, "t")  # noqa: E731
    (got,) = jax.linear_transpose(f, X)(X)
    (expected,) = jax.linear_transpose(lambda v: 3.0 * (W @ v), X)(X)
    assert_close(got, expected)


def test_grad_through_a_custom_jvp_rule_that_tags_its_tangent(maybe_jit):
    @jax.custom_jvp
    def g(x):
        return jnp.sin(x)

    @g.defjvp
    def g_jvp(primals, tangents):
        (x,), (x_dot,) = primals, tangents
        return jnp.sin(x), jt.tag(jnp.cos(x) * x_dot, "tangent")

    assert_close(maybe_jit(jax.grad(lambda x: jnp.sum(g(x))))(X), jnp.cos(X))
    assert_close(jax.hessian(lambda x: jnp.sum(g(x)))(X), jnp.diag(-jnp.sin(X)))


def test_jet_of_a_tagged_function():
    from jax.experimental import jet

    f = lambda x: jnp.sin(jt.tag(x * x, "h"))  # noqa: E731
    got = jet.jet(f, (0.7,), ((1.0, 0.5, 0.2),))
    expected = jet.jet(lambda x: jnp.sin(x * x), (0.7,), ((1.0, 0.5, 0.2),))
    assert_close(got, expected)


def test_holomorphic(maybe_jit):
    f = lambda z: jnp.sin(jt.tag(z * z, "h"))  # noqa: E731
    f_eps = lambda z, e: jnp.sin(z * z + e)  # noqa: E731
    z = jnp.complex128(0.3 + 0.8j)
    g, tag_grads = maybe_jit(jt.grad(f, holomorphic=True))(z)
    eg, etag = jax.grad(f_eps, argnums=(0, 1), holomorphic=True)(z, jnp.complex128(0))
    assert_close((g, tag_grads["h"]), (eg, etag))


# --- clear errors where JAX hides the structure ---------------------------------------------


def test_odeint_dynamics_name_the_custom_rule():
    from jax.experimental.ode import odeint

    def f(a):
        return jnp.sum(odeint(lambda y, t, a: -a * jt.tag(y, "y"), jnp.ones(2), jnp.array([0.0, 1.0]), a))

    for transform in (jt.grad, lambda f: jt.patch(f, {"y": lambda v: v})):
        with pytest.raises(jt.TagError) as info:
            transform(f)(1.0)
        message = str(info.value)
        assert "'y'" in message and "custom_vjp_call" in message and "_odeint" in message
        assert "Move the tag outside" in message and "used at" not in message
    # Reading is allowed inside a custom rule, and odeint calls the dynamics several times (before its
    # while loop and per stage inside it): the plain tag is then the usual "several sites" error.
    with pytest.raises(jt.TagError, match="'y' is used at"):
        jt.capture(f)(1.0)


def test_python_control_flow_on_a_value_says_the_function_is_traced():
    def f(x):
        h = jt.tag(x * 2, "h")
        return h**2 if h > 1 else h

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        jt.grad(f)(3.0)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "traces" in notes and "lax.cond" in notes and "jnp.where" in notes


def test_non_array_outputs_pass_through(maybe_jit):
    def f(x):
        h = jt.tag(x * 2, "h")
        return jnp.sum(h**2), {"name": "run-1", "step": 3, "lr": 0.5}

    (g, tag_grads), aux = jt.grad(f, has_aux=True)(X)
    assert aux == {"name": "run-1", "step": 3, "lr": 0.5}
    assert type(aux["step"]) is int and type(aux["lr"]) is float
    assert_close(tag_grads["h"], 4 * X)
    out, values = jt.capture(lambda x: (jt.tag(x, "h"), 3, 1.5, "s"))(2.0)
    assert out[1:] == (3, 1.5, "s") and isinstance(out[0], jax.Array) and isinstance(values["h"], jax.Array)
    assert jt.patch(lambda x: (jt.tag(x, "h") * 2, "s"), {"h": lambda v: v + 1})(2.0)[1] == "s"


def test_ensure_compile_time_eval_tag_is_reported():
    def f(x):
        with jax.ensure_compile_time_eval():
            k = jt.tag(jnp.ones(3) * 3, "k")
        return jnp.sum(k * jt.tag(x, "x"))

    # The output depends on k, so leaving it out of tags=None would be a silent drop.
    for tags in (None, "k", ["k", "x"], lambda n: n == "k"):
        with pytest.raises(jt.TagError, match="'k'.*ensure_compile_time_eval"):
            jt.grad(f, tags=tags)(X)
    with pytest.raises(jt.TagError, match="'k'.*ensure_compile_time_eval"):
        jt.capture(f)(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jt.grad(f, tags="x")(X)  # not asked for, not warned about


# --- jax.vmap of lax.cond with a per-example predicate -------------------------------------

XS = jnp.array([1.5, -2.0, 3.0, -0.5])


def branchy(x, e=None, repeated=False):
    """Both branches tag 'b' (or add e): one site; 'log' only in the first branch."""

    def mark(v, name, i):
        if e is None:
            return jt.tag(v, name, repeated=repeated)
        return v + e[i]

    def pos(x):
        return jnp.sin(mark(jnp.log(x), "b", 0)) + mark(jnp.log(x) * 2, "log", 1)

    def neg(x):
        return jnp.cos(mark(x * 3, "b", 0))

    return lax.cond(x > 0, pos, neg, x)


@pytest.mark.long_eager
@pytest.mark.parametrize("repeated", [False, True])
def test_vmapped_cond_masks_values_and_merges_branches(maybe_jit, repeated):
    f = lambda xs: jnp.sum(jax.vmap(lambda x: branchy(x, repeated=repeated))(xs) ** 2)  # noqa: E731
    f_eps = lambda xs, e: jnp.sum(jax.vmap(lambda x, e: branchy(x, e))(xs, e) ** 2)  # noqa: E731
    e0 = jnp.zeros((XS.shape[0], 2))
    g, tag_grads, values = maybe_jit(jt.grad(f, with_values=True))(XS)
    oracle = jax.grad(f_eps, argnums=1)(XS, e0)
    assert tag_grads["b"].shape == (4,) and tag_grads["log"].shape == (4,)
    assert_close(tag_grads, {"b": oracle[:, 0], "log": oracle[:, 1]})
    assert_close(g, jax.grad(f_eps)(XS, e0))
    pos = XS > 0
    safe_log = jnp.log(jnp.where(pos, XS, 1.0))
    expected = {"b": jnp.where(pos, safe_log, 3 * XS), "log": jnp.where(pos, 2 * safe_log, 0.0)}
    assert_close(values, expected)
    _, captured = maybe_jit(jt.capture(f))(XS)
    assert_close(captured, expected)
    # Per example, the unbatched cond gives the same values (zeros for the branch not taken).
    for n, x in enumerate(XS):
        _, one = jt.capture(lambda x: branchy(x, repeated=repeated))(x)
        assert_close({k: v[n] for k, v in captured.items()}, one)


def test_vmapped_cond_inside_scan_and_nested_vmap(maybe_jit):
    xs = jnp.stack([XS, -XS[::-1], XS * 0.5])  # (T=3, B=4)

    def f(xs, e=None):
        def body(c, x):
            if e is None:
                out = jax.vmap(jax.vmap(lambda x: branchy(x)))(x[None, :])[0]
            else:
                x, ee = x
                out = jax.vmap(jax.vmap(lambda x, ee: branchy(x, ee)))(x[None, :], ee[None])[0]
            return c + jnp.sum(out**2), None

        steps = xs if e is None else (xs, e)
        return lax.scan(body, 0.0, steps)[0]

    e0 = jnp.zeros((3, 4, 2))
    _, tag_grads = maybe_jit(jt.grad(f))(xs)
    oracle = jax.grad(f, argnums=1)(xs, e0)
    assert tag_grads["b"].shape == (3, 1, 4)
    assert_close(tag_grads["b"][:, 0], oracle[..., 0])
    _, values = maybe_jit(jt.capture(f))(xs)
    assert_close(values["log"][:, 0], jnp.where(xs > 0, 2 * jnp.log(jnp.where(xs > 0, xs, 1.0)), 0.0))


def test_vmapped_cond_patch_and_jvp(maybe_jit):
    f = lambda xs: jax.vmap(branchy)(xs)  # noqa: E731
    patched = maybe_jit(jt.patch(f, {"b": lambda v: 2 * v}))(XS)
    expected = jax.vmap(lambda x: lax.cond(x > 0, lambda x: jnp.sin(2 * jnp.log(x)) + 2 * jnp.log(x),
                                           lambda x: jnp.cos(6 * x), x))(XS)
    assert_close(patched, expected)
    _, _, tangents = jt.jvp(f, (XS,), (jnp.ones_like(XS),))
    assert_close(tangents["b"], jnp.where(XS > 0, 1 / XS, 3.0))
    assert_close(tangents["log"], jnp.where(XS > 0, 2 / XS, 0.0))


def test_vmapped_cond_without_tags_is_left_to_jax():
    f = jax.vmap(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x))
    assert str(jax.make_jaxpr(f)(XS)).count("select_n") >= 1
    assert "jaxtrace" not in str(jax.make_jaxpr(f)(XS))


# --- a trace JAX reuses for two uses is two uses, never merged as copies --------------------


def test_a_cached_jit_called_twice_is_two_calls(maybe_jit):
    g = jax.jit(lambda x: jt.tag(jnp.sin(x), "r", repeated=True))
    f = lambda x: jnp.sum(g(g(x)) ** 2)  # noqa: E731
    f_eps = lambda x, e: jnp.sum((jnp.sin(jnp.sin(x) + e[0]) + e[1]) ** 2)  # noqa: E731
    e0 = jnp.zeros((2, 3))
    _, tag_grads = maybe_jit(jt.grad(f))(X)
    assert_close(tag_grads["r"], jax.grad(f_eps, argnums=1)(X, e0))
    _, values = maybe_jit(jt.capture(f))(X)
    assert_close(values["r"], jnp.stack([jnp.sin(X), jnp.sin(jnp.sin(X))]))


@pytest.mark.parametrize(
    "use",
    [
        lambda g, x: g(g(x)),
        lambda g, x: g(x) + jax.jvp(g, (2 * x,), (x,))[1],
        lambda g, x: jax.grad(lambda x: jnp.sum(jax.checkpoint(g)(x) * jax.checkpoint(g)(2 * x)))(x),
    ],
    ids=["jit-twice", "jvp-of-cached", "checkpoint-twice-under-grad"],
)
def test_reused_traces_of_a_plain_tag_are_an_error_not_a_merge(use):
    g = jax.jit(lambda x: jt.tag(jnp.sin(x), "n"))
    with pytest.raises(jt.TagError, match="'n' is used at 2 sites"):
        jt.grad(lambda x: jnp.sum(use(g, x)))(X)


# --- several calls of one tag inside one branch of a vmapped cond ---------------------------


def twice_in_a_branch(x, e=None, repeated=True, name="r"):
    """Branch 'pos' calls the tag twice, 'neg' once then once more inside a nested vmapped cond."""

    def mark(v, i):
        return jt.tag(v, name, repeated=repeated) if e is None else v + e[i]

    def pos(x):
        return jnp.sin(mark(jnp.cos(mark(x * 2, 0)), 1))

    def neg(x):
        y = mark(x * 3, 0)
        return lax.cond(y < -3, lambda y: mark(jnp.tanh(y), 1), lambda y: y**2, y)

    return lax.cond(x > 0, pos, neg, x)


def test_repeated_calls_in_a_vmapped_cond_are_stacked(maybe_jit):
    f = lambda xs: jnp.sum(jax.vmap(twice_in_a_branch)(xs) ** 2)  # noqa: E731
    f_eps = lambda xs, e: jnp.sum(jax.vmap(lambda x, e: twice_in_a_branch(x, e))(xs, e) ** 2)  # noqa: E731
    e0 = jnp.zeros((XS.shape[0], 2))
    g, tag_grads, values = maybe_jit(jt.grad(f, with_values=True))(XS)
    assert tag_grads["r"].shape == (2, 4)  # calls first, then the vmap axis, as without the cond
    assert_close(tag_grads["r"], jax.grad(f_eps, argnums=1)(XS, e0).T)
    assert_close(g, jax.grad(f_eps)(XS, e0))
    _, captured = maybe_jit(jt.capture(f))(XS)
    assert_close(captured, values)
    # Per example, the unbatched cond gives the same layout and values (zeros where not taken).
    for n, x in enumerate(XS):
        _, one = jt.capture(twice_in_a_branch)(x)
        assert_close(one["r"], captured["r"][:, n])
    # The same under a jt.grad inside the vmap (the cond is then unbatched in the split program).
    _, per_example = maybe_jit(jax.vmap(jt.grad(lambda x: twice_in_a_branch(x) ** 2)))(XS)
    assert per_example["r"].shape == (4, 2)
    assert_close(per_example["r"].T, tag_grads["r"])


@pytest.mark.parametrize("nested", [False, True])
def test_a_name_twice_in_a_vmapped_cond_branch_needs_repeated(nested):
    def g(x):
        if nested:
            return twice_in_a_branch(x, repeated=False)
        return lax.cond(x > 0, lambda x: jt.tag(jnp.sin(jt.tag(x, "r")), "r"), jnp.cos, x)

    with pytest.raises(jt.TagError, match="'r' is used at 2 sites"):
        jt.grad(lambda xs: jnp.sum(jax.vmap(g)(xs)))(XS)
    with pytest.raises(jt.TagError, match="'r' is used at 2 sites"):  # as in an unbatched cond
        jt.grad(g)(XS[0])


# --- what a split returns is the tagged value: transforms around it see the path through it ---


def inner(x):
    h = jt.tag(jnp.sin(x), "h")
    return jnp.sum(h**2)


def reads_captured(x):
    out, values = jt.capture(inner)(x)
    return out + jnp.sum(values["h"] ** 3)


def reads_captured_eps(x, e):
    h = jnp.sin(x) + e
    return jnp.sum(h**2) + jnp.sum(h**3)


def test_jt_grad_sees_the_path_through_captured_values(maybe_jit):
    e0 = jnp.zeros_like(X)
    g, tag_grads = maybe_jit(jt.grad(reads_captured))(X)
    assert_close(tag_grads["h"], jax.grad(reads_captured_eps, argnums=1)(X, e0))
    assert_close(g, jax.grad(reads_captured_eps)(X, e0))
    # The tag read only through the captured value still gets its gradient.
    only = lambda x: jnp.sum(jt.capture(inner)(x)[1]["h"] ** 3)  # noqa: E731
    _, tag_grads = maybe_jit(jt.grad(only))(X)
    assert_close(tag_grads["h"], 3 * jnp.sin(X) ** 2)
    # with_values of an inner jt.value_and_grad is the tagged value too.
    def reads_values(x):
        value, _, values = jt.value_and_grad(inner, with_values=True)(x)
        return value + jnp.sum(values["h"] ** 3)

    _, tag_grads = maybe_jit(jt.grad(reads_values))(X)
    assert_close(tag_grads["h"], jax.grad(reads_captured_eps, argnums=1)(X, e0))


def test_patch_and_patch_grad_reach_captured_values(maybe_jit):
    out, values = maybe_jit(jt.patch(jt.capture(inner), {"h": jnp.full(X.shape, 0.5)}))(X)
    assert_close(values["h"], jnp.full(X.shape, 0.5))
    assert_close(out, jnp.sum(jnp.full(X.shape, 0.25)))
    _, values = maybe_jit(jt.patch(jt.capture(inner), {"h": lambda v: 2 * v}))(X)
    assert_close(values["h"], 2 * jnp.sin(X))
    # A patch_grad that zeroes the gradient at h is not bypassed through the captured value.
    cut = jt.patch_grad(reads_captured, {"h": lambda g: jnp.zeros_like(g)})
    assert_close(maybe_jit(jax.grad(cut))(X), jnp.zeros_like(X))
    halved = jt.patch_grad(reads_captured, {"h": lambda g: 0.5 * g})
    assert_close(maybe_jit(jax.grad(halved))(X), 0.5 * jax.grad(reads_captured_eps)(X, jnp.zeros_like(X)))


# --- found by the property grammar -----------------------------------------------------------

W3 = jax.random.normal(jax.random.PRNGKey(0), (3, 3)) / 2


def moved_axis(w, x, e=None):
    """Repeated calls in a vmap, the batch axis moved by the matmul between them."""

    def body(x, e):
        for i in range(2):
            x = jt.tag(x, "r", repeated=True) if e is None else x + e[i]
            x = w @ x
        return x

    xs = jnp.stack([x, 2 * x])
    return jnp.sum(jnp.sin(jax.vmap(body)(xs, e) if e is not None else jax.vmap(lambda x: body(x, None))(xs)))


def test_repeated_calls_whose_vmap_axis_moves_are_stacked(maybe_jit):
    _, tag_grads, values = maybe_jit(jt.grad(moved_axis, with_values=True))(W3, X)
    oracle = jax.grad(moved_axis, argnums=2)(W3, X, jnp.zeros((2, 2, 3)))  # (batch, calls, 3)
    assert tag_grads["r"].shape == (2, 2, 3)  # calls, then the vmap axis
    assert_close(tag_grads["r"], jnp.swapaxes(oracle, 0, 1))
    xs = jnp.stack([X, 2 * X])
    assert_close(values["r"], jnp.stack([xs, xs @ W3.T]))
    patched = jt.patch(moved_axis, {"r": jnp.stack([xs, xs])})(W3, X)  # a patch goes back in each layout
    assert_close(patched, jnp.sum(jnp.sin(xs @ W3.T)))


def pairs_in_checkpoint(p, x, e=None):
    """Three repeated calls of a pair tag in a jax.checkpoint."""

    def body(x, e):
        for i in range(3):
            if e is None:
                a, b = jt.tag((x, jnp.sin(x)[:2]), "r", repeated=True)
            else:
                a, b = x + e[0][i], jnp.sin(x)[:2] + e[1][i]
            x = a + 0.5 * jnp.sum(b)
        return x

    return jnp.sum(jnp.sin(jax.checkpoint(body)(x * p, e)))


def test_jt_grad_around_jt_grad_of_repeated_calls_in_a_checkpoint(maybe_jit):
    """Under the inner gradient JAX inlines the checkpoint's forward pass (one equation per call)
    and keeps its backward copy as one remat of two of the calls: a copy, not two more calls."""

    def outer(p, x):
        value, (_, tag_grads) = jt.value_and_grad(pairs_in_checkpoint)(p, x)
        return value + 0.1 * sum(jnp.sum(g**2) for g in jax.tree_util.tree_leaves(tag_grads))

    def outer_eps(p, x, e):
        inner = lambda e1: pairs_in_checkpoint(p, x, jax.tree_util.tree_map(jnp.add, e, e1))  # noqa: E731
        value, g = jax.value_and_grad(inner)(jax.tree_util.tree_map(jnp.zeros_like, e))
        return value + 0.1 * sum(jnp.sum(l**2) for l in jax.tree_util.tree_leaves(g))

    e0 = (jnp.zeros((3, 3)), jnp.zeros((3, 2)))
    g, tag_grads = maybe_jit(jt.grad(outer))(1.3, X)
    assert_close(tag_grads["r"], jax.grad(outer_eps, argnums=2)(1.3, X, e0), rtol=1e-10, atol=1e-12)
    assert_close(g, jax.grad(outer_eps)(1.3, X, e0), rtol=1e-10, atol=1e-12)


def pairs_in_a_switch(x, e=None):
    """Two repeated calls of a pair tag in a switch branch (taken), in a jax.checkpoint."""

    def branch(x):
        for i in range(2):
            if e is None:
                a, b = jt.tag((x, jnp.sin(x)[:2]), "r", repeated=True)
            else:
                a, b = x + e[0][i], jnp.sin(x)[:2] + e[1][i]
            x = a + 0.5 * jnp.sum(b)
        return x

    x = jnp.cos(jnp.cos(x))
    return jax.checkpoint(lambda x: lax.switch((jnp.sum(x) < 0).astype(jnp.int32), [branch, jnp.tanh], x))(x)


@pytest.mark.long_eager
@pytest.mark.parametrize("uses", [1, 2])
def test_a_partial_remat_copy_under_an_inner_grad_is_a_copy(maybe_jit, uses):
    """JAX's backward pass rematerialises only the first call of the branch: a copy of that call.
    With ``uses=2`` the checkpointed function's cached trace is also called once more directly:
    two uses, stacked (the copy belongs to the differentiated one)."""

    def g(x, e=None):
        first = None if e is None else jax.tree_util.tree_map(lambda v: v[:2], e)
        loss = lambda x: jnp.sum(jnp.sin(pairs_in_a_switch(x, first)))  # noqa: E731
        value, grad = jax.value_and_grad(loss)(x)
        out = value + 0.1 * jnp.sum(grad**2)
        if uses == 1:
            return out
        return out + jnp.sum(pairs_in_a_switch(x, None if e is None else jax.tree_util.tree_map(lambda v: v[2:], e)))

    e0 = (jnp.zeros((2 * uses, 3)), jnp.zeros((2 * uses, 2)))
    _, tag_grads = maybe_jit(jt.grad(g))(X)
    assert_close(tag_grads["r"], jax.grad(g, argnums=1)(X, e0))
    _, _, tangents = jt.jvp(g, (X,), (jnp.ones(3),))
    _, want = jax.jvp(lambda x: jt.capture(lambda x: pairs_in_a_switch(x))(x)[1]["r"], (X,), (jnp.ones(3),))
    assert_close(tangents["r"], jax.tree_util.tree_map(lambda w: jnp.concatenate([w] * uses), want))
