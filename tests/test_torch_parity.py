"""Parity with PyTorch: gradients at module outputs/inputs and parameters, layer by layer.

Each model is written twice, in torch and in equinox (with explicit ``jt.tag``
calls named like the torch modules' ``named_modules()`` paths), with the same
weights (``jaxtrace.torch.load_weights``). The torch side is the oracle: its
gradients come from tensor hooks (``jaxtrace.torch.grad``), an independent
mechanism. Float64 must agree to 1e-10 (relative to each gradient's scale);
float32 to ``RTOL32``.
"""

import math
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jaxtrace as jt  # noqa: E402
import jaxtrace.torch as jtt  # noqa: E402

jax.config.update("jax_enable_x64", True)
torch.set_num_threads(1)

RTOL64 = 1e-10
ATOL64 = 1e-13  # for gradients that are zero analytically (a key bias under softmax) and ~1e-17 in practice
RTOL32 = 1e-5  # float32: max |jax - torch| <= 1e-5 * max |torch| per gradient
nn = torch.nn


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def jax_grads(model, loss, *args, jit=False):
    """``jt.grad`` of ``loss(model, *args)`` w.r.t. the model's arrays."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def f(p, *a):
        return loss(eqx.combine(p, static), *a)

    g = jt.grad(f)
    return (jax.jit(g) if jit else g)(params, *args)


def check_parity(tmodel, jmodel, targs, jargs, tloss, jloss, *, jit, rtol=RTOL64, atol=ATOL64, zero=()):
    """Module and parameter gradients from both sides agree, and are not trivially zero."""
    jmodel = jtt.load_weights(jmodel, tmodel)
    param_grads, tag_grads = jax_grads(jmodel, jloss, *jargs, jit=jit)
    t_params, t_modules = jtt.grad(tmodel, *targs, loss=tloss, where=list(tag_grads))
    modules = jt.compare(tag_grads, t_modules, rtol=rtol, atol=atol, labels=("jax", "torch"))
    modules.assert_ok("gradients at module outputs/inputs")
    params = jt.compare(jtt.named_grads(param_grads, tmodel), t_params, rtol=rtol, atol=atol, labels=("jax", "torch"))
    params.assert_ok("parameter gradients")
    assert len(params.rows) == len(list(tmodel.parameters()))
    for name, leaf in jt._compare.named_leaves({**t_modules, **t_params}).items():
        if name not in zero:
            assert np.abs(leaf).max() > 0, f"{name}: an all-zero gradient makes this check vacuous"
    return tag_grads, t_modules


# --- MLP ------------------------------------------------------------------------


class TorchMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x):
        return self.layers(x)


class JaxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Linear(4, 6, key=k[0]),
            eqx.nn.Lambda(jnp.tanh),
            eqx.nn.Linear(6, 6, key=k[1]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(6, 3, key=k[2]),
        ]

    def __call__(self, x):
        h = jt.tag(x, "layers:in")
        for i, layer in enumerate(self.layers):
            h = jt.tag(layer(jt.tag(h, f"layers.{i}:in")), f"layers.{i}")
        return jt.tag(h, "layers")


def _data(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=dtype)
    return t, jnp.asarray(t.numpy())


@pytest.mark.parametrize("jit", [False, True])
def test_mlp(jit):
    torch.manual_seed(0)
    tmodel = TorchMLP().double()
    (tx, x), (ty, y) = _data(3, 4), _data(3, 3, seed=1)

    def jloss(m, x):
        out = jt.tag(jax.vmap(m)(x), "")
        return jnp.mean((out - y) ** 2)

    tag_grads, t_modules = check_parity(
        tmodel, JaxMLP(_keys(1)[0]), (tx,), (x,), lambda out: ((out - ty) ** 2).mean(), jloss, jit=jit
    )
    assert set(t_modules) == {"", "layers", "layers:in", *(f"layers.{i}{s}" for i in range(5) for s in ("", ":in"))}
    assert t_modules["layers.2"].shape == (3, 6)


# --- CNN with in-place ReLU and pooling --------------------------------------


class TorchCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.act1 = nn.ReLU(inplace=True)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(3, 4, 3)
        self.act2 = nn.ReLU(inplace=True)
        self.pool2 = nn.AvgPool2d(2)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.pool1(self.act1(self.conv1(x)))
        x = self.pool2(self.act2(self.conv2(x)))
        return self.fc(x.flatten(1))


class JaxCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    pool1: eqx.nn.MaxPool2d
    conv2: eqx.nn.Conv2d
    pool2: eqx.nn.AvgPool2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[0])
        self.pool1 = eqx.nn.MaxPool2d(2, stride=2)
        self.conv2 = eqx.nn.Conv2d(3, 4, 3, key=k[1])
        self.pool2 = eqx.nn.AvgPool2d(2, stride=2)
        self.fc = eqx.nn.Linear(4, 3, key=k[2])

    def __call__(self, x):  # one example, (C, H, W)
        x = jt.tag(self.conv1(x), "conv1")
        x = jt.tag(jax.nn.relu(jt.tag(x, "act1:in")), "act1")
        x = jt.tag(self.pool1(x), "pool1")
        x = jt.tag(self.conv2(x), "conv2")
        x = jt.tag(jax.nn.relu(x), "act2")
        x = jt.tag(self.pool2(x), "pool2")
        return jt.tag(self.fc(x.reshape(-1)), "fc")


def _cnn_data(dtype):
    tx, _ = _data(2, 2, 8, 8, seed=2, dtype=dtype)
    tt, _ = _data(2, 3, seed=3, dtype=dtype)
    return tx, tt


def _cnn_losses(tt):
    t = jnp.asarray(tt.numpy())

    def jloss(m, x):
        return jnp.sum(jax.vmap(m)(x) * t)

    return (lambda out: (out * tt).sum()), jloss


@pytest.mark.parametrize("jit", [False, True])
def test_cnn_inplace_relu_pooling(jit):
    torch.manual_seed(1)
    tmodel = TorchCNN().double()
    with torch.no_grad():
        tmodel.conv1.bias += 0.5  # keep most conv1 outputs positive: no all-zero max-pool windows (ties)
    tx, tt = _cnn_data(torch.float64)
    tloss, jloss = _cnn_losses(tt)
    tag_grads, t_modules = check_parity(
        tmodel, JaxCNN(_keys(1)[0]), (tx,), (jnp.asarray(tx.numpy()),), tloss, jloss, jit=jit
    )
    assert t_modules["conv1"].shape == (2, 3, 8, 8)  # NCHW, as vmap puts the batch axis first
    # The in-place ReLU: the gradient at conv1's output is the gradient after the ReLU, masked.
    mask = tag_grads["conv1"] != 0
    assert 0 < mask.mean() < 1
    np.testing.assert_array_equal(t_modules["act1:in"], t_modules["conv1"])


def test_cnn_float32_within_stated_tolerance():
    torch.manual_seed(1)
    tmodel = TorchCNN()
    with torch.no_grad():
        tmodel.conv1.bias += 0.5
    tx, tt = _cnn_data(torch.float32)
    tloss, jloss = _cnn_losses(tt)
    jmodel = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, JaxCNN(_keys(1)[0])
    )
    tag_grads, _ = check_parity(
        tmodel, jmodel, (tx,), (jnp.asarray(tx.numpy()),), tloss, jloss, jit=True, rtol=RTOL32, atol=0.0
    )
    assert tag_grads["conv1"].dtype == jnp.float32


# --- GRU: a Python loop in torch, lax.scan in JAX ---------------------------------


class TorchGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, xs):  # (T, B, 3)
        h = torch.zeros(xs.shape[1], 4, dtype=xs.dtype)
        for x in xs:
            h = self.cell(x, h)
        return self.head(h)


class JaxGRU(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(3, 4, key=k[0])
        self.head = eqx.nn.Linear(4, 2, key=k[1])

    def __call__(self, xs):  # one sequence, (T, 3)
        def step(h, x):
            x, h = jt.tag((x, h), "cell:in")
            return jt.tag(self.cell(x, h), "cell"), None

        h, _ = lax.scan(step, jnp.zeros(4, xs.dtype), xs)
        return jt.tag(self.head(h), "head")


@pytest.mark.parametrize("jit", [False, True])
def test_gru_python_loop_vs_scan(jit):
    torch.manual_seed(2)
    tmodel = TorchGRU().double()
    txs, xs = _data(5, 2, 3, seed=4)  # T=5 steps, batch 2
    tt, t = _data(2, 2, seed=5)

    def jloss(m, xs):
        return jnp.sum(jnp.sin(jax.vmap(m, in_axes=1)(xs)) * t)

    tag_grads, t_modules = check_parity(
        tmodel, JaxGRU(_keys(1)[0]), (txs,), (xs,), lambda out: (torch.sin(out) * tt).sum(), jloss, jit=jit
    )
    # Per-step hidden-state gradients: loop axis first, then the batch (vmap) axis.
    assert t_modules["cell"].shape == tag_grads["cell"].shape == (5, 2, 4)
    assert [a.shape for a in t_modules["cell:in"]] == [(5, 2, 3), (5, 2, 4)]


# --- a transformer block ----------------------------------------------------------

D, HEADS, T = 8, 2, 3


class TorchAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.softmax = nn.Softmax(dim=-1)
        self.heads = nn.Identity()  # exposes the per-head outputs, (B, H, T, D / H)

    def forward(self, x):  # (B, T, D)
        b, t, d = x.shape

        def split(z):
            return z.view(b, t, HEADS, d // HEADS).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        probs = self.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // HEADS))
        heads = self.heads(probs @ v)
        return self.o(heads.transpose(1, 2).reshape(b, t, d)), probs


class TorchBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = TorchAttention()
        self.resid1 = nn.Identity()
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.resid2 = nn.Identity()

    def forward(self, x):
        a, _ = self.attn(self.ln1(x))
        x = self.resid1(x + a)
        return self.resid2(x + self.mlp(self.ln2(x)))


def _tokens(f, x, name):
    """A per-token layer on (T, D), tagged at its input and output."""
    return jt.tag(jax.vmap(f)(jt.tag(x, name + ":in")), name)


class JaxAttention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear

    def __init__(self, key):
        self.q, self.k, self.v, self.o = (eqx.nn.Linear(D, D, key=k) for k in jax.random.split(key, 4))

    def __call__(self, x):  # (T, D)
        t, d = x.shape

        def split(z):
            return z.reshape(t, HEADS, d // HEADS).transpose(1, 0, 2)

        q, k, v = (split(_tokens(lin, x, f"attn.{n}")) for lin, n in ((self.q, "q"), (self.k, "k"), (self.v, "v")))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d // HEADS)
        probs = jt.tag(jax.nn.softmax(jt.tag(scores, "attn.softmax:in"), axis=-1), "attn.softmax")
        heads = jt.tag(probs @ v, "attn.heads")
        out = _tokens(self.o, heads.transpose(1, 0, 2).reshape(t, d), "attn.o")
        return jt.tag((out, probs), "attn")  # a tuple output, as in torch


class JaxBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: JaxAttention
    ln2: eqx.nn.LayerNorm
    mlp: list

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = JaxAttention(k[0])
        self.mlp = [eqx.nn.Linear(D, 2 * D, key=k[1]), None, eqx.nn.Linear(2 * D, D, key=k[2])]

    def __call__(self, x):  # (T, D)
        a, _ = self.attn(jt.tag(_tokens(self.ln1, x, "ln1"), "attn:in"))
        x = jt.tag(x + a, "resid1")
        h = _tokens(self.ln2, x, "ln2")
        h = _tokens(self.mlp[0], h, "mlp.0")
        h = jt.tag(jax.nn.gelu(h, approximate=False), "mlp.1")
        h = _tokens(self.mlp[2], h, "mlp.2")
        return jt.tag(x + jt.tag(h, "mlp"), "resid2")


@pytest.mark.parametrize("jit", [False, True])
def test_transformer_block(jit):
    torch.manual_seed(3)
    tmodel = TorchBlock().double()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for ln in (tmodel.ln1, tmodel.ln2):
            ln.weight.add_(0.1 * torch.randn(D, dtype=torch.float64))
            ln.bias.add_(0.1 * torch.randn(D, dtype=torch.float64))
    tx, x = _data(2, T, D, seed=6)
    tt, t = _data(2, T, D, seed=7)

    def jloss(m, x):
        return jnp.sum(jnp.tanh(jax.vmap(m)(x)) * t)

    tag_grads, t_modules = check_parity(
        tmodel,
        JaxBlock(_keys(1)[0]),
        (tx,),
        (x,),
        lambda out: (torch.tanh(out) * tt).sum(),
        jloss,
        jit=jit,
        zero=("attn[1]", "attn.k.bias"),  # probs is dropped; softmax ignores a shift of the scores
    )
    assert t_modules["attn.softmax"].shape == (2, HEADS, T, T)  # attention probabilities
    assert t_modules["attn.heads"].shape == (2, HEADS, T, D // HEADS)  # per-head outputs
    # attn returns (out, probs); the block drops probs, so the gradient at that output is zero,
    # although the same tensor's gradient inside attn (at attn.softmax) is not.
    out_grad, probs_grad = t_modules["attn"]
    assert np.abs(out_grad).max() > 0 and np.abs(probs_grad).max() == 0 == np.abs(tag_grads["attn"][1]).max()


# --- a module called twice ----------------------------------------------------------


class TorchTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.out = nn.Linear(4, 2)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = self.block(self.block(h))  # shared weights: block, block.0 and block.1 fire twice
        return self.out(h)


class JaxTwice(eqx.Module):
    emb: eqx.nn.Embedding
    block: eqx.nn.Sequential
    out: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.emb = eqx.nn.Embedding(5, 4, key=k[0])
        self.block = eqx.nn.Sequential([eqx.nn.Linear(4, 4, key=k[1]), eqx.nn.Lambda(jnp.tanh)])
        self.out = eqx.nn.Linear(4, 2, key=k[2])

    def _block(self, h):
        h = jt.tag(h, "block:in", repeated=True)
        h = jt.tag(self.block.layers[0](h), "block.0", repeated=True)
        h = jt.tag(self.block.layers[1](h), "block.1", repeated=True)
        return jt.tag(h, "block", repeated=True)

    def __call__(self, token):
        h = jt.tag(self.emb(token), "emb")
        return jt.tag(self.out(self._block(self._block(h))), "out")


@pytest.mark.parametrize("jit", [False, True])
def test_module_called_twice(jit):
    torch.manual_seed(4)
    tmodel = TorchTwice().double()
    tokens = torch.tensor([0, 3, 3, 1])
    tt, t = _data(4, 2, seed=8)

    def jloss(m, tokens):
        return jnp.sum(jnp.cos(jax.vmap(m)(tokens)) * t)

    tag_grads, t_modules = check_parity(
        tmodel,
        JaxTwice(_keys(1)[0]),
        (tokens,),
        (jnp.asarray(tokens.numpy()),),
        lambda out: (torch.cos(out) * tt).sum(),
        jloss,
        jit=jit,
    )
    # Calls stacked in call order, before the batch axis.
    for name in ("block", "block.0", "block.1", "block:in"):
        assert t_modules[name].shape == tag_grads[name].shape == (2, 4, 4)


# --- jaxtrace.torch.grad itself -------------------------------------------------------


class Pair(nn.Module):
    """Returns a dict with a float tensor, an integer tensor and None; also a tuple."""

    def forward(self, x):
        return {"double": 2 * x, "index": x.argmax(-1), "nothing": None}, (x * x, 3)


class UsesPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = Pair()
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        d, (sq, _) = self.pair(x)
        self.unused(x)  # its output does not reach the loss
        return (d["double"] * sq).sum()


def test_tuple_and_dict_outputs_keep_their_structure():
    x = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    _, modules = jtt.grad(UsesPair().double(), x, where=["pair", "unused"])
    d, (g_sq, g_int) = modules["pair"]
    assert set(d) == {"double", "index", "nothing"} and d["index"] is None and d["nothing"] is None
    # loss = sum(double * sq): d/d double = sq = x^2, d/d sq = double = 2x.
    np.testing.assert_allclose(d["double"], (x * x).numpy())
    np.testing.assert_allclose(g_sq, (2 * x).numpy())
    assert g_int is None
    np.testing.assert_array_equal(modules["unused"], np.zeros((1, 3)))  # zeros, not missing

    # The same structure tagged in JAX gives the same names in compare.
    def f(x):
        out = jt.tag(({"double": 2 * x, "index": jnp.argmax(x, -1)}, (x * x, 3.0)), "pair")
        return jnp.sum(out[0]["double"] * out[1][0])

    _, jax_tags = jt.grad(f)(jnp.asarray(x.numpy()))
    result = jt.compare(jax_tags, {"pair": modules["pair"]}, labels=("jax", "torch"))
    assert [r.name for r in result.rows] == ["pair[0]['double']", "pair[1][0]"]
    assert result.only_a == ("pair[1][1]",)  # the Python 3 is a constant in torch: no gradient


class MakesConstant(nn.Module):
    def forward(self, x):
        return torch.ones_like(x) * 3.0  # no requires_grad: the hook needs a fresh leaf


class WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.const = MakesConstant()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        return (self.fc(x) * self.const(x)).sum()


def test_gradient_at_an_output_that_needs_no_grad():
    model = WithConstant().double()
    x = torch.randn(3, 2, dtype=torch.float64)
    _, modules = jtt.grad(model, x, where=["const", "fc"])
    fc_out = model.fc(x).detach().numpy()
    np.testing.assert_allclose(modules["const"], fc_out, rtol=1e-12)
    np.testing.assert_allclose(modules["fc"], np.full((3, 2), 3.0))


class InPlaceInput(nn.Module):
    """Relies on the in-place change of its input, without using the ReLU's return value."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, x):
        h = self.fc1(x)
        self.act(h)
        return self.fc2(h).sum()


def test_inputs_of_in_place_modules():
    torch.manual_seed(5)
    model = InPlaceInput().double()
    x = torch.randn(6, 3, dtype=torch.float64)
    value, (params, modules) = jtt.value_and_grad(model, x, where=["act:in", "act", "fc1"])
    # The forward pass still sees the in-place ReLU, and the gradients match plain autograd.
    h = torch.relu(model.fc1(x))
    assert value == pytest.approx(float(model.fc2(h).sum().detach()), rel=1e-14)
    ref = torch.autograd.grad(model(x), [model.fc1.weight])[0]
    np.testing.assert_allclose(params["fc1.weight"], ref.numpy(), rtol=1e-12)
    g_out = model.fc2.weight.detach().numpy().repeat(6, 0)  # d loss / d act output
    np.testing.assert_allclose(modules["act"], g_out, rtol=1e-12)
    mask = model.fc1(x).detach().numpy() > 0
    np.testing.assert_allclose(modules["act:in"], g_out * mask, rtol=1e-12)
    np.testing.assert_allclose(modules["fc1"], g_out * mask, rtol=1e-12)


def test_agrees_with_full_backward_hooks_where_they_work():
    """An independent oracle for the naming and the at-this-point semantics: grad_output and
    grad_input of register_full_backward_hook (no in-place ops in this model)."""
    torch.manual_seed(6)
    model = TorchBlock().double()
    x = torch.randn(2, T, D, dtype=torch.float64, requires_grad=True)  # so ln1 has a grad_input
    seen = {}
    handles = [
        model.get_submodule(p).register_full_backward_hook(
            lambda m, gin, gout, p=p: seen.update({p: gout, p + ":in": gin})
        )
        for p in ("attn", "ln1", "mlp")
    ]
    torch.tanh(model(x)).sum().backward()
    for h in handles:
        h.remove()
    _, modules = jtt.grad(model, x, loss=lambda y: torch.tanh(y).sum(), where=["attn", "ln1:in", "mlp", "mlp:in"])
    for name in ("ln1:in", "mlp", "mlp:in"):
        np.testing.assert_allclose(modules[name], seen[name][0].numpy(), rtol=1e-12, atol=1e-15)
    out_grad, probs_grad = modules["attn"]
    np.testing.assert_allclose(out_grad, seen["attn"][0].numpy(), rtol=1e-12)
    assert seen["attn"][1] is None and np.abs(probs_grad).max() == 0  # dropped output: no gradient


def test_where_selection_and_errors():
    model = TorchMLP().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    loss = lambda y: y.sum()  # noqa: E731
    _, everything = jtt.grad(model, x, loss=loss)
    assert list(everything) == ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers", ""]  # call order
    _, linear = jtt.grad(model, x, loss=loss, where=lambda p, m: isinstance(m, nn.Linear), inputs=True)
    assert list(linear) == ["layers.0:in", "layers.0", "layers.2:in", "layers.2", "layers.4:in", "layers.4"]
    _, one = jtt.grad(model, x, loss=loss, where="layers.3")
    assert list(one) == ["layers.3"]
    with pytest.raises(ValueError, match=r"no module at 'layers\.9'.*'layers\.4'"):
        jtt.grad(model, x, loss=loss, where=["layers.9"])
    with pytest.raises(ValueError, match="scalar floating loss"):
        jtt.grad(model, x)
    with pytest.raises(TypeError, match="where= must be"):
        jtt.grad(model, x, loss=loss, where=[3])


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(2, 2)
        self.spare = nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x).sum()


def test_never_called_module_named_explicitly_is_an_error():
    model = Unused().double()
    x = torch.randn(1, 2, dtype=torch.float64)
    _, modules = jtt.grad(model, x)  # where=None: modules that never run are simply absent
    assert "spare" not in modules
    with pytest.raises(ValueError, match="'spare' was selected but never called"):
        jtt.grad(model, x, where=["used", "spare"])


class Growing(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(torch.cat([self.act(x), x], -1)).sum()


def test_repeated_calls_with_different_shapes_are_an_error():
    with pytest.raises(ValueError, match="'act' was called 2 times with different output shapes"):
        jtt.grad(Growing(), torch.randn(1, 2))


def test_leaves_grad_fields_and_frozen_parameters_alone():
    model = TorchMLP().double()
    model.layers[0].weight.requires_grad_(False)
    x = torch.randn(2, 4, dtype=torch.float64)
    params, _ = jtt.grad(model, x, loss=lambda y: y.sum(), where=[])
    assert all(p.grad is None for p in model.parameters())
    assert not model.layers[0].weight.requires_grad and model.layers[0].bias.requires_grad
    model.layers[0].weight.requires_grad_(True)
    ref = torch.autograd.grad(model(x).sum(), [model.layers[0].weight])[0]
    np.testing.assert_allclose(params["layers.0.weight"], ref.numpy(), rtol=1e-12)  # frozen ones too
    assert not any(h for m in model.modules() for h in (m._forward_hooks, m._forward_pre_hooks))


# --- load_weights and named_grads ----------------------------------------------------


def _layer_pairs():
    k = _keys(8, seed=9)
    return {
        "linear": (nn.Linear(3, 4), eqx.nn.Linear(3, 4, key=k[0]), (2, 3)),
        "linear_nobias": (nn.Linear(3, 4, bias=False), eqx.nn.Linear(3, 4, use_bias=False, key=k[1]), (2, 3)),
        "conv2d": (nn.Conv2d(2, 3, 3, padding=1), eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[2]), (2, 2, 5, 5)),
        "conv1d": (nn.Conv1d(2, 3, 2), eqx.nn.Conv1d(2, 3, 2, key=k[3]), (2, 2, 5)),
        "layernorm": (nn.LayerNorm(4), eqx.nn.LayerNorm(4), (2, 4)),
        "embedding": (nn.Embedding(6, 3), eqx.nn.Embedding(6, 3, key=k[4]), None),
        "grucell": (nn.GRUCell(3, 4), eqx.nn.GRUCell(3, 4, key=k[5]), (2, 3)),
    }


@pytest.mark.parametrize("kind", list(_layer_pairs()))
def test_load_weights_each_layer_gives_the_same_function(kind):
    torch.manual_seed(7)
    tlayer, jlayer, shape = _layer_pairs()[kind]
    tlayer = tlayer.double()
    with torch.no_grad():
        for p in tlayer.parameters():
            p.add_(0.1 * torch.randn_like(p))  # LayerNorm starts at ones/zeros
    jlayer = jtt.load_weights(jlayer, tlayer)
    if kind == "embedding":
        tx = torch.tensor([0, 5, 2])
        targs, jargs = (tx,), (jnp.asarray(tx.numpy()),)
    elif kind == "grucell":
        tx, th = torch.randn(*shape, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
        targs, jargs = (tx, th), (jnp.asarray(tx.numpy()), jnp.asarray(th.numpy()))
    else:
        tx = torch.randn(*shape, dtype=torch.float64)
        targs, jargs = (tx,), (jnp.asarray(tx.numpy()),)
    expected = tlayer(*targs)
    got = jax.vmap(jlayer)(*jargs)
    np.testing.assert_allclose(np.asarray(got), expected.detach().numpy(), rtol=1e-12, atol=1e-14)
    # named_grads is the adjoint: the same parameter gradients as torch for sum(out * w).
    w = torch.randn_like(expected)
    t_params, _ = jtt.grad(tlayer, *targs, loss=lambda y: (y * w).sum(), where=[])
    params, static = eqx.partition(jlayer, eqx.is_inexact_array)
    grads = jax.grad(lambda p: jnp.sum(jax.vmap(eqx.combine(p, static))(*jargs) * jnp.asarray(w.numpy())))(params)
    jt.compare(jtt.named_grads(grads, tlayer), t_params, rtol=1e-12, atol=1e-14).assert_ok()


class TorchNested(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
        self.blocks = nn.ModuleList([nn.LayerNorm(2), nn.LayerNorm(2)])
        self.heads = nn.ModuleDict({"a": nn.Linear(2, 1)})
        self.scale = nn.Parameter(torch.tensor([2.0, 3.0]))


class JaxNested(eqx.Module):
    seq: eqx.nn.Sequential
    blocks: list
    heads: dict
    scale: jax.Array

    def __init__(self, key, *, bad=False):
        k = jax.random.split(key, 3)
        self.seq = eqx.nn.Sequential(
            [eqx.nn.Linear(2, 3, key=k[0]), eqx.nn.Lambda(jax.nn.relu), eqx.nn.Linear(3, 3 if bad else 2, key=k[1])]
        )
        self.blocks = [eqx.nn.LayerNorm(2), eqx.nn.LayerNorm(2)]
        self.heads = {"a": eqx.nn.Linear(2, 1, key=k[2])}
        self.scale = jnp.ones(2)


def test_load_weights_whole_model_by_paths():
    tmodel = TorchNested().double()
    jmodel = JaxNested(_keys(1)[0])
    loaded = jtt.load_weights(jmodel, tmodel)
    named = {n: p.detach().numpy() for n, p in tmodel.named_parameters()}
    got = jtt.named_grads(loaded, tmodel)  # the arrays themselves, renamed the torch way
    assert list(got) == list(named)
    jt.compare(got, named, rtol=0.0, atol=0.0).assert_ok()
    assert loaded.seq.layers[2].weight.dtype == jnp.float64
    assert jmodel.scale.tolist() == [1.0, 1.0]  # the original is untouched
    assert jnp.array_equal(loaded.scale, jnp.array([2.0, 3.0]))


def test_load_weights_errors_name_the_parameter():
    tmodel = TorchNested().double()
    with pytest.raises(ValueError, match=r"'seq\.2\.weight' has shape \(2, 3\).*shape \(3, 3\)"):
        jtt.load_weights(JaxNested(_keys(1)[0], bad=True), tmodel)
    with pytest.raises(ValueError, match=r"nothing called 'layers'"):
        jtt.load_weights(JaxNested(_keys(1)[0]), TorchMLP())
    with pytest.raises(ValueError, match=r"'bias'.*use_bias=False"):
        jtt.load_weights(eqx.nn.Linear(2, 2, use_bias=False, key=_keys(1)[0]), nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match=r"GRUCell at '' and the equinox GRUCell .* hidden_size is 4 in torch but 5 in equinox"
    ):
        jtt.load_weights(eqx.nn.GRUCell(3, 5, key=_keys(1)[0]), nn.GRUCell(3, 4))


def test_guide_example_runs(capsys):
    import pathlib
    import re

    page = pathlib.Path(__file__).parent.parent / "docs" / "guides" / "checking-against-pytorch.md"
    code = re.search(r"```python\n(.*?)```", page.read_text(), re.S).group(1)
    exec(compile(code, str(page), "exec"), {"__name__": "guide"})
    out = capsys.readouterr().out
    assert "OK: 3/3 names match jax vs torch" in out and "OK: 4/4 names match" in out


# --- changing gradients: register_hook returning a new gradient vs jt.patch_grad --------------


PATCHES = {
    "double": (lambda g: 2.0 * g, lambda g: 2.0 * g),
    "reverse": (lambda g: -g, lambda g: -g),
    "clamp": (lambda g: torch.clamp(g, -0.02, 0.02), lambda g: jnp.clip(g, -0.02, 0.02)),
}


@pytest.mark.parametrize("kind", sorted(PATCHES))
@pytest.mark.parametrize("jit", [False, True])
def test_patch_grad_matches_register_hook_returning_a_gradient(kind, jit):
    torch.manual_seed(0)
    tmodel = TorchMLP().double()
    jmodel = jtt.load_weights(JaxMLP(_keys(1)[0]), tmodel)
    (tx, x), (ty, y) = _data(3, 4), _data(3, 3, seed=1)
    t_fn, j_fn = PATCHES[kind]
    patched_at = ["layers.1", "layers.3"]
    t_params, t_modules = jtt.grad(
        tmodel, tx, loss=lambda out: ((out - ty) ** 2).mean(), patch_grads={p: t_fn for p in patched_at}
    )
    params, static = eqx.partition(jmodel, eqx.is_inexact_array)

    def loss(p, x):
        return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)

    g = jt.grad(jt.patch_grad(loss, {p: j_fn for p in patched_at}))
    param_grads, tag_grads = (jax.jit(g) if jit else g)(params, x)
    jt.compare(jtt.named_grads(param_grads, tmodel), t_params, rtol=RTOL64, atol=ATOL64).assert_ok("parameters")
    # Both report the gradient as it arrives at a patched module; upstream sees the changed one.
    names = ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4"]
    jt.compare({n: tag_grads[n] for n in names}, {n: t_modules[n] for n in names}, rtol=RTOL64, atol=ATOL64).assert_ok()
    unpatched = jtt.grad(tmodel, tx, loss=lambda out: ((out - ty) ** 2).mean())[0]
    assert not np.allclose(t_params["layers.2.weight"], unpatched["layers.2.weight"])  # the hooks acted


def test_guided_backprop_matches_relu_backward_hooks():
    """Guided backprop: torch clamps grad_input of every ReLU in a full backward hook (as Captum
    does); the JAX port clamps the gradient arriving at each ReLU's output with jt.patch_grad."""
    torch.manual_seed(1)
    tmodel = TorchCNN().double()
    for act in (tmodel.act1, tmodel.act2):
        act.inplace = False  # full backward hooks refuse in-place modules
    jmodel = jtt.load_weights(JaxCNN(_keys(1)[0]), tmodel)
    tx, _ = _cnn_data(torch.float64)
    handles = [
        act.register_full_backward_hook(lambda m, g_in, g_out: (torch.clamp(g_in[0], min=0.0),))
        for act in (tmodel.act1, tmodel.act2)
    ]
    try:
        xt = tx.clone().requires_grad_(True)
        tmodel(xt)[:, 1].sum().backward()
    finally:
        for h in handles:
            h.remove()
    relu = lambda g: jnp.maximum(g, 0.0)  # noqa: E731
    guided = jt.patch_grad(lambda x: jnp.sum(jax.vmap(jmodel)(x)[:, 1]), {"act1": relu, "act2": relu})
    saliency = jax.jit(jax.grad(guided))(jnp.asarray(tx.numpy()))
    jt.compare({"saliency": saliency}, {"saliency": xt.grad.numpy()}, rtol=RTOL64, atol=ATOL64).assert_ok()
    plain = jax.grad(lambda x: jnp.sum(jax.vmap(jmodel)(x)[:, 1]))(jnp.asarray(tx.numpy()))
    assert not np.allclose(saliency, plain)  # the hooks changed something


class TorchBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)


class JaxBN(eqx.Module):
    """A hand-written inference-mode batch norm with fields named as torch's buffers."""

    weight: jax.Array
    bias: jax.Array
    running_mean: jax.Array
    running_var: jax.Array

    def __init__(self):
        self.weight, self.bias = jnp.ones(4), jnp.zeros(4)
        self.running_mean, self.running_var = jnp.zeros(4), jnp.ones(4)


class JaxWithBN(eqx.Module):
    fc: eqx.nn.Linear
    bn: JaxBN

    def __init__(self, key):
        self.fc, self.bn = eqx.nn.Linear(3, 4, key=key), JaxBN()


def test_load_weights_copies_buffers_and_fills_an_abstract_model():
    torch.manual_seed(0)
    net = TorchBN().double()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-1, 1)
        net.bn.running_var.uniform_(0.5, 2)
    for target in (JaxWithBN(_keys(1)[0]), eqx.filter_eval_shape(JaxWithBN, _keys(1)[0])):
        model = jtt.load_weights(target, net)
        np.testing.assert_array_equal(model.bn.running_mean, net.bn.running_mean.numpy())
        np.testing.assert_array_equal(model.bn.running_var, net.bn.running_var.numpy())
        np.testing.assert_array_equal(model.fc.weight, net.fc.weight.detach().numpy())
        assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(model))


def test_load_weights_warns_about_buffers_it_cannot_place():
    class WithMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_buffer("scale", torch.tensor(3.0))  # persistent, no field of its name
            self.register_buffer("cache", torch.zeros(2), persistent=False)  # not state: never copied

        def forward(self, x):
            return self.fc(x) * self.scale

    class Port(eqx.Module):
        fc: eqx.nn.Linear

    target = Port(eqx.nn.Linear(2, 2, key=_keys(1)[0]))
    with pytest.warns(UserWarning, match=r"did not copy the torch buffer\(s\) 'scale'"):
        model = jtt.load_weights(target, WithMask())
    assert isinstance(model, Port)

    class PortWithScale(eqx.Module):  # a field of the buffer's name: copied, no warning
        fc: eqx.nn.Linear
        scale: jax.Array

    net = WithMask()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = jtt.load_weights(PortWithScale(eqx.nn.Linear(2, 2, key=_keys(1)[0]), jnp.zeros(())), net)
    assert float(model.scale) == 3.0


# --- load_weights: each layer mapping, forward and backward -----------------------------------
#
# The oracle is torch's register_full_backward_hook on the layer (its grad_output and grad_input)
# and the parameters' .grad; jaxtrace gives the same at tags on the layer's output and input, and
# named_grads maps the parameter gradients back. Float64, 1e-10, eager and under jax.jit.


class _Flat(nn.Module):
    """The layer, its output flattened to a tuple of tensors (full backward hooks see a flat tuple)."""

    def __init__(self, layer, call=None):
        super().__init__()
        self.layer = layer
        self.call = call

    def forward(self, *args):
        out = self.call(self.layer, *args) if self.call else self.layer(*args)
        return tuple(t for t in jax.tree_util.tree_leaves(out, is_leaf=lambda t: isinstance(t, torch.Tensor)))


def layer_parity(tlayer, jlayer, jcall, targs, *, tcall=None, state=None):
    """Load ``tlayer``'s weights into ``jlayer``; forward/backward of both agree at the layer."""
    torch.manual_seed(3)
    tlayer = tlayer.double()
    with torch.no_grad():
        for p in tlayer.parameters():
            p.add_(0.2 * torch.randn_like(p))  # norms start at ones/zeros, biases are often zero
    loaded = jtt.load_weights(jlayer, tlayer, state=state) if state is not None else jtt.load_weights(jlayer, tlayer)
    jlayer, state = loaded if state is not None else (loaded, None)
    wrapped = _Flat(tlayer, tcall)
    recorded = {}
    handle = wrapped.register_full_backward_hook(lambda m, g_in, g_out: recorded.update(g_in=g_in, g_out=g_out))
    try:
        leaves = [a.clone().requires_grad_(True) if a.is_floating_point() else a for a in targs]
        outs = wrapped(*leaves)
        weights = [torch.randn_like(o) for o in outs]
        sum((torch.tanh(o) * w).sum() for o, w in zip(outs, weights)).backward()
    finally:
        handle.remove()
    t_params = {n: p.grad.numpy() for n, p in tlayer.named_parameters()}
    floating = [i for i, a in enumerate(targs) if a.is_floating_point()]
    t_in = {f"in{i}": recorded["g_in"][i].numpy() for i in floating}

    jargs = [jnp.asarray(a.numpy()) for a in targs]
    jweights = [jnp.asarray(w.numpy()) for w in weights]
    params, static = eqx.partition(jlayer, eqx.is_inexact_array)

    def loss(params, *args):
        args = [jt.tag(a, f"in{i}") if i in floating else a for i, a in enumerate(args)]
        outs = jt.tag(tuple(jax.tree_util.tree_leaves(jcall(eqx.combine(params, static), state, *args))), "out")
        return sum(jnp.sum(jnp.tanh(o) * w) for o, w in zip(outs, jweights))

    for g in (jt.grad(loss), jax.jit(jt.grad(loss))):
        param_grads, tag_grads = g(params, *jargs)
        out = jt.compare({"out": tag_grads["out"]}, {"out": tuple(t.numpy() for t in recorded["g_out"])}, rtol=RTOL64)
        out.assert_ok("gradient at the layer's output (grad_output)")
        jt.compare({k: tag_grads[k] for k in t_in}, t_in, rtol=RTOL64, atol=ATOL64).assert_ok("grad_input")
        named = jtt.named_grads(param_grads, tlayer)
        params_cmp = jt.compare(named, t_params, rtol=RTOL64, atol=ATOL64, labels=("jax", "torch"))
        params_cmp.assert_ok("parameter gradients")
        assert set(named) == set(t_params)
    # The forward pass itself (the output gradients depend on it, but say it plainly).
    t_out = [o.detach().numpy() for o in wrapped(*targs)]
    j_out = jax.tree_util.tree_leaves(jcall(jlayer, state, *jargs))
    for a, b in zip(j_out, t_out):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-12, atol=1e-13)


def _vmap(layer, state, *args):
    return jax.vmap(layer)(*args)


def _run_rnn(layers, xs, lstm):
    """Multi-layer, optionally bidirectional GRU/LSTM on one sequence (seq, in): torch's semantics."""
    finals = []
    for layer in layers:
        cells = layer if isinstance(layer, (list, tuple)) else [layer]
        outs = []
        for d, cell in enumerate(cells):
            h = jnp.zeros(cell.hidden_size, xs.dtype)
            init = (h, h) if lstm else h

            def step(carry, x, cell=cell):
                carry = cell(x, carry)
                return carry, carry[0] if lstm else carry

            last, ys = lax.scan(step, init, xs, reverse=d == 1)
            outs.append(ys)
            finals.append(last)
        xs = jnp.concatenate(outs, axis=-1)
    if lstm:
        return xs, (jnp.stack([h for h, _ in finals]), jnp.stack([c for _, c in finals]))
    return xs, jnp.stack(finals)


def _rnn_call(lstm):
    def call(layers, state, xs):  # xs: (batch, seq, in), as torch's batch_first=True
        out_axes = (0, (1, 1)) if lstm else (0, 1)
        return jax.vmap(lambda x: _run_rnn(layers, x, lstm), out_axes=out_axes)(xs)

    return call


def _bn_call(bn, state, x):
    return jax.vmap(lambda x: bn(x, state, inference=True)[0], axis_name="batch")(x)


def _mha_call(mha, state, q, k, v):
    return jax.vmap(mha)(q, k, v)


def _layer_cases():
    k = _keys(12, seed=5)
    d = torch.float64
    gru = [[eqx.nn.GRUCell(3, 4, key=k[0]), eqx.nn.GRUCell(3, 4, key=k[1])]]
    gru.append([eqx.nn.GRUCell(8, 4, key=k[2]), eqx.nn.GRUCell(8, 4, key=k[3])])
    lstm = [[eqx.nn.LSTMCell(3, 4, key=k[4]), eqx.nn.LSTMCell(3, 4, key=k[5])]]
    lstm.append([eqx.nn.LSTMCell(8, 4, key=k[6]), eqx.nn.LSTMCell(8, 4, key=k[7])])
    bn, bn_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="ema")
    mha_t = lambda: nn.MultiheadAttention(8, 2, batch_first=True)  # noqa: E731
    biases = {f"use_{n}_bias": True for n in ("query", "key", "value", "output")}  # torch's bias=True
    return {
        "conv1d": (
            nn.Conv1d(2, 3, 3, stride=2, padding=1),
            eqx.nn.Conv1d(2, 3, 3, 2, 1, key=k[0]),
            _vmap,
            (torch.randn(2, 2, 7, dtype=d),),
            {},
        ),
        "conv3d": (
            nn.Conv3d(2, 3, 2, padding=1),
            eqx.nn.Conv3d(2, 3, 2, padding=1, key=k[1]),
            _vmap,
            (torch.randn(2, 2, 3, 4, 3, dtype=d),),
            {},
        ),
        "conv_transpose2d": (
            nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2),
            eqx.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2, key=k[2]),
            _vmap,
            (torch.randn(2, 4, 3, 4, dtype=d),),
            {},
        ),
        "conv_transpose1d": (
            nn.ConvTranspose1d(2, 3, 4, stride=3),
            eqx.nn.ConvTranspose1d(2, 3, 4, 3, key=k[3]),
            _vmap,
            (torch.randn(2, 2, 5, dtype=d),),
            {},
        ),
        "groupnorm": (nn.GroupNorm(2, 4), eqx.nn.GroupNorm(2, 4), _vmap, (torch.randn(3, 4, 5, dtype=d),), {}),
        "embedding": (
            nn.Embedding(6, 3),
            eqx.nn.Embedding(6, 3, key=k[4]),
            lambda m, s, i: jax.vmap(jax.vmap(m))(i),
            (torch.tensor([[0, 5], [2, 2]]),),
            {},
        ),
        "lstm_cell": (
            nn.LSTMCell(3, 4),
            eqx.nn.LSTMCell(3, 4, key=k[5]),
            lambda m, s, x, h, c: jax.vmap(m)(x, (h, c)),
            (torch.randn(2, 3, dtype=d), torch.randn(2, 4, dtype=d), torch.randn(2, 4, dtype=d)),
            {"tcall": lambda m, x, h, c: m(x, (h, c))},
        ),
        "gru_2layer_bidirectional": (
            nn.GRU(3, 4, num_layers=2, bidirectional=True, batch_first=True),
            gru,
            _rnn_call(False),
            (torch.randn(2, 5, 3, dtype=d),),
            {},
        ),
        "lstm_2layer_bidirectional": (
            nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True),
            lstm,
            _rnn_call(True),
            (torch.randn(2, 5, 3, dtype=d),),
            {},
        ),
        "lstm_2layer": (
            nn.LSTM(3, 4, num_layers=2, batch_first=True),
            [eqx.nn.LSTMCell(3, 4, key=k[8]), eqx.nn.LSTMCell(4, 4, key=k[9])],
            _rnn_call(True),
            (torch.randn(2, 5, 3, dtype=d),),
            {},
        ),
        "multihead_attention": (
            mha_t(),
            eqx.nn.MultiheadAttention(2, 8, **biases, key=k[10]),
            _mha_call,
            (torch.randn(2, 4, 8, dtype=d),) * 3,
            {"tcall": lambda m, q, kk, v: m(q, kk, v, need_weights=False)[0]},
        ),
        "multihead_attention_kdim_vdim": (
            nn.MultiheadAttention(8, 2, kdim=5, vdim=3, batch_first=True),
            eqx.nn.MultiheadAttention(2, 8, key_size=5, value_size=3, **biases, key=k[11]),
            _mha_call,
            (torch.randn(2, 4, 8, dtype=d), torch.randn(2, 6, 5, dtype=d), torch.randn(2, 6, 3, dtype=d)),
            {"tcall": lambda m, q, kk, v: m(q, kk, v, need_weights=False)[0]},
        ),
        "batchnorm2d_state": (
            nn.BatchNorm2d(3),
            bn,
            _bn_call,
            (torch.randn(4, 3, 2, 2, dtype=d),),
            {"state": bn_state},
        ),
    }


@pytest.mark.parametrize("kind", list(_layer_cases()))
def test_load_weights_layer_parity_forward_and_backward(kind):
    tlayer, jlayer, jcall, targs, extra = _layer_cases()[kind]
    if kind.startswith("batchnorm"):
        with torch.no_grad():
            tlayer.running_mean.uniform_(-1, 1)
            tlayer.running_var.uniform_(0.5, 2.0)
        tlayer.eval()
    layer_parity(tlayer, jlayer, jcall, targs, **extra)


def test_load_weights_layer_errors_name_the_path_and_the_fix():
    k = _keys(4, seed=6)

    class Net(nn.Module):
        def __init__(self, rnn):
            super().__init__()
            self.rnn = rnn

    class JNet(eqx.Module):
        rnn: Any

    with pytest.raises(ValueError, match=r"RNN at 'rnn' has no equinox counterpart"):
        jtt.load_weights(JNet([eqx.nn.GRUCell(3, 4, key=k[0])]), Net(nn.RNN(3, 4)))
    with pytest.raises(
        ValueError, match=r"GRU at 'rnn' goes into a list of 2 layers, each a list \[forward, reverse\]"
    ):
        jtt.load_weights(JNet([eqx.nn.GRUCell(3, 4, key=k[0])]), Net(nn.GRU(3, 4, 2, bidirectional=True)))
    with pytest.raises(ValueError, match=r"'rnn' \(layer 1\).*input_size is 4 in torch but 3 in equinox"):
        cells = [eqx.nn.LSTMCell(3, 4, key=k[0]), eqx.nn.LSTMCell(3, 4, key=k[1])]
        jtt.load_weights(JNet(cells), Net(nn.LSTM(3, 4, 2)))
    with pytest.raises(ValueError, match=r"needs an equinox.nn.LSTMCell there, but .* GRUCell at \.rnn\[0\]"):
        jtt.load_weights(JNet([eqx.nn.GRUCell(3, 4, key=k[0])]), Net(nn.LSTM(3, 4)))
    with pytest.raises(ValueError, match=r"proj_size=2"):
        jtt.load_weights(JNet([eqx.nn.LSTMCell(3, 4, key=k[0])]), Net(nn.LSTM(3, 4, proj_size=2)))
    with pytest.raises(ValueError, match=r"MultiheadAttention at 'rnn' was built with add_bias_kv=True"):
        jtt.load_weights(
            JNet(eqx.nn.MultiheadAttention(2, 4, key=k[0])), Net(nn.MultiheadAttention(4, 2, add_bias_kv=True))
        )
    with pytest.raises(ValueError, match=r"num_heads is 2 in torch but 4 in equinox"):
        mha = eqx.nn.MultiheadAttention(
            4, 8, use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True, key=k[0]
        )
        jtt.load_weights(JNet(mha), Net(nn.MultiheadAttention(8, 2)))
    with pytest.raises(ValueError, match=r"Embedding at 'rnn' has max_norm=1.0"):
        jtt.load_weights(JNet(eqx.nn.Embedding(5, 2, key=k[0])), Net(nn.Embedding(5, 2, max_norm=1.0)))
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="ema")
    with pytest.raises(ValueError, match=r"BatchNorm1d at 'rnn' has running statistics.*state=state"):
        jtt.load_weights(JNet(bn), Net(nn.BatchNorm1d(3)))
    bn_batch, state_batch = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    with pytest.raises(ValueError, match=r"mode='batch'; only mode='ema'"):
        jtt.load_weights(JNet(bn_batch), Net(nn.BatchNorm1d(3)), state=state_batch)


def test_load_weights_abstract_targets_with_state_and_new_layouts():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2)
            self.rnn = nn.GRU(4, 3, num_layers=2)
            self.bn = nn.BatchNorm1d(3)

    class JNet(eqx.Module):
        attn: eqx.nn.MultiheadAttention
        rnn: list
        bn: eqx.nn.BatchNorm

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.attn = eqx.nn.MultiheadAttention(
                2, 4, use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True, key=k[0]
            )
            self.rnn = [eqx.nn.GRUCell(4, 3, key=k[1]), eqx.nn.GRUCell(3, 3, key=k[2])]
            self.bn = eqx.nn.BatchNorm(3, "batch", mode="ema")

    net = Net().double()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-1, 1)
    real = eqx.nn.make_with_state(JNet)(_keys(1)[0])
    abstract = eqx.filter_eval_shape(eqx.nn.make_with_state(JNet), _keys(1)[0])
    results = [jtt.load_weights(m, net, state=s) for m, s in (real, abstract)]
    for model, state in results:
        assert not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves((model, state)))
        np.testing.assert_array_equal(model.attn.key_proj.weight, net.attn.in_proj_weight.detach().numpy()[4:8])
        np.testing.assert_array_equal(model.rnn[1].weight_hh, net.rnn.weight_hh_l1.detach().numpy())
        mean, var = state.get(model.bn.ema_state_index)
        np.testing.assert_array_equal(mean, net.bn.running_mean.numpy())
        assert mean.dtype == jnp.float64 and not state.get(model.bn.ema_first_time_index)
    assert jax.tree_util.tree_structure(results[0]) == jax.tree_util.tree_structure(results[1])
