"""Tags inside JAX constructs (loops, vmap, cond, remat, jit) and composition with
the user's own transforms, each against an explicit-perturbation oracle."""

import jax
import jax.numpy as jnp
import pytest
from oracles import assert_close, hlo
from jax import lax

import jaxtrace as jt

T, B, H = 5, 3, 4
W = jax.random.normal(jax.random.PRNGKey(0), (H, H)) / 2
XS = jax.random.normal(jax.random.PRNGKey(1), (T, B, H))
H0 = jax.random.normal(jax.random.PRNGKey(2), (B, H))


def rnn(w, xs, h0, eps=None, reverse=False):
    """tanh RNN; with ``eps`` (T, B, H) the oracle adds it to each step's state."""

    def step(h, inp):
        x, e = inp
        h = jnp.tanh(h @ w + x)
        h = jt.tag(h, "h") if e is None else h + e
        return h, jnp.sum(h**2)

    steps = (xs, None) if eps is None else (xs, eps)
    if eps is None:
        step_fn = lambda h, x: step(h, (x, None))  # noqa: E731
        h, ys = lax.scan(step_fn, h0, xs, reverse=reverse)
    else:
        h, ys = lax.scan(step, h0, steps, reverse=reverse)
    return jnp.sum(ys) + jnp.sum(jnp.cos(h))


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_stacks_per_step(maybe_jit, reverse):
    grads, tag_grads = maybe_jit(jt.grad(lambda w: rnn(w, XS, H0, reverse=reverse)))(W)
    expected = jax.grad(lambda e: rnn(W, XS, H0, e, reverse=reverse))(jnp.zeros((T, B, H)))
    assert tag_grads["h"].shape == (T, B, H)
    assert_close(tag_grads["h"], expected)
    assert_close(grads, jax.grad(lambda w: rnn(w, XS, H0, reverse=reverse))(W))


def test_nested_scans_outer_axis_first(maybe_jit):
    def f(x, eps=None):
        def outer(c, i):
            def inner(c2, j):
                v = jnp.sin(c2 * (i + 1.0) + j)
                v = jt.tag(v, "v") if eps is None else v + eps[i.astype(int), j.astype(int)]
                return v, None

            c, _ = lax.scan(inner, c, jnp.arange(3.0))
            return c, None

        c, _ = lax.scan(outer, x, jnp.arange(2.0))
        return jnp.sum(c**2)

    x = jnp.linspace(0.1, 0.4, 4)
    _, tag_grads = maybe_jit(jt.grad(f))(x)
    expected = jax.grad(lambda e: f(x, e))(jnp.zeros((2, 3, 4)))
    assert_close(tag_grads["v"], expected)


def test_fori_loop_static_bounds_and_lax_map(maybe_jit):
    def f(x, eps=None):
        def body(i, c):
            c = jnp.sin(c) * 1.5
            return jt.tag(c, "c") if eps is None else c + eps["c"][i]

        c = lax.fori_loop(0, 4, body, x)

        def row(inp):
            r, i = inp
            m = r * jnp.cos(r)
            return jt.tag(m, "m") if eps is None else m + eps["m"][i]

        m = lax.map(row, (c[None] * jnp.arange(1.0, 3.0)[:, None], jnp.arange(2)))
        return jnp.sum(m * c)

    x = jnp.linspace(0.1, 0.4, 3)
    _, tag_grads = maybe_jit(jt.grad(f))(x)
    expected = jax.grad(lambda e: f(x, e))({"c": jnp.zeros((4, 3)), "m": jnp.zeros((2, 3))})
    assert_close(tag_grads, expected)


def test_vmap_inside_gives_per_example_axis(maybe_jit):
    def f(w, xs, eps=None):
        def per_example(x, e):
            h = jnp.tanh(x @ w)
            h = jt.tag(h, "h") if e is None else h + e
            return jnp.sum(h**3)

        e_axis = None if eps is None else 0
        return jnp.sum(jax.vmap(per_example, in_axes=(0, e_axis))(xs, eps))

    xs = XS[0]
    _, tag_grads = maybe_jit(jt.grad(f))(W, xs)
    assert_close(tag_grads["h"], jax.grad(lambda e: f(W, xs, e))(jnp.zeros((B, H))))


def test_vmap_batch_axis_not_leading_is_moved_first(maybe_jit):
    # The tagged value carries its vmap axis at position 1 inside the program.
    def f(w, xs, eps=None):
        def per_example(x, e):
            h = jnp.sin(w * x)  # (H, H) * (H,) -> batch axis of the result stays where vmap puts it
            h = jt.tag(h, "h") if e is None else h + e
            return jnp.sum(h**2)

        e_axis = None if eps is None else 0
        return jnp.sum(jax.vmap(per_example, in_axes=(1, e_axis))(xs, eps))

    xs = XS[0].T  # (H, B): examples along axis 1
    _, tag_grads = maybe_jit(jt.grad(f))(W, xs)
    expected = jax.grad(lambda e: f(W, xs, e))(jnp.zeros((B, H, H)))
    assert_close(tag_grads["h"], expected)


@pytest.mark.parametrize("order", ["vmap_of_scan", "scan_of_vmap"])
def test_scan_and_vmap_axis_order_is_loops_then_batch(maybe_jit, order):
    """The documented rule: loop axes first, then vmap axes, whatever the nesting."""

    def cell(h, x, e):
        h = jnp.tanh(h @ W + x)
        return jt.tag(h, "h") if e is None else h + e

    def f(xs, eps=None):  # xs: (T, B, H)
        if order == "vmap_of_scan":

            def one(xs_b, e_b):  # xs_b: (T, H), e_b: (T, H) or None
                def step(h, inp):
                    x, e = inp
                    h = cell(h, x, e)
                    return h, None

                h, _ = lax.scan(step, H0[0], (xs_b, e_b))
                return jnp.sum(h**2)

            e_axis = None if eps is None else 1
            return jnp.sum(jax.vmap(one, in_axes=(1, e_axis))(xs, eps))

        def step(h, inp):
            x, e = inp
            e_axis = None if e is None else 0
            h = jax.vmap(lambda hb, xb, eb: cell(hb, xb, eb), in_axes=(0, 0, e_axis))(h, x, e)
            return h, None

        h, _ = lax.scan(step, H0, (xs, eps))
        return jnp.sum(h**2)

    _, tag_grads = maybe_jit(jt.grad(f))(XS)
    assert tag_grads["h"].shape == (T, B, H)
    assert_close(tag_grads["h"], jax.grad(lambda e: f(XS, e))(jnp.zeros((T, B, H))))


def test_vmap_of_jt_grad_gives_per_example_grads(maybe_jit):
    def loss(w, x, e=None):
        h = jnp.tanh(x @ w)
        h = jt.tag(h, "h") if e is None else h + e
        return jnp.sum(h**2)

    xs = XS[0]
    grads, tag_grads = maybe_jit(jax.vmap(jt.grad(loss), in_axes=(None, 0)))(W, xs)
    expected_w, expected_h = jax.vmap(jax.grad(loss, argnums=(0, 2)), in_axes=(None, 0, None))(W, xs, jnp.zeros(H))
    assert_close(grads, expected_w)
    assert_close(tag_grads["h"], expected_h)


def test_cond_branch_not_taken_gives_zeros_and_shared_name_is_one_site(maybe_jit):
    def f(x, pred, eps=None):
        mark = (lambda v, n: jt.tag(v, n)) if eps is None else (lambda v, n: v + eps[n])

        def yes(v):
            return mark(jnp.sin(v), "branch") * mark(v * 2.0, "only_yes")

        def no(v):
            return mark(jnp.cos(v), "branch")

        return jnp.sum(lax.cond(pred, yes, no, x) ** 2)

    x = jnp.linspace(0.1, 0.5, 3)
    zeros = {"branch": jnp.zeros(3), "only_yes": jnp.zeros(3)}
    for pred in (True, False):
        _, tag_grads = maybe_jit(jt.grad(f))(x, pred)
        assert_close(tag_grads, jax.grad(lambda e: f(x, pred, e))(zeros))
    _, tag_grads = maybe_jit(jt.grad(f))(x, False)
    assert_close(tag_grads["only_yes"], jnp.zeros(3))


def test_switch_in_scan(maybe_jit):
    def f(x, eps=None):
        def step(c, i):
            branches = [lambda v: jnp.sin(v), lambda v: v * 3.0, lambda v: jnp.cos(v) * v]
            v = lax.switch(i % 3, [lambda v, b=b: (jt.tag(b(v), "s") if eps is None else b(v) + eps[i]) for b in branches], c)
            return v, None

        c, _ = lax.scan(step, x, jnp.arange(5))
        return jnp.sum(c**2)

    x = jnp.linspace(0.1, 0.5, 3)
    _, tag_grads = maybe_jit(jt.grad(f))(x)
    assert_close(tag_grads["s"], jax.grad(lambda e: f(x, e))(jnp.zeros((5, 3))))


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable])
def test_checkpoint_nested_jit_and_closed_call(maybe_jit, policy):
    from jax.extend.core import primitives

    def f(w, x, eps=None):
        mark = (lambda v, n: jt.tag(v, n)) if eps is None else (lambda v, n: v + eps[n])

        @jax.jit
        def inner(a):
            return mark(jnp.sin(a @ w), "jit")

        @jax.checkpoint if policy is None else (lambda g: jax.checkpoint(g, policy=policy))
        def block(a):
            return mark(jnp.tanh(inner(a) @ w), "remat")

        h = block(x)
        return jnp.sum(h**2)

    x = XS[0]
    zeros = {"jit": jnp.zeros((B, H)), "remat": jnp.zeros((B, H))}
    grads, tag_grads = maybe_jit(jt.grad(f))(W, x)
    expected_w, expected_tags = jax.grad(f, argnums=(0, 2))(W, x, zeros)
    assert_close(tag_grads, expected_tags)
    assert_close(grads, expected_w)

    closed = jax.make_jaxpr(lambda a: jt.tag(jnp.sin(a), "cc") * 2.0)(x)

    def g(a):
        params, subfuns = primitives.closed_call_p.get_bind_params({"call_jaxpr": closed}), ()
        if isinstance(params, tuple):  # JAX < 0.9.2 returns (subfuns, params)
            subfuns, params = params
        (out,) = primitives.closed_call_p.bind(*subfuns, a, **params)
        return jnp.sum(out**2)

    _, tag_grads = maybe_jit(jt.grad(g))(x)
    assert_close(tag_grads["cc"], 2.0 * 2.0 * jnp.sin(x) * 2.0)


def test_higher_order_penalty_on_tag_gradient(maybe_jit):
    """jax.grad of a function of the tag gradients (a gradient penalty on a hidden layer)."""

    def loss(w, x, e=None):
        h = jnp.tanh(x @ w)
        h = jt.tag(h, "h") if e is None else h + e
        return jnp.sum(jnp.sin(h @ w))

    x = XS[0]

    def penalty(w):
        _, tag_grads = jt.grad(loss)(w, x)
        return jnp.sum(tag_grads["h"] ** 2)

    def penalty_oracle(w):
        return jnp.sum(jax.grad(loss, argnums=2)(w, x, jnp.zeros((B, H))) ** 2)

    assert_close(maybe_jit(jax.grad(penalty))(W), jax.grad(penalty_oracle)(W))
    hessian_vector = jax.jvp(jax.grad(penalty), (W,), (jnp.ones_like(W),))[1]
    assert_close(hessian_vector, jax.jvp(jax.grad(penalty_oracle), (W,), (jnp.ones_like(W),))[1])


def test_jt_grad_inside_scan_body(maybe_jit):
    def loss(w, x):
        return jnp.sum(jt.tag(jnp.sin(x * w), "h") ** 2)

    def train(w):
        def step(w, x):
            grads, tag_grads = jt.grad(loss)(w, x)
            return w - 0.1 * grads, tag_grads["h"]

        return lax.scan(step, w, XS[:, 0])

    w_final, hs = maybe_jit(train)(W[0])

    def oracle(w):
        def step(w, x):
            g, gh = jax.grad(lambda w, e: jnp.sum((jnp.sin(x * w) + e) ** 2), argnums=(0, 1))(w, jnp.zeros(H))
            return w - 0.1 * g, gh

        return lax.scan(step, w, XS[:, 0])

    assert_close((w_final, hs), oracle(W[0]))


def test_tagged_function_calling_jax_grad_inside(maybe_jit):
    """A meta-learning step: the tagged loss runs inside an inner jax.grad and again outside."""

    def inner_loss(w, x, e):
        h = jnp.tanh(x @ w)
        return jnp.sum((jt.tag(h, "h", repeated=True) if e is None else h + e) ** 2)

    def outer(w, x, eps=None):
        e0, e1 = (None, None) if eps is None else eps
        w_adapted = w - 0.5 * jax.grad(inner_loss)(w, x, e0)
        return inner_loss(w_adapted, x * 2.0, e1)

    x = XS[0]
    _, tag_grads = maybe_jit(jt.grad(outer))(W, x)
    expected = jax.grad(lambda e: outer(W, x, e))((jnp.zeros((B, H)), jnp.zeros((B, H))))
    assert_close(tag_grads["h"], jnp.stack(expected))


def test_meta_learning_inner_grad_oracle(maybe_jit):
    def inner_loss(w, x, e):
        h = jt.tag(jnp.tanh(x @ w), "h") if e is None else jnp.tanh(x @ w) + e
        return jnp.sum(h**2)

    def outer(w, x, e=None):
        w_adapted = w - 0.5 * jax.grad(inner_loss)(w, x, e)
        return jnp.sum(jnp.sin(x @ w_adapted))

    x = XS[0]
    _, tag_grads = maybe_jit(jt.grad(outer))(W, x)
    expected = jax.grad(lambda e: outer(W, x, e))(jnp.zeros((B, H)))
    assert_close(tag_grads["h"], expected)


def test_repeated_tag_stacks_calls_in_order(maybe_jit):
    w_shared = W

    def f(x, eps=None):
        for i in range(3):
            x = jnp.tanh(x @ w_shared)
            x = jt.tag(x, "block", repeated=True) if eps is None else x + eps[i]
        return jnp.sum(x**2)

    x = XS[0]
    _, tag_grads = maybe_jit(jt.grad(f))(x)
    assert_close(tag_grads["block"], jax.grad(lambda e: f(x, e))(jnp.zeros((3, B, H))))


def test_repeated_tag_inside_scan_body(maybe_jit):
    def f(x, eps=None):
        def step(c, i):
            for k in range(2):
                c = jnp.sin(c) + 0.5
                c = jt.tag(c, "r", repeated=True) if eps is None else c + eps[i, k]
            return c, None

        c, _ = lax.scan(step, x, jnp.arange(4))
        return jnp.sum(c**2)

    x = jnp.linspace(0.1, 0.5, 3)
    _, tag_grads = maybe_jit(jt.grad(f))(x)
    assert_close(tag_grads["r"], jax.grad(lambda e: f(x, e))(jnp.zeros((4, 2, 3))))


# --- cost -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mlp", "scan", "vmap_axis1", "cond", "vmap_cond"])
def test_jax_grad_of_tagged_function_compiles_to_same_hlo(case):
    def model(w, x, mark):
        if case == "mlp":
            return jnp.sum(jnp.tanh(mark(x @ w, "a")) @ w)
        if case == "scan":
            return jnp.sum(lax.scan(lambda c, xi: (mark(jnp.tanh(c @ w + xi), "h"), None), x[0], XS[:, 0])[0])
        if case == "vmap_axis1":
            return jnp.sum(jax.vmap(lambda col: mark(jnp.sin(w * col), "v"), in_axes=1)(x.T))
        if case == "vmap_cond":  # a per-example predicate: jaxtrace masks the tags in the branches
            branch = lambda r: lax.cond(r.sum() > 0, lambda r: mark(jnp.sin(r), "b"), lambda r: mark(r * 3, "b"), r)  # noqa: E731,E501
            return jnp.sum(jax.vmap(branch)(x[:, None] * w))
        return jnp.sum(lax.cond(x.sum() > 0, lambda a: mark(a * 2, "c"), lambda a: a, x @ w))

    tagged = jax.grad(lambda w, x: model(w, x, jt.tag))
    plain = jax.grad(lambda w, x: model(w, x, lambda v, n: v))
    assert hlo(tagged, W, XS[0]) == hlo(plain, W, XS[0])


def test_no_retrace_on_second_call():
    traces = []

    def f(w, x):
        traces.append(1)
        return jnp.sum(jt.tag(jnp.tanh(x @ w), "h") ** 2)

    step = jax.jit(jt.value_and_grad(f))
    step(W, XS[0])
    step(W * 2, XS[1])
    assert len(traces) == 1
