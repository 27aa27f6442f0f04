"""Procedural tasks: deterministic per seed, disjoint splits, verifiers accept own solutions."""

from __future__ import annotations

import dataclasses

import pytest

from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.data.tasks import TASKS, arithmetic, generate_record, split_of
from jaxrl4llm.rewards import make_reward_fn

CONFIGS = {
    "arithmetic": [
        arithmetic.ArithmeticConfig(),
        arithmetic.ArithmeticConfig(digits=3, num_operands=4, ops="+-*/", allow_negative=True),
    ],
    "countdown": [
        TASKS["countdown"].config_cls(),
        TASKS["countdown"].config_cls(num_numbers=3, max_number=20, max_target=50),
    ],
}
CASES = [(task, config) for task, configs in CONFIGS.items() for config in configs]


def _records(task, config, split, n, seed=0):
    return [generate_record(task, config, seed=seed, split=split, index=i) for i in range(n)]


@pytest.mark.parametrize("task,config", CASES)
def test_deterministic_per_seed_and_different_across_seeds(task, config):
    a, b = _records(task, config, "train", 8), _records(task, config, "train", 8)
    assert a == b
    other = _records(task, config, "train", 8, seed=1)
    assert [r.prompt for r in a] != [r.prompt for r in other]
    # random access: record 5 alone equals record 5 of the run
    assert generate_record(task, config, seed=0, split="train", index=5) == a[5]


@pytest.mark.parametrize("task,config", CASES)
def test_splits_are_disjoint(task, config):
    train, test = _records(task, config, "train", 60), _records(task, config, "test", 20)
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    # the split is a function of the question text alone, so disjointness holds for any size
    assert all(split_of(task, r.prompt, 0.1) == "train" for r in train)
    assert all(split_of(task, r.prompt, 0.1) == "test" for r in test)


@pytest.fixture(scope="module")
def reward_fn():
    with make_reward_fn("auto") as fn:
        yield fn


def _perturbed_completion(record: Record) -> tuple[str, Record]:
    """A completion that must be rejected: a wrong value / a wrong target."""
    if record.metadata["task"] == "arithmetic":
        return f"\\boxed{{{int(record.answer) + 1}}}", record
    meta = dict(record.metadata, target=record.metadata["target"] + 1)
    return f"\\boxed{{{record.answer}}}", dataclasses.replace(record, metadata=meta)


@pytest.mark.parametrize("task,config", CASES)
def test_verifiers_accept_own_solutions_and_reject_perturbed(task, config, reward_fn):
    records = _records(task, config, "train", 25) + _records(task, config, "test", 5)
    own = reward_fn.score([f"Thinking... \\boxed{{{r.answer}}}" for r in records], records)
    assert own.correct.all(), [(r.answer, why) for r, why in zip(records, own.reasons)]
    perturbed = [_perturbed_completion(r) for r in records]
    bad = reward_fn.score([c for c, _ in perturbed], [r for _, r in perturbed])
    assert not bad.correct.any()


def test_task_instructions_are_metadata_not_part_of_the_question():
    """The question is the question; its answer format is the record's instruction, used
    instead of (never after) the default one."""
    from jaxrl4llm.data.prompts import DEFAULT_INSTRUCTION, record_messages

    record = generate_record("countdown", seed=0, split="train", index=0)
    assert "\\boxed" not in record.prompt and "\\boxed" in record.metadata["instruction"]
    (message,) = record_messages(record)
    assert message["content"] == record.prompt + "\n" + record.metadata["instruction"]
    assert DEFAULT_INSTRUCTION not in message["content"]


def test_arithmetic_default_is_small_and_non_negative():
    for record in _records("arithmetic", None, "train", 50):
        assert 0 <= int(record.answer) <= 198
        assert record.prompt.startswith("What is ")
        assert "+" in record.prompt or "-" in record.prompt


def test_bad_knobs_are_clear_errors():
    with pytest.raises(DataError, match="ops"):
        arithmetic.ArithmeticConfig(ops="^")
    with pytest.raises(DataError, match="valid: arithmetic, code, countdown"):
        generate_record("sudoku")
    with pytest.raises(DataError, match="unknown split"):
        generate_record("arithmetic", split="dev")
    with pytest.raises(DataError, match="too small"):  # 100 possible questions, none in test
        generate_record(
            "arithmetic",
            arithmetic.ArithmeticConfig(digits=1, ops="+"),
            split="test",
            test_fraction=0.0001,
        )
