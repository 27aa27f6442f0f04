"""tools/bench_turns.py on the toy model: both engines give the same rows, the dense one
computes every row at each decode step, the paged one fewer (rows parked for the tool's
reply), and the two useful shares count the same decoded tokens."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tools")
)
import bench_turns  # noqa: E402

from tests.sampling.test_multiturn import _prompts  # noqa: E402


def test_the_paged_engine_computes_fewer_rows_for_the_same_samples(toy_policy):
    config, _ = toy_policy
    prompts = _prompts(config, (5, 9, 3, 18, 7, 12, 4, 6))
    settings = dict(
        group=2, budget=24, max_turns=3, latency=0.05, stop=(10,), observation=(20, 30), eos=(3,)
    )
    report = bench_turns.compare(toy_policy, prompts, settings, repeats=1)
    rows = len(prompts) * 2
    assert report["rows_identical"] == 1.0
    assert report["turns_mean"] > 1, "the toy model should end several turns at token 10"
    assert report["dense_rows_computed"] % rows == 0  # every row at every step
    assert report["paged_rows_computed"] < report["dense_rows_computed"]
    decoded = [report[f"{e}_useful"] * report[f"{e}_rows_computed"] for e in ("dense", "paged")]
    np.testing.assert_allclose(decoded[0], decoded[1])
    assert decoded[0] > 0
