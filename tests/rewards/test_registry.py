"""make_reward_fn: routing a mixed batch by record task, options, errors."""
from __future__ import annotations

import numpy as np
import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.rewards import make_reward_fn


def test_mixed_batch_routes_by_task_without_starting_the_pool():
    records = [
        Record("q", "12", {"task": "arithmetic"}),
        Record("q", "12", {"task": "arithmetic"}),
        Record("q", "", {"task": "countdown", "numbers": [3, 4], "target": 12}),
        Record("q", "", {"task": "knights_knaves", "names": ["Ava"], "solution": [False]}),
        {"prompt": "q", "answer": "#### 7", "metadata": {}},  # plain dict, default task math
    ]
    completions = ["\\boxed{12}", "\\boxed{13}", "\\boxed{3*4}", "\\boxed{Ava is a knave}",
                   "no answer"]
    with make_reward_fn("auto", scale="pm1", format_penalty=0.25) as reward_fn:
        batch = reward_fn.score(completions, records)
        assert reward_fn.verifiers["math"]._pool is None  # integer answers: fast path only
    np.testing.assert_array_equal(batch.rewards, [1, -1, 1, 1, -1.25])
    np.testing.assert_array_equal(batch.correct, [True, False, True, True, False])
    assert batch.reasons == ["correct", "wrong", "correct", "correct", "no_answer"]
    assert batch.metrics()["correct"] == 3


def test_forced_kind_and_lengths():
    with make_reward_fn("countdown", max_new_tokens=10, overlong_buffer=4) as reward_fn:
        batch = reward_fn([ "\\boxed{3*4}"] * 2,
                          [Record("q", "", {"task": "math", "numbers": [3, 4], "target": 12})] * 2,
                          lengths=[5, 10])
    np.testing.assert_allclose(batch.rewards, [1.0, 0.0])


def test_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="valid: auto, math"):
        make_reward_fn("algebra")
    with pytest.raises(ValueError, match="valid: .*answer_mode"):
        make_reward_fn("math", answer_mod="boxed")
    with make_reward_fn() as reward_fn:
        with pytest.raises(ValueError, match="no verifier"):
            reward_fn.score(["x"], [Record("q", "1", {"task": "chess"})])
        with pytest.raises(ValueError, match="2 completions for 1 records"):
            reward_fn.score(["x", "y"], [Record("q", "1", {})])
