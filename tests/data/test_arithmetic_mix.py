"""The arithmetic task's hard mix (hard_fraction) and synthetic sources of distinct questions."""

import pytest

from jaxrl4llm.data.records import DataError
from jaxrl4llm.data.sources import parse_synthetic

MIX = "arithmetic?digits=1&ops=+-*&hard_fraction=0.5&hard_digits=3&n=2000"


def test_the_mix_is_half_hard_products_and_deterministic():
    source = parse_synthetic(MIX, "train")
    records = [source[i] for i in range(2000)]
    hard = [r for r in records if r.metadata["hard"]]
    assert 900 < len(hard) < 1100  # binomial(2000, 0.5): 5 sd is 112
    for r in hard:
        a, b = (int(x) for x in r.metadata["expression"].split(" * "))
        assert 100 <= a <= 999 and 100 <= b <= 999 and r.answer == str(a * b)
        assert r.prompt == f"What is {a} * {b}?"
    for r in records:
        if not r.metadata["hard"]:
            x, op, y = r.metadata["expression"].split()
            assert 0 <= int(x) <= 9 and 0 <= int(y) <= 9 and op in "+-*"
            assert int(r.answer) == eval(f"{x} {op} {y}") >= 0
    again = parse_synthetic(MIX, "train")
    assert [again[i] for i in range(50)] == records[:50]


def test_a_plain_config_draws_what_it_drew_before():
    # hard_fraction = 0 consumes no extra random number: the examples are unchanged.
    plain = parse_synthetic("arithmetic?digits=1&ops=+-*", "train")
    zero = parse_synthetic("arithmetic?digits=1&ops=+-*&hard_fraction=0", "train")
    assert [plain[i] for i in range(20)] == [zero[i] for i in range(20)]
    assert "hard" not in plain[0].metadata


def test_distinct_questions_held_out_from_training():
    spec = "arithmetic?digits=1&ops=+-*&test_fraction=0.8"
    test = parse_synthetic(spec + "&distinct=true&n=200", "test")
    questions = [test[i].prompt for i in range(200)]
    assert len(set(questions)) == 200
    train = parse_synthetic(spec + "&n=3000", "train")
    assert not {train[i].prompt for i in range(3000)} & set(questions)
    with pytest.raises(DataError, match="only .* distinct test questions.*lower n"):
        parse_synthetic("arithmetic?digits=1&ops=+&distinct=true&n=200", "test")


def test_bad_mix_knobs_are_refused():
    with pytest.raises(DataError, match="hard_fraction must be in"):
        parse_synthetic("arithmetic?hard_fraction=1.5", "train")
    with pytest.raises(DataError, match="hard_digits must be in"):
        parse_synthetic("arithmetic?hard_digits=1", "train")


def test_distinct_without_n_holds_every_held_out_question_once():
    # An eval set that asks for more prompts than exist (the default test size is 500) gets
    # every distinct held-out question, found here independently by a long plain scan.
    spec = "arithmetic?digits=1&ops=+-*&test_fraction=0.8"
    distinct = parse_synthetic(spec + "&distinct=true", "test")
    questions = [distinct[i].prompt for i in range(len(distinct))]
    assert len(questions) == len(set(questions)) < 500
    scanned = parse_synthetic(spec + "&n=20000", "test")
    assert set(questions) == {scanned[i].prompt for i in range(20000)}
