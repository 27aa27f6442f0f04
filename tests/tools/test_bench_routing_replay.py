"""tools/bench_routing_replay.py: its share of differing expert sets by hand, and a small run
whose replaying pass runs exactly the sampler's experts."""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from jaxrl4llm.train.update.logprobs import TokenRouting  # noqa: E402
from tools import bench_routing_replay  # noqa: E402


def test_differs_counts_expert_sets_not_their_order():
    # 2 layers x 3 tokens, top-2; the third token is padding (weight 0).
    recorded = jnp.array([[[0, 1], [2, 3], [0, 1]], [[1, 2], [0, 3], [3, 2]]])
    other = jnp.array([[[1, 0], [2, 1], [3, 3]], [[1, 2], [3, 0], [0, 1]]])
    routing = TokenRouting(
        logits_LNE=jnp.zeros((2, 3, 4)),
        experts_LNK=other,
        weight_N=jnp.array([1.0, 1.0, 0.0]),
        recorded_LNK=recorded,
    )
    # Real pairs: (0,0) same set, (0,1) differs, (1,0) same, (1,1) same set reordered.
    assert bench_routing_replay.differs(other, routing) == pytest.approx(1 / 4)


def test_a_small_run_replays_exactly_the_samplers_experts(capsys):
    argv = ["--prompts=2", "--group=2", "--new_tokens=6", "--layers=2", "--experts=4"]
    assert bench_routing_replay.main(argv + ["--top_k=2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    replayed = next(r for r in rows if r.startswith("| replaying the sampler"))
    assert replayed.rstrip(" |").endswith("| 0.0000")  # no expert run differs
