"""jt.value_grad_and_norms and jt.NormHistory: spike forensics from the step that spiked, without re-running.

The gradient and the norms against the definition (row ``i`` of ``jax.jacrev`` of the losses vector,
float64), under jit and without; one backward pass (XLA's flop count); the ring buffer's slots as it
wraps around; the report's ratios against NumPy; and a jitted equinox + optax training loop with an
outlier injected at a known step and example: the report of that step names the step, the example and
the layers the outlier hits, from the history the step carried.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrace as jt
from oracles import assert_close, oracle_per_example

KEY = jax.random.key(0)
F64 = jnp.float64


def f64(model):
    return jax.tree.map(lambda a: a.astype(F64) if eqx.is_inexact_array(a) else a, model)


class TwoBranch(eqx.Module):
    """Features 0-3 enter through ``a``, 4-7 through ``b``; their sum, through a ReLU, to ``head``."""

    a: eqx.nn.Linear
    b: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key, width=16):
        ka, kb, kh = jax.random.split(key, 3)
        self.a, self.b = eqx.nn.Linear(4, width, key=ka), eqx.nn.Linear(4, width, key=kb)
        self.head = eqx.nn.Linear(width, 1, key=kh)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.a(x[:4]) + self.b(x[4:])))


def losses_fn(model, x, y):
    return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)


def batch(key, n=12):
    x = jax.random.normal(key, (n, 8), F64)
    return x, jnp.sin(x[:, :1]) + jnp.cos(x[:, 4:5])


def stacked(sq_norms) -> np.ndarray:
    """``(B, L)``: the per-leaf squared norms side by side, in the order of the pytree's leaves."""
    return np.stack([np.asarray(leaf) for leaf in jax.tree.leaves(sq_norms)], axis=-1)


# --- value_grad_and_norms against the definition ---------------------------------------------------


@pytest.mark.long_eager  # eagerly, the pass runs op by op: seconds; its jit variant always runs
def test_value_grad_and_norms_against_jacrev(maybe_jit):
    model = f64(TwoBranch(KEY))
    x, y = batch(jax.random.key(1))
    losses, (grads, sq) = maybe_jit(jt.value_grad_and_norms(losses_fn))(model, x, y)
    ref = oracle_per_example(losses_fn, model, x, y)
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-12)
    mean_grad = jax.tree.map(lambda rows: jnp.mean(rows, axis=0), ref.grads)  # the gradient of the mean loss
    assert all(g.dtype == F64 for g in jax.tree.leaves(grads))
    assert_close(grads, mean_grad, "the gradient of the mean loss", rtol=1e-10, atol=1e-13)
    assert_close(sq, ref.sq_norms, "per-leaf squared norms", rtol=1e-10, atol=1e-13)
    # and the gradient is the plain step's
    plain = eqx.filter_grad(lambda m: jnp.mean(losses_fn(m, x, y)))(model)
    assert_close(grads, plain, "the plain step's gradient", rtol=1e-10, atol=1e-13)


def test_value_grad_and_norms_has_aux_and_nnx():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(nnx.Linear(3, 5, rngs=nnx.Rngs(0), param_dtype=F64), nnx.Linear(5, 2, rngs=nnx.Rngs(1), param_dtype=F64))
    x = jax.random.normal(jax.random.key(2), (6, 3), F64)

    def fun(m, x):
        out = m(x)
        return jnp.sum(out**2, axis=-1), jnp.max(out)

    (losses, aux), (grads, sq) = jt.value_grad_and_norms(fun, has_aux=True)(model, x)
    ref = oracle_per_example(lambda m, x: fun(m, x)[0], model, x)
    np.testing.assert_allclose(aux, jnp.max(model(x)), rtol=1e-12)
    assert_close(sq, ref.sq_norms, "per-leaf squared norms", rtol=1e-10, atol=0)
    assert_close(grads, jax.tree.map(lambda r: r.mean(0), ref.grads), "the gradient of the mean loss", rtol=1e-10, atol=1e-13)
    history = jt.NormHistory.init(2, losses, sq)
    assert history.names == ("layers.0.bias", "layers.0.kernel", "layers.1.bias", "layers.1.kernel")


def test_one_backward_pass():
    """XLA's flop count: the gradient and the norms cost about one plain gradient on an MLP (no second
    backward pass; the norms of a Linear layer on one position per example are O(B d) each)."""
    model = eqx.nn.MLP(64, 10, 64, 3, key=KEY)
    x, y = jnp.ones((32, 64)), jnp.zeros((32, 10))
    arrays, static = eqx.partition(model, eqx.is_array)

    def flops(f):
        compiled = jax.jit(lambda a, x, y: f(eqx.combine(a, static), x, y)).lower(arrays, x, y).compile()
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]

    plain = flops(eqx.filter_value_and_grad(lambda m, x, y: jnp.mean(losses_fn(m, x, y))))
    ours = flops(jt.value_grad_and_norms(losses_fn))
    twice = flops(lambda m, x, y: (jt.per_example_norms(losses_fn)(m, x, y), eqx.filter_grad(lambda m: jnp.mean(losses_fn(m, x, y)))(m)))
    assert ours <= 1.1 * plain, (ours, plain)
    assert ours < twice, (ours, twice)


class EveryRoute(eqx.Module):
    """A model whose leaves take every route of ``value_grad_and_norms``' gradient: a tanh RNN closing over
    ``w`` and ``u`` in ``lax.scan`` (each example's weight gradient formed: its 12 steps are more than half
    the width), its bias (a vector leaf), a Linear at every position of a sequence (the gradient formed)
    and one on the pooled features (the Gram form), a convolution at many output positions (its blocks per
    kernel offset) and one at few, wide (the Gram form), embeddings through one-hot factors (a wide table:
    the Gram form; a narrow one read many times: the gradient formed), and a leaf transformed before its
    use (the exact path)."""

    w: jax.Array
    u: jax.Array
    b: jax.Array
    seq: eqx.nn.Linear
    head: eqx.nn.Linear
    conv_many: eqx.nn.Conv2d
    conv_wide: eqx.nn.Conv2d
    wide_table: eqx.nn.Embedding
    narrow_table: eqx.nn.Embedding
    raw: jax.Array

    def __init__(self, key):
        k = jax.random.split(key, 10)
        self.w, self.u = 0.4 * jax.random.normal(k[0], (5, 5)), 0.4 * jax.random.normal(k[1], (3, 5))
        self.b = 0.1 * jax.random.normal(k[2], (5,))
        self.seq, self.head = eqx.nn.Linear(5, 6, key=k[3]), eqx.nn.Linear(6, 6, key=k[4])
        self.conv_many = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[5])
        self.conv_wide = eqx.nn.Conv2d(3, 8, 3, stride=4, padding=1, key=k[6])
        self.wide_table, self.narrow_table = eqx.nn.Embedding(11, 6, key=k[7]), eqx.nn.Embedding(3, 2, key=k[8])
        self.raw = 0.3 * jax.random.normal(k[9], (6,))

    def __call__(self, xs, image, ids, few_ids):
        h, hs = jax.lax.scan(lambda h, x: (jnp.tanh(h @ self.w + x @ self.u + self.b),) * 2, jnp.zeros(5, xs.dtype), xs)
        seq = jax.vmap(self.seq)(hs)  # (12, 6): 12 positions
        pooled = self.head(jnp.tanh(seq.mean(0))) * jnp.exp(jnp.tanh(self.raw))
        c = self.conv_wide(jnp.tanh(self.conv_many(image)))  # 8x8 positions, then 2x2
        emb = jax.vmap(self.wide_table)(few_ids).sum(0) + jnp.concatenate([jax.vmap(self.narrow_table)(ids).sum(0), jnp.zeros(4)])
        return jnp.sum(pooled * emb) + jnp.sum(c**2) + jnp.sum(h)


def every_route_losses(model, xs, image, ids, few_ids):
    return jax.vmap(model)(xs, image, ids, few_ids) ** 2


def every_route_batch(b=5):
    k = jax.random.split(jax.random.key(3), 4)
    return (jax.random.normal(k[0], (b, 12, 3), F64), jax.random.normal(k[1], (b, 2, 8, 8), F64),
            jax.random.randint(k[2], (b, 9), 0, 3), jax.random.randint(k[3], (b, 2), 0, 11))


@pytest.mark.parametrize("b", [5, 1])
@pytest.mark.long_eager
def test_value_grad_and_norms_every_route_against_jacrev(maybe_jit, b):
    """The gradient from the norms' own factors (each example's gradient summed where the norm forms it,
    one contraction of the factors elsewhere, the rows of the exact path) is the mean of the definition's
    rows, and the norms are the definition's, float64; and ``clipped_grad``'s weighted sum by the same
    routes is the definition's clipped sum."""
    from jaxtrace._per_example._pass import Call

    model, batch_ = f64(EveryRoute(KEY)), every_route_batch(b)
    if b > 1:  # every route is taken (not a test of nothing); traced only
        paths = []
        jax.make_jaxpr(lambda *a: paths.extend(Call(every_route_losses, 0, "vmap", False, a, {}).leaf_paths()))(model, *batch_)
        assert {p for p, _ in paths} == {"factors", "exact"}, paths
    losses, (grads, sq) = maybe_jit(jt.value_grad_and_norms(every_route_losses))(model, *batch_)
    ref = eqx.filter_jit(oracle_per_example)(every_route_losses, model, *batch_)
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-12)
    for ours, want in zip(jax.tree.leaves(grads), jax.tree.leaves(jax.tree.map(lambda r: jnp.mean(r, axis=0), ref.grads))):
        assert ours.dtype == F64
        np.testing.assert_allclose(ours, want, rtol=1e-10, atol=1e-13)
    for ours, want in zip(jax.tree.leaves(sq), jax.tree.leaves(ref.sq_norms)):
        np.testing.assert_allclose(ours, want, rtol=1e-10, atol=1e-13)
    # clipped_grad's weighted sum takes the same routes (the bound bites for about half the examples)
    c = float(jnp.median(jnp.sqrt(ref.total)))
    clipped = maybe_jit(jt.clipped_grad(every_route_losses, c))(model, *batch_)[1]
    for ours, want in zip(jax.tree.leaves(clipped), jax.tree.leaves(ref.clipped(c))):
        np.testing.assert_allclose(ours, want, rtol=1e-10, atol=1e-13)


def test_the_gradient_is_not_formed_twice():
    """XLA's flop count: where the norms form each example's weight gradient (a convolution at many
    positions, an RNN's weights over its steps), the gradient is their sum, and the backward pass's own
    weight gradient is left out of the program: the step costs about the plain one, not one weight
    gradient more (the scan unrolled, so that each step's products are counted); nor does
    ``clipped_grad``, whose weighted sum is of the same per-example gradients."""

    class RNN(eqx.Module):
        w: jax.Array
        u: jax.Array

        def __call__(self, xs):
            h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ self.w + x @ self.u), None), jnp.zeros(32), xs, unroll=True)
            return jnp.sum(h**2)

    class CNN(eqx.Module):
        convs: list

        def __call__(self, x):
            for conv in self.convs:
                x = jax.nn.relu(conv(x))
            return jnp.sum(x.mean((1, 2)) ** 2)

    k = jax.random.split(KEY, 4)
    rnn = RNN(0.2 * jax.random.normal(k[0], (32, 32)), 0.2 * jax.random.normal(k[1], (8, 32)))
    cnn = CNN([eqx.nn.Conv2d(3, 16, 3, padding=1, key=k[2]), eqx.nn.Conv2d(16, 32, 3, stride=2, padding=1, key=k[3])])
    for model, x in ((rnn, jnp.ones((8, 24, 8))), (cnn, jnp.ones((8, 3, 16, 16)))):
        losses = lambda m, x: jax.vmap(m)(x)  # noqa: E731
        arrays, static = eqx.partition(model, eqx.is_array)

        def flops(f):
            compiled = jax.jit(lambda a, x: f(eqx.combine(a, static), x)).lower(arrays, x).compile()
            cost = compiled.cost_analysis()
            return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]

        plain = flops(eqx.filter_value_and_grad(lambda m, x: jnp.mean(losses(m, x))))
        ours = flops(jt.value_grad_and_norms(losses))
        clipped = flops(jt.clipped_grad(losses, 1.0))
        assert ours <= 1.12 * plain, (type(model).__name__, ours / plain)
        assert clipped <= 1.12 * plain, (type(model).__name__, clipped / plain)


def _stacked_writes(hlo: str, steps: int) -> int:
    """How many arrays of ``steps`` rows the compiled program's ``while`` loops write a row of at each step
    (the scans' stacked outputs: what they carry out of the loop), read from XLA's optimised HLO text:
    the instructions of each loop body whose result has ``steps`` rows, but for reads and views."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    loops = [m.group(1) for lines in bodies.values() for line in lines if (m := re.search(r"\bwhile\(.*body=%([\w.\-]+)", line))]
    row = re.compile(rf"\s*(?:ROOT )?%[\w.\-]+ = \w+\[{steps},[\d,]*\]\S* ([\w\-]+)\(")
    return sum(
        1 for body in loops for line in bodies[body]
        if (m := row.match(line)) and m.group(1) not in ("get-tuple-element", "parameter", "bitcast", "copy")
    )


def test_an_rnn_step_stacks_one_array_more_than_the_plain_step():
    """The step of ``value_grad_and_norms`` on a tanh RNN (``tanh(h @ w + x_t @ u)``, both weights closed over
    by the scan) has its scans stack one array per step more than the plain gradient step's: the output
    gradient of the sum the two reads add into, once. Not ``x_t`` again (the pass records ``xs`` itself),
    nor that gradient once per read (5 arrays against the plain step's 2 before, on JAX 0.12)."""

    class RNN(eqx.Module):
        w: jax.Array
        u: jax.Array

        def __call__(self, xs):  # xs: (steps, batch, width)
            h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ self.w + x @ self.u), None), jnp.zeros((xs.shape[1], 16)), xs)
            return jnp.mean(h**2, axis=-1)

    k = jax.random.split(KEY, 3)
    rnn = RNN(0.3 * jax.random.normal(k[0], (16, 16)), 0.3 * jax.random.normal(k[1], (16, 16)))
    xs = jax.random.normal(k[2], (24, 8, 16))  # 24 steps: no other array has 24 rows
    arrays, static = eqx.partition(rnn, eqx.is_array)
    losses = lambda m, xs: m(xs)  # noqa: E731

    def hlo(f):
        return jax.jit(lambda a, xs: f(eqx.combine(a, static), xs)).lower(arrays, xs).compile().as_text()

    plain = _stacked_writes(hlo(eqx.filter_value_and_grad(lambda m, xs: jnp.mean(losses(m, xs)))), 24)
    ours = _stacked_writes(hlo(jt.value_grad_and_norms(losses)), 24)
    assert plain >= 2 and ours == plain + 1, (plain, ours)


def test_an_mlp_step_runs_no_matrix_product_the_plain_step_does_not():
    """The compiled step of ``value_grad_and_norms`` on the guide's ``eqx.nn.MLP`` (8-32x3-1, batch 64) runs as
    many ``dot`` instructions as the plain gradient step: each bias's gradient is a sum over the rows, as the
    plain backward forms it, not a product with ones (three more dots before, in a step of 0.2 ms: with an Adam
    update, 1.39x the plain step on JAX 0.10.2, 1.17x since, a hand-written ghost-norm step 1.11x, in one
    interleaved run on a loaded 2-core machine; JAX 0.12 alike)."""
    model = eqx.nn.MLP(8, 1, 32, 3, key=KEY)
    x = jax.random.normal(jax.random.key(1), (64, 8))
    y = jnp.sin(x[:, :1])
    arrays, static = eqx.partition(model, eqx.is_array)

    def dots(f):  # matrix products: not the norms' row-by-row inner products, batched dots on JAX 0.7.2's XLA
        hlo = jax.jit(lambda a, x, y: f(eqx.combine(a, static), x, y)).lower(arrays, x, y).compile().as_text()
        return len([line for line in re.findall(r" = \S+ dot\(.*", hlo[hlo.index("ENTRY") :]) if "lhs_batch_dims" not in line])

    plain = dots(eqx.filter_value_and_grad(lambda m, x, y: jnp.mean(losses_fn(m, x, y))))
    assert dots(jt.value_grad_and_norms(losses_fn)) == plain, plain


# --- the ring buffer -------------------------------------------------------------------------------


def synthetic(k, b=4):
    """Step ``k``'s losses and squared norms: recognisable numbers."""
    return jnp.full((b,), float(k)), {"w": jnp.arange(b, dtype=jnp.float32) + 10.0 * k, "v": jnp.full((b,), 100.0 + k)}


def test_push_is_one_update_per_array():
    """Donated, the push writes each array's slot in place with one ``dynamic_update_slice`` kernel each (three
    arrays and the count): 6 kernels in XLA's optimised entry computation on JAX 0.10.2 and 0.12, where
    ``.at[slot].set`` (a scatter, its index built and checked in kernels of their own) compiled to 10."""
    losses, sq = synthetic(0)
    history = jt.NormHistory.init(3, losses, sq)
    hlo = jax.jit(lambda h, l, s: h.push(l, s), donate_argnums=0).lower(history, losses, sq).compile().as_text()
    assert "input_output_alias" in hlo.splitlines()[0]  # the state's buffers are the new state's
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    kernels = [m.group(1) for line in entry.splitlines() if (m := re.search(r"= \S+ ([\w\-]+)\(", line))]
    kernels = [k for k in kernels if k not in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")]
    assert len(kernels) <= 6, kernels


@pytest.mark.parametrize("jit", [False, True])
def test_ring_buffer_wraps_around(jit):
    losses, sq = synthetic(0)
    history = jt.NormHistory.init(3, *jax.eval_shape(lambda: synthetic(0)))  # from shapes alone
    assert history.names == ("v", "w") and history.sq_norms.shape == (3, 4, 2) and history.size == 3
    assert history.steps.tolist() == [-1, -1, -1] and int(history.count) == 0
    push = jax.jit(lambda h, l, s, k: h.push(l, s, step=k)) if jit else (lambda h, l, s, k: h.push(l, s, step=k))
    for k in range(7):
        history = push(history, *synthetic(k), 100 + k)
        if k == 1:
            assert history.steps.tolist() == [100, 101, -1]
    assert int(history.count) == 7
    assert history.steps.tolist() == [106, 104, 105]  # step k in slot k % 3: the oldest overwritten
    for slot, k in zip(range(3), (6, 4, 5)):
        losses, sq = synthetic(k)
        np.testing.assert_array_equal(history.losses[slot], losses)
        np.testing.assert_array_equal(history.sq_norms[slot], stacked(sq))
    assert history.report().step == 106  # the last pushed, though it is not in the last slot
    with pytest.raises(ValueError, match=r"step 103 is not held; it holds steps \[104, 105, 106\]"):
        history.report(step=103)
    counted = jt.NormHistory.init(2, losses, sq)
    for _ in range(3):
        counted = counted.push(losses, sq)  # no step given: the number of pushes before
    assert counted.steps.tolist() == [2, 1]


def test_report_against_numpy():
    rng = np.random.default_rng(0)
    history = jt.NormHistory.init(4, jnp.zeros(5), {"a": jnp.zeros(5), "b": jnp.zeros(5), "c": jnp.zeros(5)})
    pushed = []
    for k in range(5):  # wraps: steps 1-4 held
        losses = rng.uniform(size=5)
        sq = {n: rng.uniform(0.5, 2.0, size=5) for n in "abc"}
        if k == 3:
            sq["b"][2] = 1e6  # example 2's leaf b
            sq["c"][4] = np.nan  # example 4: a non-finite norm comes first
        pushed.append((losses, sq))
        history = history.push(jnp.asarray(losses), jax.tree.map(jnp.asarray, sq))
    report = history.report(step=3, top=2)
    table = np.stack([np.stack([s[n] for n in "abc"], -1) for _, s in pushed[1:]])  # steps 1..4, (4, B, L)
    others = table[[0, 1, 3]]
    typical_leaf = np.nanmedian(others.reshape(-1, 3), axis=0)
    typical_total = np.nanmedian(others.sum(-1))
    np.testing.assert_allclose(report.leaf_ratios, np.sqrt(table[2] / typical_leaf), rtol=1e-6)
    np.testing.assert_allclose(report.example_ratios, np.sqrt(table[2].sum(-1) / typical_total), rtol=1e-6)
    assert report.step == 3 and report.compared_with == 3 and report.examples == (4, 2)
    ratios = np.sqrt(table[2] / typical_leaf)
    for i, leaves in zip(report.examples, report.leaves):  # worst first, a nan (example 4's c) before all
        want = sorted("abc", key=lambda n: -np.inf if np.isnan(ratios[i, "abc".index(n)]) else -ratios[i, "abc".index(n)])
        assert leaves == tuple(want[:2])
    assert report.leaves[0][0] == "c" and report.leaves[1][0] == "b"
    np.testing.assert_allclose(report.loss, pushed[3][0].mean(), rtol=1e-6)
    np.testing.assert_allclose(report.typical_loss, np.median([pushed[k][0].mean() for k in (1, 2, 4)]), rtol=1e-6)
    text = str(report)
    assert text.startswith("step 3: loss") and "against the 3 other steps held" in text
    assert f"example 2: loss {pushed[3][0][2]:.3g}, gradient norm {report.example_ratios[2]:.3g}x typical; b {ratios[2, 1]:.3g}x" in text
    assert "example 4:" in text and "gradient norm not finite; c not finite" in text

    alone = jt.NormHistory.init(3, jnp.zeros(5), {"a": jnp.zeros(5)}).push(jnp.ones(5), {"a": jnp.array([1.0, 1, 1, 1, 400])})
    only = alone.report()
    assert only.compared_with == 0 and only.examples[0] == 4 and np.isnan(only.typical_loss)
    np.testing.assert_allclose(only.example_ratios, [1, 1, 1, 1, 20])  # against its own batch's median
    assert "this step's batch (no other step held)" in str(only)


def test_history_errors():
    losses, sq = synthetic(0)
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        jt.NormHistory.init(0, losses, sq)
    history = jt.NormHistory.init(2, losses, sq)
    with pytest.raises(ValueError, match="holds no step yet"):
        history.report()
    with pytest.raises(ValueError, match="a batch of 3 examples, the history holds 4 per step"):
        history.push(*synthetic(1, b=3))
    with pytest.raises(ValueError, match=r"the squared norms have the leaves \['w'\], the history was made for \['v', 'w'\]"):
        history.push(losses, {"w": sq["w"]})
    with pytest.raises(ValueError, match=r"one \(B,\) array per leaf"):
        jt.NormHistory.init(2, losses, {"w": jnp.zeros((4, 2))})


# --- the training loop: an outlier injected at a known step and example ------------------------------


def test_training_loop_names_the_injected_outlier():
    """A jitted equinox + optax step carries the history; the batch of step 10 has example 5's features
    of branch ``a`` 1000x too large. The step's loss flags the spike; the report of that step, read
    from the history the step returned, names step 10, example 5, and ``a.weight`` and ``head.weight``
    (the layers whose inputs the outlier makes large: ``a``'s are its features, ``head``'s ``a``'s
    output) as its two leaves furthest above their typical norms, ``b.weight`` (its inputs in range)
    a thousand times below them. The held norms and losses are the definition's (jax.jacrev, float64)
    at the model each step was taken at, after the buffer wrapped around."""
    optax = pytest.importorskip("optax")
    model = f64(TwoBranch(KEY))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    fun = jt.value_grad_and_norms(losses_fn)

    traces = []

    @eqx.filter_jit
    def step(model, opt_state, history, x, y):
        traces.append(1)
        losses, (grads, sq_norms) = fun(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, history.push(losses, sq_norms), jnp.mean(losses)

    x, y = batch(jax.random.key(0))
    losses, (_, sq) = eqx.filter_eval_shape(fun, model, x, y)
    history = jt.NormHistory.init(6, losses, sq)
    seen, spikes, losses_seen = {}, [], []
    for i in range(14):
        x, y = batch(jax.random.key(i))
        if i == 10:
            x = x.at[5, :4].multiply(1000.0)
        seen[i] = (model, x, y)
        model, opt_state, history, loss = step(model, opt_state, history, x, y)
        if losses_seen and float(loss) > 10 * np.median(losses_seen):
            spikes.append(history.report())
        else:
            losses_seen.append(float(loss))
    assert len(traces) == 1  # the history's shapes and names are fixed: one trace for every step
    assert [r.step for r in spikes] == [10]
    (report,) = spikes
    assert report.examples[0] == 5 and report.compared_with == 5
    assert set(report.leaves[0][:2]) == {"a.weight", "head.weight"}
    names = list(report.names)
    ratio = dict(zip(names, report.leaf_ratios[5]))
    assert min(ratio["a.weight"], ratio["head.weight"]) > 100 * ratio["b.weight"]
    assert report.example_ratios[5] > 100 * np.max(np.delete(report.example_ratios, 5))

    # the held numbers are the definition's, at the model each step's gradient was taken at
    assert history.steps.tolist() == [12, 13, 8, 9, 10, 11]  # 14 pushes into 6 slots
    oracle = eqx.filter_jit(lambda m, x, y: oracle_per_example(losses_fn, m, x, y))  # compiled once for the six
    for slot, i in enumerate(history.steps.tolist()):
        ref = oracle(*seen[i])
        np.testing.assert_allclose(history.losses[slot], ref.losses, rtol=1e-10)
        np.testing.assert_allclose(history.sq_norms[slot], stacked(ref.sq_norms), rtol=1e-10, atol=1e-13)
    assert tuple(names) == ("a.weight", "a.bias", "b.weight", "b.bias", "head.weight", "head.bias")


def test_guide_spike_history_blocks():
    """The training-statistics guide's "The step keeps its own record": its loop flags step 25 alone, the
    report names example 17 (the injected input outlier) first; the weight-over-bias ratios the page prints
    are about 400 for that input outlier at every layer and below 2 for the wrong label of its second block."""
    pytest.importorskip("optax")
    import pathlib
    import re

    page = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "training-statistics.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    (first,) = [k for k, b in enumerate(blocks) if "jt.NormHistory.init" in b]
    namespace: dict = {}
    x64 = jax.config.jax_enable_x64
    try:
        jax.config.update("jax_enable_x64", False)  # the page runs in float32, as a reader's session does
        for code in blocks[first : first + 2]:
            exec(compile(code, str(page), "exec"), namespace)
    finally:
        jax.config.update("jax_enable_x64", x64)
    (report,) = namespace["reports"]
    assert report.step == 25 and report.examples[0] == 17 and report.compared_with == 15
    for r, i, low, high in ((report, 17, 100, 1000), (namespace["labelled"].report(), 40, 1.0, 2.0)):
        assert r.examples[0] == i
        ratio = dict(zip(r.names, r.leaf_ratios[i]))
        for k in range(4):
            assert low < ratio[f"layers.{k}.weight"] / ratio[f"layers.{k}.bias"] < high, (i, k)
