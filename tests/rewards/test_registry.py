"""make_reward_fn: routing a mixed batch by record task, options, errors."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.rewards import make_reward_fn


def test_mixed_batch_routes_by_task():
    records = [
        Record("q", "12", {"task": "arithmetic"}),
        Record("q", "12", {"task": "arithmetic"}),
        Record("q", "", {"task": "countdown", "numbers": [3, 4], "target": 12}),
        Record("q", "", {"task": "knights_knaves", "names": ["Ava"], "solution": [False]}),
        {"prompt": "q", "answer": "#### 7", "metadata": {}},  # plain dict, default task math
    ]
    completions = [
        "\\boxed{12}",
        "\\boxed{13}",
        "\\boxed{3*4}",
        "\\boxed{Ava is a knave}",
        "no answer",
    ]
    with make_reward_fn("auto", scale="pm1", format_penalty=0.25) as reward_fn:
        batch = reward_fn.score(completions, records)
    np.testing.assert_array_equal(batch.rewards, [1, -1, 1, 1, -1.25])
    np.testing.assert_array_equal(batch.correct, [True, False, True, True, False])
    assert batch.reasons == ["correct", "wrong", "correct", "correct", "no_answer"]
    assert batch.metrics()["correct"] == 3


def test_integer_answers_never_start_the_pool():
    with make_reward_fn("auto") as reward_fn:
        batch = reward_fn.score(
            ["\\boxed{12}", "\\boxed{1,000}", "no"],
            [
                Record("q", "12", {"task": "arithmetic"}),
                Record("q", "#### 1000", {}),
                Record("q", "3", {}),
            ],
        )
        assert reward_fn.pool.worker_pids == []  # decided by the exact-match fast path
    assert batch.reasons == ["correct", "correct", "no_answer"]


def test_forced_kind_and_lengths():
    with make_reward_fn("countdown", max_new_tokens=10, overlong_buffer=4) as reward_fn:
        batch = reward_fn(
            ["\\boxed{3*4}"] * 2,
            [Record("q", "", {"task": "math", "numbers": [3, 4], "target": 12})] * 2,
            lengths=[5, 10],
        )
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


@pytest.mark.parametrize(
    "record,completion",
    [
        (Record("q", "", {"task": "countdown", "numbers": [3, 4], "target": 12}), "\\boxed{3*4}"),
        (
            Record("q", "", {"task": "knights_knaves", "names": ["Ava"], "solution": [False]}),
            "\\boxed{Ava is a knave}",
        ),
    ],
)
def test_every_verifier_runs_in_the_pool_under_its_deadlines(record, completion):
    # A batch deadline too short to start any job: the row fails, it is not scored as wrong.
    with make_reward_fn("auto", scale="pm1", batch_timeout_s=1e-6) as reward_fn:
        batch = reward_fn.score([completion] * 2, [record] * 2)
    assert batch.reasons == ["timeout", "timeout"]
    np.testing.assert_array_equal(batch.failed, [True, True])
    np.testing.assert_array_equal(batch.rewards, [0.0, 0.0])  # not -1 (wrong under pm1)
    with make_reward_fn("auto", scale="pm1") as reward_fn:
        batch = reward_fn.score([completion] * 2, [record] * 2)
        assert reward_fn.pool.stats["jobs"] == 1  # the group's identical answers: one job
    assert batch.reasons == ["correct", "correct"] and not batch.failed.any()


def test_deadlines_are_reward_config_fields_and_validated():
    with pytest.raises(ValueError, match="--item_timeout_s=0 must be a positive"):
        make_reward_fn("auto", item_timeout_s=0)
    with pytest.raises(ValueError, match="--batch_timeout_s=nan must be a positive"):
        make_reward_fn("auto", batch_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="--reward_workers=0"):  # the flag, not the field
        make_reward_fn("auto", num_workers=0)
    with make_reward_fn("auto", item_timeout_s=7.0, batch_timeout_s=90.0) as reward_fn:
        assert reward_fn.pool.config.item_timeout_s == 7.0
        assert reward_fn.pool.config.batch_timeout_s == 90.0
