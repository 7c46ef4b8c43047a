"""Differentially private SGD (DP-SGD) with optax: per-example clipping and Gaussian noise.

Run:  python examples/dp_sgd.py [--quick] [--out DIR]

An unmodified ``eqx.nn.MLP`` learns to tell three interleaved spirals apart (the data are
generated, nothing is downloaded). Each step of DP-SGD clips every example's gradient to
norm ``C`` and adds Gaussian noise of standard deviation ``sigma * C`` to their sum.
``jaxtrace.clipped_grad`` gives that clipped sum without forming a gradient per example:
one forward pass and one backward pass give each layer's input and output gradient, and
from them the per-example norms and the clipped sum (each example's part of the ordinary
weight gradient scaled by its clipping factor). What makes that exact is proven from the
traced program, not assumed: each layer's output positions reach one example's loss, and
each layer multiplies the parameter itself; a loss where examples interact (a batch mean of
activations, BatchNorm in training mode, an in-batch contrastive term) is refused with a
``jt.TagError`` naming the operation and its line, since per-example clipping bounds nothing
there. ``--out`` is accepted
for symmetry with the other examples; nothing is written. The loss goes down, and the
printed fraction of clipped examples shows the clipping at work.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxtrace as jt


def spirals(key, n, classes=3, noise=0.2):
    k1, k2, k3 = jax.random.split(key, 3)
    label = jax.random.randint(k1, (n,), 0, classes)
    r = jax.random.uniform(k2, (n,), minval=0.15, maxval=1.0)
    angle = 6.0 * r + 2 * jnp.pi * label / classes
    x = jnp.stack([r * jnp.cos(angle), r * jnp.sin(angle)], axis=-1) * 3.0
    return x + noise * jax.random.normal(k3, x.shape) * r[:, None], label


def losses(model, x, y):
    """One cross-entropy per example, shape (batch,): what DP-SGD clips."""
    logp = jax.nn.log_softmax(jax.vmap(model)(x))
    return -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (CI)")
    parser.add_argument("--out", default=None, help="unused (nothing is written)")
    parser.add_argument("--clip", type=float, default=1.0, help="C, the per-example norm bound")
    parser.add_argument("--noise", type=float, default=0.5, help="sigma, the noise multiplier")
    args = parser.parse_args()
    steps, batch = (150, 64) if args.quick else (1500, 128)

    key = jax.random.key(0)
    model = eqx.nn.MLP(2, 3, 64, 2, activation=jax.nn.tanh, key=key)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    x_test, y_test = spirals(jax.random.key(1), 1024)

    @eqx.filter_jit
    def step(model, opt_state, x, y, key, clip):
        losses_, grads = jt.clipped_grad(losses, clip)(model, x, y)  # sum_i min(1, C/|g_i|) g_i
        leaves, treedef = jax.tree.flatten(grads)
        keys = jax.random.split(key, len(leaves))
        noisy = [(g + args.noise * clip * jax.random.normal(k, g.shape, g.dtype)) / x.shape[0] for g, k in zip(leaves, keys)]
        updates, opt_state = optimizer.update(jax.tree.unflatten(treedef, noisy), opt_state)
        return eqx.apply_updates(model, updates), opt_state, jnp.mean(losses_)

    @eqx.filter_jit
    def evaluate(model):
        _, sq = jt.per_example_norms(losses, total=True)(model, x_test[:256], y_test[:256])
        clipped = jnp.mean(jnp.sqrt(sq) > args.clip)
        accuracy = jnp.mean(jnp.argmax(jax.vmap(model)(x_test), -1) == y_test)
        return jnp.mean(losses(model, x_test, y_test)), accuracy, clipped

    start = time.perf_counter()
    first, _, _ = evaluate(model)
    for i in range(steps + 1):
        if i % (steps // 5) == 0:
            loss, acc, clipped = evaluate(model)
            print(f"step {i:5d}  test loss {loss:.3f}  accuracy {acc:.2f}  clipped {clipped:.0%}")
        if i == steps:
            break
        key, k_data, k_noise = jax.random.split(key, 3)
        x, y = spirals(k_data, batch)
        model, opt_state, _ = step(model, opt_state, x, y, k_noise, args.clip)
    last, _, _ = evaluate(model)
    print(f"test loss {first:.3f} -> {last:.3f} in {time.perf_counter() - start:.1f} s")
    assert last < 0.8 * first, "DP-SGD did not train"


if __name__ == "__main__":
    main()
