"""The large benchmark's ``tagging``: it must reach the tags ``jt.tag_modules`` puts.

``benchmarks/large.py`` swaps the function tagged modules call, so that its hook-style and
recipe variants run exactly the same modules. If that function is renamed, the benchmark
breaks only in CI's main job; this test catches it here, in one second.
"""

import os
import sys

import equinox as eqx

import jaxtrace as jt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import large  # noqa: E402


def test_tagging_sees_every_tag_the_tagged_model_makes():
    # Shapes only (building the model eagerly takes seconds): tagging acts while tracing.
    net, tokens, targets = eqx.filter_eval_shape(lambda: large.transformer(layers=1, d=8, heads=2, vocab=11, seq=3, batch=1))
    tagged = jt.tag_modules(net)
    tag_grads = eqx.filter_eval_shape(jt.filter_value_and_grad(large.loss), tagged, tokens, targets)[1][1]

    seen = []

    def record(value, name):
        seen.append(name)
        return value

    with large.tagging(record):
        eqx.filter_eval_shape(large.loss, tagged, tokens, targets)
    assert seen, "tagging(record) saw no tag: the function tagged modules call has moved"
    assert set(seen) == set(tag_grads)
