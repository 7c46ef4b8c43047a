"""``jaxtrace.torch.grad`` at the seams of real models (issue 34), each against an independent oracle.

The oracle (``torch_common.oracle``, shared with the model sweep in test_torch_sweep.py) is a zero-perturbation forward hook, registered with ``prepend=True``: it returns
``output + eps`` (``eps`` a zero tensor that requires grad) and ``torch.autograd.grad`` gives the
gradient at ``eps``. Where the model later changes the output's memory in place, a hook that
returns a new tensor would change the forward pass itself; there the oracle adds ``eps`` in
place (``output.add_(eps)``), so every later use of that memory sees it, as in the model.

- Others' forward hooks (Hugging Face's output recorders, a user's hook that stores the output)
  registered before jaxtrace's: the numbers do not depend on them, on every call.
- Outputs that alias an input (``nn.Identity``, ``Dropout`` in eval, ``nn.Flatten``'s view) and
  in-place ops after them: the model computes exactly what it computes without jaxtrace.
- A submodule called under ``torch.no_grad()``: runs, zeros, parameter gradients right.
- A module called with keyword arguments only: ``":in"`` is a dict of the keywords.
- bfloat16: gradients and values in the module's dtype (``ml_dtypes.bfloat16``), bit for bit.
"""

import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxtrace.torch as jtt  # noqa: E402
from torch_common import assert_matches, nn, oracle  # noqa: E402
from torch_common import assert_params as _assert_params  # noqa: E402
from torch_common import leaves as _leaves  # noqa: E402
from torch_common import plain as _plain  # noqa: E402

jax.config.update("jax_enable_x64", True)
torch.set_num_threads(1)


# --- others' forward hooks ------------------------------------------------------------


class Recorded(nn.Module):
    """Reads ``fc``'s output both from its return value and from what a forward hook stored."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)
        self.stored = []

    def forward(self, x):
        y = self.fc(x)
        return (self.head(torch.tanh(y)) ** 2).sum() + (self.stored.pop() ** 3).sum()


def test_user_hook_registered_before_sees_the_watched_output():
    torch.manual_seed(0)
    model = Recorded().double()
    model.fc.register_forward_hook(lambda m, a, out: model.stored.append(out))
    x = torch.randn(5, 3, dtype=torch.float64)
    value, expected = oracle(model, (x,), lambda v: v, ["fc"])
    for _ in range(2):
        got, (params, modules) = jtt.value_and_grad(model, x, where=["fc"])
        assert got == float(value)
        assert_matches(modules, expected)
        _assert_params(params, _plain(model, (x,), lambda v: v)[1])


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, attn_implementation="eager"
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double().eval()


def _gpt2_loss(out):
    """Reads the logits, every attention map and every hidden state (captured by HF's hooks)."""
    total = (out["logits"] ** 2).mean()
    total = total + sum((a * torch.arange(a.shape[-1], dtype=a.dtype)).sum() for a in out["attentions"])
    return total + sum((h**2).mean() for h in out["hidden_states"])


def test_gpt2_output_attentions_same_numbers_on_every_call():
    """HF installs output recorders on the first such call and keeps them: from the second call on
    they run before hooks registered without ``prepend=True``; the numbers must not change."""
    model = _gpt2()
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    kwargs = dict(output_attentions=True, output_hidden_states=True)
    paths = ["transformer.h.0.attn", "transformer.h.0", "transformer.h.1.attn"]
    runs = []
    for _ in range(2):
        runs.append(jtt.value_and_grad(model, ids, loss=_gpt2_loss, kwargs=kwargs, where=paths))
    value, expected = oracle(model, (ids,), _gpt2_loss, paths, kwargs=kwargs)
    ref_params = _plain(model, (ids,), _gpt2_loss, kwargs)[1]
    for got, (params, modules) in runs:
        assert got == float(value)
        assert_matches(modules, expected)
        _assert_params(params, ref_params)
    for path in paths:  # identical on both calls, bit for bit
        for a, b in zip(_leaves(runs[0][1][1][path]), _leaves(runs[1][1][1][path])):
            np.testing.assert_array_equal(a, b)
    attn_weights_grad = _leaves(runs[1][1][1]["transformer.h.0.attn"])[1]
    assert np.abs(attn_weights_grad).max() > 0.5  # the recorded attention map's gradient, not zeros


@pytest.mark.parametrize("record", [False, True])
def test_gpt2_every_module_and_input_against_the_oracle(record):
    """``where=None, inputs=True``: every module's output and input, on two calls, with and without
    Hugging Face's output recorders, against zero-perturbation hooks."""
    model = _gpt2()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    kwargs = dict(output_attentions=True, output_hidden_states=True) if record else {}
    loss = _gpt2_loss if record else (lambda out: (out["logits"] ** 2).mean())
    for _ in range(2):
        got, (params, modules) = jtt.value_and_grad(model, ids, loss=loss, kwargs=kwargs, inputs=True)
        value, expected = oracle(model, (ids,), loss, list(modules), kwargs=kwargs)
        assert got == float(value) and len(expected) == 62
        unused = set() if record else {"transformer.h.0.attn", "transformer.h.1.attn"}  # weights dropped
        assert_matches({p: modules[p] for p in expected if p not in unused}, {p: expected[p] for p in expected if p not in unused})
        for p in unused:
            np.testing.assert_array_equal(_leaves(modules[p])[1], 0.0)
            np.testing.assert_allclose(_leaves(modules[p])[0], expected[p][0][0].numpy(), rtol=1e-12, atol=1e-13)


# --- outputs that alias an input ---------------------------------------------------------


class IdentityResidual(nn.Module):
    """``nn.Identity`` as a norm placeholder: its input also feeds the residual (read, not changed)."""

    def __init__(self):
        super().__init__()
        self.fc0, self.norm, self.fc = nn.Linear(3, 4), nn.Identity(), nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.fc0(x))  # tanh saves its output: the alias watch must keep versions
        return (self.fc(self.norm(h)) ** 2).sum() + (3 * h).sum()


class AliasChangedLater(nn.Module):
    """``Dropout`` in eval returns its input; the caller adds to it in place, then reads the input."""

    def __init__(self):
        super().__init__()
        self.fc0, self.drop, self.fc1, self.fc2 = nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.fc0(x)
        out = self.drop(h)
        out += self.fc1(x)  # changes h too
        return (self.fc2(h) ** 2).sum() + (h * out).sum()


class ResidualShortcut(nn.Module):
    """A residual block written ``out = shortcut(x); out += body(...)`` with an ``nn.Identity`` shortcut."""

    def __init__(self):
        super().__init__()
        self.fc0, self.shortcut, self.body, self.head = nn.Linear(3, 4), nn.Identity(), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc0(x)
        out = self.shortcut(h)
        out += self.body(x)
        return (torch.relu(self.head(h)) ** 2).mean() + out.sum()


class FlattenView(nn.Module):
    def __init__(self, change_later=False):
        super().__init__()
        self.fc0, self.flat, self.fc = nn.Linear(3, 6), nn.Flatten(), nn.Linear(12, 1)
        self.change_later = change_later

    def forward(self, x):  # (B, 2, 3)
        h = self.fc0(x).transpose(1, 2).contiguous()  # (B, 6, 2)
        f = self.flat(h)  # a view of h
        if self.change_later:
            h.mul_(2)  # f sees it
        return (self.fc(f) ** 2).sum() + (h**3).sum()


ALIAS_CASES = {
    "identity_residual": (IdentityResidual, (4, 3), ["norm", "fc0", "fc", "norm:in"], ()),
    "dropout_changed_later": (AliasChangedLater, (4, 3), ["drop", "fc0", "fc1", "fc2"], ("drop",)),
    "shortcut_changed_later": (ResidualShortcut, (4, 3), ["shortcut", "shortcut:in", "head", "body"], ("shortcut",)),
    "flatten_view": (FlattenView, (4, 2, 3), ["flat", "fc0", "fc", "flat:in"], ()),
}


@pytest.mark.parametrize("case", list(ALIAS_CASES))
def test_aliasing_outputs_leave_the_model_unchanged(case):
    cls, shape, paths, in_place = ALIAS_CASES[case]
    torch.manual_seed(1)
    model = cls().double().eval()
    x = torch.randn(*shape, dtype=torch.float64)
    plain_value, plain_params = _plain(model, (x,), lambda v: v)
    in_place = set(in_place) | ({p + ":in" for p in in_place} & set(paths))
    value, expected = oracle(model, (x,), lambda v: v, paths, in_place=in_place)
    assert value.item() == plain_value.item()  # the oracle itself leaves the forward pass alone
    got, (params, modules) = jtt.value_and_grad(model, x, where=paths)
    assert got == plain_value.item()  # bit for bit
    assert_matches(modules, expected)
    _assert_params(params, plain_params)
    whole, (params, _) = jtt.value_and_grad(model, x, inputs=True)  # where=None, inputs too: the same
    assert whole == plain_value.item()
    _assert_params(params, plain_params)


def test_identity_with_in_passes_on_the_callers_memory():
    """``nn.Identity`` with only ``":in"`` watched: what it returns shares the caller's memory."""
    seen = []

    class Keep(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.id = nn.Linear(3, 3), nn.Identity()

        def forward(self, x):
            h = self.fc(x)
            out = self.id(h)
            seen.append(out.data_ptr() == h.data_ptr() and out.shape == h.shape)
            return (h**2).sum() + out.sum()

    model = Keep().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    _, modules = jtt.grad(model, x, where=["id:in"])
    assert seen == [True] and "id" not in modules
    np.testing.assert_allclose(modules["id:in"], np.ones((2, 3)), rtol=1e-15)  # the returned tensor's use
    with pytest.raises(ValueError, match=r"patch_grads has 'id:in', but 'id' returns its input as it is"):
        jtt.grad(model, x, where=["id:in"], patch_grads={"id:in": lambda g: 2 * g})


def test_a_view_output_changed_in_place_later_is_a_clear_error():
    torch.manual_seed(2)
    model = FlattenView(change_later=True).double()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    plain_value, plain_params = _plain(model, (x,), lambda v: v)
    with pytest.raises(ValueError, match=r"output of 'flat' is a view of one of its inputs.*changed that memory in place"):
        jtt.grad(model, x, where=["flat"])
    got, (params, modules) = jtt.value_and_grad(model, x, where=["fc0", "fc"])
    assert got == plain_value.item()
    _assert_params(params, plain_params)
    assert_matches(modules, oracle(model, (x,), lambda v: v, ["fc"])[1])


# --- no_grad parts ----------------------------------------------------------------------


class Distill(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.teacher = nn.Sequential(nn.Linear(3, 2), nn.Tanh())

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        return ((self.student(x) - target) ** 2).sum()


def test_submodule_under_no_grad_runs_with_zero_gradient():
    torch.manual_seed(3)
    model = Distill().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    plain_value, plain_params = _plain(model, (x,), lambda v: v)
    got, (params, modules), values = jtt.value_and_grad(model, x, inputs=True, with_values=True)
    assert got == plain_value.item()
    _assert_params(params, plain_params)
    for path in ["teacher", "teacher:in", "teacher.0", "teacher.1"]:
        np.testing.assert_array_equal(modules[path], np.zeros(values[path].shape))
    np.testing.assert_array_equal(values["teacher"], model.teacher(x).detach().numpy())
    expected = oracle(model, (x,), lambda v: v, ["student", "student.0", "student:in", "teacher"])[1]
    assert_matches(modules, expected, zero_ok={"teacher"})


# --- keyword-only calls ------------------------------------------------------------------


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, hidden_states=None, scale=None, mask=None):
        return self.fc(hidden_states) * scale + mask.sum()


class KeywordCaller(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        mask = (x > 0).long()  # not floating: no gradient
        s = torch.tanh(self.scale * x[:, :1])
        a = self.inner(hidden_states=x, scale=s, mask=mask)
        b = self.inner(x, s, mask)  # positional: ":in" keeps its positional structure
        return (a**2).sum() + (b**3).sum()


def test_keyword_only_call_gives_a_dict_of_the_keywords():
    torch.manual_seed(4)
    model = KeywordCaller().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    only = KeywordCaller().double()
    only.load_state_dict(model.state_dict())
    only.forward = lambda x: (only.inner(hidden_states=x, scale=torch.tanh(only.scale * x[:, :1]), mask=(x > 0).long()) ** 2).sum()
    _, modules = jtt.grad(only, x, where=["inner:in", "inner"])
    g = modules["inner:in"]
    assert isinstance(g, dict) and list(g) == ["hidden_states", "scale", "mask"] and g["mask"] is None
    value, expected = oracle(only, (x,), lambda v: v, ["inner:in", "inner"])
    assert_matches(modules, expected)
    with pytest.raises(ValueError, match="different output shapes or structures"):
        jtt.grad(model, x, where=["inner:in"])  # a dict on one call, a tuple on the other


# --- bfloat16 ---------------------------------------------------------------------------


def test_bfloat16_gradients_and_values_in_the_module_dtype():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(torch.bfloat16)
    x = torch.randn(2, 3).to(torch.bfloat16)
    params, modules, values = jtt.grad(model, x, loss=lambda y: y.float().sum(), where=["0", "1"], with_values=True)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert params["0.weight"].dtype == bf16 and modules["1"].dtype == bf16 and values["0"].dtype == bf16
    # Bit for bit what torch computes, read through an int16 view.
    np.testing.assert_array_equal(values["0"].view(np.int16), model[0](x).detach().view(torch.int16).numpy())
    ref_w = torch.autograd.grad(model(x).float().sum(), [model[0].weight])[0]
    np.testing.assert_array_equal(params["0.weight"].view(np.int16), ref_w.view(torch.int16).numpy())
    _, expected = oracle(model, (x,), lambda y: y.float().sum(), ["1"])
    np.testing.assert_array_equal(modules["1"].view(np.int16), expected["1"][0][0].view(torch.int16).numpy())
