"""gym: sources (reasoning-gym): options, disjoint splits, knights-and-knaves settings."""

from __future__ import annotations

import pickle
import re

import pytest

from jaxrl4llm.data.records import DataError
from jaxrl4llm.data.sources import make_source
from jaxrl4llm.data.tasks.common import split_of

pytest.importorskip("reasoning_gym")  # a test dependency ('.[test]'); the 'gym' extra for users
OTHER_ROLES = (
    "pioneer",
    "laggard",
    "saint",
    "sinner",
    "hero",
    "villain",
    "angel",
    "devil",
    "altruist",
    "egoist",
    "sage",
    "fool",
)


@pytest.mark.parametrize("people", [2, 5, 8])
def test_knights_knaves_people_depth_width(people):
    source = make_source(
        f"gym:knights_knaves?n_people={people}&depth_constraint=3&width_constraint=3&n=6",
        split="test",
    )
    assert len(source) == 6
    for record in source:
        entry = pickle.loads(record.metadata["gym_entry"])
        assert len(entry["metadata"]["names"]) == people
        assert entry["metadata"]["difficulty"] == {
            "n_people": people,
            "depth_constraint": 3,
            "width_constraint": 3,
        }
        assert record.task == "gym" and record.metadata["gym_task"] == "knights_knaves"
        assert f"You meet {people} inhabitants" in record.prompt
        assert record.answer.count(" is a kn") == people  # knight / knave only (terms=knight)
        assert not any(
            re.search(rf"\b{w}s?\b", record.prompt + record.answer, re.I) for w in OTHER_ROLES
        )


def test_knights_knaves_compound_statements_nest_at_depth_three():
    source = make_source("gym:knights_knaves?n_people=4&depth_constraint=3&n=30", split="train")
    statements = [pickle.loads(r.metadata["gym_entry"])["metadata"]["statements"] for r in source]
    ops = {s[0] for puzzle in statements for s in puzzle}
    assert {"and", "or", "->", "<=>"} & ops  # compound statements occur
    nested = any(
        isinstance(part, tuple) and part[0] in ("and", "or", "not", "->", "<=>")
        for puzzle in statements
        for s in puzzle
        for part in s[1:]
    )
    assert nested


def test_people_range_mixes_sizes_equally():
    """n_people=3..7: the Logic-RL / REINFORCE++ training mix (3 to 7 people)."""
    source = make_source("gym:knights_knaves?n_people=3..7&n=10", "train")
    people = [len(pickle.loads(r.metadata["gym_entry"])["metadata"]["names"]) for r in source]
    assert people == [3, 4, 5, 6, 7] * 2
    assert '"n_people": 5' in source[2].metadata["gym_config"]
    with pytest.raises(DataError, match="only one option may be a range"):
        make_source("gym:knights_knaves?n_people=2..3&depth_constraint=1..2")
    with pytest.raises(DataError, match="range n_people=5..3 is empty"):
        make_source("gym:knights_knaves?n_people=5..3")


def test_random_terms_keep_reasoning_gyms_role_words():
    words = set()
    for record in make_source("gym:knights_knaves?n_people=2&terms=random&n=40", "train"):
        words |= {w for w in OTHER_ROLES if re.search(rf"\b{w}\b", record.answer)}
    assert words  # several of the seven pairs appear


def test_splits_are_disjoint_and_deterministic():
    spec = "gym:knights_knaves?n_people=3&n=40"
    train, test = make_source(spec, "train"), make_source(spec, "test")
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert all(split_of("gym:knights_knaves", r.prompt, 0.1) == "test" for r in test)
    again = make_source(spec, "test")
    assert [r.prompt for r in again] == [r.prompt for r in test]
    other_seed = make_source(spec + "&seed=1", "test")
    assert [r.prompt for r in other_seed] != [r.prompt for r in test]


def test_countdown_and_gsm_symbolic_options():
    countdown = make_source("gym:countdown?min_numbers=3&max_numbers=3&operators=+,-&n=5", "train")
    for record in countdown:
        entry = pickle.loads(record.metadata["gym_entry"])
        assert len(entry["metadata"]["numbers"]) == 3
        assert set(re.findall(r"[-+*/]", record.answer)) <= {"+", "-"}
    gsm = make_source("gym:gsm_symbolic?n=3", "test")
    assert all(r.answer.lstrip("-").isdigit() for r in gsm)
    assert gsm[0].metadata["instruction"].startswith("Put your final answer within <answer>")


@pytest.mark.parametrize(
    "spec,match",
    [
        ("gym:no_such_task", "reasoning-gym has no task 'no_such_task'"),
        ("gym:knights_knaves?people=3", "unknown option 'people=3'; valid: depth_constraint"),
        ("gym:knights_knaves?n_people=three", "n_people='three' is not a valid int"),
        ("gym:knights_knaves?n_people=0", "reasoning-gym refused the options"),
        ("gym:knights_knaves?terms=fancy", "terms must be one of knight, random"),
    ],
)
def test_bad_options_are_clear_errors(spec, match):
    with pytest.raises(DataError, match=match):
        make_source(spec)
