"""jaxtrace on 8 simulated devices: sharded jit, donation, sharding constraints, shard_map.

JAX fixes the device count at start-up, so the checks live in
``multidevice_checks.py`` and run once, in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; the rest of the suite
keeps one device. Each test below reports one check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "multidevice_checks.py")
CHECKS = [
    "data_parallel_step",
    "model_parallel_auto",
    "model_parallel_explicit",
    "explicit_mesh_cond",
    "explicit_mesh_same_shape_tags",
    "nested_jit_keeps_shardings",
    "shard_map_varying_values",
    "shard_map_replicated_value",
    "shard_map_forward_side",
    "shard_map_partial_manual_vjp",
    "stats_one_all_reduce_round",
    "per_example_fsdp_collectives",
    "find_nonfinite_shard_jit",
    "find_nonfinite_shard_map",
    "find_nonfinite_replicated_and_unknown",
    "find_nonfinite_collectives",
]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(HERE)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, SCRIPT, *CHECKS], env=env, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"the 8-device checks did not run (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1])


@pytest.mark.long  # an 8-device subprocess, about a minute: run with --long (.ci/run does)
@pytest.mark.parametrize("name", CHECKS)
def test_multidevice(results, name):
    outcome = results[name]
    if outcome != "ok":
        pytest.fail(outcome, pytrace=False)
