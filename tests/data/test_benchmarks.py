"""The registry: every entry loads its fixture rows (written in the benchmark's published
schema), normalises its answers, and a correct completion scores 1 and a wrong one 0."""

from __future__ import annotations

import dataclasses

import pytest

from jaxrl4llm.data import benchmarks
from jaxrl4llm.data.benchmarks import ANSWER_FORMS, BENCHMARKS
from jaxrl4llm.data.records import DataError
from jaxrl4llm.data.sources import make_source
from jaxrl4llm.rewards import make_reward_fn

from tests.data.hub_fixtures import write_registry_repos

# name -> (split, the reference answers the fixture rows must normalise to, a wrong answer)
EXPECTED = {
    "math500": ("test", ["\\left( 3, \\frac{\\pi}{2} \\right)", "26000"], "25000"),
    "aime24": ("test", ["204", "025"], "203"),
    "aime25": ("test", ["70", "588"], "71"),
    "amc23": ("test", ["27.0", "36.0"], "28"),
    "minerva_math": ("test", ["0.49", "1216"], "0.5"),
    "olympiadbench": ("test", ["2", "(6,3),(9,3),(9,5),(54,5)"], "3"),
    "gsm8k": ("test", ["18", "1250"], "17"),
    "numina_math": ("train", ["4", "\\frac{5}{6}"], "5"),
    "dapo_math_17k": ("train", ["34"], "35"),
    # Levels 3-5 only (the fixture's levels 1 and 2 are left out), in the published order.
    "math_lvl3to5_8k": ("train", ["7", "9", "\\frac{5}{6}"], "8"),
}
# What a model writes for the same answers (other spellings where the math allows).
WRITTEN = {
    "minerva_math": ["0.490", "1216"],
    "amc23": ["27", "36"],
    "aime24": ["204", "25"],
    "olympiadbench": ["2", "(6,3), (9,3), (9,5), (54,5)"],
    "gsm8k": ["18", "1,250"],
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("hub"))
    write_registry_repos(cache)
    return cache


@pytest.fixture
def offline(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def reward_fn():
    with make_reward_fn("auto") as fn:
        yield fn


def test_every_entry_has_a_test():
    assert set(EXPECTED) == {n for n, b in BENCHMARKS.items() if b.task == "math"}
    for bench in BENCHMARKS.values():  # the code sets: tests/data/test_code_sets.py
        assert bench.answer in ANSWER_FORMS and bench.source.startswith("hf:")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_entry_loads_normalises_and_scores(name, offline, reward_fn):
    split, answers, wrong = EXPECTED[name]
    source = make_source(name, split=split)
    assert [r.answer for r in source] == answers
    assert all(r.prompt and r.task == "math" and r.metadata["benchmark"] == name for r in source)
    written = WRITTEN.get(name, answers)
    right = reward_fn.score([f"So the answer is \\boxed{{{a}}}." for a in written], list(source))
    assert right.correct.all(), right.reasons
    bad = reward_fn.score([f"\\boxed{{{wrong}}}"] * len(source), list(source))
    assert not bad.correct.any() and set(bad.reasons) == {"wrong"}


def test_numina_drops_and_counts_rows_without_an_answer(offline):
    source = make_source("numina_math", split="train")
    assert source.counts == {"rows": 4, "dropped": 2, "kept": 2}
    with pytest.raises(DataError, match="numina_math has no 'test' split"):
        make_source("numina_math", split="test")


def test_gsm8k_splits_and_the_raw_solution_stays_in_metadata(offline):
    train = make_source("gsm8k", split="train")
    assert [r.answer for r in train] == ["72"]
    assert train[0].metadata["answer"].endswith("#### 72")
    assert train.name.startswith("gsm8k@")  # the commit that was read


def test_answer_forms_by_hand():
    assert ANSWER_FORMS["gsm8k"]("a <<1+1=2>>2\n#### 1,024") == "1024"
    assert ANSWER_FORMS["gsm8k"]("no marker") is None
    assert ANSWER_FORMS["list"](["$x=1$", "$y=2$"]) == "x=1, y=2"
    assert ANSWER_FORMS["boxed"]("so \\boxed{\\frac{1}{2}} and \\boxed{3}") == "3"
    assert ANSWER_FORMS["boxed_or_text"](" 42 ") == "42"
    assert ANSWER_FORMS["boxed_or_text"]("") is None
    assert ANSWER_FORMS["text"](588) == "588"


def test_unknown_name_lists_the_registry():
    with pytest.raises(DataError, match="unknown dataset name 'math5000'; registered: aime24"):
        make_source("math5000")


def test_math_levels_3_to_5_keeps_the_shortest_prompts_deterministically(offline, monkeypatch):
    """REINFORCE++'s zero-RL data: levels 3-5, then the N shortest prompts (characters), in
    the published order. The fixture's level 3-5 prompts have 44, 42 and 33 characters."""
    entry = BENCHMARKS["math_lvl3to5_8k"]
    assert entry.where == {"level": (3, 4, 5)} and entry.shortest == 8000
    monkeypatch.setitem(
        benchmarks.BENCHMARKS, "math_lvl3to5_8k", dataclasses.replace(entry, shortest=2)
    )
    first = make_source("math_lvl3to5_8k", split="train")
    assert [r.answer for r in first] == ["9", "\\frac{5}{6}"]
    assert [r.prompt for r in first] == [
        r.prompt for r in make_source("math_lvl3to5_8k", split="train")
    ]
