"""Reward shaping: scales, the format penalty and DAPO's soft overlong punishment."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl4llm.rewards.base import RewardBatch, Verdict
from jaxrl4llm.rewards.shaping import ShapingConfig, overlong_penalty, shape

VERDICTS = [Verdict(True, "correct"), Verdict(False, "wrong"), Verdict(False, "no_answer")]


def test_scales_and_format_penalty():
    rewards, correct = shape(VERDICTS, ShapingConfig(scale="01"))
    np.testing.assert_array_equal(rewards, [1, 0, 0])
    np.testing.assert_array_equal(correct, [True, False, False])
    assert rewards.dtype == np.float32 and correct.dtype == bool
    rewards, _ = shape(VERDICTS, ShapingConfig(scale="pm1", format_penalty=0.5))
    np.testing.assert_array_equal(rewards, [1, -1, -1.5])


def test_dapo_overlong_penalty_is_linear_in_the_buffer():
    config = ShapingConfig(max_new_tokens=100, overlong_buffer=20, overlong_penalty=1.0)
    lengths = np.array([10, 80, 85, 90, 100, 120])
    # DAPO eq. 13: 0 up to L_max - L_buffer = 80, ((80 - L) / 20) inside, -1 beyond L_max.
    np.testing.assert_allclose(overlong_penalty(lengths, config), [0, 0, -0.25, -0.5, -1, -1])
    rewards, _ = shape([Verdict(True, "correct")] * 3, config, lengths=[50, 90, 100])
    np.testing.assert_allclose(rewards, [1.0, 0.5, 0.0])


def test_bad_shaping_options_are_clear_errors():
    with pytest.raises(ValueError, match="valid: 01, pm1"):
        ShapingConfig(scale="0-1")
    with pytest.raises(ValueError, match="max_new_tokens"):
        ShapingConfig(overlong_buffer=10)
    with pytest.raises(ValueError, match="lengths"):
        shape(VERDICTS, ShapingConfig(max_new_tokens=10, overlong_buffer=5))


def test_metrics_count_every_reason():
    batch = RewardBatch(np.zeros(3, np.float32), np.zeros(3, bool), ["wrong", "timeout", "wrong"])
    metrics = batch.metrics()
    assert metrics["wrong"] == 2 and metrics["timeout"] == 1 and metrics["correct"] == 0
    assert "crash" in metrics  # stable keys across steps
