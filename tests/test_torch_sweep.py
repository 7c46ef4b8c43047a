"""A torch-side oracle sweep (issue 34): a zoo of models, every module against zero-perturbation hooks.

Hugging Face models built from tiny configs (random init, no download: GPT-2, BERT, Llama, T5,
ViT, ALBERT) and a hand-written model with the seams of issue 34 in one forward pass (an
aliasing output changed in place later, an in-place module, a ``torch.no_grad()`` part, a
keyword-only call made twice, a user's forward hook registered before jaxtrace's that the
model reads), another with outputs of every shape (and user hooks that replace values), and
activation checkpointing (BERT and Llama in training mode; ``torch.utils.checkpoint``). For
each, in float64, with ``where=None, inputs=True``:

- every module's output (and input) gradient equals the oracle's (``torch_common.oracle``: a
  forward hook registered with ``prepend=True`` returning ``output + eps``), on two calls, with
  and without ``output_attentions`` / ``output_hidden_states`` (without: after a call with them,
  so Hugging Face's output recorders are installed and stay);
- the parameter gradients and the loss equal those of a run with no hooks;
- the model's forward output is bit for bit what it is without jaxtrace.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxtrace.torch as jtt  # noqa: E402
from torch_common import assert_matches, assert_params, leaves, nn, oracle, plain  # noqa: E402

jax.config.update("jax_enable_x64", True)
torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

RECORD = dict(output_attentions=True, output_hidden_states=True)


# --- the zoo: each maker returns (model, args, kwargs, in_place) --------------------------


def _ids(vocab, shape=(2, 5), seed=0):
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=8, n_layer=1, n_head=2, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double().eval(), (_ids(40),), dict(use_cache=False), ()


def bert():
    cfg = transformers.BertConfig(
        vocab_size=29, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, attn_implementation="eager",
    )
    torch.manual_seed(1)
    ids = _ids(29, seed=1)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # padding: the extended attention mask is a float constant made in forward
    return transformers.BertModel(cfg).double().eval(), (ids,), dict(attention_mask=mask), ()


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
    )
    torch.manual_seed(2)
    # The rotary embedding's forward runs under torch.no_grad(): its cos / sin are constants that
    # jaxtrace differentiates through fresh leaves, as the oracle's + eps does.
    return transformers.LlamaForCausalLM(cfg).double().eval(), (_ids(40, seed=2),), dict(use_cache=False), ()


def t5():
    cfg = transformers.T5Config(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
    )
    torch.manual_seed(3)
    model = transformers.T5ForConditionalGeneration(cfg).double().eval()
    # the shared embedding is called by the encoder and the decoder: two calls, stacked
    return model, (_ids(32, seed=3),), dict(decoder_input_ids=_ids(32, (2, 4), seed=4), use_cache=False), ()


def vit():
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, attn_implementation="eager",
    )
    torch.manual_seed(5)
    pixels = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    return transformers.ViTModel(cfg).double().eval(), (pixels,), {}, ()


def albert():
    cfg = transformers.AlbertConfig(
        vocab_size=30, embedding_size=8, hidden_size=16, num_hidden_layers=2, num_hidden_groups=1,
        num_attention_heads=2, intermediate_size=16, max_position_embeddings=16, attn_implementation="eager",
    )
    torch.manual_seed(6)
    # one shared layer group called twice: its modules' gradients are stacked per call
    return transformers.AlbertModel(cfg).double().eval(), (_ids(30, seed=6),), {}, ()


def checkpointed(make):
    """The model in training mode with activation checkpointing (dropout off, so runs agree): the
    backward pass runs each layer's forward again, and those runs are not calls."""

    def maker():
        model, args, kwargs, in_place = make()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        model.config.attention_probs_dropout_prob = model.config.attention_dropout = 0.0
        model.train()
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable({"use_reentrant": False})
            assert model.is_activation_checkpointing
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert model.is_gradient_checkpointing
        return model, args, kwargs, in_place

    return maker


class Block(nn.Module):
    """Called with keywords only; an in-place ReLU, then a Dropout (eval) that returns its input."""

    def __init__(self):
        super().__init__()
        self.fc, self.act, self.drop, self.norm = nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Dropout(0.2), nn.LayerNorm(8)

    def forward(self, hidden_states=None, scale=None):
        h = self.drop(self.act(self.fc(hidden_states)))
        return self.norm(h * scale + hidden_states)


class HandWritten(nn.Module):
    """Every seam of issue 34 in one forward pass; ``output_attentions`` etc. are accepted and ignored."""

    def __init__(self):
        super().__init__()
        self.emb, self.block, self.shortcut = nn.Linear(4, 8), Block(), nn.Identity()
        self.teacher = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.flat, self.head = nn.Flatten(), nn.Linear(8, 3)
        self.stored = []
        self.head.register_forward_hook(lambda m, a, out: self.stored.append(out))  # before jaxtrace's

    def forward(self, x, output_attentions=False, output_hidden_states=False):
        h = torch.tanh(self.emb(x))
        b = self.block(hidden_states=h, scale=torch.full((x.shape[0], 1), 1.5, dtype=x.dtype))
        b = self.block(hidden_states=b, scale=torch.tanh(h[:, :1]))  # the same module again, keywords only
        out = self.shortcut(b)
        out += self.emb(x)  # in place on the Identity's output, which is b too
        with torch.no_grad():
            target = self.teacher(x)
        y = self.head(self.flat(out.unsqueeze(1)))  # Flatten returns a view
        return {"loss_part": ((y - target[:, :3]) ** 2).sum() + (self.stored.pop() ** 3).sum(), "b": b, "y": y}


def hand_written():
    torch.manual_seed(7)
    x = torch.randn(3, 4, dtype=torch.float64)
    return HandWritten().double().eval(), (x,), {}, {"shortcut", "shortcut:in"}


class Pair(nn.Module):
    def forward(self, x):
        y = x * 2
        return y, y  # the same tensor twice


class Slice(nn.Module):
    def forward(self, x):
        return x[:, :2]  # a view of the input


class Weight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self):
        return self.w  # a parameter itself, no inputs


class Detach(nn.Module):
    def forward(self, x):
        return x.detach() * 3  # its input gets zeros


class Outputs(nn.Module):
    """Outputs of every shape: tuples, one tensor twice, a view, a parameter, a detached value, the
    attention weights of nn.MultiheadAttention, an LSTM's nest, a GRUCell stepped in a loop; and a
    user's forward hook that replaces ``fc``'s output and a pre-hook that replaces ``lin``'s input."""

    def __init__(self):
        super().__init__()
        self.fc, self.pair, self.slice, self.weight, self.detach = nn.Linear(3, 3), Pair(), Slice(), Weight(), Detach()
        self.mha, self.lstm, self.cell = nn.MultiheadAttention(3, 1, batch_first=True), nn.LSTM(3, 4, batch_first=True), nn.GRUCell(3, 3)
        self.lin = nn.Linear(3, 2)
        self.fc.register_forward_hook(lambda m, a, out: out * 2)
        self.lin.register_forward_pre_hook(lambda m, a: (torch.sin(a[0]),))

    def forward(self, x, output_attentions=False, output_hidden_states=False):
        h = self.fc(x)
        a, b = self.pair(h)
        w = self.weight()
        att, weights = self.mha(h[None], h[None], h[None])
        o, (hn, cn) = self.lstm(h[None])
        state = torch.zeros(1, 3, dtype=x.dtype)
        for t in range(3):
            state = self.cell(h[t : t + 1], state)
        total = (self.slice(a).sum() * b).sum() + (w * h).sum() + (self.detach(h) * h).sum() + (att**2).sum()
        return total + (weights**2).sum() + o.sum() + (hn * cn).sum() + state.sum() + self.lin(h).pow(2).sum()


def outputs():
    torch.manual_seed(9)
    return Outputs().double(), (torch.randn(4, 3, dtype=torch.float64),), {}, ()


ZOO = {
    "gpt2": gpt2, "bert": bert, "llama": llama, "t5": t5, "vit": vit, "albert": albert, "hand_written": hand_written,
    "outputs": outputs, "bert_checkpointed": checkpointed(bert), "llama_checkpointed": checkpointed(llama),
}
# Main outputs / first inputs whose oracle gradient is zero by construction: the part run under
# torch.no_grad(), and the rotary embedding's hidden_states (read for its dtype only).
ZERO_OK = {
    "hand_written": {"teacher", "teacher:in", "teacher.0", "teacher.0:in", "teacher.1", "teacher.1:in"},
    "llama": {"model.rotary_emb:in"},
    "outputs": {"detach:in"},
    "llama_checkpointed": {"model.rotary_emb:in"},
}


def loss(out):
    """Reads every floating tensor of the output, each with its own weights (and squared)."""
    total = 0.0
    for leaf in leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            w = torch.sin(torch.arange(leaf.numel(), dtype=leaf.dtype) + 1.0).reshape(leaf.shape)
            total = total + (leaf * w).sum() + (leaf**2).mean()
    return total


def _assert_bitwise(got, want):
    a, b = leaves(got), leaves(want)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.detach(), y.detach()), "the forward output changed under jaxtrace"
        else:
            assert type(x) is type(y)


@pytest.mark.parametrize("record", [False, True], ids=["plain", "record"])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_module_against_the_oracle(name, record):
    model, args, kwargs, in_place = ZOO[name]()
    with torch.no_grad():
        model(*args, **kwargs, **RECORD)  # Hugging Face installs its output recorders now; they stay
    kwargs = {**kwargs, **RECORD} if record else kwargs
    want = model(*args, **kwargs)  # no hooks of jaxtrace's
    runs = []
    for _ in range(2):
        seen = []
        value, grads = jtt.value_and_grad(
            model, *args, loss=lambda out: loss(seen.append(out) or out), kwargs=kwargs, inputs=True
        )
        _assert_bitwise(seen[0], want)
        runs.append((value, grads))
    plain_value, plain_params = plain(model, args, loss, kwargs)
    value, expected = oracle(model, args, loss, list(runs[0][1][1]), kwargs=kwargs, in_place=in_place)
    assert value.item() == plain_value.item()
    assert len(expected) >= 10
    for got, (params, modules) in runs:
        assert got == plain_value.item()  # bit for bit
        assert set(modules) == set(expected)
        assert_params(params, plain_params)
        zeros = assert_matches(modules, expected, zero_ok=set(expected))
        # A module's main output (leaf 0) always reaches the loss here; the others (attention
        # maps, T5's position bias) may be dropped by the model.
        main = {p for p, j in zeros if j == 0}
        assert main <= ZERO_OK.get(name, set()), sorted(main)
        assert len(zeros) <= len(expected) // 3, sorted(zeros)
    for path in expected:  # the two calls agree bit for bit
        for a, b in zip(leaves(runs[0][1][1][path]), leaves(runs[1][1][1][path])):
            assert (a is None and b is None) or np.array_equal(a, b), path


# --- activation checkpointing -------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=self.reentrant)
        return (self.head(h) ** 2).sum()


def test_checkpoint_recompute_is_not_a_call():
    """torch.utils.checkpoint runs ``body`` again in backward; jaxtrace reports the one call
    (before the fix: a second, all-zero call stacked on it, and its values twice)."""
    torch.manual_seed(8)
    model = Checkpointed().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    plain_value, plain_params = plain(model, (x,), lambda v: v)
    value, (params, modules), values = jtt.value_and_grad(model, x, inputs=True, with_values=True)
    assert value == plain_value.item()
    assert_params(params, plain_params)
    assert modules["body.0"].shape == values["body.0"].shape == (5, 4) and modules["body:in"].shape == (5, 3)
    np.testing.assert_array_equal(values["body.1"], model.body[:2](x).detach().numpy())
    _, expected = oracle(model, (x,), lambda v: v, list(modules))
    assert_matches(modules, expected)


@pytest.mark.parametrize("input_grad", [False, True])
def test_reentrant_checkpoint_is_a_clear_error(input_grad):
    """The reentrant variant hides ``body``'s parameters from ``torch.autograd.grad``: torch raises
    when the input needs no gradient, and (before the fix) the gradients were silently zeros when it
    does (``.backward()`` gives them)."""
    model = Checkpointed(reentrant=True).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=input_grad)
    with pytest.raises(ValueError, match=r"torch.utils.checkpoint with use_reentrant=True.*Pass use_reentrant=False"):
        jtt.grad(model, x)
