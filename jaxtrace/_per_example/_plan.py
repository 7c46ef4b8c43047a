"""The plan of a model: its differentiated leaves, and which covered layer uses which.

``plan_for(model)`` tags an equinox or Flax NNX model's covered layers (their inputs,
outputs and parameters; ``Plan.roles`` says what each of those tags marks, by its name), lists
its differentiated leaves in the order of its gradients' leaves, and maps each covered layer's
parameters to those leaves, with the leaf names and owning modules that errors name. The steps are one function for both frameworks; what
differs is a small adapter each (``_Equinox``, ``_Nnx``): the tree the gradients mirror and
which of its leaves are differentiated, where a layer's parameter sits in it (tied weights
and ``eqx.nn.Shared`` resolved), how the model is rebuilt from leaves, and (NNX) the state a
call changes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from .._frameworks import is_equinox_module, is_nnx_module
from .._module_tags import INPUT_SUFFIX, PARAMS_SUFFIX
from .._paths import key_name, path_name
from .._tag import new_scope
from .._tag_modules import tag_module_calls
from ._rules import Rule, ensure_rules, rule_for

__all__ = ["Layer", "Plan", "TagKind", "TagRole", "input_tags", "plan_for"]


class TagKind(enum.Enum):
    """What a tag of a covered layer marks."""

    OUTPUT = "output"  # its output, named by the layer's path
    INPUT = "input"  # its positional inputs, ``"<path>:in"``
    PARAM = "param"  # one of its parameters where it reads it, ``"<path>:params:<attribute>"``


@dataclasses.dataclass(frozen=True)
class TagRole:
    """What one of the plan's tags marks, looked up by the tag's name (``Plan.roles``), never parsed from it."""

    kind: TagKind
    layer: str  # the covered layer's path
    attribute: Optional[str] = None  # for a ``PARAM``: the parameter's attribute name


@dataclasses.dataclass
class Layer:
    """A covered layer of the model: its path (its tags' name), the module, its rule, and its leaves."""

    path: str
    module: Any
    rule: Rule
    leaves: dict  # attribute name -> index into Plan.leaves


@dataclasses.dataclass
class Plan:
    """A model's differentiated leaves and covered layers, and the functions that rebuild it from leaves."""

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
    scope: Any = None  # the scope of the layers' tags (``_tag.scoped``): seen by the pass only, not by transforms around it
    roles: dict = dataclasses.field(default_factory=dict)  # tag name -> TagRole, for every tag of a covered layer (of ``layers``)


def plan_for(model) -> Plan:
    """The plan of ``model``: its covered layers tagged, its differentiated leaves, which layer uses which.

    Args:
        model: an untagged equinox or Flax NNX module.

    Returns:
        The ``Plan``.

    Raises:
        TypeError: if ``model`` is neither.
    """
    adapter = _adapter_for(model)
    ensure_rules(adapter.package)
    records: list = []
    scope = new_scope()
    tagged = tag_module_calls(model, where=_record(records), inputs=True, params_of=lambda m: rule_for(m).params(m), scope=scope)
    frame = adapter(model, tagged)
    diff = [i for i, (_, leaf) in enumerate(frame.flat) if frame.differentiated(leaf)]
    rank = {i: r for r, i in enumerate(diff)}
    layers = []
    for (path, module, rule), where in zip(records, frame.positions(records)):
        if where is not None:
            layers.append(Layer(path, module, rule, {attr: rank[i] for attr, i in where.items() if i in rank}))
    return Plan(
        leaves=[frame.flat[i][1] for i in diff],
        layers=layers,
        names=[frame.name(frame.flat[i][0]) for i in diff],
        owners=[frame.owner(frame.flat[i][0]) for i in diff],
        blocked={rank[i] for i in frame.blocked if i in rank},
        **frame.rebuild(diff),
        scope=scope,
        roles=_roles(layers),
    )


def input_tags(plan: Plan) -> dict:
    """``{tag name: layer path}`` of the tags that mark ``plan``'s layers' inputs."""
    return {name: role.layer for name, role in plan.roles.items() if role.kind is TagKind.INPUT}


def _roles(layers: list) -> dict:
    """``{tag name: TagRole}`` for the tags ``tag_module_calls`` puts on the covered layers' calls."""
    roles = {}
    for layer in layers:
        path = layer.path
        roles[path] = TagRole(TagKind.OUTPUT, path)
        roles[path + INPUT_SUFFIX] = TagRole(TagKind.INPUT, path)
        roles.update({path + PARAMS_SUFFIX + a: TagRole(TagKind.PARAM, path, a) for a in layer.rule.params(layer.module)})
    return roles


def _adapter_for(model) -> type:
    if is_equinox_module(model):
        return _Equinox
    if is_nnx_module(model):
        return _Nnx
    raise TypeError(
        "jaxtrace.per_example_norms and jaxtrace.clipped_grad differentiate an equinox or Flax NNX "
        f"model, which they tag themselves; got a {type(model).__name__}."
    )


def _record(records: list) -> Callable:
    """A ``where=`` for ``tag_module_calls`` that selects the covered layers and records ``(path, module, rule)``."""

    def where(path, module):
        rule = rule_for(module)
        if rule is not None:
            records.append((path, module, rule))
        return rule is not None

    return where


# --- the adapters: what differs between frameworks ---------------------------------
#
# Each is built from (model, tagged model) and has: ``package`` (whose rules), ``flat`` (the
# (path, leaf) pairs of the tree the gradients mirror), ``differentiated(leaf)``, ``name(path)``,
# ``owner(path)``, ``positions(records)`` (per recorded layer, {attribute: index into flat}, or
# None where the model holds no such call), ``blocked`` (indices into flat no rule may claim)
# and ``rebuild(diff)`` (the Plan's functions, given the differentiated indices into flat).


class _Equinox:
    """Equinox: the gradients mirror the model itself (``eqx.filter_grad``); its inexact arrays are differentiated."""

    package = "equinox"

    def __init__(self, model, tagged):
        self.model, self.tagged = model, tagged
        self.flat, treedef = jax.tree_util.tree_flatten_with_path(model)
        self.alias, self.blocked = _shared_ties(self.flat, treedef)

    @staticmethod
    def differentiated(leaf) -> bool:
        import equinox as eqx

        return eqx.is_inexact_array(leaf)

    @staticmethod
    def name(kp) -> str:
        return path_name(kp)

    def owner(self, kp) -> tuple[str, str]:
        return _owner(self.model, kp)

    def positions(self, records) -> list[Optional[dict]]:
        """The n-th record of a module is its n-th place in the model (a module held twice is two layers)."""
        ids = {id(m) for _, m, _ in records}
        found: dict = {}
        for kp, node in jax.tree_util.tree_flatten_with_path(self.model, is_leaf=lambda x: id(x) in ids)[0]:
            if id(node) in ids:
                found.setdefault(id(node), []).append(kp)
        index = {kp: i for i, (kp, _) in enumerate(self.flat)}
        seen: dict = {}
        out: list = []
        for _, module, rule in records:
            kps, n = found.get(id(module), []), seen.get(id(module), 0)
            seen[id(module)] = n + 1
            if n >= len(kps):
                out.append(None)
                continue
            at = {attr: index.get((*kps[n], jax.tree_util.GetAttrKey(attr))) for attr in rule.params(module)}
            out.append({attr: self.alias.get(i, i) for attr, i in at.items() if i is not None})
        return out

    def rebuild(self, diff) -> dict:
        import equinox as eqx

        tagged_diff, tagged_rest = eqx.partition(self.tagged, eqx.is_inexact_array)
        tdef = jax.tree_util.tree_structure(tagged_diff)
        plain_diff, plain_rest = eqx.partition(self.model, eqx.is_inexact_array)
        pdef = jax.tree_util.tree_structure(plain_diff)
        return dict(
            run_model=lambda ls: eqx.combine(jax.tree_util.tree_unflatten(tdef, ls), tagged_rest),
            plain_model=lambda ls: eqx.combine(jax.tree_util.tree_unflatten(pdef, ls), plain_rest),
            out=lambda ls: jax.tree_util.tree_unflatten(pdef, ls),
        )


class _Tok:
    """A stand-in leaf: which position of the flattened model a module's attribute is."""

    def __init__(self, i):
        self.i = i

    def __repr__(self):
        return f"_Tok({self.i})"


def _shared_ties(flat, treedef) -> tuple[dict, set]:
    """The leaves ``eqx.nn.Shared`` ties: ``({position: the position it stands for}, {positions left to
    the fallback})``. At call time Shared's ``where`` nodes become ``get`` nodes; which position each
    stand-in stands for is found by running ``get`` on tokens."""
    import equinox as eqx

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
    return alias, blocked


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


class _Nnx:
    """Flax NNX: the gradients mirror the model's ``nnx.Param`` state (``nnx.grad``); its inexact leaves are
    differentiated, and the other state a call changes (RNG counts, statistics) is written back."""

    package = "flax"

    def __init__(self, model, tagged):
        from flax import nnx

        self.model = model
        self.graphdef, params, self.rest = nnx.split(tagged, nnx.Param, ...)
        self.flat, self.pdef = jax.tree_util.tree_flatten_with_path(params)
        self.blocked: set = set()
        self.var_path: dict = {}  # id of a Variable -> its state path
        self.modules: dict = {}  # state path of a module -> its class name
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Variable):
                self.var_path.setdefault(id(node), tuple(path))
            elif isinstance(node, nnx.Module):
                self.modules.setdefault(tuple(path), type(node).__name__)

    @staticmethod
    def differentiated(leaf) -> bool:
        return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)

    @staticmethod
    def name(kp) -> str:
        return ".".join(map(str, _state_path(kp)))

    def owner(self, kp) -> tuple[str, str]:
        p = _state_path(kp)[:-1]
        while p and p not in self.modules:
            p = p[:-1]
        return (".".join(map(str, p)), self.modules.get(p, type(self.model).__name__))

    def positions(self, records) -> list[Optional[dict]]:
        """A layer's parameter is found by its Variable (tied weights are one Variable)."""
        index = {_state_path(kp): i for i, (kp, _) in enumerate(self.flat)}
        out = []
        for _, module, rule in records:
            at = {attr: index.get(self.var_path.get(id(getattr(module, attr, None)))) for attr in rule.params(module)}
            out.append({attr: i for attr, i in at.items() if i is not None})
        return out

    def rebuild(self, diff) -> dict:
        from flax import nnx

        plain_graphdef, _, plain_rest = nnx.split(self.model, nnx.Param, ...)
        fixed = [leaf for _, leaf in self.flat]

        def params(ls, base):
            out = list(base)
            for r, i in enumerate(diff):
                out[i] = ls[r]
            return out

        full = lambda ls: jax.tree_util.tree_unflatten(self.pdef, params(ls, fixed))  # noqa: E731
        blank = [None] * len(fixed)
        return dict(
            # The non-parameter state enters each trace as fresh Variables (tree_map rebuilds them), so
            # that a module may update it there (nnx.Dropout's RNG count); state_of reads it back.
            run_model=lambda ls: nnx.merge(self.graphdef, full(ls), jax.tree_util.tree_map(lambda x: x, self.rest)),
            plain_model=lambda ls: nnx.merge(plain_graphdef, full(ls), jax.tree_util.tree_map(lambda x: x, plain_rest)),
            out=lambda ls: jax.tree_util.tree_unflatten(
                self.pdef, [jnp.zeros_like(f) if v is None else v for v, f in zip(params(ls, blank), fixed)]
            ),
            state_of=lambda m: nnx.split(m, nnx.Param, ...)[2],
            write_back=lambda state: nnx.update(self.model, state),
        )


def _state_path(kp) -> tuple:
    """An NNX state path (its dict keys) from a pytree path into an ``nnx.State``."""
    return tuple(k.key for k in kp if isinstance(k, jax.tree_util.DictKey))
