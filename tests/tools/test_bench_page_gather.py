"""tools/bench_page_gather.py: its dense cache holds the pages the table names, and every
gather variant's attention equals the dense one's (run checks it) on a tiny shape."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tools")
)
import bench_page_gather  # noqa: E402


def test_the_dense_cache_holds_the_tables_pages():
    x = {k: np.asarray(v) for k, v in bench_page_gather._inputs(3, 2, 2, 2, 4).items()}
    page = bench_page_gather.PAGE
    for s, k, m, p, h in [(0, 0, 0, 0, 0), (2, 1, 1, 15, 3), (1, 0, 1, 7, 2)]:
        stored = x["k_KNPH"][k, x["table_SM"][s, m], p, h]
        assert x["k_SKHL"][s, k, h, m * page + p] == stored
        assert x["k_KNHP"][k, x["table_SM"][s, m], h, p] == stored
        assert x["v_SKLH"][s, k, m * page + p, h] == x["v_KNPH"][k, x["table_SM"][s, m], p, h]
    assert len(set(x["table_SM"].ravel())) == x["table_SM"].size  # distinct pages


def test_every_variant_runs_and_agrees():
    results = bench_page_gather.run(4, 3, 2, 2, 8, repeats=1)
    assert tuple(results) == bench_page_gather.VARIANTS
    assert results["dense"][0] == 0.0
    assert all(gather >= 0 and attention > 0 for gather, attention in results.values())
