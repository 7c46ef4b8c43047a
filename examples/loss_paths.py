"""Which loss term reaches which layer? One jt.jacrev call, and the stop_gradient bug it catches.

Run:  python examples/loss_paths.py [--quick] [--out DIR]

A small multi-task model: a shared two-layer encoder, a classification head, a
reconstruction decoder, and an auxiliary loss computed from an intermediate of
the encoder (a sparsity penalty on its first layer). The question that sends
PyTorch users to ``register_hook`` is: does each loss term really reach the
layers it should, and how much of the gradient there comes from each?

``jt.jacrev`` of the dict of loss terms gives d term / d tag for every term and
every tagged layer in one forward pass; ``jt.stats.jacrev`` reduces it to a
tag x term table of norms inside the jitted function, and
``jt.stats.format_paths`` prints it, marking exact zeros: a term
that does not reach a layer at all. Then the classic bug: a ``stop_gradient``
slips onto the auxiliary branch, the auxiliary term silently stops training
the encoder, and the table shows it as ``0 (none)``.

When PyTorch is installed, the same model (weights copied across) gets the
per-term gradients the PyTorch way, with ``register_hook`` on each layer and
one ``backward(retain_graph=True)`` per term, and ``jt.compare`` checks them
against ``jt.jacrev``. Writes ``loss_paths.png`` (the heatmaps, clean and buggy, on one
colour scale).
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxtrace as jt

jax.config.update("jax_enable_x64", True)

D_IN, D_HID, D_CODE, N_CLASSES = 12, 16, 6, 3
LAYERS = ("encoder.0", "encoder.1", "head", "decoder")


def init(rng):
    def dense(n_in, n_out):
        return {"w": rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), "b": rng.normal(size=(n_out,)) * 0.1}

    return {
        "encoder.0": dense(D_IN, D_HID),
        "encoder.1": dense(D_HID, D_CODE),
        "head": dense(D_CODE, N_CLASSES),
        "decoder": dense(D_CODE, D_IN),
    }


def losses(params, x, labels, detach_aux=False):
    """Three loss terms from one forward pass; every layer's output is tagged by its name."""

    def layer(name, h, act=None):
        out = h @ params[name]["w"] + params[name]["b"]
        return jt.tag(out if act is None else act(out), name)

    h1 = layer("encoder.0", x, jnp.tanh)
    code = layer("encoder.1", h1, jnp.tanh)
    logits = layer("head", code)
    recon = layer("decoder", code)
    aux_input = jax.lax.stop_gradient(h1) if detach_aux else h1  # the bug: a stray stop_gradient
    log_probs = jax.nn.log_softmax(logits)
    return {
        "ce": -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1)),
        "recon": jnp.mean((recon - x) ** 2),
        "sparsity": 0.1 * jnp.mean(jnp.abs(aux_input)),
    }


def term_table(params, x, labels, detach_aux=False):
    """The tag x term table of gradient norms, computed inside jax.jit."""
    _, table = jt.stats.jacrev(losses, stats="norm")(params, x, labels, detach_aux)
    return table


term_table = jax.jit(term_table, static_argnames="detach_aux")


def torch_per_term_grads(params, x, labels):
    """The PyTorch way: hooks on every layer output, one backward(retain_graph=True) per term."""
    import torch

    def dense(name):
        layer = torch.nn.Linear(*params[name]["w"].shape).double()
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(np.array(params[name]["w"]).T))
            layer.bias.copy_(torch.from_numpy(np.array(params[name]["b"])))
        return layer

    layers = {name: dense(name) for name in LAYERS}
    xt, yt = torch.from_numpy(np.array(x)), torch.from_numpy(np.array(labels))
    outs = {}
    h1 = outs["encoder.0"] = torch.tanh(layers["encoder.0"](xt))
    code = outs["encoder.1"] = torch.tanh(layers["encoder.1"](h1))
    logits = outs["head"] = layers["head"](code)
    recon = outs["decoder"] = layers["decoder"](code)
    terms = {
        "ce": torch.nn.functional.cross_entropy(logits, yt),
        "recon": torch.mean((recon - xt) ** 2),
        "sparsity": 0.1 * torch.mean(torch.abs(h1)),
    }
    grads = {}
    for term, value in terms.items():
        seen = {}
        handles = [
            out.register_hook(lambda g, n=name: seen.__setitem__(n, g.detach().numpy())) for name, out in outs.items()
        ]
        value.backward(retain_graph=True)
        for handle in handles:
            handle.remove()
        for name in LAYERS:  # a hook that never fired: the term does not reach that layer
            grads[f"{name}/{term}"] = seen.get(name, np.zeros(tuple(outs[name].shape)))
    return grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller batch (CI)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(jnp.asarray, init(rng))
    n = 16 if args.quick else 128
    x = jnp.asarray(rng.normal(size=(n, D_IN)))
    labels = jnp.asarray(rng.integers(0, N_CLASSES, n))

    table = term_table(params, x, labels)
    print("d term / d layer output, L2 norm (clean model):")
    print(jt.stats.format_paths(table))
    buggy = term_table(params, x, labels, detach_aux=True)
    print("\nThe same with a stop_gradient on the auxiliary branch:")
    print(jt.stats.format_paths(buggy))
    reaches = lambda t, term: bool(np.any(t["encoder.0"][term]["norm"]))  # noqa: E731
    lost = [term for term in table["encoder.0"] if reaches(table, term) and not reaches(buggy, term)]
    print(f"\nTerms that stopped reaching encoder.0: {lost}")
    assert lost == ["sparsity"], lost

    try:
        import torch  # noqa: F401
    except ImportError:
        print(
            "\n(PyTorch is not installed, so the comparison against register_hook is skipped. A CPU build is "
            "enough: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        )
    else:
        _, tag_jacs = jax.jit(jt.jacrev(losses))(params, x, labels)  # the full Jacobians, to compare
        ours = {f"{name}/{term}": tag_jacs[name][term] for name in LAYERS for term in tag_jacs[name]}
        theirs = torch_per_term_grads(params, x, labels)
        comparison = jt.compare(ours, theirs, rtol=1e-10, atol=1e-12, labels=("jaxtrace", "torch"))
        print(
            f"\nAgainst PyTorch hooks (one backward per term, {len(comparison.rows)} term/layer pairs): "
            f"{'all agree' if comparison.ok else 'MISMATCH'}, largest error {max(r.max_abs for r in comparison.rows):.1e}"
        )
        comparison.assert_ok()

    try:
        from jaxtrace import plot
    except ImportError:
        print('(matplotlib is not installed: pip install -e ".[plot]" for the picture)')
        return
    fig_path = out_dir / "loss_paths.png"
    plot.paths(
        [table, buggy],
        tags=LAYERS,
        titles=["clean model", "stop_gradient on the auxiliary branch"],
        title="|d term / d layer output| (L2 norm), one colour scale",
        path=fig_path,
    )
    print(f"wrote {fig_path}")


if __name__ == "__main__":
    main()
