"""Gradient health in a jitted training step: per-layer statistics, logged as you train.

Run:  python examples/train_step.py [--quick] [--out DIR] [--framework {equinox,flax}]

A deep tanh MLP (an unmodified ``eqx.nn.MLP``) learns to tell three
interleaved spirals apart (the data are generated, nothing is downloaded).
``jaxtrace.tag_modules`` tags the output of each of its ``Linear`` layers
(``layers.0`` ... ``layers.6``, as PyTorch would name them). The jitted optax
step takes gradients with ``jaxtrace.filter_value_and_grad(..., stats=True)``
and returns, besides the new model, four numbers per layer computed inside the
step (L2 norm, mean and max |gradient|, fraction non-finite; one per step of a
scan, should a layer run in one) instead of the full activation gradients.
Every few steps they go into a ``jaxtrace.stats.History``, a progress line is
printed, and at the end ``jaxtrace.plot.grad_flow`` draws them. At
initialisation the first layer's activation gradient is tens of times smaller
than the last one's (it vanishes through the tanh layers); within a few
hundred Adam steps the order flips and the gradient grows towards the input.
Writes ``grad_flow.png``.

``--framework flax`` trains the same network as an unmodified Flax NNX model
(an ``nnx.Sequential`` of ``nnx.Linear`` layers and ``nnx.tanh``, so the
layers are ``0``, ``2``, ... ``12`` as in ``torch.nn.Sequential``) with an
``nnx.Optimizer``: ``jaxtrace.tag_modules`` takes the nnx model too, and the
``nnx.jit`` step takes gradients with ``jaxtrace.flax.value_and_grad``
(``nnx.value_and_grad`` plus the gradients at the tags). Needs ``pip install flax``.
"""

import argparse
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxtrace as jt


def spirals(key, n, classes=3, noise=0.25):
    """``n`` points on ``classes`` interleaved spiral arms in the plane, with labels."""
    k1, k2, k3 = jax.random.split(key, 3)
    label = jax.random.randint(k1, (n,), 0, classes)
    r = jax.random.uniform(k2, (n,), minval=0.15, maxval=1.0)
    angle = 8.0 * r + 2 * jnp.pi * label / classes
    x = jnp.stack([r * jnp.cos(angle), r * jnp.sin(angle)], axis=-1) * 3.0
    return x + noise * jax.random.normal(k3, x.shape) * r[:, None], label


def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)  # the tags get a batch axis; the statistics reduce over it
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)


def make_step(optimizer):
    # stats=True: a few numbers per layer (per scanned layer, per step) leave the step, reduced inside it,
    # not the (batch, width) activation gradients
    grad_fn = jt.filter_value_and_grad(loss_fn, has_aux=True, stats=True)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        (loss, acc), (grads, tag_stats) = grad_fn(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss, acc, tag_stats

    return step


def flax_model(key, width=32, depth=6):
    """The same MLP in Flax NNX: Linear layers with tanh between them, in an nnx.Sequential."""
    from flax import nnx

    rngs = nnx.Rngs(key)
    sizes = [2] + [width] * depth + [3]
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nnx.Linear(n_in, n_out, rngs=rngs)] + ([nnx.tanh] if i < depth else [])
    return nnx.Sequential(*layers)


def make_flax_step():
    from flax import nnx

    import jaxtrace.flax

    def loss_of_model(model, x, y):
        logits = model(x)  # nnx layers take the batch as it is
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == y)

    @nnx.jit
    def step(model, optimizer, x, y):
        # nnx.value_and_grad's result (grads of the nnx.Param state), and statistics of the gradients at the tags
        grad_fn = jaxtrace.flax.value_and_grad(loss_of_model, has_aux=True, stats=True)
        (loss, acc), (grads, tag_stats) = grad_fn(model, x, y)
        optimizer.update(model, grads)  # nnx.Optimizer updates the model in place
        return loss, acc, tag_stats

    return step


def progress(i, total, width=24):
    done = round(width * i / total)
    return f"[{'#' * done}{'.' * (width - done)}] {i:>5}/{total}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (CI)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "out")
    parser.add_argument("--framework", choices=["equinox", "flax"], default="equinox",
                        help="the model library (flax: an nnx model)")
    args = parser.parse_args(argv)
    steps, every, batch = (200, 20, 128) if args.quick else (3000, 50, 256)

    x_all, y_all = spirals(jax.random.PRNGKey(0), 4096)
    if args.framework == "flax":
        from flax import nnx

        # tag_modules clones the nnx model; the clone is the one trained
        model = jt.tag_modules(flax_model(1), where=lambda path, module: isinstance(module, nnx.Linear))
        optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        flax_step = make_flax_step()

        def step(model, opt_state, x, y):  # nnx updates model and optimizer in place
            return (model, opt_state, *flax_step(model, optimizer, x, y))

        opt_state = None
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        full = jax.eval_shape(lambda x: jt.capture(lambda x: nnx.merge(graphdef, params, rest)(x))(x)[1],
                              x_all[:batch])
        names = sorted(full, key=int)  # "0", "2", ... "12" (a dict from jit comes back sorted as strings)
    else:
        mlp = eqx.nn.MLP(2, 3, width_size=32, depth=6, activation=jnp.tanh, key=jax.random.PRNGKey(1))
        model = jt.tag_modules(mlp, where=lambda path, module: path.startswith("layers."))
        optimizer = optax.adam(3e-3)
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        step = make_step(optimizer)
        full = eqx.filter_eval_shape(jt.filter_grad(loss_fn, has_aux=True), model, x_all[:batch], y_all[:batch])[0][1]
        names = [f"layers.{i}" for i in range(len(mlp.layers))]

    # What the step hands back per layer, versus what the full cotangents would be.
    n_full = sum(a.size for a in jax.tree_util.tree_leaves(full))
    n_layers = len(names)
    print(f"{n_layers} tagged layers ({names[0]} ... {names[-1]}); the step returns "
          f"{n_layers * len(jt.stats.STATS)} statistics instead of {n_full:,} activation-gradient entries.")

    history = jt.stats.History()
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    for i in range(1, steps + 1):
        idx = rng.integers(0, len(x_all), batch)
        model, opt_state, loss, acc, tag_stats = step(model, opt_state, x_all[idx], y_all[idx])
        if i == 1 or i % every == 0:
            history.append(i, tag_stats, loss=loss, acc=acc)
            first, last = history.array(names[0])[-1], history.array(names[-1])[-1]
            print(f"{progress(i, steps)}  loss {float(loss):.3f}  acc {float(acc):.2f}  "
                  f"|g| {names[0]} {first:.1e} … {names[-1]} {last:.1e}", flush=True)
    print(f"{steps} steps in {time.perf_counter() - start:.1f} s")

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        from jaxtrace import plot
    except ImportError as e:
        print(f"(no picture: {e})")
        return
    path = args.out / "grad_flow.png"
    acc = history.scalar("acc")[-1]
    library = "Flax NNX" if args.framework == "flax" else "equinox"
    plot.grad_flow(history, names=names, title=f"Gradient flow in a {n_layers}-layer tanh MLP ({library}) on spirals "
                   f"(accuracy {acc:.0%})",
                   path=path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
