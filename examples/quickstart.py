"""jaxtrace quickstart: gradients at the hidden layers of an MLP.

Run:  python examples/quickstart.py

Tags mark the hidden activations; one jitted call returns the parameter
gradients and the gradients at every tag. If PyTorch is installed, the same
network with the same weights is run with ``register_hook`` on its hidden
tensors, and the largest difference is printed.
"""

import jax

jax.config.update("jax_enable_x64", True)  # float64, so the PyTorch check is exact

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxtrace as jt  # noqa: E402

SIZES = [8, 16, 16, 4]


def init(key):
    params = []
    for i, (n_in, n_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        key, k = jax.random.split(key)
        params.append({"w": jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.full((n_out,), 0.1 * i)})
    return params


def loss_fn(params, x, y):
    h = x
    for i, layer in enumerate(params):
        z = jt.tag(h @ layer["w"] + layer["b"], f"layer{i}.pre")  # mark the pre-activation
        h = jnp.tanh(z) if i < len(params) - 1 else z
    return jnp.mean((h - y) ** 2)


def torch_tag_grads(params, x, y):
    """The same numbers from PyTorch: ``register_hook`` on each pre-activation."""
    import torch

    grads, h = {}, torch.tensor(np.asarray(x))
    weights = [{k: torch.tensor(np.asarray(v), requires_grad=True) for k, v in layer.items()} for layer in params]
    for i, layer in enumerate(weights):
        z = h @ layer["w"] + layer["b"]
        z.register_hook(lambda g, name=f"layer{i}.pre": grads.__setitem__(name, g.numpy()))
        h = torch.tanh(z) if i < len(weights) - 1 else z
    torch.mean((h - torch.tensor(np.asarray(y))) ** 2).backward()
    leaf_grads = {f"{i}.{k}": v.grad.numpy() for i, layer in enumerate(weights) for k, v in layer.items()}
    return grads, leaf_grads


def table(title, rows):
    print(f"\n{title}")
    print(f"  {'name':<12} {'shape':<10} {'grad norm':>12}")
    for name, g in rows.items():
        print(f"  {name:<12} {str(tuple(g.shape)):<10} {float(jnp.linalg.norm(g)):>12.6f}")


def main():
    params = init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (32, SIZES[0]))
    y = jax.random.normal(jax.random.PRNGKey(2), (32, SIZES[-1]))

    loss, (grads, tag_grads) = jax.jit(jt.value_and_grad(loss_fn))(params, x, y)
    print(f"loss = {float(loss):.6f}")
    table("Gradients at the tags (d loss / d pre-activation):", tag_grads)
    leaf_grads = {f"{i}.{k}": v for i, layer in enumerate(grads) for k, v in layer.items()}
    table("Parameter gradients:", leaf_grads)

    try:
        import torch  # noqa: F401
    except ImportError:
        print(
            "\n(PyTorch is not installed, so the comparison against register_hook is skipped. A CPU build is "
            "enough: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        )
        return
    torch_tags, torch_leaves = torch_tag_grads(params, x, y)
    diff = max(
        max(float(np.max(np.abs(np.asarray(tag_grads[n]) - torch_tags[n]))) for n in tag_grads),
        max(float(np.max(np.abs(np.asarray(leaf_grads[n]) - torch_leaves[n]))) for n in leaf_grads),
    )
    print(f"\nPyTorch register_hook on the same weights: max |difference| = {diff:.2e}")
    assert diff < 1e-10, "jaxtrace and PyTorch disagree"


if __name__ == "__main__":
    main()
