"""The planner's slot model (jaxrl4llm/planner/slots.py): the lognormal fitted to a
completion length profile, and the rollout's slot utilisation with a fixed batch and with
continuous batching."""

from __future__ import annotations

import math
import os
import statistics
import sys

import numpy as np
import pytest

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"
    ),
)
from jaxrl4llm.planner import slots as plan_slots  # noqa: E402


def test_the_fitted_lognormal_has_the_profiles_mean_and_p99():
    mu, sigma = plan_slots.fit_lognormal(600, 3000)
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(600)
    assert math.exp(statistics.NormalDist(mu, sigma).inv_cdf(0.99)) == pytest.approx(3000)
    draws = np.random.default_rng(1).lognormal(mu, sigma, 2_000_000)
    assert np.mean(draws) == pytest.approx(600, rel=0.01)
    assert np.quantile(draws, 0.99) == pytest.approx(3000, rel=0.01)
    assert plan_slots.fit_lognormal(100, 100) == (math.log(100), 0.0)
    with pytest.raises(ValueError, match="0 < mean <= p99"):
        plan_slots.fit_lognormal(300, 200)
    with pytest.raises(ValueError, match="at most 15.0x its mean"):
        plan_slots.fit_lognormal(100, 1600)


def test_steps_of_a_fixed_batch_and_of_continuous_batching_by_hand():
    lengths = np.array([5, 1, 1, 1])
    # Fixed: batches [5, 1] and [1, 1] run to 5 and 1. Continuous: one slot holds the
    # 5-token row while the other decodes the three 1-token rows one after another.
    assert plan_slots.fixed_batch_steps(lengths, 2) == 6
    assert plan_slots.continuous_steps(lengths, 2) == 5
    assert plan_slots.continuous_steps(np.array([3, 3, 3]), 2) == 6
    assert plan_slots.continuous_steps(lengths, 8) == 5


def test_slot_use_matches_the_expected_longest_row_of_a_batch():
    mean, p99, limit, slots = 300, 2000, 1024, 64
    use = plan_slots.slot_use(mean, p99, limit, rows=64 * slots, slots=slots)
    # Lengths ceil(L) cut at the limit: P(length <= k) = P(L <= k) for k < limit.
    mu, sigma = plan_slots.fit_lognormal(mean, p99)
    cdf = np.array(
        [0.0] + [statistics.NormalDist(mu, sigma).cdf(math.log(k)) for k in range(1, limit)]
    )
    expected_length = np.sum(1 - cdf)
    expected_longest = np.sum(1 - cdf**slots)
    assert use.mean_tokens == pytest.approx(expected_length, rel=0.02)
    assert use.fixed_utilisation == pytest.approx(expected_length / expected_longest, rel=0.03)
    assert use.fixed_steps == pytest.approx(64 * expected_longest, rel=0.03)
    # Continuous batching keeps the slots busy but for the tail.
    assert use.fixed_utilisation < 0.5 < use.continuous_utilisation <= 1
    assert use.continuous_steps < use.fixed_steps
    even = plan_slots.slot_use(100, 100, 1024, rows=256, slots=64)
    assert even.fixed_utilisation == even.continuous_utilisation == 1.0
