"""tools/bench_mismatch.py's statistics of the gap, on values worked out by hand."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools import bench_mismatch  # noqa: E402


def test_gap_stats_by_hand():
    sampler = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], np.float32)
    trainer = np.array([[-1.0, -2.02, -2.0], [-0.505, -0.5, 0.0]], np.float32)
    mask = np.array([[True, True, True], [True, True, False]])
    s = bench_mismatch.gap_stats(trainer, sampler, mask)
    # d on valid tokens: 0, -0.02, 1.0, -0.005, 0 (the padded -9 -> 0 is ignored).
    assert s["tokens"] == 5
    assert s["mismatch/logp_abs_diff_mean"] == pytest.approx(1.025 / 5, rel=1e-4)
    assert s["mismatch/logp_abs_diff_max"] == pytest.approx(1.0, rel=1e-5)
    assert s["abs_diff_over_0.01_frac"] == pytest.approx(2 / 5)
    assert s["mismatch/ratio_outside_frac"] == pytest.approx(1 / 5)  # exp(1) = 2.7
    # Geometric means: exp(0.98 / 3) = 1.39 (outside 1%), exp(-0.0025) = 0.9975 (inside).
    assert s["geo_ratio_outside_1pct_frac"] == pytest.approx(0.5)
