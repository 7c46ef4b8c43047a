"""Activation and gradient norms per layer of a scanned stack, over training: plot.layer_flow.

Run:  python examples/layer_flow.py [--quick] [--out DIR]

A classifier of three interleaved spirals (the data of ``train_step.py``) whose hidden layers are
one stacked ``eqx.nn.Linear`` run by ``lax.scan`` (12 tanh layers of width 32, their weights in
one array), with one ``jt.tag`` in the scan body: one tag, one entry per layer. The jitted optax
step takes ``jt.filter_value_and_grad(..., stats=("norm", "rms"), with_values=True)``: besides
the gradients, the norm and rms of each layer's output and of the gradient there, one per
scanned layer, reduced inside the step. Every few steps they go into a
``jaxtrace.stats.History``; at the end ``jaxtrace.plot.layer_flow`` draws both, one line per
layer (dark: the first layer, light: the last). At initialisation the activations shrink layer
after layer and the gradient is smallest at the first layer; training reshapes both.
Writes ``layer_flow.png``.
"""

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxtrace as jt
from jaxtrace import plot
from train_step import spirals


class ScannedStack(eqx.Module):
    embed: eqx.nn.Linear
    layers: eqx.nn.Linear  # depth layers, their weights stacked on a leading axis
    head: eqx.nn.Linear

    def __init__(self, width, depth, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(2, width, key=k1)
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(jax.random.split(k2, depth))
        self.head = eqx.nn.Linear(width, 3, key=k3)

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, layer):
            return jt.tag(jnp.tanh(eqx.combine(layer, static)(h)), "layer"), None  # one tag, one entry per layer

        h, _ = jax.lax.scan(body, jnp.tanh(self.embed(x)), dynamic)
        return self.head(h)


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y).mean()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (CI)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "out")
    args = parser.parse_args(argv)
    steps, every, batch = (100, 10, 128) if args.quick else (1500, 25, 256)

    x_all, y_all = spirals(jax.random.PRNGKey(0), 4096)
    model = ScannedStack(32, 12, jax.random.PRNGKey(1))
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    grad_fn = jt.filter_value_and_grad(loss_fn, stats=("norm", "rms"), with_values=True)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, (grads, tag_stats), value_stats = grad_fn(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss, tag_stats, value_stats

    history = jt.stats.History()
    for i in range(steps + 1):
        idx = jax.random.randint(jax.random.PRNGKey(100 + i), (batch,), 0, len(x_all))
        model, opt_state, loss, tag_stats, value_stats = step(model, opt_state, x_all[idx], y_all[idx])
        if i % every == 0:
            history.append(i, tag_stats, value_stats, loss=loss)
    print(f"{steps} steps: loss {float(history.scalar('loss')[0]):.3f} -> {float(history.scalar('loss')[-1]):.3f}; "
          f"{history['layer']['norm'].shape[1]} layers in one tag")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "layer_flow.png"
    plot.layer_flow(history, "norm", title="12 tanh layers in one lax.scan: norms per layer over training", path=path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
