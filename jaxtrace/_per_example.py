"""Per-example gradient norms and clipped gradients from one pass (DP-SGD, ghost clipping).

For a layer ``y = layer(x)`` whose parameter gradient is a sum of outer products of a
function of its input and the gradient at its output, each example's parameter gradient
is ``sum_k a_k (x) b_k`` over that example's positions ``k`` (sequence steps, pixels,
repeated calls). Its squared norm is either

- ``sum_{k,l} <a_k, a_l> <b_k, b_l>`` (the Gram, or "ghost norm", form: memory ``K**2``
  per example), or
- ``|sum_k a_k b_k^T|**2`` (the per-example gradient of that layer: memory ``dA * dB``),

whichever is smaller, picked per leaf from the shapes, as Opacus's fast gradient clipping
does. One ``jt.vjp(..., with_values=True)`` pass over a model tagged by ``jt.tag_modules``
gives every covered layer's input and output gradient; ``RULES`` says, per module class,
which ``(a, b)`` factors each parameter gets. A leaf used by several layers (tied weights,
a module called several times) gets the factors of all its uses, so the cross terms are in
its norm. Leaves no rule covers are computed with ``jax.vmap(jax.grad)`` for those leaves
alone (``fallback="vmap"``), or refused (``fallback="error"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ._ad import vjp as _vjp
from ._forward import capture as _capture
from ._sites import TagError

INPUT_SUFFIX = ":in"
_HI = jax.lax.Precision.HIGHEST


# --- factors ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Index:
    """A one-hot factor given by its indices: ``ids`` of shape ``(B, K)`` into ``size`` rows."""

    ids: jax.Array
    size: int


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a leaf: its per-example gradient is ``sum_k outer(a[:, k], b[:, k])``.

    ``a`` is ``(B, K, dA)`` (or an ``Index``), ``b`` is ``(B, K, dB)`` or ``None`` (a
    vector-shaped leaf such as a bias: ``b = 1``). ``outer(a, b)`` flattened is the leaf
    flattened (C order).
    """

    a: Any
    b: Optional[jax.Array]


def _k(f) -> int:
    return f.ids.shape[1] if isinstance(f, Index) else f.shape[1]


def _width(f) -> int:
    return f.size if isinstance(f, Index) else f.shape[2]


def _inner(f, h) -> jax.Array:
    """``<f_k, h_l>`` for every pair of positions: ``(B, Kf, Kh)``."""
    if isinstance(f, Index) and isinstance(h, Index):
        return (f.ids[:, :, None] == h.ids[:, None, :]).astype(jnp.float32)
    if isinstance(f, Index):
        return jnp.swapaxes(_inner(h, f), 1, 2)
    if isinstance(h, Index):  # <f_k, e_{id_l}> = f[k, id_l]
        return jnp.take_along_axis(f, jnp.broadcast_to(h.ids[:, None, :], (*f.shape[:2], h.ids.shape[1])), axis=2)
    return jnp.einsum("bka,bla->bkl", f, h, precision=_HI)


def _dense(f, dtype) -> jax.Array:
    if isinstance(f, Index):
        return jax.nn.one_hot(f.ids, f.size, dtype=dtype)
    return f


def _sq_norm(uses: list[Use], dtype) -> jax.Array:
    """Squared norm of ``sum over uses`` of the per-example gradient, per example: ``(B,)``."""
    if all(u.b is None for u in uses):
        total = sum(jnp.sum(_dense(u.a, dtype), axis=1) for u in uses)
        return jnp.sum(total * total, axis=-1)
    uses = [u if u.b is not None else Use(u.a, jnp.ones((*_batch_k(u.a), 1), dtype)) for u in uses]
    k_total = sum(_k(u.a) for u in uses)
    size = _width(uses[0].a) * _width(uses[0].b)
    if k_total * k_total <= size:  # the Gram ("ghost") form is the smaller one
        out = 0.0
        for i, u in enumerate(uses):
            for j in range(i, len(uses)):
                v = uses[j]
                term = jnp.sum(_inner(u.a, v.a) * _inner(u.b, v.b), axis=(1, 2))
                out = out + (term if i == j else 2.0 * term)
        return out
    grad = 0.0
    for u in uses:  # the per-example gradient of this leaf, (B, dA, dB)
        if isinstance(u.a, Index):
            b = u.b
            grad = grad + jax.vmap(lambda ids, bb: jnp.zeros((u.a.size, bb.shape[-1]), dtype).at[ids].add(bb))(u.a.ids, b)
        else:
            grad = grad + jnp.einsum("bka,bkc->bac", u.a, u.b, precision=_HI)
    return jnp.sum(grad * grad, axis=(1, 2))


def _batch_k(f):
    return f.ids.shape if isinstance(f, Index) else f.shape[:2]


# --- per-layer rules ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one module class's parameters get their factors.

    ``ranks(module)`` gives the ranks of one call's input and output (the axes before
    them are batch, sequence and repeated-call axes), or ``None`` where this module's
    configuration is not covered. ``factors(module, x, g)`` gets the input ``x`` of shape
    ``(B, L, *input)`` and output gradient ``g`` of shape ``(B, L, *output)`` and returns
    ``{attribute name: Use}``.
    """

    ranks: Callable[[Any], Optional[tuple[int, int]]]
    factors: Callable[[Any, jax.Array, jax.Array], dict[str, Use]]
    params: Callable[[Any], tuple[str, ...]]


RULES: dict[type, Rule] = {}


def rule_for(module) -> Optional[Rule]:
    """The rule for ``module``: its class's (or a base's, when ``__call__`` is inherited)."""
    call = type(module).__call__
    for cls in type(module).__mro__:
        rule = RULES.get(cls)
        if rule is not None:
            return rule if call is cls.__call__ and rule.ranks(module) is not None else None
    return None


def _flat(x, rank):
    """``(B, L, *feat)`` -> ``(B, L * prod(feat[:-?]) ...)``: keep the last ``rank`` axes, flattened to one."""
    b, l = x.shape[:2]
    return x.reshape(b, l, int(np.prod(x.shape[2:], dtype=int)))


def _params(*names):
    return lambda m: tuple(n for n in names if getattr(m, n, None) is not None)


def _as_vectors(x, rank):
    """``(B, L, *s)`` with ``rank`` feature axes -> ``(B, L, prod(s))`` (rank 0: ``(B, L, 1)``)."""
    return x.reshape(*x.shape[:2], -1) if rank else x[..., None]


def _unit_affine(module, ones: dict, apply: Callable, x):
    """Apply a normalisation ``module`` with its scale at one and its bias at zero to ``(B, L, *s)``."""
    b, l = x.shape[:2]
    xhat = apply(module, ones, x.reshape(b * l, *x.shape[2:]))
    return xhat.reshape(x.shape)


def _register_equinox():
    import equinox as eqx

    def lin_ranks(m):
        return (0 if m.in_features == "scalar" else 1, 0 if m.out_features == "scalar" else 1)

    def lin_factors(m, x, g):
        ri, ro = lin_ranks(m)
        gv = _as_vectors(g, ro)
        out = {"weight": Use(gv, _as_vectors(x, ri))}
        if m.bias is not None:
            out["bias"] = Use(gv, None)
        return out

    RULES[eqx.nn.Linear] = Rule(lin_ranks, lin_factors, _params("weight", "bias"))

    def emb_factors(m, x, g):
        return {"weight": Use(Index(x.reshape(*x.shape[:2]), m.weight.shape[0]), g)}

    RULES[eqx.nn.Embedding] = Rule(lambda m: (0, 1), emb_factors, _params("weight"))

    def norm_rule(cls):
        def ranks(m):
            r = len(m.shape)
            return (r, r)

        def factors(m, x, g):
            out = {}
            gv = _flat(g, 0)
            if m.use_weight:
                unit = eqx.tree_at(lambda n: n.weight, m, jnp.ones_like(m.weight))
                if m.use_bias:
                    unit = eqx.tree_at(lambda n: n.bias, unit, jnp.zeros_like(m.bias))
                b, l = x.shape[:2]
                xhat = jax.vmap(unit)(x.reshape(b * l, *x.shape[2:])).reshape(x.shape)
                out["weight"] = Use(gv * _flat(xhat, 0).astype(gv.dtype), None)
            if m.use_bias:
                out["bias"] = Use(gv, None)
            return out

        RULES[cls] = Rule(ranks, factors, _params("weight", "bias"))

    norm_rule(eqx.nn.LayerNorm)
    norm_rule(eqx.nn.RMSNorm)

    def conv_ranks(m):
        if m.groups != 1 or m.padding_mode != "ZEROS":
            return None
        return (m.num_spatial_dims + 1, m.num_spatial_dims + 1)

    def conv_factors(m, x, g):
        b, l = x.shape[:2]
        xs = x.reshape(b * l, *x.shape[2:])
        patches = jax.lax.conv_general_dilated_patches(
            xs, m.kernel_size, m.stride, m.padding, rhs_dilation=m.dilation, precision=_HI
        )  # (N, in * prod(k), *out_spatial), features ordered (in, *k) as the weight's
        p = patches.reshape(b, l, patches.shape[1], -1)
        bfac = jnp.moveaxis(p, 2, 3).reshape(b, -1, patches.shape[1])
        gv = jnp.moveaxis(g.reshape(b, l, g.shape[2], -1), 2, 3).reshape(b, -1, g.shape[2])
        out = {"weight": Use(gv, bfac.astype(gv.dtype))}
        if m.use_bias:
            out["bias"] = Use(gv, None)
        return out

    RULES[eqx.nn.Conv] = Rule(conv_ranks, conv_factors, _params("weight", "bias"))


def _register_nnx():
    from flax import nnx

    def lin_factors(m, x, g):
        gv = _flat(g, 1)
        out = {"kernel": Use(_flat(x, 1), gv)}
        if m.bias is not None:
            out["bias"] = Use(gv, None)
        return out

    RULES[nnx.Linear] = Rule(lambda m: (1, 1), lin_factors, _params("kernel", "bias"))

    def emb_factors(m, x, g):
        return {"embedding": Use(Index(x.reshape(*x.shape[:2]), m.num_embeddings), g)}

    RULES[nnx.Embed] = Rule(lambda m: (0, 1), emb_factors, _params("embedding"))

    def last_axis(m):
        axes = [a if isinstance(a, int) else None for a in np.atleast_1d(np.array(m.reduction_axes, dtype=object))]
        feats = [a if isinstance(a, int) else None for a in np.atleast_1d(np.array(m.feature_axes, dtype=object))]
        return axes == [-1] and feats == [-1]

    def norm_rule(cls, scale_attr, bias_attr):
        def factors(m, x, g):
            out = {}
            gv = _flat(g, 1)
            if getattr(m, scale_attr, None) is not None:
                graphdef, state = nnx.split(m)
                unit = jax.tree.map(lambda v: v, state)
                unit[scale_attr] = jax.tree.map(jnp.ones_like, state[scale_attr])
                if getattr(m, bias_attr or "", None) is not None:
                    unit[bias_attr] = jax.tree.map(jnp.zeros_like, state[bias_attr])
                b, l = x.shape[:2]
                xhat = nnx.merge(graphdef, unit)(x.reshape(b * l, x.shape[-1])).reshape(x.shape)
                out[scale_attr] = Use(gv * _flat(xhat, 1).astype(gv.dtype), None)
            if bias_attr and getattr(m, bias_attr, None) is not None:
                out[bias_attr] = Use(gv, None)
            return out

        RULES[cls] = Rule(lambda m: (1, 1) if last_axis(m) else None, factors, _params(scale_attr, bias_attr or scale_attr))

    norm_rule(nnx.LayerNorm, "scale", "bias")
    norm_rule(nnx.RMSNorm, "scale", None)

    def conv_padding(m):
        pad = m.padding
        if isinstance(pad, str):
            return pad.upper() if pad.upper() in ("SAME", "VALID") else None
        d = len(m.kernel_size)
        if isinstance(pad, int):
            return [(pad, pad)] * d
        try:
            pairs = [(p, p) if isinstance(p, int) else tuple(p) for p in pad]
        except TypeError:
            return None
        return pairs if len(pairs) == d and all(len(p) == 2 for p in pairs) else None

    def conv_ranks(m):
        if m.feature_group_count != 1 or m.mask is not None or conv_padding(m) is None:
            return None
        return (len(m.kernel_size) + 1, len(m.kernel_size) + 1)

    def bcast(v, d):
        if v is None:
            return (1,) * d
        return (v,) * d if isinstance(v, int) else tuple(v)

    def conv_factors(m, x, g):
        d = len(m.kernel_size)
        b, l = x.shape[:2]
        xs = jnp.moveaxis(x.reshape(b * l, *x.shape[2:]), -1, 1)  # NHWC -> NCHW
        patches = jax.lax.conv_general_dilated_patches(
            xs,
            m.kernel_size,
            bcast(m.strides, d),
            conv_padding(m),
            lhs_dilation=bcast(m.input_dilation, d),
            rhs_dilation=bcast(m.kernel_dilation, d),
            precision=_HI,
        )  # (N, in * prod(k), *out_spatial), features ordered (in, *k)
        cin = x.shape[-1]
        p = patches.reshape(b, l, cin, *m.kernel_size, -1)
        p = jnp.moveaxis(p, 2, 2 + d)  # features (*k, in), as the kernel (*k, in, out)
        bfac = jnp.moveaxis(p.reshape(b, l, cin * math.prod(m.kernel_size), -1), 2, 3)
        bfac = bfac.reshape(b, -1, bfac.shape[-1])
        gv = g.reshape(b, -1, g.shape[-1])
        out = {"kernel": Use(bfac.astype(gv.dtype), gv)}
        if m.bias is not None:
            out["bias"] = Use(gv, None)
        return out

    RULES[nnx.Conv] = Rule(conv_ranks, conv_factors, _params("kernel", "bias"))


_REGISTERED: set = set()


def _ensure_rules(framework: str) -> None:
    if framework not in _REGISTERED:
        {"equinox": _register_equinox, "nnx": _register_nnx}[framework]()
        _REGISTERED.add(framework)


# --- the model: its differentiated leaves, and which layer uses which ----------------


@dataclasses.dataclass
class _Layer:
    path: str
    module: Any
    rule: Rule
    leaves: dict  # attribute name -> index into _Plan.leaves


@dataclasses.dataclass
class _Plan:
    leaves: list  # the differentiated arrays, in the order of the gradients' leaves
    run_model: Callable  # leaves -> the tagged model, to call ``fun`` with
    plain_model: Callable  # leaves -> the untagged model (for the vmap fallback)
    out: Callable  # list of per-leaf values -> the user's structure (eqx.filter_grad's / nnx.grad's)
    layers: list
    names: list  # leaf index -> "path" (for errors)
    owners: list  # leaf index -> (module path, class name)
    blocked: set  # leaf indices that no rule may claim (an eqx.nn.Shared we could not resolve)


class _Tok:
    """A stand-in leaf: which position of the flattened model a module's attribute is."""

    def __init__(self, i):
        self.i = i

    def __repr__(self):
        return f"_Tok({self.i})"


def _keystr(kp) -> str:
    parts = []
    for k in kp:
        name = getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))
        parts.append(str(name))
    return ".".join(parts)


def _is_eqx(model) -> bool:
    eqx = __import__("sys").modules.get("equinox")
    return eqx is not None and isinstance(model, eqx.Module)


def _is_nnx(model) -> bool:
    import sys

    if "flax" not in sys.modules:
        return False
    from flax import nnx

    return isinstance(model, nnx.Module)


def _record(records):
    def where(path, module):
        rule = rule_for(module)
        if rule is not None:
            records.append((path, module, rule))
        return rule is not None

    return where


def _eqx_plan(model) -> _Plan:
    import equinox as eqx

    from . import tag_modules

    _ensure_rules("equinox")
    records: list = []
    tagged = tag_modules(model, where=_record(records), inputs=True)
    flat, treedef = jax.tree_util.tree_flatten_with_path(model)
    kp_index = {kp: i for i, (kp, _) in enumerate(flat)}
    inexact = [eqx.is_inexact_array(leaf) for _, leaf in flat]
    diff_pos = [i for i, d in enumerate(inexact) if d]
    rank = {i: r for r, i in enumerate(diff_pos)}

    # eqx.nn.Shared ties leaves: at call time `where` nodes become `get` nodes. Find out
    # which position each stand-in stands for by running it on tokens.
    stand_in = lambda i, leaf: leaf if callable(leaf) else _Tok(i)  # noqa: E731  (Shared's where/get are leaves)
    tokens = jax.tree_util.tree_unflatten(treedef, [stand_in(i, leaf) for i, (_, leaf) in enumerate(flat)])
    alias: dict = {}
    blocked: set = set()
    is_shared = lambda x: isinstance(x, eqx.nn.Shared)  # noqa: E731
    for node in jax.tree_util.tree_leaves(tokens, is_leaf=is_shared):
        if not is_shared(node):
            continue
        stored = jax.tree_util.tree_leaves(node.pytree)
        try:
            resolved = jax.tree_util.tree_leaves(node())
        except Exception:  # `get` computes (a transpose): leave every leaf under it to the fallback
            blocked.update(t.i for t in stored if isinstance(t, _Tok))
            continue
        for s, r in zip(stored, resolved):
            if isinstance(s, _Tok) and isinstance(r, _Tok) and s.i != r.i:
                alias[s.i] = r.i

    ids = {id(m) for _, m, _ in records}
    found: dict = {}
    for kp, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: id(x) in ids)[0]:
        if id(node) in ids:
            found.setdefault(id(node), []).append(kp)
    seen: dict = {}
    layers = []
    owners: list = [None] * len(diff_pos)
    for path, module, rule in records:
        kps = found.get(id(module), [])
        n = seen.get(id(module), 0)
        seen[id(module)] = n + 1
        if n >= len(kps):
            continue
        leaves = {}
        for attr in rule.params(module):
            i = kp_index.get((*kps[n], jax.tree_util.GetAttrKey(attr)))
            i = alias.get(i, i)
            if i is not None and i in rank:
                leaves[attr] = rank[i]
        layers.append(_Layer(path, module, rule, leaves))
    for i, (kp, _) in enumerate(flat):
        if i in rank:
            owners[rank[i]] = _owner(model, kp)

    diff, nondiff = eqx.partition(tagged, eqx.is_inexact_array)
    ddef = jax.tree_util.tree_structure(diff)
    plain_diff, plain_nondiff = eqx.partition(model, eqx.is_inexact_array)
    pdef = jax.tree_util.tree_structure(plain_diff)
    return _Plan(
        leaves=jax.tree_util.tree_leaves(diff),
        run_model=lambda ls: eqx.combine(jax.tree_util.tree_unflatten(ddef, ls), nondiff),
        plain_model=lambda ls: eqx.combine(jax.tree_util.tree_unflatten(pdef, ls), plain_nondiff),
        out=lambda ls: jax.tree_util.tree_unflatten(pdef, ls),
        layers=layers,
        names=[_keystr(flat[i][0]) for i in diff_pos],
        owners=owners,
        blocked={rank[i] for i in blocked if i in rank},
    )


def _owner(model, kp):
    """The innermost module on the path ``kp`` to a leaf: ``(its path, its class name)``."""
    node, path, owner = model, [], ("", type(model).__name__)
    for k in kp[:-1]:
        try:
            if isinstance(k, jax.tree_util.GetAttrKey):
                node = getattr(node, k.name)
            elif isinstance(k, jax.tree_util.SequenceKey):
                node = node[k.idx]
            elif isinstance(k, jax.tree_util.DictKey):
                node = node[k.key]
            else:
                break
        except Exception:
            break
        path.append(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))))
        if hasattr(node, "__call__") and hasattr(type(node), "__dataclass_fields__"):
            owner = (".".join(path), type(node).__name__)
    return owner


def _nnx_plan(model) -> _Plan:
    from flax import nnx

    from . import tag_modules

    _ensure_rules("nnx")
    records: list = []
    tagged = tag_modules(model, where=_record(records), inputs=True)

    def state_path(kp):
        keys = [k.key for k in kp if isinstance(k, jax.tree_util.DictKey)]
        return tuple(keys)

    graphdef, params, rest = nnx.split(tagged, nnx.Param, ...)
    flat, pdef = jax.tree_util.tree_flatten_with_path(params)
    diff_pos = [i for i, (_, leaf) in enumerate(flat) if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    rank = {i: r for r, i in enumerate(diff_pos)}
    index = {state_path(kp): i for i, (kp, _) in enumerate(flat)}
    var_path: dict = {}
    modules: dict = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            var_path.setdefault(id(node), tuple(path))
        elif isinstance(node, nnx.Module):
            modules.setdefault(tuple(path), type(node).__name__)
    layers = []
    for path, module, rule in records:
        leaves = {}
        for attr in rule.params(module):
            var = getattr(module, attr, None)
            i = index.get(var_path.get(id(var)))
            if i is not None and i in rank:
                leaves[attr] = rank[i]
        layers.append(_Layer(path, module, rule, leaves))
    owners = []
    for i in diff_pos:
        p = state_path(flat[i][0])[:-1]
        while p and p not in modules:
            p = p[:-1]
        owners.append((".".join(map(str, p)), modules.get(p, type(model).__name__)))

    plain_graphdef, _, plain_rest = nnx.split(model, nnx.Param, ...)
    fixed = [leaf for _, leaf in flat]

    def full(ls):
        out = list(fixed)
        for r, i in enumerate(diff_pos):
            out[i] = ls[r]
        return jax.tree_util.tree_unflatten(pdef, out)

    def out(ls):
        vals = [None] * len(flat)
        for r, i in enumerate(diff_pos):
            vals[i] = ls[r]
        for i in range(len(flat)):
            if vals[i] is None:
                vals[i] = jnp.zeros_like(fixed[i])
        return jax.tree_util.tree_unflatten(pdef, vals)

    return _Plan(
        leaves=[flat[i][1] for i in diff_pos],
        run_model=lambda ls: nnx.merge(graphdef, full(ls), rest),
        plain_model=lambda ls: nnx.merge(plain_graphdef, full(ls), plain_rest),
        out=out,
        layers=layers,
        names=[".".join(map(str, state_path(flat[i][0]))) for i in diff_pos],
        owners=owners,
        blocked=set(),
    )


def _plan(model) -> _Plan:
    if _is_eqx(model):
        return _eqx_plan(model)
    if _is_nnx(model):
        return _nnx_plan(model)
    raise TypeError(
        "jaxtrace.per_example_norms and jaxtrace.clipped_grad differentiate an equinox or Flax NNX "
        f"model, which they tag themselves; got a {type(model).__name__}."
    )


# --- the pass ------------------------------------------------------------------------


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _batch_axis(shape, n_lead, batch, probe_shape):
    """Which of the leading axes is the batch axis, or ``None``."""
    lead = shape[:n_lead]
    cands = [i for i, s in enumerate(lead) if s == batch]
    if len(cands) == 1:
        return cands[0]
    if probe_shape is None or len(probe_shape) != len(shape):
        return None
    diff = [i for i in range(n_lead) if probe_shape[i] != shape[i]]
    return diff[0] if len(diff) == 1 and diff[0] in cands else None


def _to_bl(x, axis, n_lead):
    """Batch axis first, the other leading axes flattened into one: ``(B, L, *rest)``."""
    x = jnp.moveaxis(x, axis, 0)
    return x.reshape(x.shape[0], -1, *x.shape[n_lead:])


class _Call:
    """One call of a per-example transform: the pass, the norms and (for clipping) a second pullback."""

    def __init__(self, fun, argnums, fallback, args, kwargs, needs):
        if not isinstance(argnums, int):
            raise TypeError(f"argnums must be an int (the position of the model), got {argnums!r}.")
        if fallback not in ("vmap", "error"):
            raise ValueError(f'fallback must be "vmap" or "error", got {fallback!r}.')
        self.fun, self.argnums, self.fallback, self.kwargs = fun, argnums, fallback, kwargs
        self.args = list(args)
        self.plan = plan = _plan(args[argnums])
        names = set()
        for layer in plan.layers:
            names.update((layer.path, layer.path + INPUT_SUFFIX))
        self.tag_names = names
        self.losses, self.pullback, self.values = _vjp(
            self._call_with, plan.leaves, with_values=True, tags=lambda n: n in names
        )
        if jnp.ndim(self.losses) != 1:
            raise ValueError(
                "jaxtrace.per_example_norms and jaxtrace.clipped_grad need `fun` to return one loss per "
                f"example, of shape (batch,); got shape {jnp.shape(self.losses)}."
            )
        self.batch = self.losses.shape[0]

    def _call_with(self, leaves, model_fn=None, args=None):
        args = list(self.args if args is None else args)
        args[self.argnums] = (model_fn or self.plan.run_model)(leaves)
        return self.fun(*args, **self.kwargs)

    def _others(self):
        return [a for i, a in enumerate(self.args) if i != self.argnums]

    def _with_others(self, others):
        it = iter(others)
        return [self.args[i] if i == self.argnums else next(it) for i in range(len(self.args))]

    def _probe(self):
        """Tag shapes for a batch of one: tells the batch axis apart from axes of the same size."""
        flat, tdef = jax.tree_util.tree_flatten(self._others())
        sliced = [a[:1] if _batched(a, self.batch) else a for a in flat]
        where = [k for k, a in enumerate(sliced) if _is_array(a)]

        def shapes(*arrays):
            vals = list(sliced)
            for k, a in zip(where, arrays):
                vals[k] = a
            full = self._with_others(jax.tree_util.tree_unflatten(tdef, vals))
            run = _capture(lambda lv: self._call_with(lv, args=full), tags=lambda n: n in self.tag_names)
            return run(self.plan.leaves)[1]

        try:
            return jax.eval_shape(shapes, *[sliced[k] for k in where])
        except Exception:  # a model that cannot run on one example: its ambiguous layers fall back
            return {}

    def sq_norms(self):
        """Per-leaf squared norms ``(B,)``, in the order of ``plan.leaves``."""
        plan, batch = self.plan, self.batch
        (leaf_cts,), tag_cts = self.pullback(jnp.ones_like(self.losses))
        dtypes = [_compute_dtype(jnp.result_type(leaf)) for leaf in plan.leaves]
        if batch == 1:
            return [jnp.sum(jnp.square(c.astype(dt)))[None] for c, dt in zip(leaf_cts, dtypes)]
        uses: dict = {}
        bad = set(plan.blocked)
        probe = None
        for layer in plan.layers:
            if not layer.leaves:
                continue
            if layer.path not in tag_cts:  # never called: its leaves' gradients are zero
                continue
            x, g = self.values.get(layer.path + INPUT_SUFFIX), tag_cts[layer.path]
            ri, ro = layer.rule.ranks(layer.module)
            ok = isinstance(x, jax.Array) and isinstance(g, jax.Array)
            n_lead = x.ndim - ri if ok else 0
            ok = ok and n_lead >= 1 and g.ndim - ro == n_lead and x.shape[:n_lead] == g.shape[:n_lead]
            axis = None
            if ok:
                axis = _batch_axis(x.shape, n_lead, batch, None)
                if axis is None and x.shape[:n_lead].count(batch) > 1:
                    probe = self._probe() if probe is None else probe
                    p = probe.get(layer.path + INPUT_SUFFIX)
                    axis = _batch_axis(x.shape, n_lead, batch, getattr(p, "shape", None))
            if axis is None:
                bad.update(layer.leaves.values())
                continue
            dt = functools.reduce(jnp.promote_types, [dtypes[i] for i in layer.leaves.values()], _compute_dtype(g.dtype))
            xb = _to_bl(x if not jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(dt), axis, n_lead)
            gb = _to_bl(g.astype(dt), axis, n_lead)
            for attr, use in layer.rule.factors(layer.module, xb, gb).items():
                if attr in layer.leaves:
                    uses.setdefault(layer.leaves[attr], []).append(use)
        out: list = [None] * len(plan.leaves)
        for i, us in uses.items():
            if i not in bad:
                out[i] = _sq_norm(us, dtypes[i]).astype(dtypes[i])
        missing = [i for i in range(len(out)) if out[i] is None]
        if missing:
            for i, v in zip(missing, self._fallback(missing, dtypes)):
                out[i] = v
        return out

    def _fallback(self, missing, dtypes):
        plan = self.plan
        if self.fallback == "error":
            lines = [
                f"  {plan.names[i]!r} (in module {plan.owners[i][0]!r}, {plan.owners[i][1]})" for i in missing
            ]
            raise TagError(
                "jaxtrace.per_example_norms has no per-layer rule for these leaves (a rule covers "
                "Linear, Embedding, LayerNorm, RMSNorm and Conv layers called by their __call__ with "
                "the batch on a leading axis):\n" + "\n".join(lines) + "\nPass fallback=\"vmap\" to "
                "compute them with jax.vmap(jax.grad), for those leaves only."
            )
        fixed = list(plan.leaves)
        flat, tdef = jax.tree_util.tree_flatten(self._others())
        where = [k for k, a in enumerate(flat) if _batched(a, self.batch)]

        def one(sub, batched):
            ls = list(fixed)
            for i, v in zip(missing, sub):
                ls[i] = v
            args = list(flat)
            for k, a in zip(where, batched):
                args[k] = a[None]
            full = self._with_others(jax.tree_util.tree_unflatten(tdef, args))
            return self._call_with(ls, model_fn=plan.plain_model, args=full)[0]

        per = jax.vmap(jax.grad(one), in_axes=(None, 0))([fixed[i] for i in missing], [flat[k] for k in where])
        return [
            jnp.sum(jnp.square(p.astype(dtypes[i])).reshape(p.shape[0], -1), axis=1) for i, p in zip(missing, per)
        ]


def _is_array(a) -> bool:
    return isinstance(a, (jax.Array, np.ndarray))


def _batched(a, batch) -> bool:
    return _is_array(a) and np.ndim(a) >= 1 and np.shape(a)[0] == batch


# --- the public functions ---------------------------------------------------------


def per_example_norms(fun: Callable, argnums: int = 0, *, fallback: str = "vmap", total: bool = False) -> Callable:
    """Each example's squared parameter-gradient norm, per leaf, without a per-example gradient.

    ``fun(model, *batch)`` returns one loss per example, shape ``(B,)``; ``model`` (the
    argument at ``argnums``) is an equinox or Flax NNX model, untagged. The returned
    function gives ``(losses, sq_norms)``: ``sq_norms`` has the structure of the model's
    gradients (what ``eqx.filter_grad`` gives, for NNX what ``nnx.grad`` gives), each leaf
    of shape ``(B,)``: ``|d losses[i] / d leaf|**2``. With ``total=True`` it gives
    ``(losses, total_sq_norms)`` instead, summed over the leaves (the squared norm of each
    example's whole gradient).

    One pass (one forward, one backward of ``sum(losses)``) gives every covered layer's
    input and output gradient, and from them its parameters' per-example norms: Linear with
    any leading axes (per leaf, the Gram "ghost norm" form or the per-example gradient of
    that layer, whichever is smaller), Embedding, LayerNorm/RMSNorm scale and bias, and
    Conv (patches). Tied weights and a layer called several times are one gradient per
    example (their uses are summed, with the cross terms). Other leaves: with
    ``fallback="vmap"`` they are computed with ``jax.vmap(jax.grad)`` for those leaves
    alone, splitting every argument array whose first axis has length ``B`` into examples
    (keyword arguments and other arguments are passed to every example as they are);
    ``fallback="error"`` raises ``jt.TagError`` naming them and their modules.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> def losses(model, x, y):
        ...     return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> losses, sq = eqx.filter_jit(jt.per_example_norms(losses, total=True))(model, x, y)
        >>> sq.shape
        (4,)
    """

    @functools.wraps(fun)
    def norms_fun(*args, **kwargs):
        call = _Call(fun, argnums, fallback, args, kwargs, "norms")
        sq = call.sq_norms()
        if total:
            return call.losses, functools.reduce(jnp.add, sq) if sq else jnp.zeros_like(call.losses)
        return call.losses, call.plan.out(sq)

    return norms_fun


def clipped_grad(fun: Callable, max_norm, argnums: int = 0, *, fallback: str = "vmap") -> Callable:
    """The clipped sum of DP-SGD: ``sum_i min(1, max_norm / |g_i|) g_i``, without per-example gradients.

    ``fun(model, *batch)`` returns one loss per example, shape ``(B,)``; ``g_i`` is the
    gradient of ``losses[i]`` for all of the model's differentiated leaves together. The
    returned function gives ``(losses, grads)``, ``grads`` structured as ``eqx.filter_grad``
    gives them (for an NNX model, as ``nnx.grad`` does). The norms come from
    ``per_example_norms`` (one forward and one backward pass); the clipped sum is a second
    backward pass, of ``sum_i w_i losses[i]`` with ``w_i = min(1, max_norm / |g_i|)``, from
    the same forward pass. ``max_norm`` may be a traced value under ``jax.jit``; the
    result is differentiable in everything (``jax.grad`` around it works as around the
    ``vmap(grad)`` formula). ``fallback`` is as for ``per_example_norms``.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp, jaxtrace as jt
        >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
        >>> def losses(model, x, y):
        ...     return jnp.sum((jax.vmap(model)(x) - y) ** 2, axis=-1)
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> losses, grads = eqx.filter_jit(jt.clipped_grad(losses, 1.0))(model, x, y)
        >>> grads.layers[0].weight.shape
        (8, 3)
    """

    @functools.wraps(fun)
    def clipped_fun(*args, **kwargs):
        call = _Call(fun, argnums, fallback, args, kwargs, "clip")
        sq = call.sq_norms()
        sq_total = functools.reduce(jnp.add, sq) if sq else jnp.zeros(call.losses.shape, jnp.float32)
        weights = clip_weights(sq_total, max_norm)
        (grads,), _ = call.pullback(weights.astype(call.losses.dtype))
        return call.losses, call.plan.out(list(grads))

    return clipped_fun


def clip_weights(sq_norms: jax.Array, max_norm) -> jax.Array:
    """``min(1, max_norm / sqrt(sq_norms))``, with finite derivatives at zero norms."""
    max_norm = jnp.asarray(max_norm, sq_norms.dtype)
    over = sq_norms > max_norm * max_norm
    safe = jnp.where(over, sq_norms, 1.0)
    return jnp.where(over, max_norm * jax.lax.rsqrt(safe), 1.0)
