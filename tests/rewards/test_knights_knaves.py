"""Knights & knaves verifier: claims parsed from the final answer vs the unique solution."""
from __future__ import annotations

import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.rewards.knights_knaves import KnightsKnavesVerifier, parse_claims, solution_of

RECORD = Record("q", "Zoey is a knight, Oliver is a knave, Emma is a knight",
                {"task": "knights_knaves", "names": ["Zoey", "Oliver", "Emma"],
                 "solution": [True, False, True]})


@pytest.mark.parametrize("completion,expected", [
    ("\\boxed{Zoey is a knight, Oliver is a knave, Emma is a knight}", (True, "correct")),
    ("\\boxed{Emma is a Knight; Oliver is a KNAVE. Zoey is a knight}", (True, "correct")),
    ("<answer>(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Emma is a knight</answer>",
     (True, "correct")),
    ("\\boxed{Zoey is a knight, Oliver is a knight, Emma is a knight}", (False, "wrong")),
    ("\\boxed{Zoey is a knight, Oliver is a knave}", (False, "incomplete")),
    ("\\boxed{Zoey is a knight, Zoey is a knave, Oliver is a knave, Emma is a knight}",
     (False, "wrong")),                                   # contradicts itself
    ("Zoey is a knight, Oliver is a knave, Emma is a knight", (False, "no_answer")),
    ("\\boxed{nobody knows}", (False, "parse_error")),
])
def test_verdicts(completion, expected):
    assert tuple(KnightsKnavesVerifier().verify_one(completion, RECORD)) == expected


def test_solution_from_answer_text_when_metadata_is_absent():
    record = Record("q", "Ava is a knave, Noah is a knight", {"task": "knights_knaves"})
    assert solution_of(record) == {"Ava": False, "Noah": True}
    assert KnightsKnavesVerifier().verify_one("\\boxed{Noah is a knight, Ava is a knave}",
                                              record).correct
    with pytest.raises(ValueError, match="names, solution"):
        solution_of(Record("q", "no idea", {}))


def test_names_match_whole_words_only():
    claims = parse_claims("Jackson is a knave, Jack is a knight", ["Jack"])
    assert claims == {"Jack": {True}}
