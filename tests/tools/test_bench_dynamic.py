"""tools/bench_dynamic.py on the toy model: the three ways gather the same batch, and its
report holds each way's time and the paged engine's work."""

from __future__ import annotations

import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tools")
)
import bench_dynamic  # noqa: E402

from tests.sampling.test_admission import Tokens, _chunks  # noqa: E402


def test_the_three_ways_gather_the_same_batch(toy_policy):
    config, params = toy_policy
    chunks = _chunks(config, (12,) * 4)
    settings = dict(group=4, budget=24, modulus=3, max_resample_rounds=3, stop=(5, 9))
    report = bench_dynamic.compare((config, params, Tokens()), chunks, settings, repeats=1)
    assert report["batch_identical"] == 1.0
    assert report["dynamic_time_ratio_admission"] > 0
    for way in ("rounds", "admission"):
        assert report[f"{way}_decoded"] > 0 and report[f"{way}_steps"] > 0
    assert report["rounds_chunks"] == report["compacted_chunks"] >= 1
    assert report["admission_dropped"] >= 0
