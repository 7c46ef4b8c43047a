"""What the torch test files share: tolerances, keys, and a small MLP (needs torch)."""

import jax
import torch

RTOL64 = 1e-10
ATOL64 = 1e-13  # for gradients that are zero analytically (a key bias under softmax) and ~1e-17 in practice
RTOL32 = 1e-5  # float32: max |jax - torch| <= 1e-5 * max |torch| per gradient
nn = torch.nn


def keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


class TorchMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x):
        return self.layers(x)
