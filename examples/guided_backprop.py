"""Guided backprop and plain saliency with jt.patch_grad, checked against PyTorch backward hooks.

Run:  python examples/guided_backprop.py [--quick] [--out DIR]

The CNN of ``gradcam.py`` learns which shapes appear in generated images. Its
forward pass here tags every ReLU output (``"relu0"`` .. ``"relu2"``).

- **Saliency**: ``jax.grad`` of the predicted class's score with respect to the
  image (Simonyan et al., 2014).
- **Guided backprop** (Springenberg et al., 2015): the same gradient, but at
  every ReLU only positive gradients pass back. Captum and most PyTorch code
  build it from module backward hooks that clamp ``grad_input``; here it is
  ``jt.patch_grad(score, {"relu0": relu, ...})``: no hooks, under ``jax.jit``.

When torch is installed, a torch twin of the network (the same weights, in
float64) computes guided backprop with ``register_full_backward_hook`` on its
ReLUs, and ``jt.compare`` checks the maps agree. Writes ``guided_backprop.png``
(input, saliency, guided backprop, for a few images).
"""

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import gradcam  # noqa: E402  (the CNN, the generated shapes and the training loop)

import jaxtrace as jt  # noqa: E402

RELUS = ("relu0", "relu1", "relu2")


def scores(model, image):
    """``gradcam.CNN``'s forward pass for one image, with every ReLU output tagged."""
    h = image
    for i, conv in enumerate(model.convs):
        h = jt.tag(jax.nn.relu(conv(h)), f"relu{i}")
        if i < len(model.convs) - 1:
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2), (1, 2, 2), "VALID")
    return model.head(jnp.max(h, axis=(1, 2)))


def positive(g):
    return jnp.maximum(g, 0.0)


@jax.jit
def saliency_maps(model, images, classes):
    """Plain and guided saliency of each image's class score, per pixel."""

    def score(image, c):
        return scores(model, image)[c]

    guided = jt.patch_grad(score, {name: positive for name in RELUS})
    plain_maps = jax.vmap(jax.grad(score))(images, classes)
    guided_maps = jax.vmap(jax.grad(guided))(images, classes)
    return plain_maps, guided_maps


def torch_guided(model, images, classes):
    """The PyTorch way: a twin network whose ReLUs clamp grad_input in full backward hooks."""
    import torch

    convs = []
    for conv in model.convs:
        layer = torch.nn.Conv2d(conv.in_channels, conv.out_channels, 3, padding=1).double()
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(np.array(conv.weight, np.float64)))
            layer.bias.copy_(torch.from_numpy(np.array(conv.bias, np.float64).reshape(-1)))
        convs.append(layer)
    head = torch.nn.Linear(model.head.in_features, model.head.out_features).double()
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(np.array(model.head.weight, np.float64)))
        head.bias.copy_(torch.from_numpy(np.array(model.head.bias, np.float64)))
    relus = [torch.nn.ReLU() for _ in convs]
    clamp = lambda m, g_in, g_out: (torch.clamp(g_in[0], min=0.0),)  # noqa: E731
    handles = [r.register_full_backward_hook(clamp) for r in relus]
    x = torch.from_numpy(np.array(images, np.float64)).requires_grad_(True)
    h = x
    for i, (conv, relu) in enumerate(zip(convs, relus)):
        h = relu(conv(h))
        if i < len(convs) - 1:
            h = torch.nn.functional.max_pool2d(h, 2)
    out = head(torch.amax(h, dim=(2, 3)))
    out[torch.arange(len(classes)), torch.from_numpy(np.array(classes))].sum().backward()
    for handle in handles:
        handle.remove()
    return x.grad.numpy()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (CI)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "out")
    args = parser.parse_args(argv)
    steps = 120 if args.quick else 500

    print(f"training the CNN of gradcam.py on generated shapes ({steps} steps)")
    model = gradcam.train(gradcam.CNN(jax.random.PRNGKey(0)), np.random.default_rng(0), steps)
    images, labels, masks = gradcam.shapes(np.random.default_rng(1), 8)
    classes = np.asarray(jnp.argmax(jax.vmap(model)(jnp.asarray(images)), axis=1))
    plain, guided = saliency_maps(model, jnp.asarray(images), jnp.asarray(classes))

    def on_shape(m):
        m = np.abs(np.asarray(m))
        return float(np.mean([np.sum(m[i, 0] * masks[i, c]) / np.sum(m[i, 0]) for i, c in enumerate(classes)]))

    print(
        f"share of |map| on the predicted class's shape: saliency {on_shape(plain):.0%}, "
        f"guided backprop {on_shape(guided):.0%}"
    )

    try:
        import torch  # noqa: F401
    except ImportError:
        print(
            "(PyTorch is not installed, so the comparison against backward hooks is skipped. A CPU build is "
            "enough: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        )
    else:
        jax.config.update("jax_enable_x64", True)  # the check runs in float64, as the test suite's do
        try:
            model64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64) if isinstance(a, jax.Array) else a, model)
            _, guided64 = saliency_maps(model64, jnp.asarray(images, jnp.float64), jnp.asarray(classes))
            theirs = torch_guided(model, images, classes)
        finally:
            jax.config.update("jax_enable_x64", False)
        comparison = jt.compare(
            {"guided": np.asarray(guided64)}, {"guided": theirs}, rtol=1e-10, atol=1e-12, labels=("jaxtrace", "torch")
        )
        print(
            f"guided backprop vs torch backward hooks (float64): "
            f"{'agree' if comparison.ok else 'MISMATCH'}, max error {comparison.rows[0].max_abs:.1e}"
        )
        comparison.assert_ok()

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        from jaxtrace import plot
    except ImportError as e:
        print(f"(no picture: {e})")
        return
    panels, heat, titles = [], [], []
    for i in range(4):
        name = gradcam.CLASSES[classes[i]]
        for title, m in (("input", None), (f"saliency ({name})", plain), (f"guided ({name})", guided)):
            panels.append(images[i, 0])
            if m is None:
                heat.append(None)
            else:
                a = np.abs(np.asarray(m[i, 0]))
                heat.append(a / a.max() if a.max() > 0 else None)
            titles.append(title)
    path = args.out / "guided_backprop.png"
    plot.overlay(panels, heat, titles=titles, ncols=3, vmax=1.0, path=path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
