"""Flax models: jt.tag_modules on nnx modules and jaxtrace.flax.tag_modules for Linen.

Oracles: Flax's own ``perturb`` (the gradient with respect to a zero
perturbation added at the same place) and the hand-written ``+ eps`` program,
in float64 (conftest turns x64 on), eager and under jit.
"""

import doctest
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxtrace as jt  # noqa: E402
import jaxtrace.flax  # noqa: E402

from oracles import NnxStack, assert_close, eps_oracle, nnx_stack_by_hand  # noqa: E402

F64 = jnp.float64


def _value(v):
    return v[...] if isinstance(v, nnx.Variable) else v


def _plain(state):  # PRNG keys as their bits, so that states compare as arrays
    def bits(a):
        return jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a

    return jax.tree_util.tree_map(bits, state)


# --- NNX ------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs, param_dtype=F64)
        self.l2 = nnx.Linear(4, 2, rngs=rngs, param_dtype=F64)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


class PerturbedMLP(MLP):  # the oracle: the same model, edited as Flax's perturb wants
    def __call__(self, x):
        h = self.perturb("p_l1", self.l1(x))
        return self.perturb("p_l2", self.l2(jnp.tanh(h)))


def mse(model, x):
    return jnp.sum(jnp.sin(model(x)) ** 2)


X = jnp.linspace(-1.0, 1.0, 15, dtype=F64).reshape(5, 3)


def test_nnx_mlp_against_perturb(maybe_jit):
    tagged = jt.tag_modules(MLP(nnx.Rngs(0)), ["l1", "l2"])
    grads, tag_grads = maybe_jit(jt.grad(mse))(tagged, X)

    oracle = PerturbedMLP(nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # perturb outside nnx.capture (newer flax)
        oracle(X)  # perturb's init pass: creates the zero perturbations, shaped by this batch
        expected = nnx.grad(mse, argnums=nnx.DiffState(0, nnx.Perturbation))(oracle, X)
    assert_close(tag_grads, {"l1": _value(expected["p_l1"]), "l2": _value(expected["p_l2"])})
    # the parameter gradients are those of the untagged model
    assert_close(nnx.state(grads, nnx.Param), nnx.state(nnx.grad(mse)(MLP(nnx.Rngs(0)), X), nnx.Param))


def test_nnx_names_where_inputs_and_errors():
    model = MLP(nnx.Rngs(0))
    names = sorted(jt.grad(mse)(jt.tag_modules(model, inputs=True), X)[1])
    assert names == ["", ":in", "l1", "l1:in", "l2", "l2:in"]
    picked = jt.tag_modules(model, lambda path, m: isinstance(m, nnx.Linear))
    assert sorted(jt.grad(mse)(picked, X)[1]) == ["l1", "l2"]
    by_class = jt.tag_modules(model, nnx.Linear)  # a class selects its instances, as for equinox
    assert sorted(jt.grad(mse)(by_class, X)[1]) == ["l1", "l2"]
    with pytest.raises(ValueError, match=r"no callable submodule at 'l3'.*'l1', 'l2'"):
        jt.tag_modules(model, ["l1", "l3"])
    seq = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    assert sorted(jt.grad(lambda m: jnp.sum(m(jnp.ones(2))))(jt.tag_modules(seq))[1]) == ["", "0", "2"]


def test_nnx_original_untouched_and_state_interchangeable():
    model = MLP(nnx.Rngs(0))
    before = nnx.state(model)
    tagged = jt.tag_modules(model)
    assert type(model.l1) is nnx.Linear and isinstance(tagged.l1, nnx.Linear) and type(tagged.l1) is not nnx.Linear
    graphdef, state = nnx.split(tagged)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(before)
    assert_close(state, before)
    # the tagged GraphDef with the untagged model's state is a tagged model
    merged = nnx.merge(graphdef, nnx.state(model))
    assert sorted(jt.grad(mse)(merged, X)[1]) == ["", "l1", "l2"]
    # pickle and deepcopy keep the tagging classes
    import copy
    import pickle

    copies = [copy.deepcopy(tagged)]
    try:
        pickle.dumps(model)
    except (AttributeError, pickle.PicklingError):
        pass  # flax 0.12.0 keeps initializers as local functions: its modules do not pickle at all
    else:
        copies.append(pickle.loads(pickle.dumps(tagged)))
        # issue 26 moved NNX tagging to jaxtrace.flax._nnx: a pickle made before names the old paths
        import jaxtrace._nnx

        assert jaxtrace._nnx._restore is jaxtrace.flax._nnx.restore
        data = pickle.dumps(tagged, protocol=3)  # protocols 0-3 name classes as text lines
        assert b"cjaxtrace.flax._nnx\nrestore\n" in data
        old = data.replace(b"cjaxtrace.flax._nnx\nrestore\n", b"cjaxtrace._nnx\n_restore\n")
        old = old.replace(b"cjaxtrace._module_tags\nModuleTag\n", b"cjaxtrace._nnx\n_ModuleTag\n")
        copies.append(pickle.loads(old))
    for copied in copies:
        assert sorted(jt.grad(mse)(copied, X)[1]) == ["", "l1", "l2"]
    # a model whose state is changed later gets it back with nnx.update
    nnx.update(tagged, jax.tree_util.tree_map(lambda a: a + 1, nnx.state(model)))
    assert_close(nnx.state(model), before)


def test_nnx_optimizer_step_equals_untagged():
    optax = pytest.importorskip("optax")
    model, tagged = MLP(nnx.Rngs(0)), jt.tag_modules(MLP(nnx.Rngs(0)))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    opt_tagged = nnx.Optimizer(tagged, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
        opt.update(model, nnx.grad(mse)(model, x))

    @nnx.jit
    def step_tagged(model, opt, x):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        grads, tag_grads = jt.grad(lambda p: mse(nnx.merge(graphdef, p, rest), x))(params)
        opt.update(model, grads)
        return jt.stats.summarize(tag_grads)

    for _ in range(2):
        step(model, opt, X)
        stats = step_tagged(tagged, opt_tagged, X)
    assert sorted(stats) == ["", "l1", "l2"]
    assert_close(nnx.state(tagged), nnx.state(model))
    assert_close(nnx.state(opt_tagged), nnx.state(opt))


class Shared(nnx.Module):  # one module called twice: the calls are stacked in call order
    def __init__(self, rngs):
        self.cell = nnx.Linear(3, 3, rngs=rngs, param_dtype=F64)

    def __call__(self, x):
        return self.cell(jnp.tanh(self.cell(x)))


def test_nnx_repeated_calls_stack_against_eps(maybe_jit):
    model = Shared(nnx.Rngs(0))
    _, tag_grads = maybe_jit(jt.grad(mse))(jt.tag_modules(model, "cell"), X)
    w, b = model.cell.kernel[...], model.cell.bias[...]

    def oracle(eps, x):
        h = x @ w + b + eps[0]
        return jnp.sum(jnp.sin(jnp.tanh(h) @ w + b + eps[1]) ** 2)

    assert_close(tag_grads["cell"], jax.grad(oracle)(jnp.zeros((2, 5, 3), F64), X))


def test_nnx_scanned_stack_per_layer_against_eps(maybe_jit):
    model = NnxStack(nnx.Rngs(0))
    _, tag_grads = maybe_jit(jt.grad(mse))(jt.tag_modules(model, ["blocks", "blocks.lin"]), X)

    def oracle(eps, x):  # + eps at each block's Linear (eps[0]) and output (eps[1])
        return jnp.sum(jnp.sin(nnx_stack_by_hand(model, x, eps[1], eps_lin=eps[0])[0]) ** 2)

    expected = eps_oracle(oracle, jnp.zeros((2, 4, 5, 3), F64), X)
    assert tag_grads["blocks"].shape == (4, 5, 3)  # one entry per layer
    assert_close(tag_grads["blocks.lin"], expected[0])
    assert_close(tag_grads["blocks"], expected[1])


def test_nnx_compositions():
    model = MLP(nnx.Rngs(0))
    tagged = jt.tag_modules(model, "l1")
    _, expected = jt.grad(mse)(tagged, X)
    # jax.vmap around: per example
    per_example = jax.vmap(lambda x: jt.grad(mse)(tagged, x)[1]["l1"])(X)
    assert_close(per_example, expected["l1"])
    # nnx.vmap around, the model broadcast
    per_example = nnx.vmap(lambda m, x: jt.grad(mse)(m, x)[1]["l1"], in_axes=(None, 0))(tagged, X)
    assert_close(per_example, expected["l1"])
    # nnx.grad / nnx.value_and_grad of the tagged model are the untagged model's
    assert_close(nnx.state(nnx.grad(mse)(tagged, X)), nnx.state(nnx.grad(mse)(model, X)))
    value, _ = nnx.value_and_grad(mse)(tagged, X)
    assert_close(value, mse(model, X))

    # jt.grad inside jax.grad: the x-derivative of a function of the tag's gradient, against + eps
    def through_tag(x):
        return jnp.sum(jt.grad(mse)(tagged, x)[1]["l1"] ** 2)

    w1, b1 = model.l1.kernel[...], model.l1.bias[...]
    w2, b2 = model.l2.kernel[...], model.l2.bias[...]

    def eps_loss(eps, x):
        return jnp.sum(jnp.sin(jnp.tanh(x @ w1 + b1 + eps) @ w2 + b2) ** 2)

    oracle = lambda x: jnp.sum(jax.grad(eps_loss)(jnp.zeros((5, 4), F64), x) ** 2)  # noqa: E731
    assert_close(jax.grad(through_tag)(X), jax.grad(oracle)(X))

    # jax.checkpoint inside the loss, jax.jvp around jt.grad, jt.capture around jt.grad: all against + eps
    zeros = jnp.zeros((5, 4), F64)
    remat_loss = lambda m, x: jnp.sum(jnp.sin(jax.checkpoint(lambda x: m(x))(x)) ** 2)  # noqa: E731
    assert_close(jt.grad(remat_loss)(tagged, X)[1]["l1"], jax.grad(eps_loss)(zeros, X))
    tangent = jnp.cos(X)
    got = jax.jvp(lambda x: jt.grad(mse)(tagged, x)[1]["l1"], (X,), (tangent,))
    want = jax.jvp(lambda x: jax.grad(eps_loss)(zeros, x), (X,), (tangent,))
    assert_close(got, want)
    grads_at_l1, values = jt.capture(lambda x: jt.grad(mse)(tagged, x)[1]["l1"])(X)
    assert_close(grads_at_l1, jax.grad(eps_loss)(zeros, X))
    assert_close(values["l1"], X @ w1 + b1)  # the outer capture sees the inner split's tag


def test_nnx_import_is_lazy():
    code = textwrap.dedent(
        """
        import sys, equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        jt.tag_modules(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
        assert "flax" not in sys.modules, "jaxtrace imported flax"
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


class Stateful(nnx.Module):  # RNG counts and batch statistics change on every call
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs, param_dtype=F64)
        self.norm = nnx.BatchNorm(4, rngs=rngs, dtype=F64, param_dtype=F64)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.norm(self.dense(x)))


@pytest.mark.long_eager
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types")  # nnx.BatchNorm keeps float32 stats
def test_flax_grad_on_a_stateful_model_equals_nnx_grad(jit):
    model, tagged = Stateful(nnx.Rngs(0)), jt.tag_modules(Stateful(nnx.Rngs(0)), ["dense", "norm"])

    def ours(m, x):
        return jaxtrace.flax.value_and_grad(mse, has_aux=False)(m, x)

    def theirs(m, x):
        return nnx.value_and_grad(mse)(m, x)

    ours, theirs = (nnx.jit(ours), nnx.jit(theirs)) if jit else (ours, theirs)
    for _ in range(2):  # the second call sees the first one's RNG count and statistics
        value, (grads, tag_grads) = ours(tagged, X)
        expected_value, expected = theirs(model, X)
        assert_close(value, expected_value)
        assert_close(grads, expected)
        assert_close(_plain(nnx.state(tagged)), _plain(nnx.state(model)))
    assert tag_grads["dense"].shape == tag_grads["norm"].shape == (5, 4)
    grad_and_aux = jaxtrace.flax.grad(lambda m, x: (mse(m, x), 7), has_aux=True)(tagged, X)
    assert grad_and_aux[1] == 7 and sorted(grad_and_aux[0][1]) == ["dense", "norm"]
    with pytest.raises(TypeError, match="take an nnx.Module"):
        jaxtrace.flax.grad(mse)({"w": X}, X)


def _nnx_terms(out, h1):
    """A main loss and an auxiliary loss read from an intermediate (l1's output), as the loss-paths guide."""
    return {"main": jnp.sum(jnp.sin(out) ** 2), "aux": 0.1 * jnp.mean(h1**2)}


@pytest.mark.long_eager
@pytest.mark.parametrize("jit", [False, True])
def test_flax_jacrev_against_eps(jit):
    """jaxtrace.flax.jacrev: d term / d tag against jax.jacrev of the ``+ eps`` program, jac against nnx's state."""
    model = MLP(nnx.Rngs(0))
    tagged = jt.tag_modules(MLP(nnx.Rngs(0)), ["l1", "l2"])

    def losses(model, x):
        out, acts = jt.capture(model)(x)
        return _nnx_terms(out, acts["l1"])

    def by_hand(model, x, eps):
        h1 = model.l1(x) + eps["l1"]
        return _nnx_terms(model.l2(jnp.tanh(h1)) + eps["l2"], h1)

    eps0 = {"l1": jnp.zeros((5, 4), F64), "l2": jnp.zeros((5, 2), F64)}
    expected = jax.jacrev(lambda eps: by_hand(model, X, eps))(eps0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    expected_jac = jax.jacrev(lambda p: by_hand(nnx.merge(graphdef, p, rest), X, eps0))(params)

    full = jaxtrace.flax.jacrev(losses)
    table_fun = jaxtrace.flax.jacrev(losses, stats=("norm", "max_abs"))
    if jit:
        full, table_fun = nnx.jit(full), nnx.jit(table_fun)
    jac, tag_jacs = full(tagged, X)
    assert_close(tag_jacs, {name: {term: expected[term][name] for term in expected} for name in eps0})
    assert_close(jax.tree_util.tree_leaves(jac), jax.tree_util.tree_leaves(expected_jac))
    assert np.any(tag_jacs["l1"]["aux"]) and not np.any(tag_jacs["l2"]["aux"])
    _, table = table_fun(tagged, X)
    assert list(table) == ["l1", "l2"] and all(list(per_term) == ["main", "aux"] for per_term in table.values())
    for name in eps0:
        for term in expected:
            np.testing.assert_allclose(table[name][term]["norm"], np.linalg.norm(np.ravel(expected[term][name])), rtol=1e-12)
    assert jt.stats.format_paths(table).splitlines()[2].endswith("0 (none)")  # aux does not reach l2
    # param_stats=True: the parameters' table, named by their paths without the Variable's ".value".
    params_fun = jaxtrace.flax.jacrev(losses, stats="norm", param_stats=True)
    params_table, _ = (nnx.jit(params_fun) if jit else params_fun)(tagged, X)
    expected_params = {}
    for term in expected_jac:
        for path, leaf in jax.tree_util.tree_flatten_with_path(expected_jac[term])[0]:
            name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path if getattr(k, "name", None) != "value")
            expected_params.setdefault(name, {})[term] = np.linalg.norm(np.ravel(leaf))
    assert sorted(params_table) == sorted(expected_params) == ["l1.bias", "l1.kernel", "l2.bias", "l2.kernel"]
    for name, per_term in expected_params.items():
        assert list(params_table[name]) == ["main", "aux"]
        for term, norm in per_term.items():
            np.testing.assert_allclose(params_table[name][term]["norm"], norm, rtol=1e-12)
    lines = jt.stats.format_paths(params_table, header="parameter").splitlines()
    assert lines[0].split() == ["parameter", "main", "aux"]
    assert [line.split()[0] for line in lines if line.endswith("0 (none)")] == ["l2.bias", "l2.kernel"]  # aux reaches l1 only
    with pytest.raises(TypeError, match=r"^jaxtrace\.flax\.jacrev: param_stats=True .* stats= is None\. Pass stats=\"norm\""):
        jaxtrace.flax.jacrev(losses, param_stats=True)


@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types")  # nnx.BatchNorm keeps float32 stats
def test_flax_jacrev_writes_state_back_and_has_aux():
    model, tagged = Stateful(nnx.Rngs(0)), jt.tag_modules(Stateful(nnx.Rngs(0)), ["dense", "norm"])
    (_, tag_jacs), aux = jaxtrace.flax.jacrev(lambda m, x: ({"a": mse(m, x)}, 3), has_aux=True)(tagged, X)
    nnx.grad(mse)(model, X)  # the same call through nnx: the same RNG count and batch statistics after it
    assert aux == 3 and tag_jacs["dense"]["a"].shape == (5, 4)
    assert_close(_plain(nnx.state(tagged)), _plain(nnx.state(model)))
    with pytest.raises(TypeError, match="jaxtrace.flax.jacrev take an nnx.Module"):
        jaxtrace.flax.jacrev(mse)({"w": X}, X)


class TorchNet(nnx.Module):  # an nnx port of the torch module below, with torch's names
    def __init__(self, rngs):
        self.emb = nnx.Embed(5, 4, rngs=rngs, param_dtype=F64)
        self.conv = nnx.Conv(4, 6, (3,), padding="VALID", rngs=rngs, param_dtype=F64)
        self.norm = nnx.LayerNorm(6, epsilon=1e-5, rngs=rngs, param_dtype=F64)
        self.bn = nnx.BatchNorm(6, use_running_average=True, epsilon=1e-5, rngs=rngs, param_dtype=F64)
        self.blocks = nnx.List([nnx.Linear(6, 6, rngs=rngs, param_dtype=F64), nnx.Linear(6, 2, rngs=rngs, param_dtype=F64)])

    def __call__(self, idx):
        h = self.bn(self.norm(self.conv(self.emb(idx))))  # (batch, length, channels)
        for block in self.blocks:
            h = jnp.tanh(block(h))
        return h


def test_torch_load_weights_into_nnx():
    torch = pytest.importorskip("torch")
    import jaxtrace.torch as jtt

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 4)
            self.conv = torch.nn.Conv1d(4, 6, 3)
            self.norm = torch.nn.LayerNorm(6)
            self.bn = torch.nn.BatchNorm1d(6)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 2)])

        def forward(self, idx):  # torch's conv and batch norm take (batch, channels, length)
            h = self.conv(self.emb(idx).transpose(1, 2)).transpose(1, 2)
            h = self.bn(self.norm(h).transpose(1, 2)).transpose(1, 2)
            for block in self.blocks:
                h = torch.tanh(block(h))
            return h

    torch.manual_seed(0)
    net = Net().double().eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_()
        net.bn.running_var.uniform_(0.5, 2.0)
        net.norm.weight.uniform_()
    idx = np.array([[0, 1, 2, 3, 4, 1], [4, 3, 2, 1, 0, 0]])
    empty = TorchNet(nnx.Rngs(0))
    model = jtt.load_weights(empty, net)
    assert model is not empty
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(idx))), net(torch.tensor(idx)).detach().numpy(), atol=1e-12)
    names = ["norm", "blocks.0", "blocks.1"]
    _, torch_grads = jtt.grad(net, torch.tensor(idx), loss=lambda y: (y**2).sum(), where=names)
    _, tag_grads = jt.grad(lambda m: jnp.sum(m(jnp.asarray(idx)) ** 2))(jt.tag_modules(model, names))
    for name in names:
        np.testing.assert_allclose(np.asarray(tag_grads[name]), torch_grads[name], atol=1e-12)
    with pytest.raises(ValueError, match="no module at 'emb'"):
        jtt.load_weights(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), net)


# --- Linen ------------------------------------------------------------------------


class LinenMLP(nn.Module):
    perturbed: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, param_dtype=F64, name="hidden")(x)
        if self.perturbed:
            h = self.perturb("p_hidden", h)
        y = nn.Dense(2, param_dtype=F64, name="out")(jnp.tanh(h))
        return self.perturb("p_out", y) if self.perturbed else y


def test_linen_mlp_against_perturb(maybe_jit):
    model, oracle = LinenMLP(), LinenMLP(perturbed=True)
    variables = oracle.init(jax.random.key(0), X)  # params and the perturbations, sized to X
    params = {"params": variables["params"]}

    def loss(params, x):
        return jnp.sum(jnp.sin(model.apply(params, x)) ** 2)

    with jaxtrace.flax.tag_modules(["hidden", "out"]):
        grads, tag_grads = maybe_jit(jt.grad(loss))(params, X)

    def oracle_loss(variables, x):
        return jnp.sum(jnp.sin(oracle.apply(variables, x)) ** 2)

    expected = jax.grad(oracle_loss)(variables, X)
    assert_close(tag_grads, {"hidden": expected["perturbations"]["p_hidden"], "out": expected["perturbations"]["p_out"]})
    assert_close(grads, {"params": expected["params"]})


class Cell(nn.Module):
    perturbed: bool = False

    @nn.compact
    def __call__(self, h, x):
        a = nn.Dense(3, param_dtype=F64, name="ih")(x)
        if self.perturbed:
            a = self.perturb("p_ih", a)
        h = jnp.tanh(a + nn.Dense(3, use_bias=False, param_dtype=F64, name="hh")(h))
        return h, h


class RNN(nn.Module):
    perturbed: bool = False

    @nn.compact
    def __call__(self, xs):
        # perturb needs the 'perturbations' entry in variable_axes (without it: a silent no-op)
        axes = {"perturbations": 0} if self.perturbed else {}
        scan = nn.scan(Cell, variable_broadcast="params", variable_axes=axes, split_rngs={"params": False},
                       in_axes=0, out_axes=0)
        h, hs = scan(self.perturbed, name="cell")(jnp.zeros(xs.shape[1:-1] + (3,), F64), xs)
        return nn.Dense(1, param_dtype=F64)(h) + jnp.sum(hs)


def test_linen_scan_rnn_per_step_against_perturb(maybe_jit):
    xs = jnp.sin(jnp.arange(12, dtype=F64)).reshape(6, 2)  # 6 steps
    model, oracle = RNN(), RNN(perturbed=True)
    variables = oracle.init(jax.random.key(0), xs)

    def loss(params, xs):
        return jnp.sum(model.apply(params, xs) ** 2)

    with jaxtrace.flax.tag_modules():
        _, tag_grads = maybe_jit(jt.grad(loss))({"params": variables["params"]}, xs)
    expected = jax.grad(lambda v: jnp.sum(oracle.apply(v, xs) ** 2))(variables)
    assert tag_grads["cell/ih"].shape == (6, 3)  # per step
    assert_close(tag_grads["cell/ih"], expected["perturbations"]["cell"]["p_ih"])
    assert sorted(tag_grads) == ["", "Dense_0", "cell", "cell/hh", "cell/ih"]
    assert tag_grads["cell"][0].shape == tag_grads["cell"][1].shape == (6, 3)  # (carry, y) per step

    # a silent no-op: perturb in nn.scan without the 'perturbations' variable_axes entry
    class Forgot(RNN):
        @nn.compact
        def __call__(self, xs):
            scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False}, in_axes=0, out_axes=0)
            return jnp.sum(scan(True, name="cell")(jnp.zeros(3, F64), xs)[1])

    assert "perturbations" not in Forgot().init(jax.random.key(0), xs)


class Scale(nn.Module):
    perturbed: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3, param_dtype=F64, name="dense")(x)
        return self.perturb("p_dense", h) if self.perturbed else h


def test_linen_vmap_remat_jit_per_example_against_perturb(maybe_jit):
    def make(perturbed):
        axes = {"params": None, "perturbations": 0} if perturbed else {"params": None}
        inner = nn.remat(nn.jit(Scale))
        return nn.vmap(inner, variable_axes=axes, split_rngs={"params": False}, in_axes=0, out_axes=0)

    class Model(nn.Module):
        perturbed: bool = False

        @nn.compact
        def __call__(self, x):
            return make(self.perturbed)(self.perturbed, name="per_example")(x)

    oracle = Model(perturbed=True)
    variables = oracle.init(jax.random.key(0), X)
    params = {"params": variables["params"]}

    def loss(params, x):
        return jnp.sum(jnp.sin(Model().apply(params, x)) ** 2)

    with jaxtrace.flax.tag_modules(["per_example/dense"]):
        _, tag_grads = maybe_jit(jt.grad(loss))(params, X)
    expected = jax.grad(lambda v: jnp.sum(jnp.sin(oracle.apply(v, X)) ** 2))(variables)
    assert_close(tag_grads["per_example/dense"], expected["perturbations"]["per_example"]["p_dense"])


def test_linen_batch_size_free_and_shared_module():
    # perturb's variables are shaped by the init batch; the tags follow whatever batch comes
    params = LinenMLP().init(jax.random.key(0), X)
    with jaxtrace.flax.tag_modules("hidden", inputs=True):
        for n in (1, 7):
            _, tag_grads = jt.grad(lambda p, x: jnp.sum(LinenMLP().apply(p, x)))(params, jnp.ones((n, 3), F64))
            assert tag_grads["hidden"].shape == (n, 4) and tag_grads["hidden:in"].shape == (n, 3)

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = nn.Dense(3, param_dtype=F64)
            return d(jnp.tanh(d(x)))

    p = Twice().init(jax.random.key(0), X)
    tags = jaxtrace.flax.tag_modules(["Dense_0"])
    with tags, tags:  # re-entered: still one tag per call
        _, tag_grads = jt.grad(lambda p: jnp.sum(Twice().apply(p, X) ** 2))(p)
    assert tag_grads["Dense_0"].shape == (2, 5, 3)  # two calls, in call order


def test_linen_errors():
    params = LinenMLP().init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"no module at 'nope' was called.*'hidden'"):
        with jaxtrace.flax.tag_modules(["nope"]):
            LinenMLP().apply(params, X)
    applied = jax.jit(LinenMLP().apply)
    applied(params, X)  # traced before the block: its trace has no tags
    with pytest.raises(ValueError, match="no Linen module was called"):
        with jaxtrace.flax.tag_modules():
            applied(params, X)
    with pytest.raises(TypeError, match="not a model"):
        jaxtrace.flax.tag_modules(LinenMLP())
    with pytest.raises(TypeError, match="Linen module"):
        jt.tag_modules(LinenMLP())


@pytest.mark.parametrize("module", ["jaxtrace.flax", "jaxtrace.flax._linen", "jaxtrace.flax._nnx_grad", "jaxtrace.flax._nnx"])
def test_flax_module_docstring_examples(module):
    assert doctest.testmod(sys.modules[module], optionflags=doctest.ELLIPSIS).failed == 0


def test_flax_outputs_keep_structure():
    class Pair(nn.Module):
        @nn.compact
        def __call__(self, x):
            return {"y": nn.Dense(2, param_dtype=F64)(x), "n": jnp.arange(3)}

    p = Pair().init(jax.random.key(0), X)
    with jaxtrace.flax.tag_modules([""]):
        _, tag_grads = jt.grad(lambda p: jnp.sum(Pair().apply(p, X)["y"]))(p)
    np.testing.assert_array_equal(tag_grads[""]["y"], np.ones((5, 2)))


def test_where_of_the_wrong_type_is_one_sentence_for_every_framework():
    """Issue 23: jt.tag_modules(model, 3) said "'int' object is not iterable"; each framework now names
    where= and what it takes, in one wording after the name of the function called."""
    import equinox as eqx

    calls = {
        "equinox": ("jaxtrace.tag_modules", lambda w: jt.tag_modules(eqx.nn.Linear(2, 2, key=jax.random.key(0)), w)),
        "nnx": ("jaxtrace.tag_modules", lambda w: jt.tag_modules(MLP(nnx.Rngs(0)), w)),
        "linen": ("jaxtrace.flax.tag_modules", lambda w: jaxtrace.flax.tag_modules(w)),
    }
    try:
        import torch

        import jaxtrace.torch as jtt

        net = torch.nn.Linear(2, 1)
        calls["torch"] = ("jaxtrace.torch.grad", lambda w: jtt.grad(net, torch.ones(2), loss=lambda y: y.sum(), where=w))
    except ImportError:
        pass
    for bad, got in [(3, "got 3 of type int. For one module pass its path"), (["l1", 3], "got 3 of type int in the sequence")]:
        tails = set()
        for framework, (api, call) in calls.items():
            with pytest.raises(TypeError) as info:
                call(bad)
            message = str(info.value)
            assert message.startswith(f"{api}: where= must be None (every module), a path, a sequence of paths, "), (framework, message)
            assert got in message, (framework, message)
            tails.add(message.removeprefix(api))
        assert len(tails) == 1, tails
