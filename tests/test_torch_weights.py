"""``jaxtrace.torch.load_weights`` and ``named_grads``: torch weights into equinox (and back).

Each layer mapping is checked forward and backward against torch (its full backward hooks and
the parameters' ``.grad``), in float64 to 1e-10; errors name the path and the fix.
"""

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
from torch_common import ATOL64, RTOL32, RTOL64, TorchMLP, nn  # noqa: E402, F401
from torch_common import keys as _keys  # noqa: E402

jax.config.update("jax_enable_x64", True)
torch.set_num_threads(1)


_LAYER_PAIRS = {  # kind -> (torch layer, equinox layer from a key, input shape); built in the test, not at collection
    "linear": lambda k: (nn.Linear(3, 4), eqx.nn.Linear(3, 4, key=k[0]), (2, 3)),
    "linear_nobias": lambda k: (nn.Linear(3, 4, bias=False), eqx.nn.Linear(3, 4, use_bias=False, key=k[1]), (2, 3)),
    "conv2d": lambda k: (nn.Conv2d(2, 3, 3, padding=1), eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[2]), (2, 2, 5, 5)),
    "conv1d": lambda k: (nn.Conv1d(2, 3, 2), eqx.nn.Conv1d(2, 3, 2, key=k[3]), (2, 2, 5)),
    "layernorm": lambda k: (nn.LayerNorm(4), eqx.nn.LayerNorm(4), (2, 4)),
    "embedding": lambda k: (nn.Embedding(6, 3), eqx.nn.Embedding(6, 3, key=k[4]), None),
    "grucell": lambda k: (nn.GRUCell(3, 4), eqx.nn.GRUCell(3, 4, key=k[5]), (2, 3)),
}


@pytest.mark.parametrize("kind", list(_LAYER_PAIRS))
def test_load_weights_each_layer_gives_the_same_function(kind):
    torch.manual_seed(7)
    tlayer, jlayer, shape = _LAYER_PAIRS[kind](_keys(8, seed=9))
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


LAYER_CASES = (
    "conv1d", "conv3d", "conv_transpose2d", "conv_transpose1d", "groupnorm", "embedding", "lstm_cell",
    "gru_2layer_bidirectional", "lstm_2layer_bidirectional", "lstm_2layer", "multihead_attention",
    "multihead_attention_kdim_vdim", "batchnorm2d_state",
)


def _layer_case(kind):
    """``kind``'s torch layer, equinox layer, call, torch inputs and options; only that one is built (each
    equinox layer's initialisation runs eagerly, op by op: building all of them took ~11 s on 3.11)."""
    torch.manual_seed(5)
    k = _keys(12, seed=5)
    d = torch.float64
    cells = lambda cell, n: [[cell(3, 4, key=k[n]), cell(3, 4, key=k[n + 1])], [cell(8, 4, key=k[n + 2]), cell(8, 4, key=k[n + 3])]]  # noqa: E731
    bn = lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="ema")  # noqa: E731
    biases = {f"use_{n}_bias": True for n in ("query", "key", "value", "output")}  # torch's bias=True
    builders = {
        "conv1d": lambda: (
            nn.Conv1d(2, 3, 3, stride=2, padding=1),
            eqx.nn.Conv1d(2, 3, 3, 2, 1, key=k[0]),
            _vmap,
            (torch.randn(2, 2, 7, dtype=d),),
            {},
        ),
        "conv3d": lambda: (
            nn.Conv3d(2, 3, 2, padding=1),
            eqx.nn.Conv3d(2, 3, 2, padding=1, key=k[1]),
            _vmap,
            (torch.randn(2, 2, 3, 4, 3, dtype=d),),
            {},
        ),
        "conv_transpose2d": lambda: (
            nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2),
            eqx.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2, key=k[2]),
            _vmap,
            (torch.randn(2, 4, 3, 4, dtype=d),),
            {},
        ),
        "conv_transpose1d": lambda: (
            nn.ConvTranspose1d(2, 3, 4, stride=3),
            eqx.nn.ConvTranspose1d(2, 3, 4, 3, key=k[3]),
            _vmap,
            (torch.randn(2, 2, 5, dtype=d),),
            {},
        ),
        "groupnorm": lambda: (nn.GroupNorm(2, 4), eqx.nn.GroupNorm(2, 4), _vmap, (torch.randn(3, 4, 5, dtype=d),), {}),
        "embedding": lambda: (
            nn.Embedding(6, 3),
            eqx.nn.Embedding(6, 3, key=k[4]),
            lambda m, s, i: jax.vmap(jax.vmap(m))(i),
            (torch.tensor([[0, 5], [2, 2]]),),
            {},
        ),
        "lstm_cell": lambda: (
            nn.LSTMCell(3, 4),
            eqx.nn.LSTMCell(3, 4, key=k[5]),
            lambda m, s, x, h, c: jax.vmap(m)(x, (h, c)),
            (torch.randn(2, 3, dtype=d), torch.randn(2, 4, dtype=d), torch.randn(2, 4, dtype=d)),
            {"tcall": lambda m, x, h, c: m(x, (h, c))},
        ),
        "gru_2layer_bidirectional": lambda: (
            nn.GRU(3, 4, num_layers=2, bidirectional=True, batch_first=True),
            cells(eqx.nn.GRUCell, 0),
            _rnn_call(False),
            (torch.randn(2, 5, 3, dtype=d),),
            {},
        ),
        "lstm_2layer_bidirectional": lambda: (
            nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True),
            cells(eqx.nn.LSTMCell, 4),
            _rnn_call(True),
            (torch.randn(2, 5, 3, dtype=d),),
            {},
        ),
        "lstm_2layer": lambda: (
            nn.LSTM(3, 4, num_layers=2, batch_first=True),
            [eqx.nn.LSTMCell(3, 4, key=k[8]), eqx.nn.LSTMCell(4, 4, key=k[9])],
            _rnn_call(True),
            (torch.randn(2, 5, 3, dtype=d),),
            {},
        ),
        "multihead_attention": lambda: (
            nn.MultiheadAttention(8, 2, batch_first=True),
            eqx.nn.MultiheadAttention(2, 8, **biases, key=k[10]),
            _mha_call,
            (torch.randn(2, 4, 8, dtype=d),) * 3,
            {"tcall": lambda m, q, kk, v: m(q, kk, v, need_weights=False)[0]},
        ),
        "multihead_attention_kdim_vdim": lambda: (
            nn.MultiheadAttention(8, 2, kdim=5, vdim=3, batch_first=True),
            eqx.nn.MultiheadAttention(2, 8, key_size=5, value_size=3, **biases, key=k[11]),
            _mha_call,
            (torch.randn(2, 4, 8, dtype=d), torch.randn(2, 6, 5, dtype=d), torch.randn(2, 6, 3, dtype=d)),
            {"tcall": lambda m, q, kk, v: m(q, kk, v, need_weights=False)[0]},
        ),
        "batchnorm2d_state": lambda: (
            nn.BatchNorm2d(3),
            bn()[0],
            _bn_call,
            (torch.randn(4, 3, 2, 2, dtype=d),),
            {"state": bn()[1]},
        ),
    }
    return builders[kind]()


@pytest.mark.parametrize(
    "kind",  # the two-layer bidirectional RNNs take ~10 s each on 2 cores: with --long
    [pytest.param(k, marks=pytest.mark.slow) if k.endswith("2layer_bidirectional") else k for k in LAYER_CASES],
)
def test_load_weights_layer_parity_forward_and_backward(kind):
    tlayer, jlayer, jcall, targs, extra = _layer_case(kind)
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
