"""The plan of a model: its differentiated leaves, and which covered layer uses which.

``plan_for(model)`` tags an equinox or Flax NNX model's covered layers (their inputs and
outputs), lists its differentiated leaves in the order of its gradients' leaves, and maps
each covered layer's parameters to those leaves (tied weights and ``eqx.nn.Shared``
resolved), with the leaf names and owning modules that errors name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .._frameworks import is_nnx_module
from .._paths import key_name, path_name
from .._tag_modules import tag_module_calls
from ._rules import Rule, ensure_rules, rule_for


@dataclasses.dataclass
class Layer:
    path: str
    module: Any
    rule: Rule
    leaves: dict  # attribute name -> index into Plan.leaves


@dataclasses.dataclass
class Plan:
    leaves: list  # the differentiated arrays, in the order of the gradients' leaves
    run_model: Callable  # leaves -> the tagged model, to call ``fun`` with
    plain_model: Callable  # leaves -> the untagged model (for the vmap fallback)
    out: Callable  # list of per-leaf values -> the user's structure (eqx.filter_grad's / nnx.grad's)
    layers: list
    names: list  # leaf index -> "path" (for errors)
    owners: list  # leaf index -> (module path, class name)
    blocked: set  # leaf indices that no rule may claim (an eqx.nn.Shared we could not resolve)
    state_of: Callable = lambda model: ()  # the model after a call -> the state it changed (NNX: RNG counts, statistics)
    write_back: Callable = lambda state: None  # that state -> written into the user's model, as nnx.grad does


class _Tok:
    """A stand-in leaf: which position of the flattened model a module's attribute is."""

    def __init__(self, i):
        self.i = i

    def __repr__(self):
        return f"_Tok({self.i})"


def _is_eqx(model) -> bool:
    eqx = __import__("sys").modules.get("equinox")
    return eqx is not None and isinstance(model, eqx.Module)


def _is_nnx(model) -> bool:
    if not is_nnx_module(model):  # no class of flax.nnx in its MRO: not an nnx.Module (Flax not imported)
        return False
    from flax import nnx  # loaded already: the model's classes come from it

    return isinstance(model, nnx.Module)  # not an nnx.Variable, nnx.State, nnx.Rngs, ...


def _record(records):
    def where(path, module):
        rule = rule_for(module)
        if rule is not None:
            records.append((path, module, rule))
        return rule is not None

    return where


def _tag(model, records: list):
    """``model`` with each covered layer's input, output and parameters tagged (the parameters where
    the layer reads them: ``_proof`` checks they are the leaves)."""
    return tag_module_calls(model, where=_record(records), inputs=True, params_of=lambda m: rule_for(m).params(m))


def _eqx_plan(model) -> Plan:
    import equinox as eqx

    ensure_rules("equinox")
    records: list = []
    tagged = _tag(model, records)
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
        layers.append(Layer(path, module, rule, leaves))
    for i, (kp, _) in enumerate(flat):
        if i in rank:
            owners[rank[i]] = _owner(model, kp)

    diff, nondiff = eqx.partition(tagged, eqx.is_inexact_array)
    ddef = jax.tree_util.tree_structure(diff)
    plain_diff, plain_nondiff = eqx.partition(model, eqx.is_inexact_array)
    pdef = jax.tree_util.tree_structure(plain_diff)
    return Plan(
        leaves=jax.tree_util.tree_leaves(diff),
        run_model=lambda ls: eqx.combine(jax.tree_util.tree_unflatten(ddef, ls), nondiff),
        plain_model=lambda ls: eqx.combine(jax.tree_util.tree_unflatten(pdef, ls), plain_nondiff),
        out=lambda ls: jax.tree_util.tree_unflatten(pdef, ls),
        layers=layers,
        names=[path_name(flat[i][0]) for i in diff_pos],
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
        path.append(key_name(k))
        if hasattr(node, "__call__") and hasattr(type(node), "__dataclass_fields__"):
            owner = (".".join(path), type(node).__name__)
    return owner


def _nnx_plan(model) -> Plan:
    from flax import nnx

    ensure_rules("nnx")
    records: list = []
    tagged = _tag(model, records)

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
        layers.append(Layer(path, module, rule, leaves))
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

    return Plan(
        leaves=[flat[i][1] for i in diff_pos],
        # The non-parameter state enters each trace as fresh Variables (tree_map rebuilds them), so
        # that a module may update it there (nnx.Dropout's RNG count); state_of reads it back.
        run_model=lambda ls: nnx.merge(graphdef, full(ls), jax.tree_util.tree_map(lambda x: x, rest)),
        plain_model=lambda ls: nnx.merge(plain_graphdef, full(ls), jax.tree_util.tree_map(lambda x: x, plain_rest)),
        out=out,
        layers=layers,
        names=[".".join(map(str, state_path(flat[i][0]))) for i in diff_pos],
        owners=owners,
        blocked=set(),
        state_of=lambda m: nnx.split(m, nnx.Param, ...)[2],
        write_back=lambda state: nnx.update(model, state),
    )


def plan_for(model) -> Plan:
    if _is_eqx(model):
        return _eqx_plan(model)
    if _is_nnx(model):
        return _nnx_plan(model)
    raise TypeError(
        "jaxtrace.per_example_norms and jaxtrace.clipped_grad differentiate an equinox or Flax NNX "
        f"model, which they tag themselves; got a {type(model).__name__}."
    )
