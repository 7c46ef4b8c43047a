"""Torch layers into equinox arrays: the vocabulary of a weight plan and the registry of per-layer rules.

The rules are for the layers whose equinox counterpart is laid out differently.

A plan is a list of ``Assign``: one equinox array, the torch parameters it is made
from, and a linear map between them (``named_grads`` runs its transpose). ``RULES``
maps a torch layer class to a rule ``(path, module, steps, target) -> [Assign]``
that plans the whole layer, its submodules' parameters included; a layer with no
rule copies parameter by parameter (``_weights._plan``). Add a layer with
``@register(torch.nn.SomeLayer)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import equinox as eqx
import jax.numpy as jnp
import torch

__all__ = [
    "Assign", "PlanError", "RULES", "follow", "full_name", "identity", "is_hf_conv1d", "need", "register", "rule_for",
    "show_steps",
]


class PlanError(ValueError):
    """A torch module that does not map onto the model; the public function called prefixes its name."""


@dataclasses.dataclass(frozen=True)
class Assign:
    """One equinox array made from torch parameters by a linear map."""

    steps: tuple  # how to reach the array in the equinox model
    names: tuple  # the torch parameter names it is made from
    fn: Callable  # (*torch arrays) -> the equinox array; linear


def follow(tree, steps):
    for kind, key in steps:
        tree = getattr(tree, key) if kind == "attr" else tree[key]
    return tree


def show_steps(steps) -> str:
    out = ""
    for kind, key in steps:
        out += f".{key}" if kind == "attr" else f"[{key!r}]"
    return out or "the model itself"


def full_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def identity(x):
    return x


def is_hf_conv1d(mod) -> bool:
    """Whether ``mod`` is transformers' ``Conv1D`` (GPT-2's projections): a Linear whose weight is
    stored ``(in, out)``, recognised by name so that transformers need not be imported."""
    return type(mod).__name__ == "Conv1D" and type(mod).__module__.startswith("transformers") and hasattr(mod, "nf")


def need(path, mod, base, target, cls, checks: dict):
    """An error unless ``target`` is an instance of ``cls`` with ``checks`` {what: (torch, equinox)} equal."""
    kind = type(mod).__name__
    if not isinstance(target, cls):
        raise PlanError(
            f"the torch {kind} at {path!r} needs an {cls.__module__.split('.')[0]}.nn."
            f"{cls.__name__} there, but the equinox model has a {type(target).__name__} at {show_steps(base)}."
        )
    bad = {k: v for k, v in checks.items() if v[0] != v[1]}
    if bad:
        raise PlanError(
            f"the {kind} at {path!r} and the equinox {cls.__name__} at {show_steps(base)} differ: "
            + "; ".join(f"{k} is {t} in torch but {e} in equinox" for k, (t, e) in bad.items())
            + ". Build the equinox layer to match."
        )


def _plan_gru(path, mod, base, target) -> list[Assign]:
    need(
        path,
        mod,
        base,
        target,
        eqx.nn.GRUCell,
        {
            "input_size": (mod.input_size, target.input_size),
            "hidden_size": (mod.hidden_size, target.hidden_size),
            "bias (use_bias)": (mod.bias, target.use_bias),
        },
    )
    return _gru_cell(path, base, mod.hidden_size, mod.bias, "")


def _gru_cell(path, base, h, bias, suffix) -> list[Assign]:
    name = lambda n: full_name(path, n + suffix)  # noqa: E731
    at = lambda n: base + (("attr", n),)  # noqa: E731
    plan = [
        Assign(at("weight_ih"), (name("weight_ih"),), identity),
        Assign(at("weight_hh"), (name("weight_hh"),), identity),
    ]
    if bias:
        # torch: r, z = sigmoid(W_i x + b_i + W_h h + b_h) and n = tanh(W_in x + b_in + r * (W_hn h + b_hn));
        # equinox: one bias on the input side and bias_n inside the reset product.
        plan.append(
            Assign(
                at("bias"),
                (name("bias_ih"), name("bias_hh")),
                lambda b_ih, b_hh: b_ih + jnp.concatenate([b_hh[: 2 * h], jnp.zeros_like(b_hh[2 * h :])]),
            )
        )
        plan.append(Assign(at("bias_n"), (name("bias_hh"),), lambda b_hh: b_hh[2 * h :]))
    return plan


def _lstm_cell(path, base, bias, suffix) -> list[Assign]:
    name = lambda n: full_name(path, n + suffix)  # noqa: E731
    at = lambda n: base + (("attr", n),)  # noqa: E731
    plan = [
        Assign(at("weight_ih"), (name("weight_ih"),), identity),
        Assign(at("weight_hh"), (name("weight_hh"),), identity),
    ]
    if bias:  # the same gate order (i, f, g, o); equinox has one bias where torch has two
        plan.append(Assign(at("bias"), (name("bias_ih"), name("bias_hh")), _add))
    return plan


def _add(a, b):
    return a + b


def _plan_lstm_cell(path, mod, base, target) -> list[Assign]:
    need(
        path,
        mod,
        base,
        target,
        eqx.nn.LSTMCell,
        {
            "input_size": (mod.input_size, target.input_size),
            "hidden_size": (mod.hidden_size, target.hidden_size),
            "bias (use_bias)": (mod.bias, target.use_bias),
        },
    )
    return _lstm_cell(path, base, mod.bias, "")


def _plan_rnn(path, mod, base, target) -> list[Assign]:
    """``nn.GRU`` / ``nn.LSTM``: a list of layers, each a cell or a list of cells (forward, reverse)."""
    kind = type(mod).__name__
    cell_cls = eqx.nn.GRUCell if isinstance(mod, torch.nn.GRU) else eqx.nn.LSTMCell
    layout = f"a list of {mod.num_layers} layers, each " + (
        f"a list [forward, reverse] of eqx.nn.{cell_cls.__name__}"
        if mod.bidirectional
        else f"an eqx.nn.{cell_cls.__name__}"
    )
    if getattr(mod, "proj_size", 0):
        raise PlanError(
            f"the LSTM at {path!r} has proj_size={mod.proj_size}, which eqx.nn.LSTMCell does not "
            "have. Port it with your own cell (its weight_hr_l* projects the hidden state)."
        )
    if not isinstance(target, (list, tuple)) or len(target) != mod.num_layers:
        raise PlanError(
            f"the torch {kind} at {path!r} goes into {layout} (torch's layer k, direction d is "
            f"[k][d]), but the equinox model has {_describe_tree(target)} at {show_steps(base)}."
        )
    directions = 2 if mod.bidirectional else 1
    plan: list[Assign] = []
    for k, layer in enumerate(target):
        cells = layer if isinstance(layer, (list, tuple)) else [layer]
        if len(cells) != directions:
            raise PlanError(
                f"the torch {kind} at {path!r} goes into {layout}, but layer {k} at "
                f"{show_steps(base + (('item', k),))} is {_describe_tree(layer)}."
            )
        for d, cell in enumerate(cells):
            steps = base + (("item", k),) + ((("item", d),) if isinstance(layer, (list, tuple)) else ())
            where = f"{path!r} (layer {k}{', reverse' if d else ''})"
            input_size = mod.input_size if k == 0 else directions * mod.hidden_size
            need(
                where,
                mod,
                steps,
                cell,
                cell_cls,
                {
                    "input_size": (input_size, getattr(cell, "input_size", None)),
                    "hidden_size": (mod.hidden_size, getattr(cell, "hidden_size", None)),
                    "bias (use_bias)": (mod.bias, getattr(cell, "use_bias", None)),
                },
            )
            suffix = f"_l{k}" + ("_reverse" if d else "")
            if cell_cls is eqx.nn.GRUCell:
                plan.extend(_gru_cell(path, steps, mod.hidden_size, mod.bias, suffix))
            else:
                plan.extend(_lstm_cell(path, steps, mod.bias, suffix))
    return plan


def _describe_tree(x) -> str:
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}: [{', '.join(type(v).__name__ for v in x)}]"
    return f"a {type(x).__name__}"


def _plan_elman(path, mod, base, target) -> list[Assign]:
    raise PlanError(
        f"the torch {type(mod).__name__} at {path!r} has no equinox counterpart (equinox has "
        "GRUCell and LSTMCell, not a tanh/ReLU RNN cell). Port it with a Linear pair of your own, or use "
        "nn.GRU / nn.LSTM."
    )


def _plan_mha(path, mod, base, target) -> list[Assign]:
    """``nn.MultiheadAttention`` onto ``eqx.nn.MultiheadAttention``: in_proj split into q, k, v."""
    e, heads = mod.embed_dim, mod.num_heads
    if mod.bias_k is not None or mod.add_zero_attn:
        raise PlanError(
            f"the MultiheadAttention at {path!r} was built with "
            + ("add_bias_kv=True" if mod.bias_k is not None else "add_zero_attn=True")
            + ", which eqx.nn.MultiheadAttention does not have. Port it with your own attention module."
        )
    has_bias = mod.in_proj_bias is not None
    out_bias = mod.out_proj.bias is not None
    need(
        path,
        mod,
        base,
        target,
        eqx.nn.MultiheadAttention,
        {
            "num_heads": (heads, getattr(target, "num_heads", None)),
            "embed_dim (query_size)": (e, getattr(target, "query_size", None)),
            "kdim (key_size)": (mod.kdim, getattr(target, "key_size", None)),
            "vdim (value_size)": (mod.vdim, getattr(target, "value_size", None)),
            "embed_dim (output_size)": (e, getattr(target, "output_size", None)),
            "head_dim (qk_size)": (e // heads, getattr(target, "qk_size", None)),
            "head_dim (vo_size)": (e // heads, getattr(target, "vo_size", None)),
            "bias (use_query_bias, use_key_bias, use_value_bias)": (
                (has_bias,) * 3,
                tuple(getattr(target, f"use_{n}_bias", None) for n in ("query", "key", "value")),
            ),
            "out_proj bias (use_output_bias)": (out_bias, getattr(target, "use_output_bias", None)),
        },
    )
    at = lambda proj, n: base + (("attr", proj), ("attr", n))  # noqa: E731
    plan = []
    for i, proj in enumerate(("query_proj", "key_proj", "value_proj")):
        if mod._qkv_same_embed_dim:
            plan.append(Assign(at(proj, "weight"), (full_name(path, "in_proj_weight"),), _rows(i * e, (i + 1) * e)))
        else:
            own = ("q", "k", "v")[i] + "_proj_weight"
            plan.append(Assign(at(proj, "weight"), (full_name(path, own),), identity))
        if has_bias:
            plan.append(Assign(at(proj, "bias"), (full_name(path, "in_proj_bias"),), _rows(i * e, (i + 1) * e)))
    plan.append(Assign(at("output_proj", "weight"), (full_name(path, "out_proj.weight"),), identity))
    if out_bias:
        plan.append(Assign(at("output_proj", "bias"), (full_name(path, "out_proj.bias"),), identity))
    return plan


def _rows(start: int, stop: int):
    return lambda x: x[start:stop]


Rule = Callable[[str, torch.nn.Module, tuple, Any], "list[Assign]"]

RULES: dict[type, Rule] = {}


def register(*classes: type) -> Callable[[Rule], Rule]:
    """Registers the decorated rule for the torch layer ``classes`` (and their subclasses)."""

    def add(rule: Rule) -> Rule:
        for cls in classes:
            RULES[cls] = rule
        return rule

    return add


def rule_for(module: torch.nn.Module) -> Rule | None:
    """The rule for ``module``'s class, else for the first registered class it is an instance of."""
    return RULES.get(type(module)) or next((r for t, r in RULES.items() if isinstance(module, t)), None)


register(torch.nn.GRUCell)(_plan_gru)
register(torch.nn.LSTMCell)(_plan_lstm_cell)
register(torch.nn.GRU, torch.nn.LSTM)(_plan_rnn)
register(torch.nn.RNN, torch.nn.RNNCell)(_plan_elman)
register(torch.nn.MultiheadAttention)(_plan_mha)
