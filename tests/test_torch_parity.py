"""Parity with PyTorch: gradients at module outputs/inputs and parameters, layer by layer.

Each model is written twice, in torch and in equinox (with explicit ``jt.tag``
calls named like the torch modules' ``named_modules()`` paths), with the same
weights (``jaxtrace.torch.load_weights``). The torch side is the oracle: its
gradients come from tensor hooks (``jaxtrace.torch.grad``), an independent
mechanism. Float64 must agree to 1e-10 (relative to each gradient's scale);
float32 to ``RTOL32``.
"""

import math

import pytest

torch = pytest.importorskip("torch")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jaxtrace as jt  # noqa: E402
import jaxtrace.torch as jtt  # noqa: E402
from torch_common import ATOL64, RTOL32, RTOL64, TorchMLP, nn  # noqa: E402, F401
from torch_common import keys as _keys  # noqa: E402

jax.config.update("jax_enable_x64", True)
torch.set_num_threads(1)


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


@pytest.mark.long_eager
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


@pytest.mark.long_eager
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
