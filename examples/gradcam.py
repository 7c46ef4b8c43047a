"""Grad-CAM for a small equinox CNN, from one forward pass.

Run:  python examples/gradcam.py [--quick] [--out DIR]

A small CNN learns to say which of three shapes (circle, square, triangle)
appear in a noisy 32x32 image (generated; one or two shapes per image). The
last convolution's output is tagged ``"features"``. One call of
``jaxtrace.vjp(..., with_values=True)`` runs the forward pass once and gives
the activation at the tag; its ``vjp_fn``, ``jax.vmap``-ed over one cotangent
per class, gives the gradient of every class score at that activation. From
the two, Grad-CAM (Selvaraju et al., 2017): weight each channel by its mean
gradient, sum, ReLU. The maps are drawn over the images with
``jaxtrace.plot.overlay``; the share of each map that falls on the right shape
is printed. Writes ``gradcam.png``.
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

CLASSES = ("circle", "square", "triangle")
SIZE = 32


def draw(kind, cy, cx, r):
    """A boolean mask of one filled shape."""
    y, x = np.mgrid[:SIZE, :SIZE] + 0.5
    if kind == 0:
        return (y - cy) ** 2 + (x - cx) ** 2 <= r**2
    if kind == 1:
        return (np.abs(y - cy) <= 0.85 * r) & (np.abs(x - cx) <= 0.85 * r)
    top, bottom = cy - r, cy + r
    half = r * (y - top) / (bottom - top)
    return (y >= top) & (y <= bottom) & (np.abs(x - cx) <= half)


def shapes(rng, n):
    """``n`` noisy images with one or two different shapes, multi-hot labels, and each shape's mask."""
    images = rng.normal(0.0, 0.15, (n, 1, SIZE, SIZE)).astype(np.float32)
    labels = np.zeros((n, len(CLASSES)), np.float32)
    masks = np.zeros((n, len(CLASSES), SIZE, SIZE), bool)
    for i in range(n):
        kinds = rng.choice(len(CLASSES), size=rng.integers(1, 3), replace=False)
        placed = []
        for kind in kinds:
            for _ in range(100):  # place shapes apart
                r = rng.uniform(4.0, 7.0)
                cy, cx = rng.uniform(r + 1, SIZE - r - 1, size=2)
                if all((cy - py) ** 2 + (cx - px) ** 2 > (r + pr + 2) ** 2 for py, px, pr in placed):
                    break
            placed.append((cy, cx, r))
            masks[i, kind] = draw(kind, cy, cx, r)
            images[i, 0][masks[i, kind]] += 1.0
            labels[i, kind] = 1.0
    return images, labels, masks


class CNN(eqx.Module):
    convs: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.convs = [
            eqx.nn.Conv2d(1, 8, 3, padding=1, key=k[0]),
            eqx.nn.Conv2d(8, 16, 3, padding=1, key=k[1]),
            eqx.nn.Conv2d(16, 32, 3, padding=1, key=k[2]),
        ]
        self.head = eqx.nn.Linear(32, len(CLASSES), key=k[3])

    def __call__(self, image):  # (1, 32, 32) -> class scores (3,)
        h = image
        for i, conv in enumerate(self.convs):
            h = jax.nn.relu(conv(h))
            if i < len(self.convs) - 1:
                h = eqx.nn.MaxPool2d(2, 2)(h)
        h = jt.tag(h, "features")  # (32, 8, 8): the last conv layer's output
        return self.head(jnp.max(h, axis=(1, 2)))  # global max pooling: "is it anywhere?"


def train(model, rng, steps, batch=64):
    optimizer = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(params):
            logits = jax.vmap(eqx.combine(params, static))(x)
            return optax.sigmoid_binary_cross_entropy(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x, y, _ = shapes(rng, steps * batch)
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch])
        if (i + 1) % max(steps // 5, 1) == 0:
            print(f"  step {i + 1:>4}/{steps}  loss {float(loss):.3f}", flush=True)
    return eqx.combine(params, static)


@jax.jit
def grad_cam(model, images):
    """Class scores and one Grad-CAM map per class and image, from one forward pass."""
    scores, vjp_fn, values = jt.vjp(jax.vmap(model), images, tags="features", with_values=True)
    per_class = jnp.eye(len(CLASSES))[:, None, :] * jnp.ones_like(scores)  # (classes, N, classes)
    _, tag_grads = jax.vmap(vjp_fn)(per_class)
    activation, gradient = values["features"], tag_grads["features"]  # (N, C, 8, 8), (classes, N, C, 8, 8)
    weights = jnp.mean(gradient, axis=(-2, -1), keepdims=True)  # mean gradient per channel
    cams = jax.nn.relu(jnp.sum(weights * activation, axis=2))  # (classes, N, 8, 8)
    return scores, jnp.moveaxis(cams, 0, 1)  # (N, classes, 8, 8)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (CI)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "out")
    args = parser.parse_args(argv)
    steps, batch = (120, 64) if args.quick else (500, 64)

    rng = np.random.default_rng(0)
    start = time.perf_counter()
    print(f"training a small CNN on generated shapes ({steps} steps)")
    model = train(CNN(jax.random.PRNGKey(0)), rng, steps, batch)
    print(f"  trained in {time.perf_counter() - start:.1f} s")

    images, labels, masks = shapes(np.random.default_rng(1), 256)
    scores, cams = grad_cam(model, jnp.asarray(images))
    probs = np.asarray(jax.nn.sigmoid(scores))
    print(f"test accuracy (all three labels right): {np.mean(np.all((probs > 0.5) == labels, axis=1)):.0%}")

    # How much of each present class's map lies on that class's shape?
    up = np.asarray(jax.image.resize(cams, (*cams.shape[:2], SIZE, SIZE), "bilinear"))
    present = labels > 0
    on_shape = np.sum(up * masks, axis=(2, 3)) / np.maximum(np.sum(up, axis=(2, 3)), 1e-12)
    area = np.mean(masks, axis=(2, 3))
    print(f"Grad-CAM mass on the right shape: {np.mean(on_shape[present]):.0%} "
          f"(the shape covers {np.mean(area[present]):.0%} of the image)")

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        from jaxtrace import plot
    except ImportError as e:
        print(f"(no picture: {e})")
        return
    rows = [i for i in range(len(images)) if present[i].sum() == 2][:3] + [
        i for i in range(len(images)) if present[i].sum() == 1
    ][:1]
    panels, heat, titles = [], [], []
    for i in rows:
        top = np.asarray(cams[i]).max()  # one scale per image, so absent classes show as dim
        panels.append(images[i, 0]), heat.append(None), titles.append("input")
        for c, name in enumerate(CLASSES):
            panels.append(images[i, 0])
            heat.append(np.asarray(cams[i, c]) / top if top > 0 else None)
            titles.append(f"{name}  p={probs[i, c]:.2f}")
    path = args.out / "gradcam.png"
    plot.overlay(panels, heat, titles=titles, ncols=1 + len(CLASSES), vmax=1.0, path=path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
