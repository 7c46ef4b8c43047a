"""jt.per_example_norms and jt.clipped_grad against the PyTorch peers, float64, to 1e-12.

The peers: Opacus (``GradSampleModule`` per-sample gradients; ``GradSampleModuleFastGradientClipping``
with ghost clipping and with fast gradient clipping, whose per-example norms it exposes) and
BackPACK (``BatchL2Grad``, ``BatchGrad``). Models: an MLP, a small CNN (Conv2d + Linear), and an
Embedding + Linear sequence model with repeated ids in an example; the torch model's weights are
copied into the equinox one with ``jaxtrace.torch.load_weights``, and the per-example losses are
the same (one sum per example). Each peer is skipped when it is not installed. jaxtrace's side runs
under ``eqx.filter_jit`` and, with ``--long``, eagerly (``long_eager``).

Where the clipping formulas are the same (``min(1, C / |g_i|)``, the textbook DP-SGD factor that
``jt.clipped_grad`` uses), the clipped sum is built from the peer's per-example gradients or norms
and compared to 1e-12. Opacus's own optimisers divide by ``|g_i| + 1e-6``; their clipped sums are
checked against the bound that stabiliser gives, ``sum_i C * 1e-6 / |g_i|`` over clipped examples
on the global norm of the difference.
"""

import copy
import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtrace as jt
from oracles import assert_close

torch = pytest.importorskip("torch")
jtt = pytest.importorskip("jaxtrace.torch")
nn = torch.nn
F = torch.nn.functional

RTOL, ATOL = 1e-12, 1e-12
B = 8
OPACUS_EPS = 1e-6  # opacus: clip factor max_grad_norm / (norm + 1e-6), in get_clipping_coef and DPOptimizer
pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),  # Opacus's and BackPACK's hooks on the input
    pytest.mark.filterwarnings("ignore:Extension saving to"),  # BackPACK: the container module has no rule of its own
    pytest.mark.long_eager,  # jaxtrace's side eagerly takes ~25 s a model on 2 cores: with --long; under jit always
]


# --- the models, torch and equinox with the same attribute names ----------------------------------


class TorchMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class EqxMLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    fc3: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.fc1, self.fc2, self.fc3 = eqx.nn.Linear(6, 16, key=k1), eqx.nn.Linear(16, 12, key=k2), eqx.nn.Linear(12, 3, key=k3)

    def __call__(self, x):
        return self.fc3(jnp.tanh(self.fc2(jnp.tanh(self.fc1(x)))))


class TorchCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 3, stride=2)
        self.fc = nn.Linear(5 * 3 * 3, 4)

    def forward(self, x):  # x: (B, 2, 8, 8)
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.fc(h.flatten(1))


class EqxCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    fc: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(2, 4, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(4, 5, 3, stride=2, key=k2)
        self.fc = eqx.nn.Linear(5 * 3 * 3, 4, key=k3)

    def __call__(self, x):  # one example: (2, 8, 8)
        h = jnp.tanh(self.conv2(jnp.tanh(self.conv1(x))))
        return self.fc(h.reshape(-1))  # row-major, as torch's flatten


VOCAB, DIM, T = 11, 6, 7


class TorchSeq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids):  # (B, T) -> (B, T, VOCAB)
        return self.head(torch.tanh(self.fc1(self.emb(ids))))


class EqxSeq(eqx.Module):
    emb: eqx.nn.Embedding
    fc1: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.emb = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.fc1 = eqx.nn.Linear(DIM, 8, key=k2)
        self.head = eqx.nn.Linear(8, VOCAB, key=k3)

    def __call__(self, ids):  # one example: (T,) -> (T, VOCAB)
        h = jax.vmap(self.emb)(ids)
        return jax.vmap(lambda v: self.head(jnp.tanh(self.fc1(v))))(h)


# --- the per-example losses (a sum per example), in both frameworks --------------------------------


def jax_mse(model, x, y):
    return 0.5 * jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)


def torch_mse(out, y):
    return 0.5 * ((out - y) ** 2).sum(-1)


def jax_ce(model, x, y):
    logp = jax.nn.log_softmax(jax.vmap(model)(x), axis=-1)
    return -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]


def torch_ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def jax_seq_ce(model, ids, y):
    logp = jax.nn.log_softmax(jax.vmap(model)(ids), axis=-1)  # (B, T, V)
    return -jnp.sum(jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0], axis=1)


def torch_seq_ce(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)


def _data(name):
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
    if name == "cnn":
        return torch.randn(B, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (B,), generator=g)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    ids[:, 3] = ids[:, 0]  # every example reads one embedding row twice: the cross term in its norm
    return ids, torch.randint(0, VOCAB, (B, T), generator=g)


MODELS = {
    "mlp": (TorchMLP, EqxMLP, jax_mse, torch_mse),
    "cnn": (TorchCNN, EqxCNN, jax_ce, torch_ce),
    "seq": (TorchSeq, EqxSeq, jax_seq_ce, torch_seq_ce),
}


class Case:
    """One model in torch and equinox with the same weights, its batch, and jaxtrace's results."""

    def __init__(self, name, mode):
        torch_cls, eqx_cls, self.jax_losses, self.torch_losses = MODELS[name]
        torch.manual_seed(0)
        self.torch_model = torch_cls().double()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an equinox array that no torch weight fills would be a warning
            self.model = jtt.load_weights(eqx_cls(jax.random.key(0)), self.torch_model)
        self.x, self.y = _data(name)
        self.names = [n for n, _ in self.torch_model.named_parameters()]
        jx, jy = jnp.asarray(self.x.numpy()), jnp.asarray(self.y.numpy())

        def ours(model, x, y):
            losses, sq = jt.per_example_norms(self.jax_losses)(model, x, y)
            return losses, sq

        wrap = eqx.filter_jit if mode == "jit" else (lambda f: f)
        self.losses, sq = wrap(ours)(self.model, jx, jy)
        self.sq = {n: np.asarray(leaf(sq, n)) for n in self.names}  # torch name -> (B,)
        norms = np.sqrt(sum(self.sq.values()))
        s = np.sort(norms)
        self.max_norm = float((s[B // 2 - 1] + s[B // 2]) / 2)  # bites for half of the examples, none at the edge
        _, grads = wrap(lambda m, x, y, c: jt.clipped_grad(self.jax_losses, c)(m, x, y))(self.model, jx, jy, self.max_norm)
        self.clipped = {n: np.asarray(leaf(grads, n)) for n in self.names}

    def torch_copy(self):
        return copy.deepcopy(self.torch_model).train()


def leaf(tree, name):
    """The leaf of an equinox model (or its gradients) at a torch parameter name: ``"fc1.weight"``."""
    for part in name.split("."):
        tree = getattr(tree, part)
    return tree


@functools.cache
def case(name, mode):
    return Case(name, mode)


@pytest.fixture(params=list(MODELS))
def c(request, maybe_jit):
    """The model's case, jaxtrace's side run eagerly or under jit (conftest's ``maybe_jit`` names which)."""
    return case(request.param, request.node.callspec.params["maybe_jit"])


def textbook_clipped(per_sample, max_norm):
    """``sum_i min(1, C / |g_i|) g_i`` from per-example gradients ``{name: (B, *shape)}`` (torch)."""
    total = torch.sqrt(sum(g.reshape(B, -1).square().sum(1) for g in per_sample.values()))
    w = torch.where(total > max_norm, max_norm / total, torch.ones_like(total))
    return {n: torch.tensordot(w, g, 1) for n, g in per_sample.items()}


def assert_norms(c, sq_by_name, what):
    want = {n: np.asarray(sq_by_name[n]) for n in c.names}
    assert_close({n: c.sq[n] for n in c.names}, want, what, rtol=RTOL, atol=ATOL, dtype=False)


def assert_clipped(c, grads_by_name, what):
    want = {n: np.asarray(grads_by_name[n].detach()) for n in c.names}
    assert_close({n: c.clipped[n].reshape(want[n].shape) for n in c.names}, want, what, rtol=RTOL, atol=ATOL, dtype=False)


def assert_losses(c, losses):
    assert_close(np.asarray(c.losses), losses.detach().numpy(), "losses", rtol=RTOL, atol=ATOL, dtype=False)


def params_of(model):
    return dict(model.named_parameters())


# --- Opacus ----------------------------------------------------------------------------------------


@pytest.fixture
def opacus():
    """Skips a test when Opacus is not installed; first in a test's arguments, before jaxtrace's side runs."""
    return pytest.importorskip("opacus")


def test_opacus_grad_sample(opacus, c):
    """GradSampleModule's per-sample gradients: their norms per parameter, and the clipped sum."""
    model = c.torch_copy()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum", batch_first=True)
    losses = c.torch_losses(gsm(c.x), c.y)
    losses.sum().backward()
    assert_losses(c, losses)
    per = {n: p.grad_sample for n, p in params_of(model).items()}
    assert_norms(c, {n: g.reshape(B, -1).square().sum(1) for n, g in per.items()}, "Opacus GradSampleModule")
    assert_clipped(c, textbook_clipped(per, c.max_norm), "Opacus GradSampleModule, clipped by hand")


def _stabiliser_bound(c):
    """Global-norm bound on |Opacus - textbook| from Opacus's ``norm + 1e-6`` denominator."""
    norms = np.sqrt(sum(c.sq.values()))
    clipped = norms > c.max_norm
    return float(np.sum(c.max_norm * OPACUS_EPS / norms[clipped])) + 1e-12


def assert_within_stabiliser(c, grads_by_name, what):
    diff = np.sqrt(sum(np.sum((c.clipped[n].reshape(g.shape) - g.detach().numpy()) ** 2) for n, g in grads_by_name.items()))
    bound = _stabiliser_bound(c)
    assert diff <= bound, f"{what}: |Opacus - jaxtrace| = {diff:.3e} above the bound {bound:.3e} from Opacus's 1e-6"


def test_opacus_dp_optimizer(opacus, c):
    """DPOptimizer.pre_step (zero noise): Opacus's own clipped sum, within its stabiliser's bound."""
    from opacus.optimizers import DPOptimizer

    model = c.torch_copy()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum", batch_first=True)
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=c.max_norm,
                      expected_batch_size=B, loss_reduction="sum")
    opt.zero_grad(set_to_none=True)
    c.torch_losses(gsm(c.x), c.y).sum().backward()
    opt.pre_step()  # per-example norms, clip, sum, + zero noise: p.grad is the clipped sum
    assert_within_stabiliser(c, {n: p.grad for n, p in params_of(model).items()}, "Opacus DPOptimizer")


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "fast"])
def test_opacus_fast_gradient_clipping(opacus, c, ghost):
    """GradSampleModuleFastGradientClipping: its per-parameter and total norms (ghost norms for Linear
    and Embedding, per-sample gradients for Conv2d, or for all with ghost=False), then its second
    backward pass of ``sum_i w_i losses[i]`` with the textbook ``w_i``: the clipped sum."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    model = c.torch_copy()
    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=c.max_norm, use_ghost_clipping=ghost,
                                               loss_reduction="sum", batch_first=True)
    losses = c.torch_losses(gsm(c.x), c.y)
    losses.sum().backward(retain_graph=True)
    assert_losses(c, losses)
    # per parameter: the norm Opacus keeps on each parameter (``_norm_sample``; no public accessor)
    assert_norms(c, {n: p._norm_sample.square() for n, p in params_of(model).items()}, f"Opacus ghost={ghost}")
    norms = gsm.get_norm_sample()  # the public one: each example's whole-gradient norm
    np.testing.assert_allclose(np.sqrt(sum(c.sq.values())), norms.detach().numpy(), rtol=RTOL, atol=ATOL)
    w = torch.where(norms > c.max_norm, c.max_norm / norms, torch.ones_like(norms)).detach()
    gsm.zero_grad(set_to_none=True)
    gsm.disable_hooks()
    (w * losses).sum().backward()
    gsm.enable_hooks()
    assert_clipped(c, {n: p.grad for n, p in params_of(model).items()}, f"Opacus ghost={ghost}, second pass")


def test_opacus_ghost_clipping_loss(opacus, c):
    """Opacus's whole ghost-clipping step (DPLossFastGradientClipping's two passes, its clip factor
    with the 1e-6), within its stabiliser's bound."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    class PerExample:  # DPLossFastGradientClipping checks reduction == "sum"; the losses are per example
        reduction = "sum"

        def __call__(self, out, y):
            return c.torch_losses(out, y)

    model = c.torch_copy()
    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=c.max_norm, use_ghost_clipping=True,
                                               loss_reduction="sum", batch_first=True)
    opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0,
                                          max_grad_norm=c.max_norm, expected_batch_size=B, loss_reduction="sum")
    criterion = DPLossFastGradientClipping(gsm, opt, PerExample(), loss_reduction="sum")
    opt.zero_grad(set_to_none=True)
    criterion(gsm(c.x), c.y).backward()
    assert_within_stabiliser(c, {n: p.grad for n, p in params_of(model).items()}, "Opacus ghost clipping")


# --- BackPACK --------------------------------------------------------------------------------------


@pytest.fixture
def backpack():
    """Skips a test when BackPACK is not installed; first in a test's arguments, before jaxtrace's side runs."""
    return pytest.importorskip("backpack")


def test_backpack(backpack, c):
    """BatchL2Grad's per-parameter squared norms, and BatchGrad's per-example gradients: their norms
    and the clipped sum."""
    from backpack.extensions import BatchGrad, BatchL2Grad

    model = backpack.extend(c.torch_copy())
    losses = c.torch_losses(model(c.x), c.y)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # BackPACK 1.7's Embedding rule builds its one-hot in the default dtype
    try:
        with backpack.backpack(BatchL2Grad(), BatchGrad()):
            losses.sum().backward()
    finally:
        torch.set_default_dtype(default)
    assert_losses(c, losses)
    params = params_of(model)
    assert_norms(c, {n: p.batch_l2 for n, p in params.items()}, "BackPACK BatchL2Grad")
    per = {n: p.grad_batch for n, p in params.items()}
    assert_norms(c, {n: g.reshape(B, -1).square().sum(1) for n, g in per.items()}, "BackPACK BatchGrad")
    assert_clipped(c, textbook_clipped(per, c.max_norm), "BackPACK BatchGrad, clipped by hand")


# --- a transformers model: GPT-2 from a config, ported as users port it ---------------------------


@pytest.mark.long  # ~30 s on 2 cores; transformers is installed in the --long cell
def test_hf_gpt2_port_against_torch_func_per_sample_gradients():
    """GPT-2 from a ``GPT2Config`` (random init, float64, tied head) against the port of
    ``examples/hf_gpt2_port.py``, which indexes ``wte.weight[ids]`` and multiplies by ``wte.weight.T``
    as ports do: each example's gradient norms per parameter and the clipped sum, against PyTorch's
    own per-sample recipe (``torch.func.vmap(grad(functional_call))``), to 1e-12, under jit. Every
    leaf is on factors (``fallback="error"``): the LayerNorms and the Conv1D-as-Linear layers by their
    modules, the token table by its two reads (the indexed rows and the tied head's product) and the
    position table by its slice, shared by every example."""
    transformers = pytest.importorskip("transformers")
    import importlib.util
    import pathlib
    import sys

    from torch.func import functional_call, grad, vmap

    spec = importlib.util.spec_from_file_location(
        "hf_gpt2_port", pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_gpt2_port.py")
    port = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # equinox's dataclasses look it up
    spec.loader.exec_module(port)
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=31, n_positions=16, n_embd=8, n_layer=2, n_head=2,
                                  attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).double().eval()
    model = jtt.load_weights(port.make_port(cfg, jax.random.key(0)), hf)
    ids = torch.randint(0, cfg.vocab_size, (4, 6))
    ids[1, 2:] = ids[1, 1]  # one id repeated within an example

    def losses(m, ids):  # each sequence's mean next-token cross entropy
        logp = jax.nn.log_softmax(jax.vmap(m)(ids)[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0], axis=-1)

    def torch_loss(params, one):
        logits = functional_call(hf, params, (one[None],)).logits[0, :-1]
        return F.cross_entropy(logits, one[1:])

    per = vmap(grad(torch_loss), in_dims=(None, 0))(dict(hf.named_parameters()), ids)  # tied: wte once
    sq_ref = {n: g.reshape(len(ids), -1).square().sum(1).detach().numpy() for n, g in per.items()}
    max_norm = float(np.median(np.sqrt(sum(sq_ref.values()))))

    @eqx.filter_jit
    def ours(m, ids):
        return jt.per_example_norms(losses, fallback="error")(m, ids), jt.clipped_grad(losses, max_norm, fallback="error")(m, ids)

    (loss_values, sq), (_, clipped) = ours(model, jnp.asarray(ids.numpy()))
    np.testing.assert_allclose(loss_values, vmap(torch_loss, in_dims=(None, 0))(dict(hf.named_parameters()), ids).detach().numpy(),
                               rtol=RTOL, atol=ATOL)
    names = {jax.tree_util.keystr(path, simple=True, separator="."): leaf
             for path, leaf in jax.tree_util.tree_leaves_with_path(sq)}
    assert set(names) == set(sq_ref), set(names) ^ set(sq_ref)
    for n, ref in sq_ref.items():
        np.testing.assert_allclose(names[n], ref, rtol=RTOL, atol=ATOL, err_msg=n)
    # the clipped sum by hand from torch's per-sample gradients, laid out as the port by load_weights
    w = np.minimum(1.0, max_norm / np.sqrt(sum(sq_ref.values())))
    ref_model = copy.deepcopy(hf)
    with torch.no_grad():
        for n, p in ref_model.named_parameters():
            p.copy_(torch.tensordot(torch.as_tensor(w), per[n], 1))
    expected = jtt.load_weights(model, ref_model)
    ours_leaves, want_leaves = (jax.tree_util.tree_leaves(eqx.filter(t, eqx.is_inexact_array)) for t in (clipped, expected))
    assert len(ours_leaves) == len(want_leaves) == len(names)
    for a, e in zip(ours_leaves, want_leaves):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)
