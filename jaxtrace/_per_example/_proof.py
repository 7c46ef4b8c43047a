"""The proof: what the traced program says about examples and weights, read equation by equation.

The Gram ("ghost") factorisation of a covered layer's per-example gradient is exact when
(1) each position of the layer's output reaches the loss of one example only, (2) the
weight the layer multiplies is the differentiated leaf itself (or, in ``lax.scan``, one
step's slice of it), and the factors are read at the layer's own positions. ``prove``
reads both from the jaxpr of ``fun(leaves)``, never from shapes:

- **Which loss each element reaches** (backward, from the losses vector): an element is
  owned by example ``(flat index // unit) % B`` (``Axis(unit)``), or reaches every loss
  (``Every``), or none (``None``). Per-primitive rules in ``OWNERS`` carry ownership from
  outputs to operands; a value that one use gives to one example and another use to every
  example (a batch mean, an in-batch contrastive logit, attention across the batch) is
  where examples interact. Where that value depends on a differentiated leaf, per-example
  gradients are not those of independent examples: ``Proof.mixing`` names the operation
  and its line. A primitive with no rule makes its operands reach every loss ("unknown"):
  never an error, but no factors for the layers before it (they take the exact path).
- **Which leaf each covered layer's parameters are** (forward): the plan tags each
  layer's parameters as ``"<path>:params:<attribute>"`` when it is called; the operand of
  that tag is the leaf itself, one scan step's slice of a leaf (a stacked layer), or
  something computed from leaves (``stop_gradient``, a mask, a LoRA sum, a tie, the output
  of a custom derivative rule, even an identity whose backward pass scales the gradient):
  then not the leaf, and the leaf's gradient takes the exact path.
- **Custom derivative rules**: JAX differentiates a ``custom_jvp``/``custom_vjp`` call by
  its rule, which may mix examples where its primal body does not (a backward pass centred
  over the batch). The body gives each operand's candidate ownership; the call's pullback
  (``jax.vjp`` of the equation, traced) is then read backward from those operand
  cotangents, and each output cotangent must reach only its own example's. A rule that
  fails (or cannot be traced) makes its operands reach every loss ("unknown"): the layers
  before it take the exact path, which runs the rule as ``jacrev`` does. Inside ``jax.vmap``
  over the examples JAX batches the rule itself, and it passes.
- **Shared layer outputs**: a layer applied to a value shared by every example (position
  ids ``arange(T)`` inside ``jax.vmap(model)``) has an output that reaches every loss; it
  meets the examples where an elementwise operation broadcasts it against a per-example
  value, where a broadcast lays it along the examples' axis (a class token concatenated to
  each example's patches), or a ``dot_general`` contracts it with one (``h @ pos.T``). ``Proof.shared`` lists
  those places (at the program's top level or in ``jit`` and ``checkpoint`` bodies, followed into
  and out of them; a meeting inside a loop or branch body is not listed, and the layer's leaves
  take the exact path): the pass tags the broadcast value
  there (for a ``dot_general``, the shared operand broadcast along a new batch axis of the
  product), which gives each example's gradient at the shared output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from .. import _compat, _equation_params, _higher_order
from .._fused_runs import bind_equation
from .._tag import is_tag
from .._module_tags import INPUT_SUFFIX, PARAMS_SUFFIX  # "<path>:params:<attribute>": a layer's parameter where it reads it
from ._owners import ELEMENTWISE, MULTI, OWNERS, SHAPE_ONLY, Axis, Every, Step, axis_of, elementwise, inexact, shape_of, unit

__all__ = ["prove"]


# --- the records --------------------------------------------------------------


class Origin(NamedTuple):
    """Where a layer's parameter comes from: leaf ``leaf`` itself, or (``depth`` set) one step's
    slice of it, sliced by the enclosing scan at ``depth`` (0: the outermost) of a stack in ``lax.scan``."""

    leaf: int
    depth: Optional[int] = None

    @property
    def stepped(self) -> bool:
        return self.depth is not None


@dataclasses.dataclass
class Occurrence:
    """One call of a covered layer, as the program has it."""

    ctx: tuple  # the equations (calls, loops) that hold it, outermost first
    eqn: Any  # the output tag's equation
    out: Any = None  # ownership of its output (Axis / Every / None)
    params: dict = dataclasses.field(default_factory=dict)  # attribute -> Origin | None
    steps: int = 0  # enclosing scans
    inputs: tuple = ()  # its input tags' equations (one per leaf of the inputs), in the same body

    @property
    def order(self) -> tuple:
        """The axes of the output var (the program's layout) in the order of the value jaxtrace gives
        for the tag: the ``jax.vmap`` axes (``batch_axes``) first, then the others. A vmapped Linear
        without bias has its output as ``(features, positions)`` in the program, ``(positions,
        features)`` as a value."""
        batch_axes = tuple(int(a) for a in self.eqn.params.get("batch_axes", ()))
        return (*batch_axes, *(i for i in range(len(shape_of(self.eqn.outvars[0]))) if i not in batch_axes))


@dataclasses.dataclass
class SharedUse:
    """A shared layer output meeting the examples: ``eqn``'s operand ``index`` (a chain of shape
    equations ``chain`` from the layer's output) is broadcast against per-example operands
    (an elementwise ``eqn``) or contracted with one whose free axis is the examples' (a
    ``dot_general``)."""

    path: str
    eqn: Any
    index: int
    chain: list  # equations from the layer's output var to the operand, in order
    ctx: tuple = ()  # the calls (jit, checkpoint) that hold ``eqn``, outermost first


@dataclasses.dataclass
class Proof:
    occurrences: dict  # layer path -> [Occurrence] in program order
    mixing: Optional[str] = None  # a sentence naming where examples interact (leaf-dependent), or None
    unproven: dict = dataclasses.field(default_factory=dict)  # layer path -> why its output is not per-example
    shared: list = dataclasses.field(default_factory=list)  # [SharedUse]: where shared values meet the examples
    states: dict = dataclasses.field(default_factory=dict)  # (ctx, var) -> ownership

    def axis_at(self, var, batch: int, ctx: tuple = ()) -> Optional[tuple[int, int]]:
        """``(axis, inner)`` of the examples in a var (of the top level, or of the calls ``ctx``), or None."""
        state = self.states.get((ctx, var))
        return axis_of(shape_of(var), state, batch) if isinstance(state, Axis) else None

    def example_axis(self, occurrences: list, value_ndim: int, batch: int) -> Optional[tuple[int, int]]:
        """``(axis, inner)`` of the examples in the stacked value jaxtrace returns for a layer's calls
        ``occurrences`` (one tag name's: loop and repeated-call axes first, vmap axes next), the same for
        every call; else None. In the body of a scan whose steps are the examples (``Step``), the examples'
        axis is that scan's loop axis where every call sits in that one scan: the loops around them come
        first, outermost first, and calls stacked in the body after them."""
        found = set()
        for occ in occurrences:
            if occ.out is None:
                continue
            if isinstance(occ.out, Step):
                scans = [i for i, e in enumerate(occ.ctx) if hasattr(e, "primitive") and _higher_order.kind(e) == _higher_order.SCAN]
                found.add((occ.out.level, occ.out.inner, tuple(map(id, occ.ctx[: scans[occ.out.level] + 1]))))
                continue
            if not isinstance(occ.out, Axis):
                return None
            shape = shape_of(occ.eqn.outvars[0])
            where = axis_of(shape, occ.out, batch)
            if where is None:
                return None
            axis, inner = where
            found.add((value_ndim - len(shape) + occ.order.index(axis), inner))
        return found.pop()[:2] if len(found) == 1 else None


# --- the analysis -------------------------------------------------------------


def prove(jaxpr, n_leaves: int, batch: int, layer_paths: set, reads: Optional[dict] = None, in_scans: Optional[dict] = None) -> Proof:
    """Reads ``jaxpr`` (invars: the leaves, then nothing; outvar 0: the losses ``(batch,)``).

    ``reads`` maps a name to ``(var, ctx)``: the output of an equation (in the calls ``ctx``) that
    reads a leaf outside its layers (``_reads``), or a leaf itself; where that value is shared by
    every example, ``Proof.shared`` also lists where it meets the examples, under that name. ``in_scans`` maps a name to ``(scan
    equations, body invar)``: the input of the innermost body of a top-level scan and the scans nested
    in it (one step's slice of a leaf, or the leaf itself), whose meetings with the examples in that
    body are listed the same way.
    """
    analysis = _Analysis(batch, layer_paths)
    origins = [Origin(i) for i in range(n_leaves)] + [None] * (len(jaxpr.invars) - n_leaves)
    deps = [True] * n_leaves + [False] * (len(jaxpr.invars) - n_leaves)
    analysis.forward(jaxpr, [None] * len(jaxpr.constvars) + origins, [False] * len(jaxpr.constvars) + deps, (), 0)
    outs: list = [None] * len(jaxpr.outvars)
    outs[0] = Axis(1)
    analysis.backward(jaxpr, outs, ())
    proof = Proof(analysis.occurrences, analysis.mixing, states=analysis.state)
    for path, occs in analysis.occurrences.items():
        for occ in occs:
            if isinstance(occ.out, Every):
                proof.unproven[path] = occ.out
    proof.shared = analysis.shared_uses(jaxpr, reads or {}, in_scans or {})
    return proof


class _Analysis:
    def __init__(self, batch: int, layer_paths: set, rules: bool = True):
        self.batch = batch
        self.rules = rules  # read custom_jvp/custom_vjp calls by their rules (the program JAX differentiates)
        self.rule_checks: dict = {}  # (id(eqn), outs, ins) -> whether its rule keeps the examples apart
        self.layer_paths = layer_paths
        self.occurrences: dict = {}
        self.pending: dict = {}  # (ctx, path) -> params seen since that layer's last call
        self.inputs: dict = {}  # (ctx, path) -> input tag equations seen since that layer's last call
        self.by_eqn: dict = {}  # (ctx, id(eqn)) -> Occurrence
        self.dep: dict = {}  # (ctx, var) -> depends on a leaf
        self.iota: dict = {}  # (ctx, var) -> ("iota", dim) | ("false",) | ("components", {k: dim})
        self.state: dict = {}  # (ctx, var) -> ownership
        self.mixing: Optional[str] = None
        self.top_eqns: list = []
        self.users: dict = {}  # id(jaxpr) -> (jaxpr, its users and outputs), for shared_uses

    # forward: which leaf each parameter is, what depends on leaves, which ints are positions

    def forward(self, jaxpr, origins: list, deps: list, ctx: tuple, steps: int) -> tuple[list, list]:
        env = dict(zip((*jaxpr.constvars, *jaxpr.invars), origins))
        for v, d in zip((*jaxpr.constvars, *jaxpr.invars), deps):
            self.dep[(ctx, v)] = d
        read = lambda a: None if isinstance(a, _compat.Literal) else env.get(a)  # noqa: E731
        dep = lambda a: (not isinstance(a, _compat.Literal)) and self.dep.get((ctx, a), False)  # noqa: E731
        for eqn in jaxpr.eqns:
            kind = _higher_order.kind(eqn)
            ins, in_deps = [read(a) for a in eqn.invars], [dep(a) for a in eqn.invars]
            outs: list = [None] * len(eqn.outvars)
            out_deps = [any(in_deps)] * len(eqn.outvars)
            if is_tag(eqn):
                outs = [ins[0]]
                self._tag(eqn, ins[0], ctx, steps)
            elif kind in _higher_order.CALL_LIKE:
                outs, out_deps = self._call(_higher_order.body(eqn), ins, in_deps, (*ctx, eqn), steps)
                if kind == _higher_order.CUSTOM and self.rules:
                    outs = [None] * len(eqn.outvars)  # a leaf through a custom rule is not the leaf to JAX's gradient
            elif kind == _higher_order.COND:
                for branch in _equation_params.cond_branches(eqn):
                    _, bd = self._call(branch, ins[1:], in_deps[1:], (*ctx, eqn, branch), steps)
                    out_deps = [a or b for a, b in zip(out_deps, bd)] if bd else out_deps
            elif kind == _higher_order.SCAN:
                p = _equation_params.scan_params(eqn)
                k, c = p.num_consts, p.num_carry
                body_ins = ins[:k] + [None] * c + [Origin(o.leaf, steps) if isinstance(o, Origin) and not o.stepped else None for o in ins[k + c :]]
                carry = list(in_deps[k : k + c])
                while True:
                    _, bd = self._call(p.body, body_ins, in_deps[:k] + carry + in_deps[k + c :], (*ctx, eqn), steps + 1)
                    new = [a or b for a, b in zip(carry, bd[:c])]
                    if new == carry:
                        break
                    carry = new
                out_deps = carry + bd[c:]
            else:
                self._iota_rule(eqn, ctx)
            for v, o, d in zip(eqn.outvars, outs, out_deps):
                env[v] = o
                self.dep[(ctx, v)] = d
            if not ctx:
                self.top_eqns.append(eqn)
        return [read(a) for a in jaxpr.outvars], [dep(a) for a in jaxpr.outvars]

    def _call(self, body, ins, in_deps, ctx, steps):
        jaxpr, _ = _compat.jaxpr_and_consts(body)
        n = len(jaxpr.constvars)
        return self.forward(jaxpr, [None] * n + list(ins), [False] * n + list(in_deps), ctx, steps)

    def _tag(self, eqn, origin, ctx, steps):
        name = eqn.params["name"]
        if PARAMS_SUFFIX in name:
            path, attr = name.split(PARAMS_SUFFIX, 1)
            self.pending.setdefault((ctx, path), {})[attr] = origin
        elif name.endswith(INPUT_SUFFIX) and name[: -len(INPUT_SUFFIX)] in self.layer_paths:
            self.inputs.setdefault((ctx, name[: -len(INPUT_SUFFIX)]), []).append(eqn)
        elif name in self.layer_paths:
            inputs = tuple(self.inputs.pop((ctx, name), ()))
            if (ctx, id(eqn)) in self.by_eqn:  # a loop body read again (its carries' fixed point)
                self.pending.pop((ctx, name), None)
                return
            occ = Occurrence(ctx, eqn, params=self.pending.pop((ctx, name), {}), steps=steps, inputs=inputs)
            self.occurrences.setdefault(name, []).append(occ)
            self.by_eqn[(ctx, id(eqn))] = occ

    def _iota_rule(self, eqn, ctx):
        """Integer arrays that hold their own position along an axis (``arange`` and what jnp indexing
        builds from it), so that ``x[arange(B), labels]`` reads each example's own row."""
        name, get = eqn.primitive.name, lambda a: None if isinstance(a, _compat.Literal) else self.iota.get((ctx, a))
        out = None
        if name == "iota":
            out = ("iota", eqn.params["dimension"])
        elif name in ("convert_element_type", "copy") and get(eqn.invars[0]):
            out = get(eqn.invars[0])
        elif name == "lt" and _is_iota(get(eqn.invars[0])) and _literal_is(eqn.invars[1], 0):
            out = ("false",)
        elif name == "select_n" and get(eqn.invars[0]) == ("false",):
            out = get(eqn.invars[1])
        elif name == "broadcast_in_dim" and _is_iota(get(eqn.invars[0])):
            dims = eqn.params["broadcast_dimensions"]
            d = get(eqn.invars[0])[1]
            if shape_of(eqn.invars[0])[d] == shape_of(eqn.outvars[0])[dims[d]]:
                out = ("iota", int(dims[d]))
        elif name == "concatenate":
            dim = eqn.params["dimension"]
            comps, k = {}, 0
            for a in eqn.invars:
                info = get(a)
                if _is_iota(info) and info[1] != dim:
                    comps[k] = info[1]
                k += shape_of(a)[dim]
            out = ("components", dim, comps) if comps else None
        if out is not None:
            self.iota[(ctx, eqn.outvars[0])] = out

    # backward: which loss each element reaches

    def backward(self, jaxpr, out_states: list, ctx: tuple) -> list:
        states: dict = {}
        for v, s in zip(jaxpr.outvars, out_states):
            if not isinstance(v, _compat.Literal):
                states[v] = self._join(states.get(v), s, v, ctx, None)
        for eqn in reversed(jaxpr.eqns):
            outs = [states.get(v) for v in eqn.outvars]
            for v, s in zip(eqn.outvars, outs):
                self.state[(ctx, v)] = s
            occ = self.by_eqn.get((ctx, id(eqn)))
            if occ is not None:
                occ.out = _join_plain(occ.out, outs[0])
            if all(s is None for s in outs):
                continue
            ins = self._operands(eqn, outs, ctx)
            for a, s in zip(eqn.invars, ins):
                if not isinstance(a, _compat.Literal) and s is not None:
                    states[a] = self._join(states.get(a), s, a, ctx, eqn)
        for v in (*jaxpr.constvars, *jaxpr.invars):
            self.state[(ctx, v)] = states.get(v)
        return [states.get(v) for v in (*jaxpr.constvars, *jaxpr.invars)]

    def _join(self, old, new, var, ctx, eqn):
        if old is None or old == new:
            return new
        if new is None:
            return old
        if isinstance(old, Step) or isinstance(new, Step):
            return Every("unknown", eqn)  # a step's example against another claim: no claim, never a refusal
        if isinstance(old, Every) and isinstance(new, Every):
            return old if old.kind == "mix" or new.kind != "mix" else new
        # Two uses disagree: one example's element also reaches other examples' losses. Not with one
        # example: there every element that reaches a loss reaches example 0's, the only one, so "one
        # example's" and "every example's" are the same claim (and ``axis_of`` may place a batch of one
        # on any axis whose size fits: ``h - h.max(-1, keepdims=True)`` must not read as a broadcast
        # along the examples).
        every = old if isinstance(old, Every) else new if isinstance(new, Every) else Every("mix", eqn)
        if every.kind != "unknown" and self.mixing is None and self.batch > 1 and inexact(var) and self.dep.get((ctx, var), False):
            where = every.eqn if every.eqn is not None else eqn
            self.mixing = (
                f"losses[i] depends on example j != i through {_compat.construct(where)}: a value computed "
                "from several examples (a batch mean or variance, BatchNorm in training mode, an in-batch "
                "contrastive loss, attention across the batch) reaches each example's loss"
            )
        return every if every.kind != "unknown" else Every("unknown", every.eqn)

    def _operands(self, eqn, outs, ctx) -> list:
        name = eqn.primitive.name
        every = next((s for s in outs if isinstance(s, Every)), None)
        if every is not None and not _is_call(eqn):
            return [every] * len(eqn.invars)  # (a jit or checkpoint body is read: a shared value in it meets the examples outside)
        if _higher_order.kind(eqn) in _higher_order.CALL_LIKE:
            got = self._body(_higher_order.body(eqn), outs, (*ctx, eqn))
            if _higher_order.kind(eqn) == _higher_order.CUSTOM and self.rules and not self._rule_keeps(eqn, outs, got):
                every = Every("unknown", eqn)  # JAX differentiates it by a rule that mixes examples (or may)
                self._body(_higher_order.body(eqn), [every] * len(outs), (*ctx, eqn))
                return [every] * len(eqn.invars)
            return got
        if _higher_order.kind(eqn) == _higher_order.COND:
            ins: list = [None] * len(eqn.invars)
            for branch in _equation_params.cond_branches(eqn):
                got = self._body(branch, outs, (*ctx, eqn, branch))
                ins[1:] = [_join_plain(a, b) for a, b in zip(ins[1:], got)]
            return ins
        if _higher_order.kind(eqn) == _higher_order.SCAN:
            return self._scan(eqn, outs, ctx)
        steps = {s for s in outs if s is not None}
        if any(isinstance(s, Step) for s in steps):  # one loop step's example: so is every operand
            return [steps.pop() if len(steps) == 1 else Every("unknown", eqn)] * len(eqn.invars)
        rule = OWNERS.get(name)
        if rule is None or len(outs) != 1 and name not in MULTI:
            return [Every("unknown", eqn)] * len(eqn.invars)
        try:
            got = rule(self, eqn, outs, ctx)
        except Exception:  # a layout the rule does not read: reaches every loss, no claim made
            got = None
        return got if got is not None else [Every("unknown", eqn)] * len(eqn.invars)

    def _rule_keeps(self, eqn, outs, ins) -> bool:
        """Whether the derivative JAX takes of a ``custom_jvp``/``custom_vjp`` call (its rule, not its
        primal body) keeps the examples apart as ``ins`` (the operand states read from the body) say.

        The call's pullback ``(operands, cotangents) -> operand cotangents`` is traced (``jax.vjp``
        of the equation: the rule as reverse mode runs it) and read backward from the operand
        cotangents, each given its operand's state: each output cotangent must then reach only
        its own example's operand cotangents, as ``outs`` has it. A rule that reads other
        examples' cotangents (a backward pass centred over the batch), one that cannot be traced,
        or an operand the body gives to no loss whose cotangent the rule fills, fails. Inside
        ``jax.vmap`` over the examples JAX batches the rule itself, which then passes.
        """
        key = (id(eqn), tuple(outs), tuple(ins))
        if key not in self.rule_checks:
            self.rule_checks[key] = self._read_rule(eqn, outs, ins)
        return self.rule_checks[key]

    def _read_rule(self, eqn, outs, ins) -> bool:
        diff_out = [k for k, v in enumerate(eqn.outvars) if inexact(v)]
        try:
            pullback = _pullback_jaxpr(eqn, diff_out)
        except Exception:  # a rule that cannot be traced on its own: nothing is proven of it
            return False
        jaxpr, _ = _compat.jaxpr_and_consts(pullback)
        wanted = []
        for a, s in zip(eqn.invars, ins):
            if isinstance(s, Axis) and inexact(a):
                wanted.append(s)  # its cotangent must come from its own example's cotangents
            elif s is None and inexact(a):
                wanted.append(Every("unknown", eqn))  # the body gives it no loss: nor may the rule
            else:
                wanted.append(None)  # reaches every loss already (or no cotangent): no constraint
        reader = _Analysis(self.batch, set(), rules=False)
        n = len(jaxpr.constvars) + len(jaxpr.invars)
        reader.forward(jaxpr, [None] * n, [False] * n, (), 0)
        got = reader.backward(jaxpr, wanted, ())[len(jaxpr.constvars) + len(eqn.invars) :]
        for k, state in zip(diff_out, got):
            if outs[k] is not None and state is not None and state != outs[k]:
                return False
        return True

    def _body(self, body, outs, ctx) -> list:
        jaxpr, _ = _compat.jaxpr_and_consts(body)
        return self.backward(jaxpr, list(outs), ctx)[len(jaxpr.constvars) :]

    def _scan(self, eqn, outs, ctx) -> list:
        p = _equation_params.scan_params(eqn)
        k, c = p.num_consts, p.num_carry
        level = sum(1 for e in ctx if hasattr(e, "primitive") and _higher_order.kind(e) == _higher_order.SCAN)
        ys, per_step = self._scan_outputs(eqn, outs, level)
        got, carry = self._scan_body(p.body, outs[:c], ys, k, c, (*ctx, eqn))
        here = Step(level, per_step) if per_step else None
        if here is not None and any(s == here and inexact(v) for v, s in zip(eqn.invars[k : k + c], carry)):
            # a float carried from one example's step to the next: not one example's values a step
            ys = [Every("unknown", eqn) if s == here else s for s in ys]
            got, carry = self._scan_body(p.body, outs[:c], ys, k, c, (*ctx, eqn))
            here = None
        xs = []
        for v, s in zip(eqn.invars[k + c :], got[k + c :]):
            if here is not None and s == here:  # the scanned axis holds the examples, ``inner`` steps each
                xs.append(unit(shape_of(v), 0, here.inner))
                continue
            if s is None or isinstance(s, (Every, Step)):
                xs.append(s)
                continue
            inner = shape_of(v)[1:]
            where = axis_of(inner, s, self.batch)
            xs.append(unit(shape_of(v), where[0] + 1, where[1]) if where else Every("unknown", eqn))
        consts = [Every("shared", eqn) if here is not None and s == here else s for s in got[:k]]  # read by every step
        carry = [Every("unknown", eqn) if here is not None and s == here else s for s in carry]  # (no float: no gradient)
        return consts + carry + xs

    def _scan_outputs(self, eqn, outs, level: int) -> tuple[list, int]:
        """``(the states of a scan body's ys, inner)``: ``inner`` > 0 where the scan's steps are the examples
        (``inner`` steps each, the same for every ys that reaches a loss, no carry out reaching one:
        ``lax.map`` over the batch), its body's values then ``Step``; else 0."""
        c = _equation_params.scan_params(eqn).num_carry
        wheres = [
            axis_of(shape_of(v), s, self.batch) if isinstance(s, Axis) else None for v, s in zip(eqn.outvars[c:], outs[c:])
        ]
        inners = {w[1] for w in wheres if w is not None and w[0] == 0}
        stepped = len(inners) == 1 and all(s is None for s in outs[:c]) and all(
            w is not None and w[0] == 0 for w, s in zip(wheres, outs[c:]) if isinstance(s, Axis)
        )
        inner = next(iter(inners)) if stepped else 0
        ys = []
        for v, s, where in zip(eqn.outvars[c:], outs[c:], wheres):
            if s is None or isinstance(s, Step):  # (an outer scan's step: the same example at every step here)
                ys.append(s)
            elif where is not None and where[0] > 0:
                ys.append(unit(shape_of(v)[1:], where[0] - 1, where[1]))
            else:
                ys.append(Step(level, inner) if inner else Every("unknown", eqn))
        return ys, inner

    def _scan_body(self, body, carry: list, ys: list, k: int, c: int, ctx: tuple) -> tuple[list, list]:
        """The body read backward from ``ys``, its carries fed back to a fixed point: ``(the states of
        its consts, carries and xs, the carries')``."""
        carry = list(carry)
        while True:
            got = self._body(body, carry + ys, ctx)
            new = [_join_plain(a, b) for a, b in zip(carry, got[k : k + c])]
            if new == carry:
                return got, carry
            carry = new

    def shared_uses(self, jaxpr, reads: dict, in_scans: dict) -> list:
        """Where each layer output (and each read ``reads`` names, ``{name: (var, ctx)}``, and each scan
        body input ``in_scans`` names) that reaches every loss meets the examples, at the top level or
        in the ``jit`` and ``checkpoint`` bodies around it; one with any other use gets none (its leaves
        take the exact path)."""
        starts = [(path, occ.eqn.outvars[0], occ.ctx) for path, occs in self.occurrences.items() for occ in occs]
        places = []
        for path, var, ctx in starts:
            down = _calls_down(jaxpr, ctx)
            if down is not None:  # in no loop, branch or custom rule: followed out of its calls too
                places.append((path, var, *down, ctx))
        for path, (var, ctx) in reads.items():  # a read may sit in scan bodies too: it meets the examples there
            down = _calls_down(jaxpr, ctx, scans=True)
            if down is not None:
                places.append((path, var, *down, ctx))
        for path, (eqns, var) in in_scans.items():  # in the body of the innermost of nested scans
            outer = [jaxpr]
            for eqn in eqns:
                outer.append(_compat.jaxpr_and_consts(_equation_params.scan_params(eqn).body)[0])
            places.append((path, var, outer.pop(), tuple(outer), tuple(eqns)))
        found = []
        for path, var, where, outer, ctx in places:
            state = self.state.get((ctx, var))
            if not isinstance(state, Every) or state.kind != "shared":
                continue
            uses = self._meetings(where, var, [], ctx, outer)
            if uses is None:
                continue
            found.extend(SharedUse(path, eqn, index, chain, ctx) for eqn, index, chain, ctx in uses)
        return found

    def _meetings(self, jaxpr, var, chain, ctx, outer: tuple = ()) -> Optional[list]:
        """``[(eqn, operand index, chain, ctx)]``: where ``var`` of ``jaxpr`` (in the calls ``ctx``; ``outer``:
        the jaxprs that hold them) meets the examples; None if it reaches the losses any other way."""
        key = id(jaxpr)
        if key not in self.users:
            self.users[key] = (jaxpr, _users(jaxpr))  # the jaxpr kept alive: its id stays its own
        users, outs = self.users[key][1]
        found = []
        if var in outs:  # out of a jit or checkpoint body: on at the call's output; out of anything else: no
            if not ctx or len(outer) != len(ctx) or not _is_call(ctx[-1]):
                return None
            for k, a in enumerate(jaxpr.outvars):
                if a is var:
                    more = self._meetings(outer[-1], ctx[-1].outvars[k], chain, ctx[:-1], outer[:-1])
                    if more is None:
                        return None
                    found.extend(more)
        for eqn in users.get(var, []):
            if all(self.state.get((ctx, v)) is None for v in eqn.outvars):
                continue  # no output of this use reaches a loss
            name = eqn.primitive.name
            if _is_call(eqn):  # follow it into the call's body
                body, _ = _compat.jaxpr_and_consts(_higher_order.body(eqn))
                for k, a in enumerate(eqn.invars):
                    if a is var:
                        more = self._meetings(body, body.invars[k], chain, (*ctx, eqn), (*outer, jaxpr))
                        if more is None:
                            return None
                        found.extend(more)
                continue
            state = self.state.get((ctx, eqn.outvars[0]))
            if len(eqn.outvars) != 1:
                return None  # a loop, a branch or a split: the value meets the examples inside it (exact path)
            if name == "broadcast_in_dim" and isinstance(state, Axis):
                # the broadcast itself lays the value along the examples' axis, each example a copy
                # (``jnp.concatenate([cls, x])``, ``x.at[0].set(cls)`` inside ``jax.vmap(model)``)
                where = axis_of(shape_of(eqn.outvars[0]), state, self.batch)
                ins = OWNERS[name](self, eqn, [state], ctx)
                if where is None or where[1] != 1 or ins is None or not (isinstance(ins[0], Every) and ins[0].kind == "shared"):
                    return None
                found.append((eqn, 0, list(chain), ctx))
                continue
            if (name in SHAPE_ONLY or name == "transpose") and len(eqn.invars) == 1:
                more = self._meetings(jaxpr, eqn.outvars[0], [*chain, eqn], ctx)
                if more is None:
                    return None
                found.extend(more)
                continue
            if name not in ELEMENTWISE and name != "dot_general" or name == "jaxtrace_tag" or not isinstance(state, Axis):
                return None
            where = axis_of(shape_of(eqn.outvars[0]), state, self.batch)
            if where is None or where[1] != 1:
                return None
            # elementwise: broadcast against the examples; dot_general: contracted with a per-example
            # operand whose free axis is the examples' (``h @ pos.T``)
            ins = elementwise(self, eqn, [state], ctx) if name != "dot_general" else OWNERS[name](self, eqn, [state], ctx)
            if ins is None or name == "dot_general" and sum(a is var for a in eqn.invars) != 1:
                return None
            for index, a in enumerate(eqn.invars):
                if a is var:
                    if not (isinstance(ins[index], Every) and ins[index].kind == "shared"):
                        return None
                    found.append((eqn, index, list(chain), ctx))
        return found


def _pullback_jaxpr(eqn, diff_out: list):
    """The jaxpr of ``(operands, cotangents of the outputs diff_out) -> operand cotangents`` of one
    equation: ``jax.vjp`` of it, so that a custom rule is what runs."""

    def spec(a):
        return jax.ShapeDtypeStruct(shape_of(a), a.aval.dtype)

    def pullback(operands, cts):
        outs, vjp = jax.vjp(lambda *xs: bind_equation(eqn, xs), *operands)
        full = [np.zeros(np.shape(o), jax.dtypes.float0) for o in outs]
        for k, ct in zip(diff_out, cts):
            full[k] = ct
        return vjp(full)

    return jax.make_jaxpr(pullback)([spec(a) for a in eqn.invars], [spec(eqn.outvars[k]) for k in diff_out])


def _is_call(eqn) -> bool:
    """A ``jit`` or ``checkpoint`` call: its body runs once, as if inline."""
    return hasattr(eqn, "primitive") and _higher_order.kind(eqn) in (_higher_order.CALL, _higher_order.REMAT)  # (a cond branch in a ctx is a jaxpr)


def _calls_down(jaxpr, ctx: tuple, scans: bool = False) -> Optional[tuple]:
    """``(the body ctx's innermost call runs, (the jaxprs that hold each call of ctx))`` where every
    equation of ``ctx`` is a ``jit`` or ``checkpoint`` call (or, with ``scans``, a ``lax.scan``); else
    None (a loop, a branch, a custom rule)."""
    outer = []
    for eqn in ctx:
        scan = scans and hasattr(eqn, "primitive") and _higher_order.kind(eqn) == _higher_order.SCAN
        if not (_is_call(eqn) or scan):
            return None
        outer.append(jaxpr)
        body = _equation_params.scan_params(eqn).body if scan else _higher_order.body(eqn)
        jaxpr, _ = _compat.jaxpr_and_consts(body)
    return jaxpr, tuple(outer)


def _users(jaxpr) -> tuple[dict, set]:
    """``({var: [the equations that read it, once each]}, {the jaxpr's output vars})``."""
    users: dict = {}
    for eqn in jaxpr.eqns:
        for a in eqn.invars:
            if not isinstance(a, _compat.Literal) and not any(e is eqn for e in users.get(a, ())):
                users.setdefault(a, []).append(eqn)  # once per equation, however many operands it is
    return users, {a for a in jaxpr.outvars if not isinstance(a, _compat.Literal)}


def _join_plain(a, b):
    if a is None or a == b:
        return b
    if b is None:
        return a
    return a if isinstance(a, Every) else b if isinstance(b, Every) else Every("mix", None)


def _is_iota(info) -> bool:
    return bool(info) and info[0] == "iota"


def _literal_is(atom, value) -> bool:
    return isinstance(atom, _compat.Literal) and np.ndim(atom.val) == 0 and atom.val == value


