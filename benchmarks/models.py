"""The benchmark models, each written once with a ``tag(value, name)`` argument.

Every JAX model is ``loss(params, x, tag, eps=None) -> scalar``. The variants
(``drivers.py``) differ only in ``tag``: ``identity`` (plain, an untagged
program), ``jaxtrace.tag``, ``logged`` (JAX 0.12's backward logs: an identity
``custom_vjp`` registered with ``defvjp_with_logs``), or ``HookStore.tag`` (the
hook-style JAX alternative: an identity ``custom_vjp`` whose backward pass
sends the cotangent to the host with ``io_callback``). With ``eps``
(``{name: zeros}``) each tag becomes an explicit ``value + eps[name]`` (per
step inside a scan): the program one would write by hand to get these
gradients with plain ``jax.value_and_grad``. ``torch_loss`` is the same model
in PyTorch, with the same weights, where tags become ``Tensor.register_hook``.
The scaling and compile-sweep chains are models of the same form.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback


def identity(value, name):
    return value


# --- the hook-style alternative ------------------------------------------------


class HookStore:
    """Host-side store for the hook-style alternative: name -> list of arrays."""

    def __init__(self):
        self.values: dict[str, list] = {}

    def clear(self):
        self.values = {}

    def tag(self, value, name):
        return jax.tree_util.tree_map(_hook_identity(self, name), value)


@functools.lru_cache(maxsize=None)
def _hook_identity(store: HookStore, name: str):
    def receive(ct):
        store.values.setdefault(name, []).append(np.array(ct))  # copy: the buffer is XLA's

    @jax.custom_vjp
    def ident(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, ct):
        io_callback(receive, None, ct)
        return (ct,)

    ident.defvjp(fwd, bwd)
    return ident


# --- JAX 0.12's backward logs (the recipe) -------------------------------------

HAS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")
NO_LOGS_NOTE = (f"the recipe needs jax.custom_vjp.defvjp_with_logs (JAX >= 0.12); JAX {jax.__version__} has none, "
                "so its column is skipped")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _logged(value, name):
    return value


def _logged_fwd(value, name):
    return value, None


def _logged_bwd(name, _, ct):
    return (ct,), {name: ct}


if HAS_LOGS:
    _logged.defvjp_with_logs(_logged_fwd, _logged_bwd)


def logged(value, name):
    """The recipe's tag: an identity whose backward pass logs its cotangent as ``name``
    (read with ``f_vjp.with_logs(ct)`` on what ``jax.vjp`` returns)."""
    return _logged(value, name)


# --- models ---------------------------------------------------------------------


@dataclasses.dataclass
class Model:
    name: str
    loss: Callable  # (params, x, tag, eps=None) -> scalar
    params: Any  # numpy float32 pytree
    x: np.ndarray
    one_tag: str  # the tag captured by the "one tag" variant
    describe: str
    torch_loss: Callable | None = None  # (torch params, torch x, hook(name) -> fn | None) -> scalar
    plain_params: Any = None  # the untagged program's params, where they differ (the large model)
    hook: bool = True  # the hook-style variant applies
    hand: bool = True  # the hand-written + eps variant exists
    check: bool = True  # compare every variant's gradients (off where the values are huge)


def _marker(tag, eps):
    return tag if eps is None else (lambda value, name: value + eps[name])


def _normal(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def mlp(width=512, batch=256, depth=8, seed=0) -> Model:
    rng = np.random.default_rng(seed)
    params = [_normal(rng, (width, width), 1 / np.sqrt(width)) for _ in range(depth)]
    x = _normal(rng, (batch, width), 1.0)

    def loss(params, x, tag, eps=None):
        tag = _marker(tag, eps)
        h = x
        for i, w in enumerate(params):
            h = tag(jnp.tanh(h @ w), f"layer{i}")
        return jnp.mean(h**2)

    def torch_loss(params, x, hook):
        import torch

        h = x
        for i, w in enumerate(params):
            h = torch.tanh(h @ w)
            if hook:
                h.register_hook(hook(f"layer{i}"))
        return torch.mean(h**2)

    return Model("mlp", loss, params, x, f"layer{depth // 2}",
                 f"{depth}-layer MLP, width {width}, batch {batch}, a tag per layer", torch_loss)


def rnn(width=256, steps=256, batch=32, seed=0) -> Model:
    rng = np.random.default_rng(seed)
    params = {
        "w": _normal(rng, (width, width), 1 / np.sqrt(width)),
        "u": _normal(rng, (width, width), 1 / np.sqrt(width)),
    }
    xs = _normal(rng, (steps, batch, width), 1.0)

    def loss(params, xs, tag, eps=None):
        def step(h, inputs):
            x, e = inputs
            h = jnp.tanh(h @ params["w"] + x @ params["u"])
            h = tag(h, "h") if e is None else h + e
            return h, None

        h0 = jnp.zeros((xs.shape[1], params["w"].shape[0]), xs.dtype)
        h, _ = lax.scan(step, h0, (xs, None if eps is None else eps["h"]))
        return jnp.mean(h**2)

    def torch_loss(params, xs, hook):
        import torch

        h = torch.zeros(xs.shape[1], params["w"].shape[0])
        for t in range(xs.shape[0]):
            h = torch.tanh(h @ params["w"] + xs[t] @ params["u"])
            if hook:
                h.register_hook(hook("h"))
        return torch.mean(h**2)

    return Model("rnn", loss, params, xs, "h",
                 f"tanh RNN (lax.scan), {steps} steps, width {width}, batch {batch}, a tag per step", torch_loss)


def _layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5)


def _torch_layer_norm(x):
    import torch

    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + 1e-5)


def attention(layers=4, seq=128, d=256, heads=4, batch=4, seed=0) -> Model:
    rng = np.random.default_rng(seed)
    s = 1 / np.sqrt(d)
    params = [
        {
            "qkv": _normal(rng, (d, 3 * d), s),
            "o": _normal(rng, (d, d), s),
            "up": _normal(rng, (d, 4 * d), s),
            "down": _normal(rng, (4 * d, d), 1 / np.sqrt(4 * d)),
        }
        for _ in range(layers)
    ]
    x = _normal(rng, (batch, seq, d), 1.0)
    dh = d // heads
    mask = np.tril(np.ones((seq, seq), bool))

    def loss(params, x, tag, eps=None):
        tag = _marker(tag, eps)
        b, t, _ = x.shape
        for i, p in enumerate(params):
            q, k, v = jnp.split(_layer_norm(x) @ p["qkv"], 3, axis=-1)
            q, k, v = (a.reshape(b, t, heads, dh).transpose(0, 2, 1, 3) for a in (q, k, v))
            logits = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh), -1e9)
            probs = tag(jax.nn.softmax(logits, axis=-1), f"probs{i}")
            per_head = tag(probs @ v, f"heads{i}")  # (batch, heads, seq, dh)
            x = x + per_head.transpose(0, 2, 1, 3).reshape(b, t, d) @ p["o"]
            x = x + jax.nn.gelu(_layer_norm(x) @ p["up"], approximate=True) @ p["down"]
            x = tag(x, f"resid{i}")
        return jnp.mean(x**2)

    def torch_loss(params, x, hook):
        import torch

        b, t, _ = x.shape
        tmask = torch.from_numpy(mask)
        for i, p in enumerate(params):
            q, k, v = torch.split(_torch_layer_norm(x) @ p["qkv"], d, dim=-1)
            q, k, v = (a.reshape(b, t, heads, dh).permute(0, 2, 1, 3) for a in (q, k, v))
            logits = torch.where(tmask, q @ k.transpose(-1, -2) / np.sqrt(dh), torch.tensor(-1e9))
            probs = torch.softmax(logits, dim=-1)
            per_head = probs @ v
            x = x + per_head.permute(0, 2, 1, 3).reshape(b, t, d) @ p["o"]
            x = x + torch.nn.functional.gelu(_torch_layer_norm(x) @ p["up"], approximate="tanh") @ p["down"]
            if hook:
                probs.register_hook(hook(f"probs{i}"))
                per_head.register_hook(hook(f"heads{i}"))
                x.register_hook(hook(f"resid{i}"))
        return torch.mean(x**2)

    return Model("attention", loss, params, x, f"probs{layers // 2}",
                 f"{layers}-layer attention, seq {seq}, d {d}, {heads} heads, batch {batch}; tags on "
                 "probabilities, per-head outputs, residual stream", torch_loss)


def cnn(batch=32, size=32, channels=(16, 32, 64), classes=10, seed=0) -> Model:
    rng = np.random.default_rng(seed)
    chans = (3, *channels)
    params = {
        "convs": [_normal(rng, (3, 3, cin, cout), 1 / np.sqrt(9 * cin)) for cin, cout in zip(chans, chans[1:])],
        "head": _normal(rng, (chans[-1], classes), 1 / np.sqrt(chans[-1])),
    }
    x = _normal(rng, (batch, size, size, 3), 1.0)

    def loss(params, x, tag, eps=None):
        tag = _marker(tag, eps)
        h = x
        for i, w in enumerate(params["convs"]):
            h = lax.conv_general_dilated(h, w, (1, 1) if i == 0 else (2, 2), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            h = tag(jax.nn.relu(h), f"conv{i}")
        logits = h.mean(axis=(1, 2)) @ params["head"]
        return -jnp.mean(jax.nn.log_softmax(logits)[:, 0])

    def torch_loss(params, x, hook):
        import torch
        import torch.nn.functional as F

        h = x.permute(0, 3, 1, 2)
        for i, w in enumerate(params["convs"]):
            h = F.relu(F.conv2d(h, w.permute(3, 2, 0, 1), stride=1 if i == 0 else 2, padding=1))
            if hook:
                h.register_hook(hook(f"conv{i}"))
        logits = h.mean(dim=(2, 3)) @ params["head"]
        return -torch.mean(torch.log_softmax(logits, -1)[:, 0])

    return Model("cnn", loss, params, x, f"conv{len(channels) // 2}",
                 f"CNN, {len(channels)} conv layers {channels}, {size}x{size}x3, batch {batch}, a tag per conv",
                 torch_loss)


def chain(n=500, shared=None, width=64, batch=8) -> Model:
    """The compile-sweep model (issue 17's chain): ``n`` layers ``tanh(h @ w)``, a tag on each;
    ``n`` weights, or ``shared`` weights used in turn."""
    k = shared or n
    params = [np.eye(width, dtype=np.float32) * 0.5 for _ in range(k)]
    x = np.ones((batch, width), np.float32)

    def loss(ws, h, tag, eps=None):
        tag = _marker(tag, eps)
        for i in range(n):
            h = tag(jnp.tanh(h @ ws[i % k]), f"l{i}")
        return jnp.sum(h)

    weights = f"{shared} shared weights" if shared else "a weight per layer"
    return Model(f"chain{n}" + (f"/{shared}" if shared else ""), loss, params, x, "l0",
                 f"chain of {n} tanh(h @ w) layers, {weights}, width {width}, batch {batch}, a tag per layer",
                 hook=False)


def sin_chain(n: int) -> Model:
    """The tag-scaling model: ``n`` ``sin``, a tag on each."""

    def loss(params, x, tag, eps=None):
        tag = _marker(tag, eps)
        for i in range(n):
            x = tag(lax.sin(x) * params, f"t{i}")
        return jnp.sum(x)

    return Model(f"sin{n}", loss, np.float32(1.0), np.ones(4, np.float32), "t0", f"chain of {n} sin, a tag each",
                 hook=False)


def looped(length: int, width=16) -> Model:
    """The scan-scaling model: a ``width``-wide tanh layer scanned ``length`` steps, a tag per step."""

    def loss(w, h, tag, eps=None):
        def step(h, e):
            h = jnp.tanh(h @ w)
            return (tag(h, "h") if e is None else h + e), None

        h, _ = lax.scan(step, h, None if eps is None else eps["h"], length=length)
        return jnp.sum(h)

    return Model(f"scan{length}", loss, np.eye(width, dtype=np.float32) * 0.5, np.ones((4, width), np.float32), "h",
                 f"tanh layer, width {width}, scanned {length} steps, a tag per step", hook=False)


def models(quick: bool) -> list[Model]:
    if quick:
        return [mlp(width=256, batch=64), rnn(width=64, steps=64, batch=16),
                attention(layers=2, seq=64, d=128, heads=4, batch=4), cnn(batch=8, size=16), chain(100, shared=4)]
    return [mlp(), rnn(), attention(), cnn(), chain(500, shared=4)]
