"""Per-example gradients on the models DP users train: each class that was silently wrong,
against the definition (row i of ``jax.jacrev`` of the losses vector), float64, jit and not;
and the classes that are on factors stay there (``fallback="error"`` raises otherwise)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrace as jt
from oracles import assert_close, batch_normalised_ste, centred_backward, centred_tangent, clipped_backward, oracle_per_example

# Each test runs under jit (always) and without it (jit=False, with --long: the eager passes
# take 5-35 s each on 2 cores).
pytestmark = pytest.mark.long_eager

B, T, V, D = 4, 5, 7, 6
KEYS = jax.random.split(jax.random.key(0), 8)


def check(losses_fn, model, *args, jit, on_factors=True, max_norm=0.5, **kwargs):
    """Norms (``fallback="error"`` where ``on_factors``) and the clipped sum against the definition."""
    ref = oracle_per_example(losses_fn, model, *args, **kwargs)

    def ours(*args, **kwargs):  # both in one program under jit: one compilation
        norms = jt.per_example_norms(losses_fn, fallback="error" if on_factors else "vmap")(*args, **kwargs)[1]
        return norms, jt.clipped_grad(losses_fn, max_norm)(*args, **kwargs)[1]

    sq, clipped = (eqx.filter_jit(ours) if jit else ours)(model, *args, **kwargs)
    assert_close(sq, ref.sq_norms, "per-leaf squared norms", rtol=1e-10)
    assert_close(clipped, ref.clipped(max_norm), "clipped sum", rtol=1e-10)


class GPT(eqx.Module):
    tok: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    ln: eqx.nn.LayerNorm
    lin: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.tok, self.pos = eqx.nn.Embedding(V, D, key=k[0]), eqx.nn.Embedding(T, D, key=k[1])
        self.ln, self.lin, self.head = eqx.nn.LayerNorm(D), eqx.nn.Linear(D, D, key=k[2]), eqx.nn.Linear(D, V, key=k[3])

    def __call__(self, ids):
        h = jax.vmap(self.tok)(ids) + jax.vmap(self.pos)(jnp.arange(ids.shape[0]))  # position ids inside the model
        return jax.vmap(self.head)(jnp.tanh(jax.vmap(self.lin)(jax.vmap(self.ln)(h))))


def lm_losses(model, ids):
    logp = jax.nn.log_softmax(jax.vmap(model)(ids))
    return -jnp.mean(jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0], axis=1)


def last_token_losses(model, ids):
    logp = jax.nn.log_softmax(jax.vmap(model)(ids)[:, -1])
    return -logp[jnp.arange(ids.shape[0]), ids[:, 0]]  # each example's own row, by arange


IDS = jax.random.randint(KEYS[4], (B, T), 0, V)
MLP = eqx.nn.MLP(3, 2, 5, 2, key=KEYS[5])
X, Y = jax.random.normal(KEYS[6], (B, 3)), jax.random.normal(KEYS[7], (B, 2))


def mse(model, x, y):
    return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)


@pytest.mark.parametrize("jit", [False, True])
def test_position_embedding_inside_vmap_is_on_factors(jit):
    check(lm_losses, GPT(KEYS[0]), IDS, jit=jit)
    check(last_token_losses, GPT(KEYS[1]), IDS, jit=jit)


@pytest.mark.parametrize("wrap", ["eqx.filter_jit", "checkpoint"])
def test_position_embedding_of_a_jitted_or_checkpointed_loss_function_is_on_factors(wrap):
    """The whole loss in one call body: the position rows meet the examples inside it."""
    losses = {"eqx.filter_jit": eqx.filter_jit, "checkpoint": jax.checkpoint}[wrap](lm_losses)
    check(losses, GPT(KEYS[1]), IDS, jit=True)


def _tag_names(jaxpr) -> list:
    """The names of the tags in ``jaxpr`` and in every body it holds."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "jaxtrace_tag":
            names.append(eqn.params["name"])
        for value in eqn.params.values():
            for body in value if isinstance(value, (tuple, list)) else (value,):
                body = getattr(body, "jaxpr", body)
                if hasattr(body, "eqns"):
                    names += _tag_names(body)
    return names


def test_the_plan_says_what_each_of_its_tags_marks():
    """Each tag the plan puts on a covered layer's call has its role in ``Plan.roles``, by name: the
    layer's output, its input or one of its parameters (what the proof reads, never parsed back)."""
    from jaxtrace._per_example._plan import TagKind, plan_for

    model = GPT(KEYS[0])
    plan = plan_for(model)
    names = set(_tag_names(jax.make_jaxpr(lambda leaves: lm_losses(plan.run_model(leaves), IDS))(plan.leaves).jaxpr))
    assert {r.kind for r in map(plan.roles.get, names) if r is not None} == set(TagKind)
    assert names <= set(plan.roles)
    by_kind = {TagKind.OUTPUT: "{0}", TagKind.INPUT: "{0}:in", TagKind.PARAM: "{0}:params:{1}"}
    for name, role in plan.roles.items():
        assert name == by_kind[role.kind].format(role.layer, role.attribute)
    assert {layer.path for layer in plan.layers} == {r.layer for r in plan.roles.values()}
    params = {(r.layer, r.attribute) for r in plan.roles.values() if r.kind is TagKind.PARAM}
    assert {(layer.path, a) for layer in plan.layers for a in layer.leaves} <= params


def test_the_proof_is_read_only():
    """The ``Proof`` cannot change after ``prove`` returns: a frozen dataclass whose maps are read-only
    views, its layer calls frozen ``Occurrence``s that keep the backward walk's ownership of their output."""
    import dataclasses

    from jaxtrace._per_example._find import find_contributions
    from jaxtrace._per_example._owners import Axis
    from jaxtrace._per_example._traced import TracedFun

    proof = find_contributions(TracedFun(lm_losses, 0, False, (GPT(KEYS[0]), IDS), {})).proof
    head = proof.occurrences["head"][0]
    assert isinstance(head.out, Axis) and proof.shared and all(isinstance(use.chain, tuple) for use in proof.shared)
    with pytest.raises(dataclasses.FrozenInstanceError):
        proof.mixing = "changed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        head.out = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        proof.shared[0].index = 1
    for mapping in (proof.occurrences, proof.states):
        with pytest.raises(TypeError):
            mapping["changed"] = ()


@pytest.mark.parametrize("jit", [False, True])
def test_negative_embedding_ids_select_rows_from_the_end(jit):
    ids = IDS.at[0, 0].set(-1).at[0, 1].set(V - 1)  # the same row twice in one example
    check(lm_losses, GPT(KEYS[0]), ids, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_frozen_and_tied_weights(jit):
    def frozen(model, x, y):  # the equinox FAQ's freezing: the frozen weight's gradient is zero
        model = eqx.tree_at(lambda m: m.layers[0].weight, model, jax.lax.stop_gradient(model.layers[0].weight))
        return mse(model, x, y)

    check(frozen, MLP, X, Y, jit=jit)

    class Tied(eqx.Module):  # a head tied to the embedding with tree_at at call time
        emb: eqx.nn.Embedding
        head: eqx.nn.Linear

        def __call__(self, ids):
            head = eqx.tree_at(lambda lin: lin.weight, self.head, self.emb.weight)
            return jax.vmap(head)(jax.vmap(self.emb)(ids))

    check(lm_losses, Tied(eqx.nn.Embedding(V, D, key=KEYS[0]), eqx.nn.Linear(D, V, use_bias=False, key=KEYS[1])), IDS, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_transformed_weights_take_the_exact_path(jit):
    mask = (jnp.arange(15).reshape(5, 3) % 2).astype(float)

    def masked(model, x, y):
        return mse(eqx.tree_at(lambda m: m.layers[0].weight, model, model.layers[0].weight * mask), x, y)

    check(masked, MLP, X, Y, jit=jit, on_factors=False)
    with pytest.raises(jt.TagError, match="multiplies a value computed from it"):
        jt.per_example_norms(masked, fallback="error")(MLP, X, Y)

    class LoRA(eqx.Module):
        base: eqx.nn.Linear
        a: jax.Array
        b: jax.Array

        def __call__(self, x):
            w = jax.lax.stop_gradient(self.base.weight) + self.a @ self.b
            return eqx.tree_at(lambda lin: lin.weight, self.base, w)(x)

    lora = LoRA(eqx.nn.Linear(3, 2, key=KEYS[0]), 0.1 * jnp.ones((2, 1)), jax.random.normal(KEYS[1], (1, 3)))
    check(mse, lora, X, Y, jit=jit, on_factors=False)


@pytest.mark.parametrize("jit", [False, True])
def test_layers_stacked_in_scan_are_one_slice_per_step(jit):
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(jax.random.split(KEYS[2], 3))

    class Stack(eqx.Module):
        layers: eqx.nn.Linear
        out: eqx.nn.Linear

        def __call__(self, x):
            dynamic, static = eqx.partition(self.layers, eqx.is_array)
            h, _ = jax.lax.scan(lambda h, d: (jnp.tanh(eqx.combine(d, static)(h)), None), x, dynamic)
            return self.out(h)

    check(mse, Stack(stack, eqx.nn.Linear(D, 2, key=KEYS[3])), jax.random.normal(KEYS[4], (B, D)), Y, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_batch_layouts_need_no_guess(jit):
    check(lambda m, x: mse(m, x, Y), MLP, X, jit=jit)  # targets in a closure
    check(lambda m, x, y, w=None: w * mse(m, x, y), MLP, X, Y, w=jnp.arange(1.0, B + 1), jit=jit)  # a keyword

    class Mixer(eqx.Module):  # a (T, T) mask with T == B: not the example axis
        lin: eqx.nn.Linear

        def __call__(self, x, mask):
            return jnp.sum(mask @ jax.vmap(self.lin)(x), axis=0)

    mask = jnp.tril(jnp.ones((B, B)))
    xs = jax.random.normal(KEYS[2], (B, B, 3))
    fn = lambda m, x, mask, y: jnp.sum((jax.vmap(m, in_axes=(0, None))(x, mask) - y) ** 2, axis=-1)  # noqa: E731
    check(fn, Mixer(eqx.nn.Linear(3, 2, key=KEYS[1])), xs, mask, Y, jit=jit)
    check(lambda m, xt, y: mse(m, xt.T, y), MLP, X.T, Y, jit=jit)  # feature-major x


@pytest.mark.parametrize(
    "losses_fn",
    [
        pytest.param(lambda m, x, y: centred(jax.vmap(m)(x)), id="batch-mean centring"),
        pytest.param(lambda m, x, y: contrastive(jax.vmap(m)(x)), id="in-batch contrastive"),
        pytest.param(lambda m, x, y: batch_sum(jax.vmap(m)(x)), id="a batch sum"),
    ],
)
def test_interacting_examples_are_refused(losses_fn):
    """Opacus refuses BatchNorm: per-example clipping bounds nothing when examples interact."""
    with pytest.raises(jt.TagError, match="losses\\[i\\] depends on example j != i through"):
        jt.per_example_norms(losses_fn)(MLP, X, Y)
    with pytest.raises(jt.TagError, match="need independent examples"):
        jt.clipped_grad(losses_fn, 1.0)(MLP, X, Y)


def centred(out):
    return jnp.sum((out - jnp.mean(out, axis=0)) ** 2, axis=-1)


def batch_sum(out):
    return jnp.sum(out * jnp.sum(out), axis=-1)


def contrastive(z):
    logits = z @ z.T
    return jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits)


def test_interaction_through_a_second_call_is_exact():
    """The batch mean of a second call of the model: its layers' outputs reach every example, so their
    leaves take the exact path (the definition's numbers); not refused, since no value is both one
    example's and every example's."""
    check(lambda m, x, y: jnp.sum(jax.vmap(m)(x) - jnp.mean(jax.vmap(m)(x), axis=0), axis=-1), MLP, X, Y, jit=False, on_factors=False)


def test_batch_norm_in_training_mode_is_refused():
    class Net(eqx.Module):
        first: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        last: eqx.nn.Linear

    model = Net(eqx.nn.Linear(3, 5, key=KEYS[0]), eqx.nn.BatchNorm(5, axis_name="batch"), eqx.nn.Linear(5, 1, key=KEYS[1]))
    state = eqx.nn.State(model)

    def losses(m, x):
        def one(x, state):
            h, state = m.norm(m.first(x), state)
            return m.last(h)[0], state

        out, _ = jax.vmap(one, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
        return out**2

    with pytest.raises(jt.TagError, match="independent examples"):
        jt.per_example_norms(losses)(model, X)


def test_data_mixed_before_any_weight_is_not_refused():
    """Centring the inputs mixes data, not parameters: each example's gradient is still its layers' factors."""
    check(lambda m, x, y: mse(m, x - jnp.mean(x, axis=0), y), MLP, X, Y, jit=False)


# --- examples that meet through attention across the batch (issue 51) ------------------------


class SetModel(eqx.Module):
    """A set model: attention with the batch as the sequence (each example's query reads every
    example's key and value), then a Linear per row. ``first``: a Linear per row before it."""

    attn: eqx.nn.MultiheadAttention
    lin: eqx.nn.Linear
    first: object = None

    def __call__(self, x):  # x (B, d): the whole batch
        h = x if self.first is None else jnp.tanh(jax.vmap(self.first)(x))
        return jax.vmap(self.lin)(self.attn(h, h, h))


def set_model(first=False):
    k = jax.random.split(KEYS[3], 3)
    return SetModel(eqx.nn.MultiheadAttention(2, D, key=k[0]), eqx.nn.Linear(D, 3, key=k[1]), eqx.nn.Linear(D, D, key=k[2]) if first else None)


def set_losses(model, x, y):
    return jnp.sum((model(x) - y) ** 2, axis=-1)


XS, YS = jax.random.normal(KEYS[4], (B, D)), jax.random.normal(KEYS[5], (B, 3))


@pytest.mark.parametrize("jit", [False, True])
def test_attention_across_the_batch_on_the_inputs_is_the_definition(jit):
    """Issue 51: attention applied to the inputs with the batch as the sequence. The keys and values are
    layer outputs every example's query reads; each example's gradient at them comes from where they meet
    the queries, and it is on factors. Their projections (``eqx.nn.Linear`` without bias, under
    ``jax.vmap``) have their outputs as ``(features, B)`` in the program: that gradient read in the value's
    ``(B, features)`` layout was silently off (65% on the key projection's norms)."""
    check(set_losses, set_model(), XS, YS, jit=jit)


def test_attention_across_the_batch_on_activations_is_refused():
    """The same attention on the output of a Linear: that output is each example's query and every
    example's key: examples interact, refused with the operation."""
    with pytest.raises(jt.TagError, match="losses\\[i\\] depends on example j != i through"):
        jt.per_example_norms(set_losses)(set_model(first=True), XS, YS)


# --- the example axis is never read from sizes: a batch of one, a batch as wide as the classes ------------


def class_losses(model, x, labels):
    import optax  # noqa: PLC0415

    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), labels)


def centred_logits(model, x, labels):  # the keepdims reduction, broadcast back, written out
    h = jax.vmap(model)(x)
    h = h - h.max(-1, keepdims=True)
    return jnp.log(jnp.sum(jnp.exp(h), axis=-1)) - jnp.take_along_axis(h, labels[:, None], axis=-1)[:, 0]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 5])  # 1; as wide as the inputs (3); as the classes (5)
def test_batch_of_one_and_batch_as_wide_as_an_axis_are_on_factors(jit, batch):
    """Issue 51: ``B = 1`` (Poisson sampling, micro-batches of one) with a keepdims reduction broadcast back
    was refused as "examples interact"; with one example nothing interacts. ``B`` equal to the classes' or
    the inputs' size is no guess either."""
    pytest.importorskip("optax")
    model = eqx.nn.MLP(3, 5, 8, 1, key=KEYS[6])
    x, labels = jax.random.normal(KEYS[7], (batch, 3)), jnp.arange(batch) % 5
    check(class_losses, model, x, labels, jit=jit)
    check(centred_logits, model, x, labels, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_a_batch_of_one_never_interacts(jit):
    """A batch mean over one example, and attention over a batch of one, are that example's own."""
    check(lambda m, x, y: centred(jax.vmap(m)(x)), MLP, X[:1], Y[:1], jit=jit)
    check(set_losses, set_model(first=True), XS[:1], YS[:1], jit=jit)


def test_has_aux():
    def losses(m, x, y):
        per = mse(m, x, y)
        return per, {"mean": jnp.mean(per)}

    (value, aux), sq = jt.per_example_norms(losses, has_aux=True, total=True)(MLP, X, Y)
    ref = oracle_per_example(lambda m, x, y: losses(m, x, y)[0], MLP, X, Y)
    assert_close(sq, ref.total, "total squared norms", rtol=1e-10, atol=0)
    np.testing.assert_allclose(aux["mean"], jnp.mean(value), rtol=1e-12)
    (value2, aux2), grads = jt.clipped_grad(losses, 1.0, has_aux=True)(MLP, X, Y)
    np.testing.assert_allclose(value2, value)
    assert_close(grads, ref.clipped(1.0), "clipped sum", rtol=1e-10)


def test_nnx_state_updated_in_the_call_is_written_back():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs, training):
            self.first = nnx.Linear(3, 4, rngs=rngs, param_dtype=jnp.float64)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.norm = nnx.BatchNorm(4, use_running_average=not training, rngs=rngs, param_dtype=jnp.float64)
            self.last = nnx.Linear(4, 2, rngs=rngs, param_dtype=jnp.float64)

        def __call__(self, x):
            return self.last(self.norm(self.drop(jnp.tanh(self.first(x)))))

    def losses(m, x, y):
        return jnp.sum((m(x) - y) ** 2, axis=-1)

    model = Net(nnx.Rngs(0), training=False)
    reference = nnx.clone(model)  # the same RNG state: the same dropout mask
    graphdef, params, rest = nnx.split(reference, nnx.Param, ...)
    rows = jax.jacrev(lambda p: losses(nnx.merge(graphdef, p, jax.tree_util.tree_map(lambda v: v, rest)), X, Y))(params)
    expected = sum(jnp.sum(r.reshape(B, -1) ** 2, axis=1) for r in jax.tree_util.tree_leaves(rows))
    _, sq = jt.per_example_norms(losses, total=True)(model, X, Y)  # BatchNorm's scale and bias: the exact path
    np.testing.assert_allclose(sq, expected, rtol=1e-10)
    _, again = jt.per_example_norms(losses, total=True)(model, X, Y)
    assert not np.allclose(again, sq)  # the RNG count moved on: a new dropout mask

    with pytest.raises(jt.TagError, match="independent examples"):  # BatchNorm in training mode
        jt.per_example_norms(losses)(Net(nnx.Rngs(0), training=True), X, Y)


# --- freezing with eqx.partition ---------------------------------------------------


def frozen_spec(model, where):
    """``eqx.partition``'s filter: the inexact arrays, except every leaf under ``where(model)``."""
    spec = jax.tree_util.tree_map(eqx.is_inexact_array, model)
    return eqx.tree_at(where, spec, replace_fn=lambda node: jax.tree_util.tree_map(lambda _: False, node))


@pytest.mark.parametrize("jit", [False, True])
def test_freezing_with_eqx_partition(jit):
    """`params, static = eqx.partition(model, spec)` and `fun(params, static, ...)` calling `eqx.combine`:
    the static half is tagged like the params half, so the two combine; the frozen leaves are not
    differentiated and the trained ones stay on factors."""

    def losses(params, static, x, y):
        return mse(eqx.combine(params, static), x, y)

    for where in (lambda m: m.layers[0], lambda m: m.layers[1].weight):
        params, static = eqx.partition(MLP, frozen_spec(MLP, where))
        check(losses, params, static, X, Y, jit=jit)
        check(lambda p, x, y, *, static: losses(p, static, x, y), params, X, Y, static=static, jit=jit)  # a keyword

    gpt = GPT(KEYS[0])  # position ids inside the model, the token embedding frozen
    params, static = eqx.partition(gpt, frozen_spec(gpt, lambda m: m.tok))
    check(lambda p, s, ids: lm_losses(eqx.combine(p, s), ids), params, static, IDS, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("frozen", ["ln.weight", "ln.bias", "lin.weight", "lin.bias"])
def test_freezing_one_parameter_of_a_layer_with_eqx_partition_stays_on_factors(jit, frozen):
    """One parameter of a LayerNorm (and an RMSNorm with a bias) or a Linear frozen by `eqx.partition`,
    the other trained: the frozen one is `None` in the model the transform is given. The rules read the
    layer's configuration, never its arrays (a norm's scale factor is `g * xhat`, with no scale in it),
    so the trained one stays on factors."""
    layer, part = frozen.split(".")
    gpt = GPT(KEYS[0])
    params, static = eqx.partition(gpt, frozen_spec(gpt, lambda m: getattr(getattr(m, layer), part)))
    check(lambda p, s, ids: lm_losses(eqx.combine(p, s), ids), params, static, IDS, jit=jit)
    if layer != "ln":
        return

    class Normed(eqx.Module):
        norm: eqx.nn.RMSNorm
        mlp: eqx.nn.MLP

        def __call__(self, x):
            return self.mlp(self.norm(x))

    model = Normed(eqx.nn.RMSNorm(3, use_bias=True), eqx.nn.MLP(3, 2, 5, 1, key=KEYS[1]))
    model = eqx.tree_at(lambda m: (m.norm.weight, m.norm.bias), model, (jnp.arange(1.0, 4.0), jnp.array([0.1, -0.2, 0.3])))
    params, static = eqx.partition(model, frozen_spec(model, lambda m: getattr(m.norm, part)))
    check(lambda p, s, x, y: mse(eqx.combine(p, s), x, y), params, static, X, Y, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_freezing_by_closing_over_the_static_half_of_eqx_partition(jit):
    """Issue 51.6: `lambda trainable, x, y: mse(eqx.combine(trainable, frozen), x, y)`, the common
    equinox pattern, with `frozen` in a closure (either order of `eqx.combine`'s halves): the
    definition's numbers. The untagged model is traced, so each leaf is on factors where a read rule
    covers its use (the MLP's matrix products and biases, `fallback="error"`); the GPT's position
    table, read as `pos(arange(T))`, takes the exact path, and `fallback="error"` names it."""
    params, static = eqx.partition(MLP, frozen_spec(MLP, lambda m: m.layers[0]))
    check(lambda p, x, y: mse(eqx.combine(p, static), x, y), params, X, Y, jit=jit)
    check(lambda p, x, y: mse(eqx.combine(static, p), x, y), params, X, Y, jit=jit)
    gpt = GPT(KEYS[0])
    params, static = eqx.partition(gpt, frozen_spec(gpt, lambda m: m.tok))
    closed = lambda p, ids: lm_losses(eqx.combine(p, static), ids)  # noqa: E731
    check(closed, params, IDS, jit=jit, on_factors=False)
    with pytest.raises(jt.TagError, match="'pos.weight'"):
        jt.per_example_norms(closed, fallback="error")(params, IDS)
    check(lambda p, s, ids: lm_losses(eqx.combine(p, s), ids), params, static, IDS, jit=jit)  # as an argument: all on factors


def test_freezing_by_closure_on_a_model_with_no_rule_for_its_reads_names_the_leaf():
    """Where the closed-over half leaves a leaf on no factor path, `fallback="error"` names it and
    `fallback="vmap"` gives the definition's numbers."""

    class Scaled(eqx.Module):
        lin: eqx.nn.Linear
        gain: jax.Array

        def __call__(self, x):
            return jnp.tanh(self.lin(x)) * jnp.exp(self.gain)

    model = Scaled(eqx.nn.Linear(3, 2, key=KEYS[1]), jnp.array([0.3, -0.2]))
    params, static = eqx.partition(model, frozen_spec(model, lambda m: m.lin.bias))

    def losses(p, x, y):
        return jnp.sum((jax.vmap(eqx.combine(p, static))(x) - y) ** 2, axis=-1)

    check(losses, params, X, Y, jit=False, on_factors=False)
    with pytest.raises(jt.TagError, match="'gain'"):
        jt.per_example_norms(losses, fallback="error")(params, X, Y)


# --- examples that interact through a second call of the model ---------------------


def exact_or_refused(losses_fn, model, *args):
    """The definition's numbers (jit and not, norms and clipped sum), or the interaction TagError."""
    try:
        jt.per_example_norms(losses_fn)(model, *args)
    except jt.TagError as e:
        assert "losses[i] depends on example j != i through" in str(e), str(e)
        return "refused"
    for jit in (False, True):
        check(losses_fn, model, *args, jit=jit, on_factors=False)
    return "exact"


WIDE = eqx.nn.MLP(3, 3, 5, 2, key=KEYS[3])  # outputs as wide as inputs: the model can be called on them
PERM = jnp.asarray((np.arange(B) + 1) % B)


def sq_err(out, y):
    return jnp.sum((out - y[:, :1]) ** 2, axis=-1)


def second_call(mix, own_loss=False):
    """The model called on ``x``, then again on ``mix(x, first outputs)``; with ``own_loss`` the first
    outputs also enter each example's loss directly."""

    def losses(m, x, y):
        out = jax.vmap(m)(x)
        second = sq_err(jax.vmap(m)(mix(x, out)), y)
        return second + sq_err(out, y) if own_loss else second

    return losses


def shift(out):  # examples moved down by one with lax.pad (low 1, high -1): the size is kept
    return jax.lax.pad(out, 0.0, ((1, -1, 0), (0, 0, 0)))


SECOND_CALLS = {
    # the model applied again to its inputs scaled by, or centred with, a batch statistic of its first outputs
    "batch statistic": second_call(lambda x, out: x * (1 + jnp.mean(out))),
    "batch statistic and own loss": second_call(lambda x, out: x - jnp.mean(out, axis=0), own_loss=True),
    # one example's output fed into another example's call
    "rolled outputs": second_call(lambda x, out: x + jnp.roll(out, 1, axis=0)),
    "rolled outputs and own loss": second_call(lambda x, out: x + jnp.roll(out, 1, axis=0), own_loss=True),
    "permuted outputs": second_call(lambda x, out: x + out[PERM]),
    "permuted outputs and own loss": second_call(lambda x, out: out[PERM], own_loss=True),
    "padded shift": lambda m, x, y: sq_err(shift(jax.vmap(m)(x)), y),
    "padded shift, second call": second_call(lambda x, out: shift(out)),
}


@pytest.mark.parametrize("name", list(SECOND_CALLS))
def test_examples_interacting_through_a_second_call_are_exact_or_refused(name):
    """Never a silent number: the definition's, or the interaction TagError. Where a value is both one
    example's and (through the statistic or the permutation) every example's, it is refused."""
    got = exact_or_refused(SECOND_CALLS[name], WIDE, X, Y)
    if name in ("batch statistic and own loss", "permuted outputs and own loss"):
        assert got == "refused"


@pytest.mark.parametrize("jit", [False, True])
def test_shared_output_meeting_the_examples_at_the_top_and_inside_a_call(jit):
    """A position embedding added at the top level and also read inside a `jit` body whose other output
    is unused: both places reach the losses, and each example's gradient at the embedding is the sum
    of both (on factors; the top-level place alone would be silently short)."""

    class Twice(GPT):
        def __call__(self, ids):
            pos = jax.vmap(self.pos)(jnp.arange(ids.shape[0]))
            h = jax.vmap(self.tok)(ids) + pos
            _, h = jax.jit(lambda h, p: (2.0 * p, h * p))(h, pos)
            return jax.vmap(self.head)(jnp.tanh(jax.vmap(self.lin)(jax.vmap(self.ln)(h))))

    check(lm_losses, Twice(KEYS[0]), IDS, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("where", ["checkpoint", "jit", pytest.param("matmul", marks=pytest.mark.long), "matmul_lhs", "scan"])  # matmul: ~20 s
def test_shared_output_meeting_the_examples_inside_a_body_or_through_a_matmul(jit, where):
    """A shared layer output (a position embedding) that meets the examples inside a `checkpoint` or
    `jit` body, or through a matrix product with a per-example operand (either side): on factors;
    inside a `lax.scan` body: the exact path. The definition's numbers either way."""

    class Meet(GPT):
        def __call__(self, ids):
            pos = jax.vmap(self.pos)(jnp.arange(ids.shape[0]))
            tok = jax.vmap(self.tok)(ids)
            if where == "matmul":
                h = tok + jax.nn.softmax(tok @ pos.T, axis=-1) @ tok  # pos meets tok in a dot_general
            elif where == "matmul_lhs":
                h = tok + jax.nn.softmax(pos @ tok.T, axis=0).T @ tok  # ... as its left operand
            elif where == "scan":  # inside a loop body: the exact path
                h = jax.lax.scan(lambda c, tp: (c + 1.0, tp[0] + tp[1]), 0.0, (tok, pos))[1]
            else:
                h = (jax.checkpoint if where == "checkpoint" else jax.jit)(lambda a, b: a + b)(tok, pos)
            return jax.vmap(self.head)(jnp.tanh(jax.vmap(self.lin)(jax.vmap(self.ln)(h))))

    check(lm_losses, Meet(KEYS[0]), IDS, jit=jit, on_factors=where != "scan")


# --- a loss computed in shard_map over the batch -------------------------------------

SHARD_MAP_CHECK = r"""
import json, os, sys
import equinox as eqx, jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import jaxtrace as jt
from oracles import assert_close, oracle_per_example

jax.config.update("jax_enable_x64", True)
mesh = jax.make_mesh((8,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
model = eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(0))
x, y = jax.random.normal(jax.random.key(1), (16, 3)), jax.random.normal(jax.random.key(2), (16, 2))

def closed(model, x, y):  # the model closed over by the shard_map body
    body = lambda x, y: jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
    return jax.shard_map(body, mesh=mesh, in_specs=(P("b"), P("b")), out_specs=P("b"))(x, y)

def passed(model, x, y):  # the model's arrays passed in, replicated
    arrays, rest = eqx.partition(model, eqx.is_array)
    body = lambda a, x, y: jnp.sum((jax.vmap(eqx.combine(a, rest))(x) - y) ** 2, axis=-1)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("b"), P("b")), out_specs=P("b"))(arrays, x, y)

out = {}
for name, losses in (("closed", closed), ("passed", passed)):
    try:
        ref = oracle_per_example(losses, model, x, y)
        for wrap in (eqx.filter_jit,):  # eagerly, shard_map runs op by op on each device: 46 of 68 s
            _, sq = wrap(jt.per_example_norms(losses))(model, x, y)
            assert_close(sq, ref.sq_norms, "per-leaf squared norms", rtol=1e-10)
            _, clipped = wrap(jt.clipped_grad(losses, 0.5))(model, x, y)
            assert_close(clipped, ref.clipped(0.5), "clipped sum", rtol=1e-10)
        out[name] = "ok"
    except Exception as e:  # noqa: BLE001
        import traceback
        out[name] = traceback.format_exc()
print(json.dumps(out))
"""


@pytest.mark.long  # a subprocess with 8 CPU devices: JAX's start-up and compiles take over 10 s
def test_losses_in_shard_map_over_the_batch_are_exact():
    """The per-example losses computed in `jax.shard_map` over the batch (8 devices, 2 examples each),
    the model closed over or passed in replicated: the definition's norms and clipped sum."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.path.join(root, "tests"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", SHARD_MAP_CHECK], env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    for name, outcome in json.loads(lines[-1]).items():
        assert outcome == "ok", f"{name}:\n{outcome}"


# --- custom derivative rules --------------------------------------------------------
#
# The proof reads the primal program; JAX differentiates a `custom_vjp`/`custom_jvp` call by its
# rule. A rule that mixes examples where its primal does not (a backward pass centred over the
# batch) gives each example's gradient the other examples' too: by the definition (`jacrev`),
# not the layers' factors.


class TwoLayers(eqx.Module):
    first: eqx.nn.Linear
    second: eqx.nn.Linear


TWO = TwoLayers(eqx.nn.Linear(3, 5, key=KEYS[0]), eqx.nn.Linear(5, 2, key=KEYS[3]))


def custom_between(custom, inside_vmap):
    """Losses of ``second(tanh(custom(first(x))))``: ``custom`` on the batch, or inside ``jax.vmap`` per example."""

    def losses(m, x, y):
        if inside_vmap:
            out = jax.vmap(lambda x: m.second(jnp.tanh(custom(m.first(x)))))(x)
        else:
            out = jax.vmap(m.second)(jnp.tanh(custom(jax.vmap(m.first)(x))))
        return jnp.sum((out - y) ** 2, axis=-1)

    return losses


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("custom", [centred_backward, batch_normalised_ste, centred_tangent], ids=lambda f: f.__name__)
def test_a_custom_rule_that_mixes_examples_takes_the_exact_path(jit, custom):
    """Called on the batch, a rule that mixes examples: the leaves before it take the exact path (the
    pullback of the losses vector against each basis vector, which runs the rule as `jacrev` does), the
    ones after it stay on factors; `fallback="error"` names the call and its line."""
    losses = custom_between(custom, inside_vmap=False)
    check(losses, TWO, X, Y, jit=jit, on_factors=False)
    with pytest.raises(jt.TagError, match=r"'first\.weight'.*custom_[jv][vj]p_call.*test_per_example_proof\.py"):
        jt.per_example_norms(losses, fallback="error")(TWO, X, Y)
    second_only = lambda m, x, y: losses(eqx.tree_at(lambda t: t.first, m, replace_fn=lambda l: jax.tree.map(jax.lax.stop_gradient, l)), x, y)  # noqa: E731
    check(second_only, TWO, X, Y, jit=jit, on_factors=False)  # the first layer's leaves: zero, not on factors


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("custom", [centred_backward, batch_normalised_ste, centred_tangent], ids=lambda f: f.__name__)
def test_a_custom_rule_inside_vmap_over_the_examples_stays_on_factors(jit, custom):
    """The same rules called inside `jax.vmap` over the examples: JAX batches the rule, which then mixes
    the positions of one example only; proven from the rule, on factors."""
    check(custom_between(custom, inside_vmap=True), TWO, X, Y, jit=jit)


@pytest.mark.parametrize("jit", [False, True])
def test_custom_rules_of_one_example_stay_on_factors(jit):
    """`jax.nn.relu` and `jax.nn.softmax` (custom_jvp) inside `jax.vmap(model)` and on the batch, a
    softmax cross-entropy, and a backward pass that clips each cotangent element on the batch: rules
    that keep each example's positions to themselves, on factors."""
    relu_mlp = eqx.nn.MLP(3, 4, 5, 2, activation=jax.nn.relu, key=KEYS[5])
    labels = jnp.arange(B) % 4

    def cross_entropy(m, x, labels):
        logits = jax.vmap(m)(x)
        return -jnp.sum(jax.nn.one_hot(labels, 4) * jnp.log(jax.nn.softmax(logits, axis=-1)), axis=-1)

    check(cross_entropy, relu_mlp, X, labels, jit=jit)
    batched = lambda m, x, y: jnp.sum((jax.vmap(m.second)(jax.nn.softmax(jax.nn.relu(jax.vmap(m.first)(x)), axis=-1)) - y) ** 2, axis=-1)  # noqa: E731
    check(batched, TWO, X, Y, jit=jit)
    check(custom_between(clipped_backward, inside_vmap=False), TWO, X, Y, jit=jit)


def custom_block(mix):
    """``vmap(layer)`` as a `custom_vjp` function whose backward pass is JAX's own, centred over the batch with ``mix``."""

    @jax.custom_vjp
    def block(layer, x):
        return jax.vmap(layer)(x)

    def fwd(layer, x):
        return jax.vjp(lambda layer, x: jax.vmap(layer)(x), layer, x)

    def bwd(vjp, g):
        return vjp(g - jnp.mean(g, axis=0) if mix else g)

    block.defvjp(fwd, bwd)
    return block


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mix", [False, True])
def test_a_layer_called_inside_a_custom_rule_takes_the_exact_path(jit, mix):
    """A covered layer called inside a `custom_vjp` function: JAX differentiates the rule, so its tags have
    no gradient; its leaves take the exact path (no TagError about the tag), and say so with "error"."""
    block = custom_block(mix)

    def losses(m, x, y):
        return jnp.sum((jax.vmap(m.second)(jnp.tanh(block(m.first, x))) - y) ** 2, axis=-1)

    check(losses, TWO, X, Y, jit=jit, on_factors=False)
    with pytest.raises(jt.TagError, match=r"'first\.weight'.*called inside a function with a custom derivative rule"):
        jt.per_example_norms(losses, fallback="error")(TWO, X, Y)


@jax.custom_vjp
def half_gradient(w):
    """The identity, whose backward pass halves the gradient (the weight is not the leaf to JAX's gradient)."""
    return w


half_gradient.defvjp(lambda w: (w, None), lambda _, g: (0.5 * g,))


@pytest.mark.parametrize("jit", [False, True])
def test_a_weight_passed_through_a_custom_rule_takes_the_exact_path(jit):
    """An identity `custom_vjp` between the leaf and its layer whose backward pass halves the gradient:
    the layer multiplies the leaf's value, but JAX's gradient to the leaf is the rule's (the factors
    would give 4x the squared norm); the exact path."""

    def losses(m, x, y):
        first = eqx.tree_at(lambda l: l.weight, m.first, half_gradient(m.first.weight))
        return jnp.sum((jax.vmap(m.second)(jnp.tanh(jax.vmap(first)(x))) - y) ** 2, axis=-1)

    check(losses, TWO, X, Y, jit=jit, on_factors=False)
    with pytest.raises(jt.TagError, match=r"'first\.weight'.*multiplies a value computed from it"):
        jt.per_example_norms(losses, fallback="error")(TWO, X, Y)
