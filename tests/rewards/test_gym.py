"""reasoning-gym scoring in the verifier pool; Logic-RL's format reward."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl4llm.data.sources import make_source
from jaxrl4llm.rewards import Verdict, make_reward_fn, think_answer_format
from jaxrl4llm.rewards.shaping import ShapingConfig, shape

pytest.importorskip("reasoning_gym")


@pytest.fixture(scope="module")
def reward_fn():
    with make_reward_fn("auto", item_timeout_s=20) as fn:
        yield fn


def _flip(answer: str) -> str:
    return answer.replace("knight", "KNAVE").replace("knave", "knight").replace("KNAVE", "knave")


def test_knights_knaves_scores_in_the_pool(reward_fn):
    records = list(make_source("gym:knights_knaves?n_people=3&n=4", "test"))
    right = [f"<think>...</think><answer>{r.answer}</answer>" for r in records]
    lines = [
        "\n".join(
            f"({i + 1}) {claim.strip().removeprefix('and ')}"
            for i, claim in enumerate(r.answer.rstrip(".").split(", "))
        )
        for r in records
    ]  # Logic-RL's answer layout: one "(i) Name is a ..." per line
    flipped = [f"<answer>{_flip(r.answer)}</answer>" for r in records]
    scored = reward_fn.score(
        right + [f"<answer>{t}</answer>" for t in lines] + flipped + ["I am not sure."],
        records * 3 + records[:1],
    )
    assert scored.correct.tolist() == [True] * 8 + [False] * 5
    assert scored.reasons[8:] == ["wrong"] * 4 + ["no_answer"]
    assert "reasoning_gym" in reward_fn.pool.config.preload  # imported at worker start


def test_knights_knaves_hedges_are_wrong_in_the_pool(reward_fn):
    """reasoning-gym's scorer alone gives each of these full marks (tests/rewards/test_hedges.py
    checks that with the library); in the pool they are wrong."""
    (record,) = make_source("gym:knights_knaves?n_people=3&n=1", "train")
    first, rest = record.answer.split(", ", 1)
    other = _flip(first).split()[-1]
    hedged = [
        f"{first} and a {other}, {rest}",
        f"{first}, maybe, {rest}",
        f"{first} /{other}, {rest}",
        f"{record.answer} All of them are {other}s.",
    ]
    scored = reward_fn.score(
        [f"<answer>{record.answer}</answer>"] + [f"<answer>{h}</answer>" for h in hedged],
        [record] * 5,
    )
    assert scored.correct.tolist() == [True] + [False] * 4
    assert scored.reasons[1:] == ["wrong"] * 4


def test_partial_credit_is_not_correct(reward_fn):
    (record,) = make_source("gym:knights_knaves?n_people=4&n=1", "train")
    claims = record.answer.rstrip(".").split(", ")
    claims[0] = _flip(claims[0])  # reasoning-gym gives 0.3 + 0.7 * 3/4 here
    assert not reward_fn.score([f"<answer>{', '.join(claims)}</answer>"], [record]).correct[0]


def test_countdown_uses_our_safe_verifier(reward_fn, tmp_path):
    records = list(make_source("gym:countdown?min_numbers=3&max_numbers=3&n=2", "train"))
    marker = tmp_path / "pwned"
    evil = f"<answer>__import__('os').system('touch {marker}')</answer>"
    first = records[0].metadata["gym_entry"]
    import pickle

    numbers = pickle.loads(first)["metadata"]["numbers"]
    texts = [
        f"<answer>{records[0].answer}</answer>",
        evil,
        f"<answer>{numbers[0]} + {numbers[1]}</answer>",
    ]  # not every number: refused
    scored = reward_fn.score(texts, [records[0]] * 3)
    assert scored.correct.tolist() == [True, False, False]
    assert scored.reasons[1:] == ["parse_error", "invalid_numbers"]
    assert not marker.exists()


def test_other_tasks_refuse_builtin_calls_before_the_scorer(reward_fn, tmp_path):
    (record,) = make_source("gym:basic_arithmetic?n=1", "train")
    marker = tmp_path / "pwned"
    scored = reward_fn.score(
        [
            f"<answer>{record.answer}</answer>",
            f"<answer>open('{marker}', 'w')</answer>",
            "<answer>().__class__</answer>",
        ],
        [record] * 3,
    )
    assert scored.correct.tolist() == [True, False, False]
    assert scored.reasons[1:] == ["parse_error", "parse_error"]
    assert not marker.exists()


def test_gsm_symbolic_and_boxed_answers(reward_fn):
    records = list(make_source("gym:gsm_symbolic?n=2", "test"))
    scored = reward_fn.score(
        [f"\\boxed{{{records[0].answer}}}", f"<answer>{int(records[1].answer) + 1}</answer>"],
        records,
    )
    assert scored.correct.tolist() == [True, False]


def test_maj_at_k_answer_keys(reward_fn):
    (record,) = make_source("gym:knights_knaves?n_people=2&n=1", "train")
    keys = reward_fn.answer_keys(
        [
            f"<answer> {record.answer} </answer>",
            f"<answer>{record.answer.upper()}</answer>",
            "nothing",
        ],
        [record] * 3,
    )
    assert keys[0] == keys[1] and keys[2] is None


@pytest.mark.parametrize(
    "text,ok",
    [
        ("<think>a</think><answer>b</answer>", True),
        ("<think>a</think>\n\n<answer>b</answer> done", True),
        ("<answer>b</answer><think>a</think>", False),  # order
        ("<think>a</think><answer>b</answer><answer>c</answer>", False),  # twice
        ("<think>a<answer>b</answer></think>", False),  # answer inside think
        ("a</think><answer>b</answer>", False),  # no opening think (no prefill)
    ],
)
def test_think_answer_format(text, ok):
    assert think_answer_format(text) is ok


def test_logic_rl_reward_values_by_hand():
    """Logic-RL's compute_score: format +1/-1; answer +2 match, -1.5 mismatch, -2 unparsed
    or bad format. Failed verification stays unscored (0)."""
    verdicts = [
        Verdict(True, "correct"),
        Verdict(False, "wrong"),
        Verdict(False, "incomplete"),
        Verdict(False, "no_answer"),
        Verdict(True, "correct"),
        Verdict(False, "timeout"),
    ]
    formatted = [True, True, True, True, False, True]
    rewards, correct = shape(verdicts, ShapingConfig(scale="logic_rl"), formatted=formatted)
    np.testing.assert_array_equal(rewards, [3.0, -0.5, -1.0, -1.0, -3.0, 0.0])
    assert correct.tolist() == [True, False, False, False, False, False]
    with pytest.raises(ValueError, match="format_penalty does not apply"):
        ShapingConfig(scale="logic_rl", format_penalty=0.5)


def test_logic_rl_through_the_reward_fn():
    (record,) = make_source("gym:knights_knaves?n_people=2&n=1", "train")
    with make_reward_fn("auto", scale="logic_rl", item_timeout_s=20) as fn:
        scored = fn.score(
            [
                f"<think>x</think><answer>{record.answer}</answer>",
                f"<answer>{record.answer}</answer>",
            ],
            [record] * 2,
        )
    assert scored.rewards.tolist() == [3.0, -3.0]
