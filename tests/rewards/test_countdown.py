"""Countdown verifier: an AST walker over + - * / and given integers only."""

from __future__ import annotations

from fractions import Fraction

import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.rewards.countdown import (
    CountdownConfig,
    CountdownError,
    CountdownVerifier,
    clean_expression,
    evaluate,
)

RECORD = Record("q", "(25 - 5) * 5", {"task": "countdown", "numbers": [25, 5, 5, 7], "target": 100})


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("\\boxed{(25 - 5) * 5}", (True, "correct")),
        ("\\boxed{(25 - 5) \\times 5 = 100}", (True, "correct")),  # LaTeX op, "= target"
        ("<answer>100 = 5 * (25 - 5)</answer>", (True, "correct")),  # answer tag, target first
        ("\\boxed{\\frac{25}{5} * 5 * 7 - 75}", (False, "invalid_numbers")),  # 75 not given
        ("\\boxed{25 * 5 - 7 - 5}", (False, "wrong")),  # 113
        ("\\boxed{25 * 5 * 5 * 5}", (False, "invalid_numbers")),  # 5 used 3 times
        ("\\boxed{(25 - 5) * 5 / (7 - 7)}", (False, "invalid_numbers")),
        ("\\boxed{25 / (5 - 5) + 7}", (False, "wrong")),  # division by zero
        ("\\boxed{__import__('os').system('x')}", (False, "parse_error")),
        ("\\boxed{25 ** 5}", (False, "parse_error")),  # power is not allowed
        ("\\boxed{-25 + 5}", (False, "parse_error")),  # unary minus
        ("\\boxed{" + "(" * 500 + "5" + ")" * 500 + "}", (False, "parse_error")),
        ("I give up", (False, "no_answer")),
    ],
)
def test_countdown_verdicts(completion, expected):
    assert tuple(CountdownVerifier().verify_one(completion, RECORD))[:2] == expected


def test_exact_fraction_arithmetic_and_use_all():
    assert evaluate("7 / 5 * 5", [7, 5, 5]) == Fraction(7)  # exact, not 6.999...
    assert evaluate("25 * 5 - 25", [25, 5, 25]) == 100
    with pytest.raises(CountdownError):
        evaluate("25 * 5", [25, 5, 7], use_all=True)
    strict = CountdownVerifier(CountdownConfig(use_all=True))
    assert strict.verify_one("\\boxed{(25 - 5) * 5}", RECORD).reason == "invalid_numbers"
    assert strict.verify_one(
        "\\boxed{(25 - 5) * 5 * (7 / 7)}",
        Record("q", "", {"numbers": [25, 5, 5, 7, 7], "target": 100}),
    ).correct


def test_clean_expression():
    assert clean_expression("\\left(3 + 4\\right) \\cdot 2 = 14") == "(3 + 4) * 2"
    assert clean_expression("14 = 2 × 7") == "2 * 7"


def test_record_without_numbers_is_a_clear_error():
    with pytest.raises(ValueError, match="numbers"):
        CountdownVerifier().verify_one("\\boxed{1+2}", Record("q", "3", {"task": "countdown"}))
