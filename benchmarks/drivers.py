"""The drivers: every variant is one function ``(model, store) -> fun(params, x)``, a fresh
(uncached) function each call; one skeleton measures any set of them on any model.

Variants: ``plain`` (``jax.value_and_grad`` of the untagged function); ``jt all``
(``jaxtrace.value_and_grad``, every tag); ``jt one`` (one tag); ``hand eps`` (the program one
writes by hand for the same gradients: explicit ``+ eps`` at every tag, plain
``jax.value_and_grad``); ``recipe`` (JAX 0.12's backward logs: an identity ``custom_vjp``
registered with ``defvjp_with_logs`` at every tag, read with ``f_vjp.with_logs(ct)`` on what
``jax.vjp`` returns; skipped with a note on JAX without it); ``hook`` (the hook-style JAX
alternative: an identity ``custom_vjp`` whose backward sends the cotangent to the host with
``io_callback``).
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp

import jaxtrace as jt
import models as M
from timers import FIGURES, block, interleave, median, median_ratio, timed, trace_and_compile

PLAIN, ALL, ONE, HAND, RECIPE, HOOK = "plain", "jt all", "jt one", "hand eps", "recipe", "hook"
BUILD = (PLAIN, HAND, RECIPE, ALL, ONE)  # the variants whose build time is compared


def tag_shapes(model: M.Model):
    """``{name: ShapeDtypeStruct}`` of every tag (from jaxtrace, which finds them)."""
    fun = jt.value_and_grad(functools.partial(model.loss, tag=jt.tag))
    return jax.eval_shape(fun, model.params, model.x)[1][1]


def shared_zeros(shapes) -> dict:
    """``{name: zeros}``, one array per shape and dtype (as a hand-written program would share them)."""
    made: dict = {}

    def zeros(s):
        key = (s.shape, s.dtype)
        if key not in made:
            made[key] = jnp.zeros(s.shape, s.dtype)
        return made[key]

    return {n: jax.tree_util.tree_map(zeros, s) for n, s in shapes.items()}


def plain(model, store):
    return jax.value_and_grad(functools.partial(model.loss, tag=M.identity))


def jaxtrace_all(model, store):
    return jt.value_and_grad(functools.partial(model.loss, tag=jt.tag))


def jaxtrace_one(model, store):
    return jt.value_and_grad(functools.partial(model.loss, tag=jt.tag), tags=model.one_tag)


def hand(model, store):
    shapes = store.shapes

    def fun(params, x):
        eps = shared_zeros(shapes)
        return jax.value_and_grad(lambda p, e: model.loss(p, x, M.identity, e), argnums=(0, 1))(params, eps)

    return fun


def recipe(model, store):
    def fun(params, x):
        out, f_vjp = jax.vjp(lambda p: model.loss(p, x, M.logged), params)
        (grads,), logs = f_vjp.with_logs(jnp.ones_like(out))
        return out, (grads, logs)

    return fun


def hook(model, store):
    return jax.value_and_grad(functools.partial(model.loss, tag=store.tag))


VARIANTS: dict[str, Callable] = {PLAIN: plain, ALL: jaxtrace_all, ONE: jaxtrace_one, HAND: hand, RECIPE: recipe,
                                 HOOK: hook}


def available(names) -> list[str]:
    """``names`` less the recipe where the installed JAX has no backward logs."""
    return [n for n in names if n != RECIPE or M.HAS_LOGS]


class Bench:
    """One model and its variants: fresh functions, their params, lowering and compiling."""

    def __init__(self, model: M.Model, names):
        self.model = model
        self.names = [n for n in available(names) if n != HAND or model.hand]
        self.store = M.HookStore()
        self.store.shapes = tag_shapes(model) if HAND in self.names else None
        self.x = jax.tree_util.tree_map(jnp.asarray, model.x)
        self.params = jax.tree_util.tree_map(jnp.asarray, model.params)
        self.plain_params = self.params if model.plain_params is None else jax.tree_util.tree_map(
            jnp.asarray, model.plain_params)

    def args(self, name):
        return (self.plain_params if name == PLAIN else self.params), self.x

    def lower(self, name):
        return jax.jit(VARIANTS[name](self.model, self.store)).lower(*self.args(name))

    def compile_all(self) -> dict:
        return {name: self.lower(name).compile() for name in self.names}

    def call(self, compiled, name) -> Callable:
        c, args = compiled[name], self.args(name)
        if name == HOOK:
            return lambda: (block(c(*args)), jax.effects_barrier(), self.store.clear())
        return lambda: block(c(*args))


def measure_build(bench: Bench, rounds: int, names=BUILD, seed: int = 1, compile: bool = True,
                  pause_gc: bool = False) -> dict:
    """Trace + lower and compile, interleaved, fresh functions every round:
    ``{variant: {figure_ms, figure_ratio (x plain), ...}}``, with ``jt all``'s and ``jt one``'s
    ratios to hand (``over_hand``) and to the faster of recipe and hand (``over_best``)."""
    names = [n for n in available(names) if n in bench.names]
    samples = interleave({n: trace_and_compile(lambda n=n: bench.lower(n), compile, pause_gc) for n in names},
                         rounds, seed=seed)
    best = tuple(n for n in (HAND, RECIPE) if n in names)
    out = {}
    for name in names:
        v = out[name] = {}
        for fig in FIGURES if compile else ("trace", "trace_cpu"):
            v[f"{fig}_ms"] = 1e3 * median(samples[name], fig)
            v[f"{fig}_ratio"] = median_ratio(samples, name, fig, PLAIN)
            if HAND in names:
                v[f"{fig}_over_hand"] = median_ratio(samples, name, fig, HAND)
            if best:
                v[f"{fig}_over_best"] = median_ratio(samples, name, fig, best)
    return out


def measure_steps(bench: Bench, compiled: dict, rounds: int, min_time: float, names=None) -> dict:
    """Steady-state step time, interleaved: ``{variant: {step_ms, step_ratio, step_cpu_ratio,
    step_over_hand}}``; ``repeats`` runs per sample, so that a sample lasts ``min_time``."""
    steps = {n: bench.call(compiled, n) for n in (names or compiled)}
    for fn in steps.values():  # warm up
        fn()
    t = time.perf_counter()
    steps[PLAIN]()
    repeats = max(1, int(min_time / max(time.perf_counter() - t, 1e-6)))
    samples = interleave({n: timed(fn, repeats) for n, fn in steps.items()}, rounds)
    out = {"repeats": repeats}
    for name in steps:
        out[name] = {"step_ms": 1e3 * median(samples[name], "step"),
                     "step_ratio": median_ratio(samples, name, "step", PLAIN),
                     "step_cpu_ratio": median_ratio(samples, name, "step_cpu", PLAIN)}
        if HAND in steps:
            out[name]["step_over_hand"] = median_ratio(samples, name, "step", HAND)
        if HOOK in steps and name != HOOK:
            out[name]["hook_over"] = median_ratio(samples, HOOK, "step", name)
    return out


def log(message: str) -> None:
    print(f"[{message}]", file=sys.stderr, flush=True)
