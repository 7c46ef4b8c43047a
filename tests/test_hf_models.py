"""Hugging Face models from a config (random init, no download) through jaxtrace.torch (issue 24).

Output types kept (a ModelOutput at the root with where=None), tied weights (GPT-2's lm_head),
transformers' Conv1D into eqx.nn.Linear, with_values=True against forward hooks, all in float64.
The full GPT-2 port, every block / attention / MLP output and parameter to 1e-10, is
examples/hf_gpt2_port.py (run by tests/test_examples.py).
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxtrace as jt  # noqa: E402
import jaxtrace.torch as jtt  # noqa: E402

transformers.logging.set_verbosity_error()


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=31, n_positions=16, n_embd=8, n_layer=2, n_head=2,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def bert():
    cfg = transformers.BertConfig(vocab_size=29, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16, attn_implementation="eager")
    torch.manual_seed(1)
    return transformers.BertModel(cfg).double().eval()


IDS = torch.tensor([[1, 5, 7, 3, 2], [4, 4, 9, 0, 6]])


@pytest.mark.parametrize("make", [gpt2, bert], ids=["gpt2", "bert"])
def test_every_module_with_where_none_and_values_against_hooks(make):
    """where=None hooks the root too, whose output is a ModelOutput the model's own code reads."""
    model = make()
    loss = (lambda out: (out.logits**2).mean()) if "GPT2" in type(model).__name__ else (
        lambda out: (out.last_hidden_state**2).mean() + out.pooler_output.sum())
    value, (params, grads), values = jtt.value_and_grad(model, IDS, loss=loss, with_values=True)
    called = set(grads)  # the modules that ran (not a ModuleList, nor a dropout the attention skips)
    assert "" in called and called <= {p for p, _ in model.named_modules()} and len(called) >= 15
    assert set(values) == set(grads)
    # the root's gradient is a plain dict of the ModelOutput's fields (float tensors; None elsewhere)
    root = "logits" if "GPT2" in type(model).__name__ else "last_hidden_state"
    assert isinstance(grads[""], dict) and isinstance(values[""], dict) and root in grads[""]
    # the same loss without hooks
    with torch.no_grad():
        assert abs(value - float(loss(model(IDS)))) <= 1e-12 * abs(value)
    # values and gradients against forward hooks + autograd on the outputs, for every tensor-output module
    seen, handles = {}, []
    for path, mod in model.named_modules():
        def hook(mod, args, out, path=path):
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                out.retain_grad()
                seen[path] = (out.detach().clone(), out)
        handles.append(mod.register_forward_hook(hook))
    try:
        out = model(IDS)
        loss(out).backward()
    finally:
        for h in handles:
            h.remove()
    checked = 0
    for path, (v, t) in seen.items():
        if isinstance(values[path], np.ndarray) and values[path].shape == tuple(v.shape):
            np.testing.assert_allclose(values[path], v.numpy(), rtol=1e-12, atol=0)
            if t.grad is not None and not any(isinstance(m, torch.nn.Dropout) for m in [dict(model.named_modules())[path]]):
                np.testing.assert_allclose(grads[path], t.grad.numpy(), rtol=1e-10, atol=1e-300)
            checked += 1
    assert checked >= 10


def test_values_are_copies_before_a_later_in_place_op():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3).double()

        def forward(self, x):
            h = self.fc(x)
            h.mul_(2.0)  # in place, after fc returned
            return h.sum()

    net, x = Net(), torch.randn(2, 3, dtype=torch.float64)
    with torch.no_grad():
        expected = net.fc(x).numpy()
    params, grads, values = jtt.grad(net, x, where=["fc", "fc:in"], with_values=True)
    np.testing.assert_array_equal(values["fc"], expected)  # as fc returned it, not doubled
    np.testing.assert_array_equal(values["fc:in"], x.numpy())
    np.testing.assert_allclose(grads["fc"], 2.0 * np.ones((2, 3)))
    # without with_values: exactly as before
    assert len(jtt.grad(net, x, where=["fc"])) == 2 and len(jtt.value_and_grad(net, x, where=["fc"])) == 2


def test_output_types_kept_in_forward():
    """Modules returning a NamedTuple, a dataclass and an OrderedDict subclass: the caller reads their fields."""
    import collections
    import dataclasses
    import typing

    class Pair(typing.NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    @dataclasses.dataclass
    class Out:
        h: torch.Tensor
        n: int = 3

    class Od(collections.OrderedDict):
        pass

    class Inner(torch.nn.Module):
        def forward(self, x):
            return Pair(x * 2, x * 3), Out(x + 1), Od(z=x.sin())

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            p, o, d = self.inner(x)
            assert isinstance(p, Pair) and isinstance(o, Out) and isinstance(d, Od)
            return (p.a * p.b).sum() + (o.h ** 2).sum() * o.n + d["z"].sum()

    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    _, grads, values = jtt.grad(Net(), x, where=["inner"], with_values=True)
    pair, out, od = grads["inner"]
    assert type(pair).__name__ == "Pair"  # NamedTuples stay (JAX reads them); the others as dicts
    assert out == {"h": out["h"], "n": None} and isinstance(od, dict)
    np.testing.assert_allclose(out["h"], 6 * (x.numpy() + 1))
    np.testing.assert_allclose(values["inner"][2]["z"], np.sin(x.numpy()))


# --- GPT-2's tied lm_head and Conv1D into equinox ------------------------------------------------


class Head(eqx.Module):  # a port with its own lm_head Linear (HF's is tied to wte)
    transformer: dict
    lm_head: eqx.nn.Linear


def _head_port(model):
    cfg = model.config
    k = jax.random.key(0)
    return Head({"wte": eqx.nn.Embedding(cfg.vocab_size, cfg.n_embd, key=k, dtype=jnp.float64)},
                eqx.nn.Linear(cfg.n_embd, cfg.vocab_size, use_bias=False, key=k, dtype=jnp.float64))


class TiedHead(torch.nn.Module):
    def __init__(self, vocab=7, d=4):
        super().__init__()
        self.transformer = torch.nn.ModuleDict({"wte": torch.nn.Embedding(vocab, d)})
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight  # tied, as GPT-2

    def forward(self, ids):
        return self.lm_head(self.transformer["wte"](ids))


def _tied_port(vocab=7, d=4, dtype=jnp.float64):
    k = jax.random.key(3)
    return Head({"wte": eqx.nn.Embedding(vocab, d, key=k, dtype=dtype)},
                eqx.nn.Linear(d, vocab, use_bias=False, key=k, dtype=dtype))


def test_tied_weight_fills_every_field_and_named_grads_sums():
    net = TiedHead().double()
    port = jtt.load_weights(_tied_port(), net)
    w = net.transformer["wte"].weight.detach().numpy()
    np.testing.assert_array_equal(port.lm_head.weight, w)
    np.testing.assert_array_equal(port.transformer["wte"].weight, w)
    ids = torch.tensor([1, 4, 6, 0])

    def loss(m, ids):
        return jnp.sum(jnp.sin(jax.vmap(m.lm_head)(jax.vmap(m.transformer["wte"])(ids))))

    grads, _ = jt.filter_grad(loss)(port, jnp.asarray(ids.numpy()))
    t_params, _ = jtt.grad(net, ids, loss=lambda y: torch.sin(y).sum())
    named = jtt.named_grads(grads, net)
    assert list(named) == ["transformer.wte.weight"]  # torch's one name for the tied parameter
    np.testing.assert_allclose(named["transformer.wte.weight"], t_params["transformer.wte.weight"], rtol=1e-10)
    # abstract target: filled from the one tied tensor too
    abstract = eqx.filter_eval_shape(_tied_port)
    filled = jtt.load_weights(abstract, net)
    np.testing.assert_array_equal(filled.lm_head.weight, w)


def test_unfilled_arrays_warn_or_fail_when_abstract():
    class Extra(eqx.Module):
        fc: eqx.nn.Linear
        scale: jax.Array

    net = torch.nn.ModuleDict({"fc": torch.nn.Linear(2, 3)}).double()
    make = lambda: Extra(eqx.nn.Linear(2, 3, key=jax.random.key(0), dtype=jnp.float64), jnp.ones(3))  # noqa: E731
    with pytest.warns(UserWarning, match=r"\.scale"):
        jtt.load_weights(make(), net)
    with pytest.raises(ValueError, match=r"no torch parameter or buffer goes into: \.scale"):
        jtt.load_weights(eqx.filter_eval_shape(make), net)
    # everything filled: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jtt.load_weights(eqx.nn.Linear(2, 3, key=jax.random.key(0), dtype=jnp.float64), net["fc"])


def test_conv1d_into_linear_and_own_module():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(2)
    conv = Conv1D(5, 3).double()  # nf=5 outputs, nx=3 inputs: weight (3, 5)
    with torch.no_grad():
        conv.bias.uniform_(-1, 1)
    x = torch.randn(4, 3, dtype=torch.float64)
    lin = jtt.load_weights(eqx.filter_eval_shape(lambda: eqx.nn.Linear(3, 5, key=jax.random.key(0), dtype=jnp.float64)), conv)
    np.testing.assert_allclose(jax.vmap(lin)(jnp.asarray(x.numpy())), conv(x).detach().numpy(), rtol=1e-13)
    grads, _ = jt.filter_grad(lambda m, x: jnp.sum(jnp.sin(jax.vmap(m)(x))))(lin, jnp.asarray(x.numpy()))
    t_params, _ = jtt.grad(conv, x, loss=lambda y: torch.sin(y).sum())
    jt.compare(jtt.named_grads(grads, conv), t_params, rtol=1e-10, atol=0).assert_ok()

    class Own(eqx.Module):  # a module with torch's shapes: copied as is
        weight: jax.Array
        bias: jax.Array

    own = jtt.load_weights(Own(jnp.zeros((3, 5)), jnp.zeros(5)), conv)
    np.testing.assert_array_equal(own.weight, conv.weight.detach().numpy())


def test_transposed_shapes_say_so():
    class Wrong(eqx.Module):
        weight: jax.Array
        bias: jax.Array

    lin = torch.nn.Linear(3, 5)
    with pytest.raises(ValueError, match="each other's transpose"):
        jtt.load_weights(Wrong(jnp.zeros((3, 5)), jnp.zeros(5)), lin)


def test_gpt2_under_jit_and_vmap_of_the_port():
    """A small tied-head port of GPT-2's embeddings: load, then jax.jit and jax.vmap around jt.grad."""
    model = gpt2()
    port = jtt.load_weights(_head_port(model), torch.nn.ModuleDict(
        {"transformer": torch.nn.ModuleDict({"wte": model.transformer.wte}), "lm_head": model.lm_head}))
    np.testing.assert_array_equal(port.lm_head.weight, model.transformer.wte.weight.detach().numpy())

    def loss(m, ids):
        h = jt.tag(jax.vmap(m.transformer["wte"])(ids), "emb")
        return jnp.sum(jax.vmap(m.lm_head)(h) ** 2)

    ids = jnp.asarray(IDS.numpy())
    (g, tg), = [jax.jit(lambda p, i: jt.grad(loss)(p, i))(port, ids[0])]
    per = jax.vmap(lambda i: jt.grad(loss)(port, i)[1]["emb"])(ids)
    np.testing.assert_allclose(per[0], tg["emb"], rtol=1e-12)


def test_values_of_repeated_calls_stack_like_gradients():
    """A module called twice: values and gradients stacked in call order, inputs too (inputs=True)."""
    cell = torch.nn.Linear(2, 2).double()

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, x):
            return self.cell(torch.tanh(self.cell(x))).sum()

    x = torch.randn(3, 2, dtype=torch.float64)
    _, grads, values = jtt.grad(Twice(), x, where=["cell"], inputs=True, with_values=True)
    with torch.no_grad():
        first = cell(x)
        second = cell(torch.tanh(first))
    assert values["cell"].shape == grads["cell"].shape == (2, 3, 2)
    np.testing.assert_array_equal(values["cell"][0], first.numpy())
    np.testing.assert_array_equal(values["cell"][1], second.numpy())
    np.testing.assert_array_equal(values["cell:in"][1], torch.tanh(first).numpy())


def test_nnx_target_conv1d_tied_and_unfilled():
    nnx = pytest.importorskip("flax.nnx")
    from transformers.pytorch_utils import Conv1D

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(7, 4)
            self.proj = Conv1D(4, 4)  # square: a transposition would go unnoticed by the shapes
            self.head = torch.nn.Linear(4, 7, bias=False)
            self.head.weight = self.wte.weight

    class Port(nnx.Module):
        def __init__(self, rngs):
            self.wte = nnx.Embed(7, 4, rngs=rngs, param_dtype=jnp.float64)
            self.proj = nnx.Linear(4, 4, rngs=rngs, param_dtype=jnp.float64)
            self.head = nnx.Linear(4, 7, use_bias=False, rngs=rngs, param_dtype=jnp.float64)

    torch.manual_seed(4)
    net = TorchNet().double()
    with torch.no_grad():
        net.proj.bias.uniform_(-1, 1)
    port = jtt.load_weights(Port(nnx.Rngs(0)), net)
    x = torch.randn(3, 4, dtype=torch.float64)
    np.testing.assert_allclose(port.proj(jnp.asarray(x.numpy())), net.proj(x).detach().numpy(), rtol=1e-13)
    np.testing.assert_array_equal(port.head.kernel[...], net.wte.weight.detach().numpy().T)  # tied: filled

    class Extra(Port):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.gate = nnx.Param(jnp.ones(4))

    with pytest.warns(UserWarning, match="gate"):
        jtt.load_weights(Extra(nnx.Rngs(0)), net)
