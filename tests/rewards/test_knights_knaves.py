"""Knights & knaves verifier: claims parsed from the final answer vs the unique solution."""

from __future__ import annotations

import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.rewards.knights_knaves import KnightsKnavesVerifier, parse_claims, solution_of

RECORD = Record(
    "q",
    "Zoey is a knight, Oliver is a knave, Emma is a knight",
    {
        "task": "knights_knaves",
        "names": ["Zoey", "Oliver", "Emma"],
        "solution": [True, False, True],
    },
)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("\\boxed{Zoey is a knight, Oliver is a knave, Emma is a knight}", (True, "correct")),
        ("\\boxed{Emma is a Knight; Oliver is a KNAVE. Zoey is a knight}", (True, "correct")),
        (
            "<answer>(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Emma is a knight</answer>",
            (True, "correct"),
        ),
        ("\\boxed{Zoey is a knight, Oliver is a knight, Emma is a knight}", (False, "wrong")),
        ("\\boxed{Zoey is a knight, Oliver is a knave}", (False, "incomplete")),
        (
            "\\boxed{Zoey is a knight, Zoey is a knave, Oliver is a knave, Emma is a knight}",
            (False, "wrong"),
        ),  # contradicts itself
        ("Zoey is a knight, Oliver is a knave, Emma is a knight", (False, "no_answer")),
        ("\\boxed{nobody knows}", (False, "parse_error")),
    ],
)
def test_verdicts(completion, expected):
    assert tuple(KnightsKnavesVerifier().verify_one(completion, RECORD))[:2] == expected


def test_solution_from_answer_text_when_metadata_is_absent():
    record = Record("q", "Ava is a knave, Noah is a knight", {"task": "knights_knaves"})
    assert solution_of(record) == {"Ava": False, "Noah": True}
    assert (
        KnightsKnavesVerifier()
        .verify_one("\\boxed{Noah is a knight, Ava is a knave}", record)
        .correct
    )
    with pytest.raises(ValueError, match="names, solution"):
        solution_of(Record("q", "no idea", {}))


def test_names_match_whole_words_only():
    claims = parse_claims("Jackson is a knave, Jack is a knight", ["Jack"])
    assert claims == {"Jack": {True}}


@pytest.mark.parametrize(
    "answer",
    [
        "Zoey is a knight or a knave, Oliver is a knave, Emma is a knight",
        "Zoey is a knight/knave, Oliver is a knave, Emma is a knight",
        "Zoey is a knight (or a knave), Oliver is a knave, Emma is a knight",
        "Zoey is a Knight, or a Knave; Oliver is a knave, Emma is a knight",
        "Zoey is a knight and a knave, Oliver is a knave, Emma is a knight",
    ],
)
def test_hedged_claims_are_never_credited(answer):
    verdict = KnightsKnavesVerifier().verify_one("\\boxed{" + answer + "}", RECORD)
    assert tuple(verdict)[:2] == (False, "wrong")
    assert parse_claims(answer)["Zoey"] == {True, False}


def test_a_role_then_the_next_claim_is_not_a_hedge():
    answer = "Zoey is a knight and Oliver is a knave or so I think, Emma is a knight"
    assert parse_claims(answer) == {"Zoey": {True}, "Oliver": {False}, "Emma": {True}}


def test_claims_agree_with_the_reference_regex_on_natural_answers():
    # The regex the linear parser replaced is a fine reference on short, natural text.
    import random
    import re

    ref = re.compile(
        r"\b([A-Z][\w'-]*)\s+(?:is|was)\s+(?:a\s+|an\s+|the\s+)?"
        r"(?i:(knight|knave))s?\b"
    )
    words = [
        "Zoey",
        "Jack",
        "Jackson",
        "Ann-Marie",
        "is",
        "was",
        "a",
        "an",
        "the",
        "knight",
        "Knave",
        "knights",
        "not",
        "x",
        ",",
        ".",
        ";",
        "\n",
        "and",
    ]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(
            rng.choice(words) + rng.choice(["", " ", " ", "  "]) for _ in range(rng.randint(1, 12))
        )
        expected: dict[str, set[bool]] = {}
        for m in ref.finditer(text):
            expected.setdefault(m.group(1), set()).add(m.group(2).lower() == "knight")
        assert parse_claims(text) == expected, text
