"""Checks on 8 simulated CPU devices, run by ``test_multidevice.py`` in a subprocess.

JAX fixes its device count when it starts, so these run in their own process
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` while the rest of
the suite keeps one device. Run by hand with
``PYTHONPATH=. python tests/multidevice_checks.py [check ...]``; it prints one
JSON object ``{check: "ok" | traceback}`` on its last line.

Oracles: the same function written with explicit ``+ eps`` arguments and
differentiated with plain ``jax.grad`` on one device, or a closed form.
Shardings: a tag gradient is sharded as JAX shards a plain output of the
tagged value; a leaf gradient as ``jax.grad``'s.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtrace as jt  # noqa: E402
from oracles import assert_close, eps_oracle, oracle_per_example, plus_eps  # noqa: E402  (tests/ is on the path: this script's folder)

jax.config.update("jax_enable_x64", True)

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def same_sharding(got, want, what):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), f"{what}: {got.sharding} != {want.sharding}"


def mesh2d(mode=AxisType.Auto):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(mode, mode))


def put(tree, mesh, specs):
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def on_one_device(tree):
    return jax.device_put(tree, jax.devices()[0])


RNG = np.random.default_rng(0)
PARAMS = {"w1": RNG.normal(size=(3, 4)), "b1": RNG.normal(size=(4,)), "w2": RNG.normal(size=(4, 2))}
X, Y = RNG.normal(size=(16, 3)), RNG.normal(size=(16, 2))


# --- jit with NamedSharding ----------------------------------------------------


def mlp_loss(params, x, y, mark, constrain):
    h = mark(x @ params["w1"] + params["b1"], "h")
    h = constrain(h)
    out = mark(jnp.tanh(h) @ params["w2"], "out")
    return jnp.mean((out - y) ** 2)


def mlp_oracle(loss, params, x, y, shapes):
    """Leaf and tag gradients of ``loss`` by the ``+ eps`` oracle (``oracles.eps_oracle``), on one device."""
    eps = {k: jnp.zeros(s) for k, s in shapes.items()}
    marked = lambda p, e, x, y: loss(p, x, y, plus_eps(e), lambda v: v)  # noqa: E731
    return eps_oracle(marked, *on_one_device((params, eps, x, y)), argnums=(0, 1), wrap=jax.jit)


@check
def data_parallel_step():
    """A jitted SGD step, batch sharded over all 8 devices, params donated, a sharding constraint inside."""
    mesh = mesh2d()
    batch = NamedSharding(mesh, P(("data", "model")))
    constrain = lambda h: lax.with_sharding_constraint(h, batch)  # noqa: E731
    loss = lambda p, x, y: mlp_loss(p, x, y, jt.tag, constrain)  # noqa: E731

    def step(params, x, y):
        value, (grads, tag_grads) = jt.value_and_grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value, tag_grads

    want_grads, want_tags = mlp_oracle(mlp_loss, PARAMS, X, Y, {"h": (16, 4), "out": (16, 2)})
    params = put(PARAMS, mesh, {"w1": P(), "b1": P(), "w2": P()})
    x, y = put((X, Y), mesh, (P(("data", "model")),) * 2)
    plain_grads = jax.jit(jax.grad(loss))(params, x, y)
    plain_h = jax.jit(lambda p, x: constrain(x @ p["w1"] + p["b1"]))(params, x)
    plain_out = jax.jit(lambda p, x: jnp.tanh(constrain(x @ p["w1"] + p["b1"])) @ p["w2"])(params, x)

    new_params, value, tag_grads = jax.jit(step, donate_argnums=0)(params, x, y)
    assert all(p.is_deleted() for p in jax.tree_util.tree_leaves(params)), "the donated params were not donated"
    assert_close(tag_grads, want_tags, "tag gradients")
    assert_close(new_params, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, PARAMS, want_grads), "updated params")
    same_sharding(tag_grads["h"], plain_h, "h")
    same_sharding(tag_grads["out"], plain_out, "out")
    for k in PARAMS:
        same_sharding(new_params[k], plain_grads[k], k)


def model_parallel(mode):
    """A Megatron-style layer: w1 split by columns and w2 by rows over 'model', the batch over 'data'."""
    mesh = mesh2d(mode)
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}

    def loss(params, x, y, mark, constrain):
        h = mark(x @ params["w1"] + params["b1"], "h")
        a = jnp.tanh(h)
        out = constrain(a, params["w2"])
        out = mark(out, "out")
        return jnp.sum((out - y) ** 2)

    def matmul_explicit(a, w):  # contracting over a sharded axis needs an output sharding
        return jnp.matmul(a, w, out_sharding=P("data", None))

    matmul = matmul_explicit if mode == AxisType.Explicit else jnp.matmul
    tagged = lambda p, x, y: loss(p, x, y, jt.tag, matmul)  # noqa: E731
    want_grads, want_tags = mlp_oracle(
        lambda p, x, y, mark, _: loss(p, x, y, mark, jnp.matmul), PARAMS, X, Y, {"h": (16, 4), "out": (16, 2)}
    )
    params = put(PARAMS, mesh, specs)
    x, y = put((X, Y), mesh, (P("data"), P("data")))
    with jax.set_mesh(mesh):
        for wrap in (jax.jit, lambda f: f):
            grads, tag_grads = wrap(jt.grad(tagged))(params, x, y)
            assert_close(grads, want_grads, "leaf gradients")
            assert_close(tag_grads, want_tags, "tag gradients")
        plain_grads = jax.jit(jax.grad(tagged))(params, x, y)
        plain_h = jax.jit(lambda p, x: x @ p["w1"] + p["b1"])(params, x)
        plain_out = jax.jit(lambda p, x: matmul(jnp.tanh(x @ p["w1"] + p["b1"]), p["w2"]))(params, x)
    same_sharding(tag_grads["h"], plain_h, "h")
    same_sharding(tag_grads["out"], plain_out, "out")
    for k in PARAMS:
        same_sharding(grads[k], plain_grads[k], k)


@check
def model_parallel_auto():
    model_parallel(AxisType.Auto)


@check
def model_parallel_explicit():
    model_parallel(AxisType.Explicit)


@check
def explicit_mesh_cond():
    """Explicit axes: a tag in one branch of a cond; the other branch's zeros carry the same sharding."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

    def f(x):
        y = lax.cond(x.sum() > 0, lambda x: jt.tag(jnp.sin(x), "s"), lambda x: x * 2, x)
        return jnp.sum(y**2)

    xs = np.linspace(-1.0, 2.0, 16)
    x = jax.device_put(xs, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        for wrap in (jax.jit, lambda f: f):
            grads, tag_grads, values = wrap(jt.grad(f, with_values=True))(x)
            _, captured = wrap(jt.capture(f))(x)
            assert_close(values["s"], np.sin(xs), "with_values")
            assert_close(captured["s"], np.sin(xs), "capture")
            assert_close(tag_grads["s"], 2 * np.sin(xs), "grad")
            assert_close(grads, 2 * np.sin(xs) * np.cos(xs), "leaf")
            for got in (values["s"], captured["s"], tag_grads["s"]):
                same_sharding(got, x, "s")


@check
def explicit_mesh_same_shape_tags():
    """Explicit axes: two tags of one shape but different shardings keep their own."""
    mesh = mesh2d(AxisType.Explicit)

    def f(x):
        a = jt.tag(jnp.sin(x), "a")
        b = jt.tag(jax.sharding.reshard(x, P("data", None)) * 2.0, "b")
        return jnp.sum(a * b)

    xs = np.linspace(-1.0, 2.0, 32).reshape(8, 4)
    x = jax.device_put(xs, NamedSharding(mesh, P("data", "model")))
    with jax.set_mesh(mesh):
        plain_a = jax.jit(lambda x: jnp.sin(x))(x)
        plain_b = jax.jit(lambda x: jax.sharding.reshard(x, P("data", None)) * 2.0)(x)
        for wrap in (jax.jit, lambda f: f):
            _, tag_grads = wrap(jt.grad(f))(x)
            assert_close(tag_grads, {"a": 2 * xs, "b": np.sin(xs)}, "tag gradients")
            same_sharding(tag_grads["a"], plain_a, "a")
            same_sharding(tag_grads["b"], plain_b, "b")


@check
def nested_jit_keeps_shardings():
    """A nested jax.jit with in/out shardings around a tag keeps them when split."""
    for mode in (AxisType.Auto, AxisType.Explicit):
        mesh = mesh2d(mode)
        inner = jax.jit(
            lambda x, w: jnp.tanh(jt.tag(x @ w, "h")),
            in_shardings=(NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, "model"))),
            out_shardings=NamedSharding(mesh, P("data", "model")),
        )
        reshard = lax.with_sharding_constraint if mode == AxisType.Auto else jax.sharding.reshard

        def loss(w, x):
            a = reshard(inner(x, w), NamedSharding(mesh, P("data", None)))
            return jnp.sum(jt.tag(a, "a") ** 2)

        w, x = put((PARAMS["w1"], X), mesh, (P(None, "model"), P("data")))
        grads, tag_grads = jax.jit(jt.grad(loss))(w, x)
        plain = jax.jit(jax.grad(loss))(w, x)
        same_sharding(grads, plain, f"{mode}: w")
        same_sharding(tag_grads["h"], jax.jit(lambda w, x: x @ w)(w, x), f"{mode}: h")
        a = np.tanh(X @ PARAMS["w1"])
        assert_close(tag_grads["a"], 2 * a, "a")
        assert_close(tag_grads["h"], 2 * a * (1 - a**2), "h")
        assert_close(grads, plain, "w")



# --- statistics: one all-reduce round ----------------------------------------------


def all_reduces(compiled_text):
    """The all-reduce ops of a compiled HLO module (a combined one, over a tuple, counts once)."""
    pattern = re.compile(r"\s*(ROOT\s+)?%\S+\s*=.*\sall-reduce(-start)?\(")
    return sum(1 for line in compiled_text.splitlines() if pattern.match(line))


def hand_stats(g, stats, keep=0):
    """The hand-written statistics of one tag gradient: sums and a max of |g|, no scaling, over all
    but the first ``keep`` axes."""
    a, axes = jnp.abs(g), tuple(range(keep, g.ndim))
    table = {
        "norm": lambda: jnp.sqrt(jnp.sum(a**2, axis=axes)),
        "rms": lambda: jnp.sqrt(jnp.mean(a**2, axis=axes)),
        "mean_abs": lambda: jnp.mean(a, axis=axes),
        "max_abs": lambda: jnp.max(a, axis=axes),
        "nonfinite": lambda: jnp.mean(~jnp.isfinite(a), axis=axes),
    }
    return {s: table[s]() for s in stats}


STATS_ALL = ("norm", "rms", "mean_abs", "max_abs", "nonfinite")


def hand_guarded_stats(g, stats, keep=0):
    """``hand_stats`` with jt.stats' range guards, written by hand: the squares (and |g|) also summed at
    fixed power-of-two scales, each scaled entry capped after its multiply, the sum in range picked
    after the reduction (what one writes to get jt.stats' numbers for huge and tiny gradients)."""
    axes, info = tuple(range(keep, g.ndim)), jnp.finfo(g.dtype)
    n, e = int(np.prod(g.shape[keep:])), info.maxexp
    down, up, tiny = 3 * e // 4, e // 2, 2.0 ** -(e // 2 - 4)
    scaled = lambda k, cap: jnp.minimum(jnp.abs(g * 2.0**k), cap)  # noqa: E731
    sq, hi, lo = (jnp.sum(jnp.square(s), axis=axes) for s in (g, scaled(-down, info.max), scaled(up, 2.0 ** (e // 2 - 2))))
    in_range = jnp.where(jnp.isinf(sq), hi, jnp.where(sq < tiny, lo, sq))
    scale = jnp.where(jnp.isinf(sq), 2.0**down, jnp.where(sq < tiny, 2.0**-up, 1.0))
    s_abs = jnp.sum(jnp.abs(g), axis=axes)
    table = {
        "norm": lambda: scale * jnp.sqrt(in_range),
        "rms": lambda: scale * jnp.sqrt(in_range / n),
        "mean_abs": lambda: jnp.where(jnp.isinf(s_abs), jnp.sum(jnp.abs(g * 2.0**-up), axis=axes) / n * 2.0**up, s_abs / n),
        "max_abs": lambda: jnp.max(jnp.abs(g), axis=axes),
        "nonfinite": lambda: jnp.mean(~jnp.isfinite(g), axis=axes),
    }
    return {s: table[s]() for s in stats}


def stats_step(how, stats, layout):
    """A layout's step ``(params, x, y) -> (value, grads, statistics)``: ``jt.stats`` ("ours"), or
    the ``+ eps`` oracle's tag gradients reduced by hand ("hand") or by hand with the guards
    ("guarded")."""

    def step(p, x, y):
        if how == "ours":
            value, (grads, tag_stats) = jt.stats.value_and_grad(layout.loss, stats=stats)(p, x, y)
            return value, grads, tag_stats
        eps = {n: jnp.zeros(s, jnp.float32) for n, s in layout.eps.items()}
        value, (grads, tag_grads) = eps_oracle(lambda p, e: layout.marked(p, e, x, y), p, eps, argnums=(0, 1), value=True)
        by_hand = hand_stats if how == "hand" else hand_guarded_stats
        return value, grads, {n: by_hand(g, stats, layout.keep) for n, g in tag_grads.items()}

    return layout.wrap(step)


def rnn_loss(p, xs, y, eps=None):
    """A tanh RNN in a lax.scan with a tag on each step's state, or ``+ eps[step]`` there."""

    def step(h, x_e):
        x, e = x_e
        h = jnp.tanh(h @ p["w"] + x @ p["u"])
        return (jt.tag(h, "h") if e is None else h + e), None

    h, _ = lax.scan(step, jnp.zeros((xs.shape[1], p["w"].shape[0]), xs.dtype), (xs, eps))
    return jnp.mean((h - y) ** 2)


class StatsLayout:
    """One sharded step for the statistics' collectives: where each array lies, the loss with
    tags, the same with ``+ eps`` (``marked(p, eps, x, y)``), the tags' shapes, the loop axes
    jt.stats keeps, and what wraps the step (a shard_map around it, or nothing)."""

    def __init__(self, params, specs, data, data_specs, loss, marked, eps, keep=0, wrap=lambda f: f):
        self.params, self.specs, self.data, self.data_specs = params, specs, data, data_specs
        self.loss, self.marked, self.eps, self.keep, self.wrap = loss, marked, eps, keep, wrap


def stats_layouts(mesh):
    """Data parallel (an MLP, and an RNN whose tag is in a scan), 4x2 tensor parallel, FSDP, and
    shard_map with the tags inside its body (jt.stats around it) or jt.stats itself inside."""
    f32 = lambda tree: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)  # noqa: E731
    batch, mlp_data = P(("data", "model")), f32((X, Y))
    mlp = dict(
        params=f32(PARAMS),
        data=mlp_data,
        loss=lambda p, x, y: mlp_loss(p, x, y, jt.tag, lambda h: h),
        marked=lambda p, e, x, y: mlp_loss(p, x, y, plus_eps(e), lambda h: h),
        eps={"h": (16, 4), "out": (16, 2)},
    )
    replicated = {"w1": P(), "b1": P(), "w2": P()}

    def sm_body(p, x, y, mark):  # the loss per shard, averaged over the shards
        return lax.pmean(mlp_loss(p, x, y, mark, lambda h: h), ("data", "model"))

    def sm_marked(p, e, x, y):  # one block of eps per shard (a tag in the body: one axis per mesh axis)
        def body(p, x, y, e):
            return sm_body(p, x, y, plus_eps({n: v.reshape(v.shape[2:]) for n, v in e.items()}))

        return smap(body, mesh, (P(), batch, batch, {"h": P("data", "model"), "out": P("data", "model")}), P(), True)(p, x, y, e)

    def per_shard(step):  # jt.stats inside the body: the gradients averaged, the statistics per shard
        def body(p, x, y):
            value, grads, tag_stats = step(p, x, y)
            per = jax.tree_util.tree_map(lambda s: s[None], tag_stats)
            return lax.pmean(value, ("data", "model")), lax.pmean(grads, ("data", "model")), per

        return lambda p, x, y: smap(body, mesh, (P(), batch, batch), (P(), P(), batch), False)(p, x, y)

    rnn_params = f32({"w": RNG.normal(size=(8, 8)) / 3, "u": RNG.normal(size=(3, 8))})
    return {
        "data parallel": StatsLayout(specs=replicated, data_specs=(batch, batch), **mlp),
        "data parallel, a tag in a scan": StatsLayout(
            rnn_params, {"w": P(), "u": P()}, f32((RNG.normal(size=(5, 16, 3)), RNG.normal(size=(16, 8)))),
            (P(None, ("data", "model")), batch), rnn_loss, lambda p, e, x, y: rnn_loss(p, x, y, e["h"]),
            {"h": (5, 16, 8)}, keep=1),
        "tensor parallel 4x2": StatsLayout(specs={"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
                                           data_specs=(P("data"), P("data")), **mlp),
        # FSDP: every parameter sharded over the batch's axis, gathered where it is used.
        "fsdp": StatsLayout(specs={"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None)},
                            data_specs=(P("data"), P("data")), **mlp),
        "shard_map, tags in its body": StatsLayout(
            mlp["params"], replicated, mlp_data, (batch, batch),
            lambda p, x, y: smap(lambda p, x, y: sm_body(p, x, y, jt.tag), mesh, (P(), batch, batch), P(), True)(p, x, y),
            sm_marked, {"h": (4, 2, 2, 4), "out": (4, 2, 2, 2)}, keep=2),
        "shard_map, jt.stats in its body": StatsLayout(
            specs=replicated, data_specs=(batch, batch), wrap=per_shard,
            **dict(mlp, eps={"h": (2, 4), "out": (2, 2)})),
    }


def assert_hand_collectives(where, got_text, hand_text, guarded_text, guard_scalars):
    """The stats step's collectives against the hand programs': exactly the guarded hand program's
    (kind and elements of each); against the unguarded one, the same kinds and the same number of
    each, every collective but the all-reduces the same, and the all-reduces larger by at most the
    guards' scalars once per mesh axis (the scaled sums ride in the same rounds)."""
    got, hand, guarded = collectives(got_text), collectives(hand_text), collectives(guarded_text)
    assert sorted(got) == sorted(guarded), f"{where}: {sorted(got)}, the guarded hand program {sorted(guarded)}"
    assert by_kind(got) == by_kind(hand), f"{where}: {by_kind(got)}, the hand program {by_kind(hand)}"
    others = lambda ops: sorted(op for op in ops if op[0] != "all-reduce")  # noqa: E731
    assert others(got) == others(hand), f"{where}: {others(got)}, the hand program {others(hand)}"
    extra = sum(n for k, n in got if k == "all-reduce") - sum(n for k, n in hand if k == "all-reduce")
    assert 0 <= extra <= 2 * guard_scalars, f"{where}: {extra} all-reduced elements beyond the hand program's"


@check
def stats_one_all_reduce_round():
    """A sharded jt.stats step has the collectives of the same step written by hand: no all-gather
    (or other collective) and no all-reduce beyond the hand program's, the range guards included.

    Every layout of ``stats_layouts`` (data parallel, with a tag in a scan too; 4x2 tensor
    parallel, Megatron-style w1/w2; FSDP, the parameters and the batch over 'data'; shard_map,
    with tags in its body or jt.stats in it), stats="norm" and all statistics, float32: the
    compiled HLO's collectives (``assert_hand_collectives``), and the numbers, against the ``+
    eps`` oracle's tag gradients reduced by hand, with jt.stats' range guards and without. Huge
    (squares overflow) and tiny (squares underflow) values, sharded three ways, give the float64
    numbers.
    """
    mesh = mesh2d()
    for name, layout in stats_layouts(mesh).items():
        params = put(layout.params, mesh, layout.specs)
        x, y = put(layout.data, mesh, layout.data_specs)
        for stats in (("norm",), STATS_ALL):
            steps = {how: jax.jit(stats_step(how, stats, layout)) for how in ("ours", "hand", "guarded")}
            texts = {how: s.lower(params, x, y).compile().as_text() for how, s in steps.items()}
            shapes = jax.eval_shape(steps["ours"], params, x, y)[2]
            per_entry = 2 * bool({"norm", "rms"} & set(stats)) + ("mean_abs" in stats)
            guard_scalars = per_entry * sum(int(np.prod(s[stats[0]].shape)) for s in shapes.values())
            where = f"{name}, stats={stats}"
            assert_hand_collectives(where, texts["ours"], texts["hand"], texts["guarded"], guard_scalars)
            got = steps["ours"](params, x, y)
            for how in ("hand", "guarded"):
                want = steps[how](params, x, y)
                for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, err_msg=f"{where}, {how}")
    batch, everything = P(("data", "model")), STATS_ALL
    # out of range, sharded: the float64 numbers (rounded to float32)
    summarize = jax.jit(lambda g: jt.stats.summarize({"g": g}, stats=everything)["g"])
    for spec in (batch, P("data", "model"), P(None, "model")):
        for scale in (1e25, 1e-25):
            g = (np.asarray(X @ PARAMS["w1"], np.float64) * scale).astype(np.float32)  # (16, 4)
            sharded = jax.device_put(g, NamedSharding(mesh, spec))
            got, w = summarize(sharded), np.abs(g.astype(np.float64))
            want = {"norm": np.sqrt(np.sum(w**2)), "rms": np.sqrt(np.mean(w**2)), "mean_abs": np.mean(w),
                    "max_abs": np.max(w), "nonfinite": 0.0}
            for stat in everything:
                np.testing.assert_allclose(np.asarray(got[stat]), np.float32(want[stat]), rtol=2e-6, atol=0,
                                           err_msg=f"{spec}, scale {scale}: {stat}")


# --- per-example gradients under FSDP ------------------------------------------------


def collectives(compiled_text):
    """``[(kind, elements of its result)]`` for each collective of a compiled HLO module."""
    out = []
    op = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
    for m in op.finditer(compiled_text):
        dims = re.findall(r"(?:pred|[sfu]\d+|bf16)\[([\d,]*)\]", m.group(1))
        out.append((m.group(2), sum(int(np.prod([int(d) for d in ds.split(",") if d])) for ds in dims)))
    return out


def by_kind(ops):
    kinds = {}
    for kind, _ in ops:
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


@check
def per_example_fsdp_collectives():
    """jt.per_example_norms and jt.clipped_grad on an FSDP-sharded equinox MLP and a small CNN (the
    batch and every parameter over one axis of 8 devices): the numbers against the definition (row i of
    jax.jacrev of the losses, clipped) on one device (float64), and the compiled collectives against the plain gradient step (float32).

    per_example_norms: exactly the plain step's collectives plus one all-reduce (the norms) on the
    MLP; none beyond the plain step's plus that one on the CNN.
    clipped_grad: the weighted sum contracts the factors as the plain backward contracts its
    weight gradient, reading a Linear's input as the forward's own array (the CNN's flattened
    feature map was gathered twice while it read a reshaped view), so no layer input is moved:
    every all-gather beyond the plain step's is at most (B, 10) elements (the clipping weights, the
    last layer's output gradient), and at most two all-reduces are added (the norms; the last bias,
    weighted after them). Not yet the target of issue 33 (the plain step plus one all-reduce): XLA
    gathers the B clipping weights and the last layer's weighted output gradient
    (docs/performance.md, Collectives under FSDP). That is ``nan_safe=False``'s sum; the default
    (``nan_safe=True``, issue 51) zeroes the non-finite entries of each factor, an elementwise copy
    of each layer input that XLA gathers again: each all-gather it adds is one the plain step does
    (a layer input, once more), and it adds no all-reduce.
    """
    import equinox as eqx

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("fsdp",), axis_types=(AxisType.Auto,))

    def fsdp(a):
        axis = next((i for i, s in enumerate(a.shape) if s % len(devices) == 0), None)
        return NamedSharding(mesh, P() if axis is None else P(*([None] * axis), "fsdp"))

    def losses(model, x, y):
        logits = jax.vmap(model)(x)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]

    def plain(model, x, y):
        return eqx.filter_grad(lambda m: jnp.sum(losses(m, x, y)))(model)

    def definition(model, x, y, max_norm):
        ref = oracle_per_example(losses, model, x, y)
        return ref.total, ref.clipped(max_norm)

    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    y = jax.random.randint(k3, (32,), 0, 10)
    mlp = (eqx.nn.MLP(64, 10, 128, 2, key=k1), jax.random.normal(k2, (32, 64)))
    cnn = eqx.nn.Sequential([
        eqx.nn.Conv2d(3, 16, 3, key=k1), eqx.nn.Lambda(jax.nn.relu), eqx.nn.Lambda(jnp.ravel),
        eqx.nn.Linear(16 * 6 * 6, 32, key=k4), eqx.nn.Lambda(jax.nn.relu), eqx.nn.Linear(32, 10, key=k2),
    ])  # at these sizes XLA gathers the flattened map (32, 576) for the first Linear's weight gradient
    for name, (model, x) in (("MLP", mlp), ("CNN", (cnn, jax.random.normal(k2, (32, 3, 8, 8))))):
        _fsdp_collectives(name, model, x, y, losses, plain, definition, fsdp, mesh, exact_norms=name == "MLP")


def _fsdp_collectives(name, model, x, y, losses, plain, definition, fsdp, mesh, exact_norms):
    import equinox as eqx

    norms = lambda m, x, y: jt.per_example_norms(losses, total=True)(m, x, y)[1]  # noqa: E731
    clipped = lambda m, x, y: jt.clipped_grad(losses, 1.0, nan_safe=False)(m, x, y)[1]  # noqa: E731
    safe = lambda m, x, y: jt.clipped_grad(losses, 1.0)(m, x, y)[1]  # noqa: E731
    for dtype in (jnp.float64, jnp.float32):
        m, xb = jax.tree_util.tree_map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, (model, x))
        arrays, static = eqx.partition(m, eqx.is_array)
        sharded = jax.device_put(arrays, jax.tree_util.tree_map(fsdp, arrays))
        batch = tuple(jax.device_put(b, NamedSharding(mesh, P("fsdp"))) for b in (xb, y))
        steps = {
            name: jax.jit(lambda a, *b, f=f: f(eqx.combine(a, static), *b))
            for name, f in (("plain", plain), ("norms", norms), ("clipped", clipped), ("safe", safe))
        }
        if dtype == jnp.float64:
            want_sq, want_g = definition(m, xb, y, 1.0)  # unsharded: one device
            assert_close(steps["norms"](sharded, *batch), want_sq, f"per_example_norms, FSDP, {name}")
            assert_close(eqx.filter(steps["clipped"](sharded, *batch), eqx.is_array), eqx.filter(want_g, eqx.is_array), f"clipped_grad, FSDP, {name}")
            assert_close(eqx.filter(steps["safe"](sharded, *batch), eqx.is_array), eqx.filter(want_g, eqx.is_array), f"clipped_grad nan_safe, FSDP, {name}")
            continue
        ops = {n: collectives(s.lower(sharded, *batch).compile().as_text()) for n, s in steps.items()}
        base, got = by_kind(ops["plain"]), by_kind(ops["norms"])
        want = dict(base, **{"all-reduce": base.get("all-reduce", 0) + 1})
        if exact_norms:
            assert got == want, f"per_example_norms, {name}: {got}, want the plain step's {base} plus one all-reduce"
        else:
            assert all(got.get(k, 0) <= v for k, v in want.items()) and set(got) <= set(want), (
                f"per_example_norms, {name}: {got}, want at most the plain step's {base} plus one all-reduce")
        gathers = [op for op in ops["clipped"] if op[0] == "all-gather"]
        for op in ops["plain"]:
            if op in gathers:
                gathers.remove(op)
        big = [op for op in gathers if op[1] > x.shape[0] * 10]
        assert not big, f"clipped_grad, {name}: all-gathers {big} beyond the plain step's, larger than (B, 10): a factor moved"
        reduces = by_kind(ops["clipped"]).get("all-reduce", 0)
        assert reduces <= base.get("all-reduce", 0) + 2, f"clipped_grad, {name}: {reduces} all-reduces, the plain step {base}"
        added = [op for op in ops["safe"] if op[0] == "all-gather"]
        for op in ops["clipped"]:
            if op in added:
                added.remove(op)
        again = [op for op in added if op not in ops["plain"]]
        assert not again, f"clipped_grad nan_safe, {name}: all-gathers {again} beyond nan_safe=False's that the plain step does not do"
        assert by_kind(ops["safe"]).get("all-reduce", 0) == reduces, f"clipped_grad nan_safe, {name}: {by_kind(ops['safe'])}, nan_safe=False {by_kind(ops['clipped'])}"


# --- shard_map -------------------------------------------------------------------
# A tag inside a shard_map body gets one leading axis per manual mesh axis:
# entry [i, j] is the gradient at the value on the shard at mesh position (i, j).


def smap(body, mesh, in_specs, out_specs, check_vma, **kw):
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **kw)


def blocks(a, rows, cols):
    """The (rows, cols) grid of blocks of a 2-D array, as (rows, cols, block_rows, block_cols)."""
    n, m = a.shape
    return a.reshape(rows, n // rows, cols, m // cols).transpose(0, 2, 1, 3)


@check
def shard_map_varying_values():
    """Both mesh axes manual: x split by rows, w by columns; tags on per-shard values, in a scan too."""
    mesh = mesh2d()
    W = PARAMS["w1"]

    def tagged_body(x, w):
        def step(c, t):
            return c, jt.tag(jnp.sin(t * w), "s")

        _, s = lax.scan(step, 0.0, jnp.arange(3.0))
        h = jt.tag(jnp.tanh(x @ w) + s.sum((0, 1)), "h")
        return lax.psum(jnp.sum(h**2), ("data", "model"))

    def eps_body(x, w, eps):  # the same, with explicit perturbations, one block per shard
        e_s, e_h = (eps[n].reshape(eps[n].shape[2:]) for n in ("s", "h"))

        def step(c, t_e):
            t, e = t_e
            return c, jnp.sin(t * w) + e

        _, s = lax.scan(step, 0.0, (jnp.arange(3.0), e_s))
        h = jnp.tanh(x @ w) + s.sum((0, 1)) + e_h
        return lax.psum(jnp.sum(h**2), ("data", "model"))

    in_specs = (P("data"), P(None, "model"))
    eps_specs = {"h": P("data", "model"), "s": P("data", "model")}
    eps = {"h": jnp.zeros((4, 2, 4, 2)), "s": jnp.zeros((4, 2, 3, 3, 2))}
    for check_vma in (True, False):
        tagged = lambda w, x: smap(tagged_body, mesh, in_specs, P(), check_vma)(x, w)  # noqa: E731
        with_eps = lambda w, x, e: smap(eps_body, mesh, (*in_specs, eps_specs), P(), check_vma)(x, w, e)  # noqa: E731
        want_w, want_tags = eps_oracle(with_eps, W, X, eps, argnums=(0, 2), wrap=jax.jit)
        if check_vma:  # sin(t * w) is the same on every 'data' shard: one value, its gradient in equal shares
            want_tags["s"] = jnp.broadcast_to(want_tags["s"].mean(0, keepdims=True), eps["s"].shape)
        for wrap in (jax.jit, lambda f: f):
            grads, tag_grads = wrap(jt.grad(tagged))(W, X)
            assert_close(grads, want_w, f"check_vma={check_vma}: w")
            assert_close(tag_grads, want_tags, f"check_vma={check_vma}: tags")
        # and a closed form for h: the global 2 * h, cut into the mesh's blocks
        h_global = np.tanh(X @ W) + sum(np.sin(t * W) for t in range(3)).sum(0)
        assert_close(tag_grads["h"], blocks(2 * h_global, 4, 2), "h closed form")
        assert tag_grads["h"].sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 4)


@check
def shard_map_replicated_value():
    """A value computed from replicated inputs: one value under check_vma, a copy per shard without.

    Either way the gradients along the mesh axis sum to the gradient at the value.
    """
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    W = PARAMS["w1"]

    def rest(x, v):
        return lax.psum(jnp.sum(jnp.tanh(x @ v) ** 2), "data")

    def tagged_body(x, w):
        return rest(x, jt.tag(jnp.sin(w), "v"))

    def eps_body(x, w, e):
        return rest(x, jnp.sin(w) + e[0])

    # the gradient at the one value sin(w): pass it in as a replicated input
    total = jax.grad(lambda v: smap(rest, mesh, (P("data"), P()), P(), True)(X, v))(np.sin(W))
    for check_vma in (True, False):
        tagged = lambda w, x: smap(tagged_body, mesh, (P("data"), P()), P(), check_vma)(x, w)  # noqa: E731
        for wrap in (jax.jit, lambda f: f):
            grads, tag_grads = wrap(jt.grad(tagged))(W, X)
            assert tag_grads["v"].shape == (4, 3, 4)
            assert_close(grads, jax.grad(tagged)(W, X), "w")
            assert_close(tag_grads["v"].sum(0), total, "v: the sum over shards")
            if check_vma:  # one value: its gradient in equal shares
                assert_close(tag_grads["v"], np.broadcast_to(total / 4, (4, 3, 4)), "v: each entry")
            else:  # each shard's copy is its own value
                with_eps = lambda e: smap(eps_body, mesh, (P("data"), P(), P("data")), P(), False)(X, W, e)  # noqa: E731
                assert_close(tag_grads["v"], eps_oracle(with_eps, jnp.zeros((4, 3, 4))), "v: per shard")


@check
def shard_map_forward_side():
    """capture, jvp, patch and with_values through a shard_map, on a varying and an invariant value."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    W = PARAMS["w1"]

    def rest(x, v):
        return lax.psum(jnp.sum(jnp.tanh(x @ v) ** 2), "data")

    def f(w, x):
        def body(x, w):
            v = jt.tag(jnp.sin(w), "v")  # the same on every shard
            h = jt.tag(x @ v, "h")  # a block of rows per shard
            return lax.psum(jnp.sum(jnp.tanh(h) ** 2), "data")

        return smap(body, mesh, (P("data"), P()), P(), True)(x, w)

    def global_f(v, h):  # the same function of the tagged values, written globally
        return jnp.sum(jnp.tanh(h) ** 2)

    X_ = jnp.asarray(X)  # jax.jvp of a shard_map under jit fails on a NumPy primal (JAX 0.10.2)
    v, h = np.sin(W), X @ np.sin(W)
    per_shard = lambda a: np.broadcast_to(a, (4, *a.shape))  # noqa: E731
    for wrap in (jax.jit, lambda f: f):
        out, values = wrap(jt.capture(f))(W, X)
        assert_close(values["v"], per_shard(v), "capture v")
        assert_close(values["h"], h.reshape(4, 4, 4), "capture h")

        dw = np.cos(np.arange(12.0)).reshape(3, 4)
        _, out_dot, dots = wrap(lambda w, dw: jt.jvp(f, (w, X_), (dw, jnp.zeros_like(X_))))(W, dw)
        assert_close(dots["v"], per_shard(np.cos(W) * dw), "jvp v")
        assert_close(dots["h"], (X @ (np.cos(W) * dw)).reshape(4, 4, 4), "jvp h")
        assert_close(out_dot, jax.jvp(f, (W, X_), (dw, jnp.zeros_like(X_)))[1], "jvp out")

        new_v, new_h = 0.5 * v, np.tanh(h)
        assert_close(wrap(jt.patch(f, {"v": per_shard(new_v)}))(W, X), global_f(new_v, X @ new_v), "patch v")
        assert_close(wrap(jt.patch(f, {"h": new_h.reshape(4, 4, 4)}))(W, X), global_f(v, new_h), "patch h")
        assert_close(wrap(jt.patch(f, {"v": lambda a: 2 * a}))(W, X), global_f(2 * v, X @ (2 * v)), "patch v with a function")

        value, (grads, tag_grads), values = wrap(jt.value_and_grad(f, with_values=True))(W, X)
        assert_close(values["h"], h.reshape(4, 4, 4), "with_values h")
        assert_close(tag_grads["h"], jax.grad(global_f, argnums=1)(v, h).reshape(4, 4, 4), "grad h")


@check
def shard_map_partial_manual_vjp():
    """shard_map manual over 'data' only ('model' stays automatic), through jt.vjp under jit."""
    mesh = mesh2d()

    def f(x, w):
        def body(x, w):
            return jt.tag(jnp.tanh(x @ w), "h") * 2.0

        return smap(body, mesh, (P("data"), P()), P("data"), True, axis_names={"data"})(x, w)

    W = PARAMS["w1"]
    ct = np.cos(np.arange(16 * 4.0)).reshape(16, 4)

    @jax.jit
    def pull(x, w, ct):
        out, vjp_fn = jt.vjp(f, x, w)
        return out, vjp_fn(ct)

    out, ((gx, gw), tag_cts) = pull(X, W, ct)
    want_x, want_w = jax.vjp(f, X, W)[1](ct)
    assert_close((gx, gw), (want_x, want_w), "primal cotangents")
    assert_close(tag_cts["h"], (2 * ct).reshape(4, 4, 4), "h: one block of rows per 'data' shard")


# --- find_nonfinite: where a NaN began, and on which shard (issue 52, item 3) ----------------
# The oracle is the same program on one device, unsharded: the + eps program's values and
# cotangents at the tags, and the first non-finite entry in the order the program computes them.
# The shard: a device that holds that entry of the tagged value, as a plain jitted program of the
# value lays it out (jax.jit), or the shard of the batch rows that hold the example (shard_map).

NAN_STEPS = 3


def nan_loss(params, x, xs, t, tv):
    """A layer, a scan with a per-step input (a NaN there poisons one step and example), and a
    per-example output tagged under vmap (``tv``); the loss sums each example's norm, whose
    gradient at an example whose output is 0 is 0/0."""
    h = t(x @ params["w1"] + params["b1"], "h")

    def layer(c, w_x):
        w, x_t = w_x
        return t(jnp.tanh(c @ w + x_t), "layer"), None

    c, _ = lax.scan(layer, h, (params["ws"], xs))
    out = tv(c @ params["w2"], "out")
    return jnp.sum(jnp.sqrt(jnp.sum(out**2, axis=1)))


def nan_tagged(params, x, xs):
    return nan_loss(params, x, xs, jt.tag, lambda v, n: jax.vmap(lambda e: jt.tag(e, n))(v))


def nan_eps(params, x, xs, eps):
    """``nan_loss`` with ``+ eps`` where each tag is (the scan's, one slice per step); its values."""
    values = {}

    def t(v, n, e=None):
        values.setdefault(n, []).append(v + (eps[n] if e is None else e))
        return values[n][-1]

    def layer(c, w_x_e):
        w, x_t, e = w_x_e
        c = jnp.tanh(c @ w + x_t) + e
        return c, c

    h = t(x @ params["w1"] + params["b1"], "h")
    c, steps = lax.scan(layer, h, (params["ws"], xs, eps["layer"]))
    out = t(c @ params["w2"], "out")
    loss = jnp.sum(jnp.sqrt(jnp.sum(out**2, axis=1)))
    return loss, {"h": values["h"][0], "layer": steps, "out": values["out"][0]}


def nan_oracle(params, x, xs):
    """``(first value, first gradient)`` on one device, each ``(name, steps, examples, entry)``:
    the first tag, loop step and example (in the program's order, the backward pass's for the
    gradients) with a non-finite entry, and the first entry of its kind there (a NaN if one is)."""
    b = x.shape[0]
    eps = {"h": jnp.zeros((b, 4)), "layer": jnp.zeros((NAN_STEPS, b, 4)), "out": jnp.zeros((b, 2))}
    grad = jax.jit(jax.grad(nan_eps, argnums=3, has_aux=True))
    g, values = grad(*on_one_device((params, x, xs, eps)))
    forward = [("h", (), values["h"]), *(("layer", (k,), values["layer"][k]) for k in range(NAN_STEPS)), ("out", (), values["out"])]
    backward = [("out", (), g["out"]), *(("layer", (k,), g["layer"][k]) for k in reversed(range(NAN_STEPS))), ("h", (), g["h"])]

    def first(entries):
        for name, steps, a in entries:
            a = np.asarray(a)
            per = [((i,), a[i]) for i in range(len(a))] if name == "out" else [((), a)]  # out: one example at a time
            for examples, part in per:
                if not np.all(np.isfinite(part)):
                    kind = np.isnan(part) if np.isnan(part).any() else np.isinf(part)
                    return name, steps, examples, tuple(int(i) for i in np.argwhere(kind)[0])
        return None

    return first(forward), first(backward)


def nan_inputs(scenario):
    """(params, x, xs, global row): ``"value"``: a NaN in the scan's input of step 1 at row 11;
    ``"gradient"``: row 6's output is 0 (its input, the bias and its scan inputs are 0), so only
    its gradient is a NaN."""
    rng = np.random.default_rng(1)
    params = {"w1": rng.normal(size=(3, 4)), "b1": rng.normal(size=(4,)), "ws": rng.normal(size=(NAN_STEPS, 4, 4)) / 2,
              "w2": rng.normal(size=(4, 2))}
    x, xs = rng.normal(size=(16, 3)), rng.normal(size=(NAN_STEPS, 16, 4)) / 4
    if scenario == "value":
        xs[1, 11, 2] = np.nan
        return params, x, xs, 11
    params["b1"][:] = 0.0
    x[6], xs[:, 6] = 0.0, 0.0
    return params, x, xs, 6


def holders(sharding, shape, index):
    """``({mesh axis: lowest coordinate}, axes along which several devices hold it)`` of the devices
    whose block of an array of ``shape`` laid out by ``sharding`` holds entry ``index``."""
    mesh = sharding.mesh
    coords = [tuple(int(c) for c in np.argwhere(mesh.devices == d)[0])
              for d, block in sharding.devices_indices_map(shape).items()
              if all(s.indices(n)[0] <= i < s.indices(n)[1] for s, i, n in zip(block, index, shape))]
    seen = [{c[a] for c in coords} for a in range(len(mesh.axis_names))]
    return {n: min(v) for n, v in zip(mesh.axis_names, seen)}, tuple(n for n, v in zip(mesh.axis_names, seen) if len(v) > 1)


def check_report_at(at, want, what):
    assert at is not None and want is not None, f"{what}: report {at}, oracle {want}"
    name, steps, examples, entry = want
    got = (at.name, at.steps, at.examples, at.entry)
    assert got == (name, steps, examples, entry), f"{what}: report {got}, oracle {want}"


@check
def find_nonfinite_shard_jit():
    """jt.find_nonfinite under a sharded jax.jit, data parallel (the batch over all 8 devices),
    FSDP (parameters and batch over 'data') and 4x2 tensor parallel: the tag, loop step, global
    example and entry against the one-device oracle; the shard against the layout of the plain
    jitted value (and, data parallel, against the batch's rows: 2 per device)."""
    mesh = mesh2d()
    layouts = {
        "data parallel": ({"w1": P(), "b1": P(), "ws": P(), "w2": P()}, P(("data", "model"))),
        "fsdp": ({"w1": P(None, "data"), "b1": P("data"), "ws": P(None, "data"), "w2": P("data")}, P("data")),
        "tensor parallel 4x2": ({"w1": P(None, "model"), "b1": P("model"), "ws": P(None, None, "model"), "w2": P("model")}, P("data")),
    }

    def plain(params, x, xs):  # the tagged values, as a plain program computes them
        h = x @ params["w1"] + params["b1"]
        c, steps = lax.scan(lambda c, w_x: (jnp.tanh(c @ w_x[0] + w_x[1]),) * 2, h, (params["ws"], xs))
        return {"h": h, "layer": steps, "out": c @ params["w2"]}

    # One jitted function for every layout: one trace, compiled once per layout, each executable
    # reading the shardings its own compilation chose.
    jitted = jax.jit(jt.find_nonfinite(nan_tagged))
    for scenario in ("value", "gradient"):
        params_np, x_np, xs_np, row = nan_inputs(scenario)
        want_value, want_gradient = nan_oracle(params_np, x_np, xs_np)
        for layout, (param_specs, batch) in layouts.items():
            params = put(params_np, mesh, param_specs)
            x, xs = put((x_np, xs_np), mesh, (batch, P(None, *batch)))
            shardings = {n: v.sharding for n, v in jax.jit(plain)(params, x, xs).items()}
            shapes = {"h": (16, 4), "layer": (NAN_STEPS, 16, 4), "out": (16, 2)}
            runs = (("jit", jitted), ("eager", jt.find_nonfinite(nan_tagged))) if scenario == "value" else (("jit", jitted),)
            for wrap_name, run in runs:  # eager (op by op) is slow: once per layout
                report = run(params, x, xs)
                what = f"{layout}, {scenario}, {wrap_name}"
                for at, want, side in ((report.first_value, want_value, "value"), (report.first_gradient, want_gradient, "gradient")):
                    if want is None:
                        assert at is None, f"{what}: first {side} {at}, the oracle's is finite"
                        continue
                    check_report_at(at, want, f"{what}: first {side}")
                    index = (*at.steps, *at.examples, *at.entry)
                    shard, replicated = holders(shardings[at.name], shapes[at.name], index)
                    assert (at.shard, at.replicated) == (shard, replicated), f"{what}: first {side} on {at.shard} {at.replicated}, the plain value's {shard} {replicated}"
                    assert f"data={shard['data']}" in str(report), f"{what}: {report}"
                    if layout == "data parallel":  # the batch's rows, 2 per device, (data, model) major first
                        assert at.shard == {"data": row // 2 // 2, "model": row // 2 % 2}, f"{what}: {at.shard}, row {row}"


@check
def find_nonfinite_shard_map():
    """jt.find_nonfinite of a loss written per shard with jax.shard_map (the batch over both mesh
    axes, a scan and a vmapped tag in the body): the example and entry are the global ones (from the
    shard's coordinates and the batch's in_spec), the shard is the one that holds those rows, and
    the loop step is a step (the shards are not steps), against the one-device oracle of the same
    program unsharded."""
    mesh = mesh2d()
    batch = P(("data", "model"))

    def loss(params, x, xs):
        body = lambda p, x, xs: lax.psum(nan_tagged(p, x, xs), ("data", "model"))  # noqa: E731
        return smap(body, mesh, (P(), batch, P(None, *batch)), P(), True)(params, x, xs)

    jitted = jax.jit(jt.find_nonfinite(loss))
    for scenario in ("value", "gradient"):
        params_np, x_np, xs_np, row = nan_inputs(scenario)
        want_value, want_gradient = nan_oracle(params_np, x_np, xs_np)
        x, xs = put((x_np, xs_np), mesh, (batch, P(None, *batch)))
        runs = (("jit", jitted), ("eager", jt.find_nonfinite(loss))) if scenario == "value" else (("jit", jitted),)
        for wrap_name, run in runs:  # eager (op by op) is slow: once
            report = run(params_np, x, xs)
            what = f"shard_map, {scenario}, {wrap_name}"
            for at, want, side in ((report.first_value, want_value, "value"), (report.first_gradient, want_gradient, "gradient")):
                if want is None:
                    assert at is None, f"{what}: first {side} {at}, the oracle's is finite"
                    continue
                check_report_at(at, want, f"{what}: first {side}")
                shard = {"data": row // 2 // 2, "model": row // 2 % 2}  # 2 rows per shard
                assert (at.shard, at.replicated, at.local) == (shard, (), False), f"{what}: {at}"
                assert f"on the shard data={shard['data']}, model={shard['model']})" in str(report), f"{what}: {report}"
                assert at.loop_kinds == (("scan step",) if at.name == "layer" else ()), f"{what}: {at}"
            if want_value is not None:  # the step before, on every shard, is finite: the neighbour is a step, not a shard
                assert "finite up to 'layer' (scan step 0) and not at 'layer'" in str(report), f"{what}: {report}"


@check
def find_nonfinite_replicated_and_unknown():
    """A NaN in a replicated parameter: under jit the report says every device holds it (as the
    plain jitted value is laid out); inside shard_map with check_vma the value is one value, the
    same on every shard (replicated), and without check_vma each shard's copy is its own (the
    lowest shard is named). A tag whose rows jaxtrace cannot follow across the shards (a cumsum
    along the split axis) keeps the shard's own indices, and says so."""
    mesh = mesh2d()
    batch = P(("data", "model"))
    w_np, x_np = np.asarray(PARAMS["w1"]).copy(), np.asarray(X).copy()
    w_np[1, 2] = np.nan

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ jt.tag(w * 2.0, "w")))

    w, x = put((w_np, x_np), mesh, (P(), batch))
    plain = jax.jit(lambda w: w * 2.0)(w).sharding
    for wrap in (jax.jit, lambda f: f):
        at = wrap(jt.find_nonfinite(loss))(w, x).first_value
        assert (at.name, at.entry) == ("w", (1, 2)), at
        assert (at.shard, at.replicated) == holders(plain, (3, 4), (1, 2)), f"jit: {at}, the plain value on {holders(plain, (3, 4), (1, 2))}"
    report = jax.jit(jt.find_nonfinite(loss))(w, x)
    assert report.first_value.replicated == ("data", "model") and "on every device: it is replicated" in str(report), report

    def body(w, x):
        return lax.psum(loss(w, x), ("data", "model"))

    for check_vma, replicated in ((True, ("data", "model")), (False, ())):
        report = jax.jit(jt.find_nonfinite(lambda w, x: smap(body, mesh, (P(), batch), P(), check_vma)(w, x)))(w_np, x)
        at = report.first_value
        assert (at.name, at.entry, at.shard, at.replicated) == ("w", (1, 2), {"data": 0, "model": 0}, replicated), f"check_vma={check_vma}: {at}"

    x_np[11, 1] = np.nan  # row 11: row 1 of the shard data=2, model=1

    def mixed(w, x):
        return lax.psum(jnp.sum(jt.tag(jnp.cumsum(x, axis=0), "running") ** 2) + jnp.sum(jt.tag(x * 2.0, "rows") ** 2), ("data", "model"))

    sharded_mixed = lambda w, x: smap(mixed, mesh, (P(), batch), P(), True)(w, x)  # noqa: E731
    report = jax.jit(jt.find_nonfinite(sharded_mixed))(w_np, put(x_np, mesh, batch))
    at = report.first_value
    assert (at.name, at.entry, at.shard, at.local) == ("running", (1, 1), {"data": 2, "model": 1}, True), at
    assert "that shard's own" in str(report), report
    rows = jax.jit(jt.find_nonfinite(sharded_mixed, tags="rows"))(w_np, put(x_np, mesh, batch)).first_value
    assert (rows.entry, rows.shard, rows.local) == ((11, 1), {"data": 2, "model": 1}, False), rows


@check
def find_nonfinite_collectives():
    """What the report adds to the compiled step, against jt.value_and_grad(with_values=True) of
    the same loss (float32; data parallel, FSDP, 4x2 tensor parallel, shard_map): only all-reduces
    of the report's own int32 scalars (per tag a code and an entry for the values and the
    gradients, per parameter a flag and a count), never a value moved. The sharding probe leaves
    nothing in the compiled program, and there is no conditional."""
    mesh = mesh2d()
    f32 = lambda tree: jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), tree)  # noqa: E731
    params_np, x_np, xs_np, _ = f32(nan_inputs("value"))
    batch = P(("data", "model"))

    def per_shard(params, x, xs):
        body = lambda p, x, xs: lax.psum(nan_tagged(p, x, xs), ("data", "model"))  # noqa: E731
        return smap(body, mesh, (P(), batch, P(None, *batch)), P(), True)(params, x, xs)

    replicated = {"w1": P(), "b1": P(), "ws": P(), "w2": P()}
    layouts = {
        "data parallel": (nan_tagged, replicated, batch),
        "fsdp": (nan_tagged, {"w1": P(None, "data"), "b1": P("data"), "ws": P(None, "data"), "w2": P("data")}, P("data")),
        "tensor parallel 4x2": (nan_tagged, {"w1": P(None, "model"), "b1": P("model"), "ws": P(None, None, "model"), "w2": P("model")}, P("data")),
        "shard_map": (per_shard, replicated, batch),
    }
    most = 2 * (3 + len(params_np))  # 3 tags, 4 parameters: the scalars of one all-reduce round
    for layout, (loss, param_specs, batch_spec) in layouts.items():
        params = put(params_np, mesh, param_specs)
        x, xs = put((x_np, xs_np), mesh, (batch_spec, P(None, *batch_spec)))
        plain_text = jax.jit(jt.value_and_grad(loss, with_values=True)).lower(params, x, xs).compile().as_text()
        text = jax.jit(jt.find_nonfinite(loss)).lower(params, x, xs).compile().as_text()
        added = collectives(text)
        for op in collectives(plain_text):
            if op in added:
                added.remove(op)
        assert all(kind == "all-reduce" and n <= most for kind, n in added) and len(added) <= 6, f"{layout}: {added} beyond the plain step's"
        assert "InspectSharding" not in text and " conditional(" not in text, f"{layout}: the probe or a conditional is in the compiled program"


def main(names):
    results = {}
    for name in names or CHECKS:
        try:
            CHECKS[name]()
            results[name] = "ok"
        except Exception:  # report every check, not only the first failure
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    main(sys.argv[1:])
