"""Per-example gradients of tables and matrices read without calling their module, as ported models
read them (``wte.weight[ids]``, ``wpe.weight[:T]``, ``h @ wte.weight.T``, ``jnp.einsum``): on factors
(``fallback="error"`` passes) and equal to the definition, row i of ``jax.jacrev`` of the losses
vector, float64; reads the rules do not cover keep the exact path, named under ``fallback="error"``."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrace as jt
from oracles import assert_close, oracle_per_example

B, T, V, D = 3, 4, 7, 5
KEYS = jax.random.split(jax.random.key(1), 8)


def check(losses_fn, model, *args, jit, on_factors=True, max_norm=0.5, rtol=1e-10, float64=True):
    """Norms and the clipped sum (``fallback="error"`` where ``on_factors``) against the definition
    (``float64=False``: a model with float32 leaves, whose dtypes ours need not keep)."""
    ref = oracle_per_example(losses_fn, model, *args, float64=float64)
    fallback = "error" if on_factors else "vmap"

    def ours(*args):
        norms = jt.per_example_norms(losses_fn, fallback=fallback)(*args)[1]
        return norms, jt.clipped_grad(losses_fn, max_norm, fallback=fallback)(*args)[1]

    sq, clipped = (eqx.filter_jit(ours) if jit else ours)(model, *args)
    assert_close(sq, ref.sq_norms, "per-leaf squared norms", rtol=rtol, atol=rtol * 1e-2, dtype=float64)
    assert_close(clipped, ref.clipped(max_norm), "clipped sum", rtol=rtol, atol=rtol * 1e-2, dtype=float64)


class Port(eqx.Module):
    """A GPT-style port that reads its parameters as Hugging Face ports do: the token table by
    indexing, the position table by slicing, a projection by ``h @ W`` and by ``W @ h.T`` (the matrix
    as the left operand), and the head tied to the token table, ``h @ wte.T`` (or by ``jnp.einsum``,
    whose product sits in a ``jit`` body of its own)."""

    wte: jax.Array
    wpe: jax.Array
    ln: eqx.nn.LayerNorm
    proj: jax.Array
    head: str = eqx.field(static=True)

    def __init__(self, key, head="matmul"):
        k = jax.random.split(key, 3)
        self.wte, self.wpe = jax.random.normal(k[0], (V, D)), jax.random.normal(k[1], (T + 2, D))
        self.ln, self.proj = eqx.nn.LayerNorm(D), 0.5 * jax.random.normal(k[2], (D, D))
        self.head = head

    def __call__(self, ids):
        h = self.wte[ids] + self.wpe[: ids.shape[0]]
        h = jax.vmap(self.ln)(h)
        h = jnp.tanh(h @ self.proj)
        h = jnp.tanh(self.proj @ h.T).T
        if self.head == "einsum":
            return jnp.einsum("td,vd->tv", h, self.wte)
        return h @ self.wte.T


def lm_losses(model, ids):
    logp = jax.nn.log_softmax(jax.vmap(model)(ids))
    return -jnp.mean(jnp.take_along_axis(logp, jnp.roll(ids, 1, axis=1)[..., None] % V, axis=-1)[..., 0], axis=1)


def ids_with_ends():
    return jax.random.randint(KEYS[4], (B, T), -V, V).at[0, 0].set(-1).at[0, 1].set(V - 1)


@pytest.mark.parametrize("head", ["matmul", "einsum"])
@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.long_eager), True])
def test_a_ported_model_reading_its_tables_is_on_factors(jit, head):
    check(lm_losses, Port(KEYS[0], head), ids_with_ends(), jit=jit)


@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_take_out_of_range_ids_as_the_gather_does(mode):
    """``jnp.take`` (a ``jit`` body): with ``mode="fill"`` ids past the end read zeros and get no
    gradient, with ``"clip"`` they read the last row."""

    class Take(eqx.Module):
        table: jax.Array
        lin: eqx.nn.Linear

        def __call__(self, ids):
            return jax.vmap(self.lin)(jnp.tanh(jnp.take(self.table, ids, axis=0, mode=mode, fill_value=0.0 if mode == "fill" else None)))

    ids = jax.random.randint(KEYS[5], (B, T), 0, V + 3).at[0, 0].set(V + 2).at[1, 1].set(V - 1)
    model = Take(jax.random.normal(KEYS[1], (V, D)), eqx.nn.Linear(D, 2, key=KEYS[2]))
    check(lambda m, i: jnp.sum(jax.vmap(m)(i) ** 2, axis=(1, 2)), model, ids, jit=True)


def test_shared_position_rows_by_arange_and_a_three_axis_table():
    """``pos[jnp.arange(T)]`` (shared ids) and rows of a ``(V, 2, D)`` table, each row a matrix."""

    class Rows(eqx.Module):
        table: jax.Array
        pos: jax.Array

        def __call__(self, ids):
            h = self.table[ids].reshape(ids.shape[0], -1) + self.pos[jnp.arange(ids.shape[0])].reshape(ids.shape[0], -1)
            return jnp.tanh(h)

    model = Rows(jax.random.normal(KEYS[1], (V, 2, D)), jax.random.normal(KEYS[2], (T, 2, D)))
    check(lambda m, i: jnp.sum(jnp.sin(jax.vmap(m)(i)), axis=(1, 2)), model, ids_with_ends(), jit=True)


def test_reads_through_a_cast_are_on_factors():
    """Mixed precision: float32 parameters cast before they are read (``W.astype(jnp.float64)[ids]``,
    ``h @ W.T.astype(...)``); the definition's gradients are float32 (the cast's pullback), ours
    are computed in float64 from the same factors."""

    class Cast(eqx.Module):
        table: jax.Array
        pos: jax.Array

        def __call__(self, ids):
            up = lambda a: a.astype(jnp.float64)  # noqa: E731
            h = jnp.tanh(up(self.table)[ids] + up(self.pos)[: ids.shape[0]])
            return h @ self.table.T.astype(jnp.float64)

    model = Cast(jax.random.normal(KEYS[1], (V, D), jnp.float32), jax.random.normal(KEYS[2], (T + 1, D), jnp.float32))
    check(lambda m, i: jnp.sum(jnp.sin(jax.vmap(m)(i)), axis=(1, 2)), model, ids_with_ends(), jit=True, rtol=1e-5, float64=False)


def test_reads_inside_checkpoint_are_on_factors():
    class Remat(eqx.Module):
        table: jax.Array
        w: jax.Array

        def __call__(self, ids):
            return jax.checkpoint(lambda t, w: jnp.tanh(t[ids]) @ w)(self.table, self.w)

    model = Remat(jax.random.normal(KEYS[1], (V, D)), jax.random.normal(KEYS[2], (D, 3)))
    check(lambda m, i: jnp.sum(jax.vmap(m)(i) ** 2, axis=(1, 2)), model, ids_with_ends(), jit=True)


class Stacked(eqx.Module):
    """Layers stacked as raw arrays ``(L, D, D)`` and run with ``lax.scan`` over them, as hand-written
    deep models are: each step reads its own slice in a product (``h @ w``, ``jnp.einsum``, ``h @ w.T``)
    and adds its own bias slice ``(D,)`` as it is."""

    embed: jax.Array
    w1: jax.Array
    w2: jax.Array
    b1: jax.Array
    head: jax.Array

    def __init__(self, key, layers=3):
        k = jax.random.split(key, 5)
        self.embed, self.head = jax.random.normal(k[0], (V, D)), jax.random.normal(k[3], (D, V))
        self.w1, self.w2 = (0.5 * jax.random.normal(kk, (layers, D, D)) for kk in k[1:3])
        self.b1 = jax.random.normal(k[4], (layers, D))

    def __call__(self, ids):
        def block(h, w):
            w1, w2, b1 = w
            u = jnp.tanh(jnp.einsum("td,de->te", h, w1) + b1)
            return h + jnp.tanh(u @ w2.T), None

        h, _ = jax.lax.scan(block, self.embed[ids], (self.w1, self.w2, self.b1))
        return h @ self.head


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.long_eager), True])
def test_layers_stacked_as_arrays_in_a_scan_are_on_factors(jit):
    """Each scan step's slice of a stacked ``(L, D, D)`` leaf is a parameter of its own, read by a
    product in the body: on factors, one slice per step, no cross terms between steps."""
    check(lm_losses, Stacked(KEYS[0]), ids_with_ends() % V, jit=jit)


class RawRNN(eqx.Module):
    """A recurrent cell of raw arrays, closed over by the ``lax.scan`` body: ``W_xh``, ``W_hh`` (read
    as ``W_hh.T`` too) and a stacked ``(2, D, D)`` pair the same scan also reads one slice of per step."""

    w_xh: jax.Array
    w_hh: jax.Array
    head: jax.Array

    def __call__(self, x):
        def cell(h, x_t):
            h = jnp.tanh(x_t @ self.w_xh + h @ self.w_hh + 0.5 * (h @ self.w_hh.T))
            return h, h

        _, hs = jax.lax.scan(cell, jnp.zeros(self.w_hh.shape[0]), x)
        return hs @ self.head


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.long_eager), True])
def test_a_recurrent_weight_closed_over_by_a_scan_is_on_factors(jit):
    """A whole leaf read at every step of a scan (a recurrent weight): each step's factors are more
    positions of the one leaf's, with the cross terms between steps (and between its two reads)."""
    k = jax.random.split(KEYS[3], 4)
    model = RawRNN(*(0.5 * jax.random.normal(kk, (D, D)) for kk in k[:3]))
    x, y = jax.random.normal(k[3], (B, T, D)), jax.random.normal(KEYS[5], (B, T, D))
    check(lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2, axis=(1, 2)), model, x, y, jit=jit)


class FourReads(eqx.Module):
    """A recurrent cell whose step adds up four reads (``x_t @ a``, ``h @ b``, ``h @ b.T`` and ``x_t @ c.T``: one
    matrix read twice, two through a transpose) and a bias; ``x_t`` is the scan's ``xs`` slice."""

    a: jax.Array
    b: jax.Array
    c: jax.Array
    bias: jax.Array

    def __call__(self, x):
        def cell(h, x_t):
            h = jnp.tanh(x_t @ self.a + h @ self.b + h @ self.b.T + x_t @ self.c.T + self.bias)
            return h, h

        _, hs = jax.lax.scan(cell, jnp.zeros(D), x)
        return hs


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("jit", [False, True])
def test_four_reads_adding_up_in_a_scan_are_on_factors(jit, steps):
    """Reads whose outputs add up share one tag on their sum, and a read of the scan's ``xs`` slice records
    ``xs`` itself (``_read_tags``): the norms and the clipped sum are still the definition's, float64 (one
    step too: its stacked arrays are one step long)."""
    k = jax.random.split(KEYS[6], 5)
    model = FourReads(*(0.5 * jax.random.normal(kk, (D, D)) for kk in k[:3]), 0.1 * jax.random.normal(k[3], (D,)))
    x = jax.random.normal(k[4], (B, steps, D))
    from jaxtrace._per_example._pass import Call

    losses = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2, axis=(1, 2))  # noqa: E731
    found = []
    jax.make_jaxpr(lambda m, x: found.append(Call(losses, 0, "error", False, (m, x), {}).contributions))(model, x)
    ((tags,),) = {tuple(set(r.grad_tag for r in c.reads)) for c in found}  # one tag for the four reads
    assert tags is not None and len(found[0].reads) == 4, found[0].reads
    assert len(found[0].read_tags.moved_inputs) == 2  # x_t @ a and x_t @ c.T: their input recorded on xs
    check(losses, model, x, jit=jit)


@pytest.mark.slow  # ~20 s on 2 cores (jacrev under vmap and grad)
def test_four_reads_adding_up_under_vmap_grad_and_checkpoint():
    """The reads' tag on their sum and the input tags on the scan's ``xs`` (``_read_tags``) with
    ``jax.vmap`` over two parameter sets, ``jax.grad`` of the summed norms and ``jax.checkpoint`` around
    the transform: the definition's values and gradients, float64."""
    k = jax.random.split(KEYS[6], 5)
    model = FourReads(*(0.5 * jax.random.normal(kk, (D, D)) for kk in k[:3]), 0.1 * jax.random.normal(k[3], (D,)))
    x = jax.random.normal(k[4], (B, 4, D))
    losses = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2, axis=(1, 2))  # noqa: E731
    diff, static = eqx.partition(model, eqx.is_inexact_array)
    two = jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.8 * a]), diff)
    norms = lambda d: jt.per_example_norms(losses, total=True, fallback="error")(eqx.combine(d, static), x)[1]  # noqa: E731
    reference = lambda d: oracle_per_example(losses, eqx.combine(d, static), x).total  # noqa: E731
    assert_close(jax.jit(jax.vmap(norms))(two), jax.vmap(reference)(two), "under jax.vmap", rtol=1e-10, atol=0)
    ours, expected = jax.grad(lambda d: jnp.sum(norms(d)))(diff), jax.grad(lambda d: jnp.sum(reference(d)))(diff)
    assert_close(ours, expected, "under jax.grad", rtol=1e-9, atol=1e-12)
    assert_close(jax.checkpoint(norms)(diff), reference(diff), "under jax.checkpoint", rtol=1e-10, atol=0)


@pytest.mark.slow  # ~15 s on 2 cores (jacrev under vmap and grad); the grammar's scan_reads class draws these too
def test_stacked_reads_inside_vmap_jit_and_grad():
    """The stacked reads under ``jax.vmap`` over two parameter sets (jaxtrace in the body), and
    ``jax.grad`` of the summed norms against ``jax.grad`` of the definition's."""
    model, ids = Stacked(KEYS[0], layers=2), ids_with_ends() % V
    diff, static = eqx.partition(model, eqx.is_inexact_array)
    two = jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.8 * a]), diff)
    norms = lambda d: jt.per_example_norms(lm_losses, total=True, fallback="error")(eqx.combine(d, static), ids)[1]  # noqa: E731
    reference = lambda d: oracle_per_example(lm_losses, eqx.combine(d, static), ids).total  # noqa: E731
    assert_close(jax.jit(jax.vmap(norms))(two), jax.vmap(reference)(two), "under jax.vmap", rtol=1e-10, atol=0)
    ours = jax.grad(lambda d: jnp.sum(norms(d)))(diff)
    expected = jax.grad(lambda d: jnp.sum(reference(d)))(diff)
    assert_close(ours, expected, "under jax.grad", rtol=1e-9, atol=1e-12)


def test_stacked_reads_the_rules_do_not_cover_keep_the_exact_path():
    """A leaf stacked twice scanned over by a scan nested in a scan over it, a stacked bias also used outside its scan:
    exact, and ``fallback="error"`` names each leaf; the others stay on factors, a scan in reverse too (its tags stack
    in the order of ``xs``), a slice whose row is also added as it is and a stack the body closes over and indexes by
    the step (``dynamic_slice``): shared reads in the body, meeting the examples there."""

    class Loops(eqx.Module):
        ok: jax.Array  # read per step: factors
        rev: jax.Array  # read per step in a reversed scan: factors
        closed: jax.Array  # closed over and indexed by the step: factors
        added: jax.Array  # read per step, and a row of its slice added as it is: factors
        nested: jax.Array  # (L, L, D, D): each step's (L, D, D) slice scanned over again
        bias: jax.Array  # (L, D) added per step, and summed outside the scan too

        def __call__(self, x):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, self.ok)
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, self.rev, reverse=True)
            h, _ = jax.lax.scan(lambda h, i: (jnp.tanh(h @ self.closed[i]), None), h, jnp.arange(2))
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) + w[0], None), h, self.added)
            inner = lambda h, ws: (jax.lax.scan(lambda g, w: (jnp.tanh(g @ w), None), h, ws)[0], None)  # noqa: E731
            h, _ = jax.lax.scan(inner, h, self.nested)
            h, _ = jax.lax.scan(lambda h, b: (jnp.tanh(h + b), None), h, self.bias)
            return h + jnp.sum(self.bias)

    k = jax.random.split(KEYS[6], 5)
    model = Loops(
        *(0.5 * jax.random.normal(kk, (2, D, D)) for kk in k[:4]), 0.5 * jax.random.normal(k[4], (2, 2, D, D)), jnp.ones((2, D))
    )
    x = jax.random.normal(KEYS[7], (B, T, D))
    losses = lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2, axis=(1, 2))  # noqa: E731
    check(losses, model, x, jit=True, on_factors=False)
    with pytest.raises(jt.TagError) as info:
        jt.per_example_norms(losses, fallback="error")(model, x)
    for name in ("'nested'", "'bias'"):
        assert name in str(info.value)
    for name in ("'ok'", "'rev'", "'added'", "'closed'"):
        assert name not in str(info.value)


def test_reads_the_rules_do_not_cover_keep_the_exact_path():
    """A read in a ``lax.scan`` body (a whole leaf indexed), a read of a transformed matrix, a shared read inside a ``jit``
    body, a matrix read twice in one product and rows of a transpose: exact, and
    ``fallback="error"`` names each."""

    class Uncovered(eqx.Module):
        a: jax.Array  # read in a scan body
        b: jax.Array  # read through tanh
        c: jax.Array  # jnp.take of shared ids: the shared output leaves its jit body
        e: jax.Array  # e @ e
        f: jax.Array  # rows of its transpose: columns

        def __call__(self, ids):
            h = jnp.tanh(jnp.take(self.c, jnp.arange(ids.shape[0]), axis=0))
            h = h + jax.lax.scan(lambda carry, i: (carry, self.a[i]), 0.0, ids)[1]
            h = jnp.tanh(h @ jnp.tanh(self.b)) + self.f.T[ids]
            return h @ (self.e @ self.e)

    model = Uncovered(*(jax.random.normal(k, (V, V)) for k in KEYS[:5]))
    ids = jax.random.randint(KEYS[5], (B, V), 0, V)
    losses = lambda m, i: jnp.sum(jax.vmap(m)(i) ** 2, axis=(1, 2))  # noqa: E731
    check(losses, model, ids, jit=True, on_factors=False)
    with pytest.raises(jt.TagError) as info:
        jt.per_example_norms(losses, fallback="error")(model, ids)
    for name in ("'a'", "'b'", "'c'", "'e'", "'f'"):
        assert name in str(info.value)


def test_a_read_whose_outputs_reach_several_examples_is_not_on_factors():
    """The product of a matrix with the examples' mean reaches every loss: not a per-example read
    (it mixes examples: refused, as the proof refuses any mixing through a leaf)."""

    class Centred(eqx.Module):
        w: jax.Array

    def losses(m, x):
        h = jnp.tanh(x @ m.w)
        return jnp.sum((h - jnp.mean(h, axis=0) @ m.w) ** 2, axis=1)

    model, x = Centred(jax.random.normal(KEYS[1], (D, D))), jax.random.normal(KEYS[2], (B, D))
    with pytest.raises(jt.TagError, match="example"):
        jt.per_example_norms(losses)(model, x)


def test_products_with_many_axes_are_on_factors():
    """``jnp.einsum`` with a 3-axis weight (attention projections stored ``(d, heads, head_dim)``),
    contracted on its leading axis or on its two leading axes (reads); contracted on a middle axis,
    interleaved with the free ones, it is no read but a weight meeting the examples as it is (each
    example's gradient where it does: B copies of it)."""

    class Heads(eqx.Module):
        wq: jax.Array  # (d, h, k): contracted on d
        wo: jax.Array  # (h, k, d): contracted on (h, k)
        mid: jax.Array  # (h, d, k): contracted on d, its middle axis

        def __call__(self, x):
            q = jnp.tanh(jnp.einsum("td,dhk->thk", x, self.wq))
            y = jnp.einsum("thk,hkd->td", q, self.wo)
            return y + jnp.einsum("td,hdk->thk", x, self.mid).sum(-1).sum(-1, keepdims=True)

    model = Heads(*(jax.random.normal(k, s) for k, s in zip(KEYS, ((D, 2, 3), (2, 3, D), (2, D, 3)))))
    x = jax.random.normal(KEYS[5], (B, T, D))
    check(lambda m, x: jnp.sum(jnp.sin(jax.vmap(m)(x)), axis=(1, 2)), model, x, jit=True)


def test_nnx_multi_head_attention_is_on_factors():
    """``nnx.MultiHeadAttention``'s ``LinearGeneral`` projections read their 3-axis kernels by one
    product each, and add their biases as they are: every leaf on factors."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            kw = dict(rngs=rngs, param_dtype=jnp.float64, dtype=jnp.float64)
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=4, qkv_features=4, decode=False, **kw)
            self.head = nnx.Linear(4, 3, **kw)

        def __call__(self, x):
            return self.head(jnp.tanh(self.attn(x)))

    model, x = Model(nnx.Rngs(0)), jax.random.normal(KEYS[6], (B, T, 4))

    def losses(m, x):
        return jnp.sum(m(x) ** 2, axis=(1, 2))

    ref = oracle_per_example(losses, model, x)
    # To 1e-6, not 1e-10: without dropout nnx's attention calls jax.nn.dot_product_attention, whose
    # softmax is float32 whatever the dtype, so the key-projection norms move by up to 1.4e-7 relative
    # between two programs for the same gradient (measured: compiled against eager jax.jacrev, 5e-8 on
    # JAX 0.10 and 0.12; jaxtrace eager against eager jax.jacrev, 1.4e-7 on JAX 0.7.2; and the test
    # below). A wrong factor is off by order one.
    for run, rtol in ((jt.per_example_norms(losses, fallback="error"), 1e-6), (nnx.jit(jt.per_example_norms(losses, fallback="error")), 1e-6)):
        _, sq = run(model, x)
        assert_close(sq, ref.sq_norms, rtol=rtol, atol=rtol * 1e-2, scale_atol=True)


class ViTBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    att: eqx.nn.MultiheadAttention
    fc: eqx.nn.Linear
    proj: eqx.nn.Linear

    def __init__(self, key, d):
        k = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.att = eqx.nn.MultiheadAttention(2, d, key=k[0])
        self.fc, self.proj = eqx.nn.Linear(d, 2 * d, key=k[1]), eqx.nn.Linear(2 * d, d, key=k[2])

    def __call__(self, h):
        x = jax.vmap(self.ln1)(h)
        h = h + self.att(x, x, x)
        return h + jax.vmap(self.proj)(jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln2)(h))))


class ViT(eqx.Module):
    """A vision transformer as its users write it: patches by a strided Conv2d, a learned class token
    concatenated before them (or a mask token put where a fixed mask says, as BERT and MAE do), a
    position table added whole, blocks stacked with ``eqx.filter_vmap`` and run with ``lax.scan``,
    the head on the class token's output."""

    patch: eqx.nn.Conv2d
    token: jax.Array
    pos: jax.Array
    blocks: ViTBlock
    head: eqx.nn.Linear
    kind: str = eqx.field(static=True)

    def __init__(self, key, kind, d=6, layers=2):
        k = jax.random.split(key, 5)
        self.patch = eqx.nn.Conv2d(1, d, 2, stride=2, key=k[0])
        self.token, self.pos = jax.random.normal(k[1], (d,)), jax.random.normal(k[2], (5, d))
        self.blocks = eqx.filter_vmap(lambda k: ViTBlock(k, d))(jax.random.split(k[3], layers))
        self.head, self.kind = eqx.nn.Linear(d, 3, key=k[4]), kind

    def __call__(self, image):
        x = self.patch(image).reshape(self.token.shape[0], -1).T  # (4 patches, d)
        if self.kind == "class":
            h = jnp.concatenate([self.token[None], x]) + self.pos
        else:  # the mask token at patches 0 and 2, the class position a zero row
            h = jnp.concatenate([jnp.zeros_like(x[:1]), jnp.where((jnp.arange(4) % 2 == 0)[:, None], self.token, x)]) + self.pos
        params, static = eqx.partition(self.blocks, eqx.is_array)
        h, _ = jax.lax.scan(lambda h, p: (eqx.combine(p, static)(h), None), h, params)
        return self.head(h[0])


@pytest.mark.parametrize("kind", ["class", "mask"])
@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.long_eager), True])
def test_a_vit_with_a_class_or_mask_token_is_on_factors(jit, kind):
    """A token laid along the examples by a broadcast (concatenated before each example's patches, or
    put where a mask says) meets them there: each example's gradient at it is that example's copy's
    cotangent, on factors like every other leaf of the model."""

    def losses(model, images, labels):
        logp = jax.nn.log_softmax(jax.vmap(model)(images))
        return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]

    images, labels = jax.random.normal(KEYS[6], (B, 1, 4, 4)), jnp.arange(B) % 3
    check(losses, ViT(KEYS[7], kind), images, labels, jit=jit)


class Recurrent(eqx.Module):
    """equinox's own recurrent cells run by ``lax.scan``: the body closes over the cell, so its weights
    (read by matrix products) and its biases (added as they are) are the whole leaves at every step."""

    cell: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x):
        lstm = isinstance(self.cell, eqx.nn.LSTMCell)

        def step(state, x_t):
            state = self.cell(x_t, state)
            return state, state[0] if lstm else state

        zeros = jnp.zeros(self.head.in_features)
        _, hs = jax.lax.scan(step, (zeros, zeros) if lstm else zeros, x)
        return jax.vmap(self.head)(hs)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_recurrent_cells_biases_included_are_on_factors(cell):
    """A bias the scan body closes over and adds at every step: each example's gradient is its
    cotangents there, summed over the steps."""
    k = jax.random.split(KEYS[2], 3)
    make = eqx.nn.GRUCell if cell == "gru" else eqx.nn.LSTMCell
    model = Recurrent(make(D, D, key=k[0]), eqx.nn.Linear(D, 2, key=k[1]))
    model = jax.tree_util.tree_map(lambda a: a + 0.1 if eqx.is_inexact_array(a) else a, model)  # biases off zero
    x, y = jax.random.normal(k[2], (B, T, D)), jax.random.normal(KEYS[5], (B, T, 2))
    check(lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2, axis=(1, 2)), model, x, y, jit=True)


class DeepRecurrent(eqx.Module):
    """Recurrent layers in nested scans: ``layers_outer``, stacked cells (``eqx.filter_vmap``) run by a scan over
    the layers, each running its cell over the positions (a stacked RNN); ``time_outer``, at each position the
    stacked layers in turn (a multi-layer cell), beside a weight and a bias both scans close over."""

    cells: eqx.nn.GRUCell  # stacked: each leaf (L, ...)
    w: jax.Array  # (D, D), used by both scans of ``time_outer``
    b: jax.Array  # (D,)
    head: eqx.nn.Linear
    layout: str = eqx.field(static=True)

    def __call__(self, x):
        params, static = eqx.partition(self.cells, eqx.is_array)
        if self.layout == "layers_outer":
            def layer(xs, p):
                cell = eqx.combine(p, static)
                return jax.lax.scan(lambda h, x_t: (cell(x_t, h),) * 2, jnp.zeros(D), xs)[1], None

            hs = jax.lax.scan(layer, x, params)[0]
        else:
            def position(h, x_t):
                def layer(y, p):
                    return eqx.combine(p, static)(y, jnp.tanh(h @ self.w + self.b)), None

                return (jax.lax.scan(layer, x_t, params)[0],) * 2

            hs = jax.lax.scan(position, jnp.zeros(D), x)[1]
        return jax.vmap(self.head)(hs)


@pytest.mark.parametrize("layout", ["layers_outer", "time_outer"])
def test_recurrent_layers_in_nested_scans_are_on_factors(layout):
    """Each layer's slice of a stacked leaf, read at every position by the inner (or outer) scan: its factors are
    the positions' side by side, one parameter per layer; a leaf both scans close over sums over both."""
    k = jax.random.split(KEYS[3], 5)
    cells = eqx.filter_vmap(lambda kk: eqx.nn.GRUCell(D, D, key=kk))(jax.random.split(k[0], 3))
    model = DeepRecurrent(cells, 0.5 * jax.random.normal(k[1], (D, D)), jax.random.normal(k[2], (D,)), eqx.nn.Linear(D, 2, key=k[3]), layout)
    model = jax.tree_util.tree_map(lambda a: a + 0.1 if eqx.is_inexact_array(a) else a, model)  # biases off zero
    x = jax.random.normal(k[4], (B, T, D))
    check(lambda m, x: jnp.sum(jnp.tanh(jax.vmap(m)(x)) ** 2, axis=(1, 2)), model, x, jit=True)


class DeepLinear(eqx.Module):
    """A stack of ``eqx.nn.Linear`` (built with ``eqx.filter_vmap``) in nested scans or called twice a step:
    ``layers_outer``, a scan over the layers, each running its Linear over the positions with a carry (a
    stacked RNN written with Linear layers); ``time_outer``, at each position the layers in turn;
    ``twice``, each step's Linear applied twice, at every position."""

    lins: eqx.nn.Linear  # stacked: weight (L, D, D), bias (L, D)
    head: eqx.nn.Linear
    layout: str = eqx.field(static=True)

    def __call__(self, x):
        params, static = eqx.partition(self.lins, eqx.is_array)
        if self.layout == "layers_outer":
            def layer(xs, p):
                lin = eqx.combine(p, static)
                return jax.lax.scan(lambda h, x_t: (jnp.tanh(lin(x_t) + 0.5 * h),) * 2, jnp.zeros(D), xs)[1], None

            hs = jax.lax.scan(layer, x, params)[0]
        elif self.layout == "time_outer":
            def position(h, x_t):
                layer = lambda y, p: (jnp.tanh(eqx.combine(p, static)(y) + 0.5 * h), None)  # noqa: E731
                return (jax.lax.scan(layer, x_t, params)[0],) * 2

            hs = jax.lax.scan(position, jnp.zeros(D), x)[1]
        else:
            def layer(h, p):
                lin = jax.vmap(eqx.combine(p, static))
                return jnp.tanh(lin(jnp.tanh(lin(h)))), None

            hs = jax.lax.scan(layer, x, params)[0]
        return jax.vmap(self.head)(hs)


@pytest.mark.parametrize("layout", ["layers_outer", "time_outer", "twice"])
def test_a_stacked_linear_in_nested_scans_or_twice_a_step_is_on_factors(layout):
    """Each layer's slice of the stack is a parameter of its own; the positions of the loop that closes over
    it (and a step's two calls) lie side by side in its factors."""
    k = jax.random.split(KEYS[4], 4)
    lins = eqx.filter_vmap(lambda kk: eqx.nn.Linear(D, D, key=kk))(jax.random.split(k[0], 3))
    model = DeepLinear(lins, eqx.nn.Linear(D, 2, key=k[1]), layout)
    x = jax.random.normal(k[2], (B, T, D))
    check(lambda m, x: jnp.sum(jnp.tanh(jax.vmap(m)(x)) ** 2, axis=(1, 2)), model, x, jit=True)
    if layout == "twice":
        check(lambda m, x: jnp.sum(jnp.tanh(jax.vmap(m)(x)) ** 2, axis=(1, 2)), model, x, jit=False)


def test_a_closed_over_bias_also_used_outside_its_scan_keeps_the_exact_path():
    class Both(eqx.Module):
        w: jax.Array
        b: jax.Array

        def __call__(self, x):
            _, hs = jax.lax.scan(lambda h, x_t: (jnp.tanh(x_t @ self.w + h + self.b),) * 2, jnp.zeros(D), x)
            return hs + self.b

    k = jax.random.split(KEYS[3], 3)
    model = Both(jax.random.normal(k[0], (D, D)), jax.random.normal(k[1], (D,)))
    x = jax.random.normal(k[2], (B, T, D))
    losses = lambda m, x: jnp.sum(jnp.sin(jax.vmap(m)(x)), axis=(1, 2))  # noqa: E731
    with pytest.raises(jt.TagError, match="'b'"):
        jt.per_example_norms(losses, fallback="error")(model, x)
    check(losses, model, x, jit=True, on_factors=False)


@pytest.mark.parametrize("wrap", ["jax.jit", "checkpoint"])
def test_a_loss_function_under_jit_or_checkpoint_keeps_shared_positions_on_factors(wrap):
    """``@jax.jit`` (or ``jax.checkpoint``) on the loss function puts the whole program in one call body:
    the shared position rows meet the examples inside it, or leave it and meet them outside."""
    losses = {"jax.jit": jax.jit, "checkpoint": jax.checkpoint}[wrap](lm_losses)
    check(losses, Port(KEYS[0]), ids_with_ends(), jit=True)  # (a model of Embedding modules: test_per_example_proof)


def test_shared_rows_read_in_a_jit_body_meet_the_examples_outside_it():
    class JitRead(eqx.Module):
        wte: jax.Array
        wpe: jax.Array

        def __call__(self, ids):
            rows = jax.jit(lambda wpe: jnp.take(wpe, jnp.arange(ids.shape[0]), axis=0))(self.wpe)
            return (self.wte[ids] + rows) @ self.wte.T

    k = jax.random.split(KEYS[6], 2)
    check(lm_losses, JitRead(jax.random.normal(k[0], (V, D)), jax.random.normal(k[1], (T + 1, D))), ids_with_ends(), jit=True)


def test_jax_nn_dot_product_attention_is_on_factors_to_its_float32_softmax():
    """``jax.nn.dot_product_attention`` takes its softmax in float32 whatever the dtype, so in float64
    the definition itself holds to float32 rounding there (``vmap(grad)`` and ``jacrev`` differ by
    ~1e-7): on factors, and as close to ``jacrev`` as ``vmap(grad)`` is."""

    class Attention(eqx.Module):
        wpe: jax.Array
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear

        def __call__(self, x):
            h = x + self.wpe[jnp.arange(x.shape[0])]
            q, k, v = jnp.split(jax.vmap(self.qkv)(h).reshape(x.shape[0], 2, -1), 3, axis=-1)
            return jax.vmap(self.out)(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape[0], -1))

    k = jax.random.split(KEYS[7], 4)
    model = Attention(jax.random.normal(k[0], (T, 6)), eqx.nn.Linear(6, 18, key=k[1]), eqx.nn.Linear(6, 2, key=k[2]))
    x = jax.random.normal(k[3], (B, T, 6))
    losses = lambda m, x: jnp.sum(jnp.tanh(jax.vmap(m)(x)) ** 2, axis=(1, 2))  # noqa: E731
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(model)} == {np.dtype(np.float64)}
    check(losses, model, x, jit=True, rtol=2e-6)


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell"])
def test_nnx_recurrent_cells_in_nnx_rnn_are_on_factors(cell):
    """``nnx.RNN`` scans its cell with ``nnx.scan`` (and draws its initial carry from its own ``Rngs``,
    a state it writes): the cell's kernels and biases, closed over by the scan, are on factors."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            kw = dict(rngs=rngs, param_dtype=jnp.float64, dtype=jnp.float64)
            self.rnn = nnx.RNN(getattr(nnx, cell)(D, D, **kw))
            self.head = nnx.Linear(D, 2, **kw)

        def __call__(self, x):
            return self.head(self.rnn(x))

    model, x = Model(nnx.Rngs(0)), jax.random.normal(KEYS[1], (B, T, D))

    def losses(m, x):
        return jnp.sum(jnp.tanh(m(x)) ** 2, axis=(1, 2))

    ref = oracle_per_example(losses, model, x)
    for run in (jt.per_example_norms(losses, fallback="error"), nnx.jit(jt.per_example_norms(losses, fallback="error"))):
        _, sq = run(model, x)
        assert_close(sq, ref.sq_norms, rtol=1e-10, atol=1e-12 * float(jnp.max(ref.total)))


class SharedRowsInAScan(eqx.Module):
    """Rows shared by every example, read in the body of a scan over stacked layers: a position table the body
    closes over (``pos[jnp.arange(T)]`` or ``pos[:T]``, every layer: a universal-transformer layout) or each
    layer's own relative-position bias table (``rel[l][buckets]``, T5-style), meeting the examples there."""

    pos: jax.Array  # (T + 2, D)
    rel: jax.Array  # (L, 7): per layer, one bias per clipped distance
    w: jax.Array  # (L, D, D)
    read: str = eqx.field(static=True)

    def __call__(self, x):
        n = x.shape[0]
        buckets = jnp.clip(jnp.arange(n)[None, :] - jnp.arange(n)[:, None], -3, 3) + 3

        def layer(h, p):
            rel, w = p
            rows = self.pos[jnp.arange(n)] if self.read == "arange" else self.pos[:n]
            h = h + rows
            return jnp.tanh(jax.nn.softmax(h @ h.T + rel[buckets], axis=-1) @ h @ w), None

        return jax.lax.scan(layer, x, (self.rel, self.w))[0]


@pytest.mark.parametrize("read", ["arange", "slice"])
def test_shared_rows_read_in_a_scan_body_are_on_factors(read):
    k = jax.random.split(KEYS[4], 4)
    model = SharedRowsInAScan(jax.random.normal(k[0], (T + 2, D)), jax.random.normal(k[1], (3, 7)), 0.5 * jax.random.normal(k[2], (3, D, D)), read)
    x = jax.random.normal(k[3], (B, T, D))
    check(lambda m, x: jnp.sum(jnp.tanh(jax.vmap(m)(x)) ** 2, axis=(1, 2)), model, x, jit=True)



@pytest.mark.parametrize("mode, steps", [("clip", [2, 0, 2]), ("fill", [2, 5, 0])])
def test_a_row_gathered_by_a_start_index_per_axis_is_on_factors(mode, steps):
    """``W[i]`` as JAX 0.12.1 writes it (a ``gather`` of one row at the index vector ``(i, 0, 0)``, no axis
    collapsed; earlier releases wrote ``dynamic_slice``), spelled out here so that every release runs it: row
    ``i`` against each example's gradient; with ``"fill"`` a start out of range (5 of 3 rows) drops the row
    (zeros here: ``fill_value=0``), and gives it no gradient."""
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(0, 1, 2), collapsed_slice_dims=(), start_index_map=(0, 1, 2))

    class Loop(eqx.Module):
        w: jax.Array  # (L, D, D)

        def __call__(self, x):
            def layer(h, i):
                start = jnp.stack([i, jnp.zeros_like(i), jnp.zeros_like(i)])
                row = jax.lax.squeeze(jax.lax.gather(self.w, start, dims, (1, *self.w.shape[1:]), mode=mode, fill_value=0.0), (0,))
                return jnp.tanh(h @ row + 0.1), None

            return jax.lax.scan(layer, x, jnp.array(steps))[0]

    k = jax.random.split(KEYS[5], 2)
    model = Loop(0.5 * jax.random.normal(k[0], (3, D, D)))
    x = jax.random.normal(k[1], (B, T, D))
    check(lambda m, x: jnp.sum(jnp.sin(jax.vmap(m)(x)), axis=(1, 2)), model, x, jit=True)


@pytest.mark.parametrize("loop", ["fori_loop", "scan_over_arange"])
def test_stacked_layers_indexed_by_the_loop_counter_are_on_factors(loop):
    """``lax.fori_loop(0, L, lambda i, h: layer(w[i], b[i], h), h)``, the hand-written layer loop: each step's
    ``w[i]`` (a ``dynamic_slice`` by an index every example shares) meets the examples in the body; row ``i``
    against each example's gradient there, the steps' positions side by side."""

    class Loop(eqx.Module):
        w: jax.Array  # (L, D, D)
        b: jax.Array  # (L, D)

        def __call__(self, x):
            layer = lambda i, h: jnp.tanh(h @ self.w[i] + self.b[i])  # noqa: E731
            if loop == "fori_loop":
                return jax.lax.fori_loop(0, 3, layer, x)
            return jax.lax.scan(lambda h, i: (layer(i, h), None), x, jnp.array([2, 0, 2]))[0]  # a row twice

    k = jax.random.split(KEYS[5], 3)
    model = Loop(0.5 * jax.random.normal(k[0], (3, D, D)), jax.random.normal(k[1], (3, D)))
    x = jax.random.normal(k[2], (B, T, D))
    check(lambda m, x: jnp.sum(jnp.sin(jax.vmap(m)(x)), axis=(1, 2)), model, x, jit=True)
