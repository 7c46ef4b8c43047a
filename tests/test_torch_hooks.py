"""``jaxtrace.torch.grad`` itself: the hooks side, against torch's own autograd and full backward hooks.

Output structures, constants, in-place modules, selection and its errors, repeated calls,
and what the call leaves untouched (``.grad`` fields, frozen parameters, hooks).
"""

import pytest

torch = pytest.importorskip("torch")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxtrace as jt  # noqa: E402
import jaxtrace.torch as jtt  # noqa: E402
from torch_common import ATOL64, RTOL32, RTOL64, TorchMLP, nn  # noqa: E402, F401
from torch_common import keys as _keys  # noqa: E402

jax.config.update("jax_enable_x64", True)
torch.set_num_threads(1)


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
