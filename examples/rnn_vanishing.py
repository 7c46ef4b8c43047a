"""The vanishing-gradient picture: per-timestep gradient norms of a tanh RNN and a GRU.

Run:  python examples/rnn_vanishing.py [--quick] [--out DIR]

Both models read a long random sequence with ``lax.scan`` and the loss looks
only at the last hidden state. The hidden state is tagged inside the scan
body, so ``jaxtrace.stats.value_and_grad(..., per_example=True)`` returns
``||d loss / d h_t||`` for every timestep and sequence, computed inside the
jitted call (shape ``(T, batch)``; the full ``(T, batch, hidden)`` cotangent
never leaves it). How fast that norm falls going back in time is how fast the
model forgets: in the tanh RNN it shrinks by a constant factor per step and
soon underflows to exactly zero in float32; the GRU, whose update gate starts
biased towards keeping its state (``+2``, a usual initialisation for long
sequences), loses far less per step, so gradient still reaches the start of
the sequence. Writes ``rnn_vanishing.png``.
"""

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxtrace as jt

HIDDEN, INPUT = 32, 4


class TanhRNN(eqx.Module):
    """``h_t = tanh(W h_{t-1} + U x_t + b)`` with equinox's default initialisation."""

    w: eqx.nn.Linear
    u: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w = eqx.nn.Linear(HIDDEN, HIDDEN, use_bias=False, key=k1)
        self.u = eqx.nn.Linear(INPUT, HIDDEN, key=k2)

    def __call__(self, x, h):
        return jnp.tanh(self.w(h) + self.u(x))


class GRU(eqx.Module):
    """``eqx.nn.GRUCell`` with its update-gate bias raised, so that it starts out remembering."""

    cell: eqx.nn.GRUCell

    def __init__(self, key, update_bias=2.0):
        cell = eqx.nn.GRUCell(INPUT, HIDDEN, key=key)
        bias = cell.bias.at[HIDDEN : 2 * HIDDEN].add(update_bias)  # equinox orders the gates r, z, n
        self.cell = eqx.tree_at(lambda c: c.bias, cell, bias)

    def __call__(self, x, h):
        return self.cell(x, h)


def last_state(cell, xs):
    def step(h, x):
        h = jt.tag(cell(x, h), "h")  # one value per timestep
        return h, None

    h, _ = jax.lax.scan(step, jnp.zeros(HIDDEN), xs)
    return h


def loss_fn(params, static, xs, targets):
    cell = eqx.combine(params, static)
    h_last = jax.vmap(last_state, in_axes=(None, 0))(cell, xs)  # tag layout: (T, batch, hidden)
    return jnp.mean((h_last[:, 0] - targets) ** 2)


def timestep_norms(cell, xs, targets):
    """``||d loss / d h_t||`` per timestep and sequence, shape ``(T, batch)``."""
    params, static = eqx.partition(cell, eqx.is_inexact_array)
    grad_stats = jt.stats.value_and_grad(loss_fn, tags="h", stats=["norm"], per_example=True)
    _, (_, tag_stats) = jax.jit(grad_stats, static_argnums=1)(params, static, xs, targets)
    return np.asarray(tag_stats["h"]["norm"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (CI)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "out")
    args = parser.parse_args(argv)
    length, batch = (120, 16) if args.quick else (300, 64)

    k_x, k_y, k_rnn, k_gru = jax.random.split(jax.random.PRNGKey(0), 4)
    xs = jax.random.normal(k_x, (batch, length, INPUT))
    targets = jax.random.normal(k_y, (batch,))
    norms = {
        "tanh RNN": timestep_norms(TanhRNN(k_rnn), xs, targets),
        "GRU": timestep_norms(GRU(k_gru), xs, targets),
    }

    print(f"median ||d loss / d h_t|| over {batch} sequences of length {length}:")
    back = [b for b in (0, 10, 25, 50, 100, 200, length - 1) if b < length]
    print("  steps before the end " + "".join(f"{b:>10}" for b in back))
    for name, n in norms.items():
        median = np.median(n, axis=1)
        print(f"  {name:<21} " + "".join(f"{median[length - 1 - b]:>10.1e}" for b in back))
        alive = median > 0
        t = np.arange(length)[alive][-30:]  # fit the decay on the last 30 non-zero steps
        rate = np.exp(np.polyfit(t, np.log(median[alive][-30:]), 1)[0])
        zero = np.flatnonzero(~alive)
        note = f"; exactly 0 (float32 underflow) from {length - 1 - zero.max()} steps back on" if zero.size else ""
        print(f"  {'':<21} x{1 / rate:.2f} per step back{note}")

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        from jaxtrace import plot
    except ImportError as e:
        print(f"(no picture: {e})")
        return
    path = args.out / "rnn_vanishing.png"
    fig = plot.timestep_norms(
        norms,
        title=f"Gradient reaching each timestep from a loss on the last state (T = {length})",
        ylabel="‖∂loss/∂h_t‖  (median, 10–90% of sequences)",
    )
    rnn = np.median(norms["tanh RNN"], axis=1)
    if np.any(rnn == 0):
        t0 = np.flatnonzero(rnn > 0).min()
        ax = fig.axes[0]
        ax.axvline(t0, color="#d62728", ls=":", lw=1)
        ax.annotate("tanh RNN: exactly 0 before here\n(float32 underflow)", (t0, rnn[t0]), xytext=(-8, 0),
                    textcoords="offset points", ha="right", va="bottom", color="#d62728", fontsize=9)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
