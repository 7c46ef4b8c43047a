"""What the torch test files share: tolerances, keys, a small MLP, and the zero-perturbation oracle (needs torch)."""

import copy

import jax
import numpy as np
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


# --- the zero-perturbation oracle (test_torch_seams.py, test_torch_sweep.py) -------------
#
# A forward hook registered with ``prepend=True`` returns ``output + eps`` (``eps`` a zero tensor
# that requires grad) and ``torch.autograd.grad`` gives the gradient at ``eps``. Where the model
# later changes the output's memory in place, a hook returning a new tensor would change the
# forward pass itself; there the oracle adds ``eps`` in place (``output.add_(eps)``).


def leaves(obj):
    """The tensors (or arrays) of a tuple / list / dict nest in order, ``None`` for other leaves."""
    if isinstance(obj, (tuple, list)):
        return [x for v in obj for x in leaves(v)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in leaves(v)]
    return [obj]


def rebuild(obj, new):
    """``obj`` with its leaves (in ``leaves`` order) replaced by ``new``; a ModelOutput keeps its type."""
    it = iter(new)

    def go(o):
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return tuple(go(v) for v in o)
        if isinstance(o, list):
            return [go(v) for v in o]
        if isinstance(o, dict):
            out = copy.copy(o)
            for k, v in o.items():
                out[k] = go(v)
            return out
        return next(it)

    return go(obj)


def oracle(model, args, loss, paths, kwargs=None, in_place=()):
    """``(loss value, {path: [per call: [per leaf: gradient or None]]})`` from zero perturbations.

    ``"path"``: a forward hook (``prepend=True``) returning ``output + eps``; ``"path:in"``: a
    forward pre-hook (``with_kwargs=True``) adding ``eps`` to the positional arguments, or to the
    keyword arguments when there are none. Paths in ``in_place`` add ``eps`` in place instead.
    A module called under ``torch.no_grad()`` gets zeros (nothing of it reaches the loss).
    """
    named = dict(model.named_modules())
    eps, handles = {p: [] for p in paths}, []

    def perturb(path, value):
        per_call, new = [], []
        for leaf in leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not torch.is_grad_enabled():
                per_call.append(("zeros", torch.zeros_like(leaf)))  # under no_grad: no path to the loss
                new.append(leaf)
            elif isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                e = torch.zeros_like(leaf, requires_grad=True)
                per_call.append(e)
                new.append(leaf.add_(e) if path in in_place else leaf + e)
            else:
                per_call.append(None)
                new.append(leaf)
        eps[path].append(per_call)
        return new

    for path in paths:
        module = named[path.removesuffix(":in")]
        if path.endswith(":in"):

            def pre(mod, args, kw, path=path):
                if args:
                    return tuple(rebuild(list(args), perturb(path, list(args)))), kw
                return args, rebuild(dict(kw), perturb(path, dict(kw)))

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        else:

            def hook(mod, args, out, path=path):
                new = rebuild(out, perturb(path, out))
                return None if path in in_place else new

            handles.append(module.register_forward_hook(hook, prepend=True))
    try:
        value = loss(model(*args, **(kwargs or {})))
        for h in handles:  # off before backward, where activation checkpointing runs parts again
            h.remove()
        flat = [e for p in paths for call in eps[p] for e in call if isinstance(e, torch.Tensor)]
        grads = iter(torch.autograd.grad(value, flat, allow_unused=True))
    finally:
        for h in handles:
            h.remove()
    out = {}
    for p in paths:
        out[p] = []
        for call in eps[p]:
            row = []
            for e in call:
                if not isinstance(e, torch.Tensor):
                    row.append(e if e is None else e[1])
                else:
                    g = next(grads)
                    row.append(torch.zeros_like(e) if g is None else g)
            out[p].append(row)
    return value.detach(), out


def assert_matches(modules, expected, rtol=1e-12, atol=1e-13, zero_ok=()):
    """jaxtrace's ``module_grads`` equal the oracle's, leaf by leaf, call by call.

    An all-zero oracle leaf cannot tell right from wrong: it fails unless its path is in
    ``zero_ok``. Returns ``{(path, leaf index)}`` of those.
    """
    zeros = set()
    for path, calls in expected.items():
        got = modules[path]
        per_call = [got] if len(calls) == 1 else [index(got, i) for i in range(len(calls))]
        for c, (g, want) in enumerate(zip(per_call, calls)):
            got_leaves = leaves(g)
            assert len(got_leaves) == len(want), (path, len(got_leaves), len(want))
            for j, (a, b) in enumerate(zip(got_leaves, want)):
                if b is None:
                    assert a is None, (path, c, j)
                    continue
                scale = float(b.abs().max()) if b.numel() else 0.0
                np.testing.assert_allclose(a, b.numpy(), rtol=0, atol=atol + rtol * scale, err_msg=f"{path} call {c} leaf {j}")
                if scale == 0:
                    zeros.add((path, j))
                    assert path in zero_ok, f"{path}: an all-zero oracle cannot tell right from wrong"
    return zeros


def index(tree, i):
    """Call ``i`` of a stacked gradient nest (``None`` leaves stay ``None``)."""
    if isinstance(tree, tuple):
        return tuple(index(v, i) for v in tree)
    if isinstance(tree, list):
        return [index(v, i) for v in tree]
    if isinstance(tree, dict):
        return {k: index(v, i) for k, v in tree.items()}
    return None if tree is None else tree[i]


def plain(model, args, loss, kwargs=None):
    """The loss and parameter gradients of the model run with no hooks at all."""
    params = dict(model.named_parameters())
    value = loss(model(*args, **(kwargs or {})))
    grads = torch.autograd.grad(value, list(params.values()), allow_unused=True)
    return value.detach(), {n: (torch.zeros_like(p) if g is None else g) for (n, p), g in zip(params.items(), grads)}


def assert_params(params, ref):
    for name, g in ref.items():
        np.testing.assert_allclose(params[name], g.numpy(), rtol=1e-12, atol=1e-14, err_msg=name)
