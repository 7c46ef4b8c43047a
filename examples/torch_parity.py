"""Check a JAX port of a PyTorch model layer by layer: gradients at every module, side by side.

The PyTorch model is a small CNN (Conv2d, in-place ReLU, pooling, a Linear head);
its equinox port tags each layer's output (and an input) with the name of the
matching torch module, as ``named_modules()`` spells it. ``jaxtrace.torch``
copies the weights across and takes the torch gradients with hooks;
``jaxtrace.compare`` prints one row per layer.

    python examples/torch_parity.py            # float64 and float32
    python examples/torch_parity.py --quick    # float64 only, smaller input
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import jaxtrace as jt
import jaxtrace.torch as jtt  # before torch: without torch, this says how to install it

import torch  # noqa: E402, I001

jax.config.update("jax_enable_x64", True)

# --- the PyTorch model ------------------------------------------------------------


class TorchCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = torch.nn.ReLU(inplace=True)  # register_full_backward_hook breaks here; tensor hooks don't
        self.pool1 = torch.nn.MaxPool2d(2)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.act2 = torch.nn.ReLU(inplace=True)
        self.pool2 = torch.nn.AdaptiveAvgPool2d(1)
        self.head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))

    def forward(self, x):
        x = self.pool1(self.act1(self.conv1(x)))
        x = self.pool2(self.act2(self.conv2(x)))
        return self.head(x.flatten(1))


# --- its equinox port, tagged with the torch paths ------------------------------------


class JaxCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Sequential

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=k2)
        self.head = eqx.nn.Sequential(
            [eqx.nn.Linear(8, 16, key=k3), eqx.nn.Lambda(jnp.tanh), eqx.nn.Linear(16, 10, key=k4)]
        )

    def __call__(self, x):  # one image, (C, H, W); vmap adds the batch axis in front, as in NCHW
        x = jt.tag(self.conv1(jt.tag(x, "conv1:in")), "conv1")
        x = jt.tag(jax.nn.relu(x), "act1")
        x = jt.tag(eqx.nn.MaxPool2d(2, stride=2)(x), "pool1")
        x = jt.tag(self.conv2(x), "conv2")
        x = jt.tag(jax.nn.relu(x), "act2")
        x = jt.tag(jnp.mean(x, axis=(1, 2), keepdims=True), "pool2")
        h = x.reshape(-1)
        for i, layer in enumerate(self.head.layers):
            h = jt.tag(layer(h), f"head.{i}")
        return jt.tag(h, "head")


def cross_entropy_jax(logits, labels):
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0])


def run(dtype: torch.dtype, batch: int, size: int, rtol: float) -> bool:
    torch.manual_seed(0)
    torch_model = TorchCNN().to(dtype)
    images = torch.randn(batch, 3, size, size, dtype=dtype)
    labels = torch.randint(0, 10, (batch,))

    # The same weights on the JAX side, cast to the same precision.
    jax_model = jtt.load_weights(JaxCNN(jax.random.key(0)), torch_model)

    def loss(model, images, labels):
        return cross_entropy_jax(jax.vmap(model)(images), labels)

    params, static = eqx.partition(jax_model, eqx.is_inexact_array)
    grad_fn = jax.jit(jt.grad(lambda p, *a: loss(eqx.combine(p, static), *a)))
    t0 = time.perf_counter()
    param_grads, tag_grads = grad_fn(params, jnp.asarray(images.numpy()), jnp.asarray(labels.numpy()))

    # The torch side: hooks on the modules whose names the JAX side tagged.
    t_params, t_modules = jtt.grad(
        torch_model,
        images,
        loss=lambda logits: torch.nn.functional.cross_entropy(logits, labels),
        where=list(tag_grads),
    )
    seconds = time.perf_counter() - t0

    name = str(dtype).replace("torch.", "")
    print(f"\n== {name}: gradients at module outputs (batch {batch}, {size}x{size} images) ==")
    modules = jt.compare(tag_grads, t_modules, rtol=rtol, atol=0.0, labels=("jax", "torch"))
    print(modules)
    print(f"\n== {name}: parameter gradients ==")
    parameters = jt.compare(
        jtt.named_grads(param_grads, torch_model), t_params, rtol=rtol, atol=0.0, labels=("jax", "torch")
    )
    print(parameters)
    print(f"({seconds:.1f} s for both sides, including compilation)")
    return modules.ok and parameters.ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="float64 only, a smaller input")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch, size = (2, 8) if args.quick else (4, 16)
    ok = run(torch.float64, batch, size, rtol=1e-10)
    if not args.quick:
        ok = run(torch.float32, 4, 16, rtol=1e-5) and ok  # float32 sums in a different order
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
