"""Procedural reasoning tasks: name -> (config dataclass, generator). Deterministic per seed.

Only what reasoning-gym (the `gym:` source) does not: arithmetic, the embedded quickstart's
task (core install, integer answers decided without the verifier pool), countdown in
TinyZero's form (each number at most once, a target reachable from a random expression,
boxed answers), easy stdin/stdout code problems (the offline code task, tasks/code.py) and
a number-guessing game played over several turns (tasks/guess.py, with `--env=guess`).
Knights and knaves come from reasoning-gym (Xie et al.'s generator, nested and compound
statements): gym:knights_knaves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.data.tasks import arithmetic, code, countdown, guess
from jaxrl4llm.data.tasks.common import SPLITS, canonical_split, make_record, split_of


class Task(NamedTuple):
    config_cls: type
    generate: Any  # (config, random.Random) -> (question, answer, metadata)


TASKS: dict[str, Task] = {
    "arithmetic": Task(arithmetic.ArithmeticConfig, arithmetic.generate),
    "countdown": Task(countdown.CountdownTaskConfig, countdown.generate),
    "code": Task(code.CodeTaskConfig, code.generate),
    "guess": Task(guess.GuessTaskConfig, guess.generate),
}
# Tasks that moved to reasoning-gym: name -> the source to write instead.
MOVED = {"knights_knaves": "gym:knights_knaves?n_people=3 (pip install -e '.[gym]')"}


def get_task(name: str) -> Task:
    if name in MOVED:
        raise DataError(f"synthetic:{name} is now a reasoning-gym task: write {MOVED[name]}")
    if name not in TASKS:
        raise DataError(f"unknown synthetic task {name!r}; valid: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def generate_record(
    task: str,
    config: Any = None,
    *,
    seed: int = 0,
    split: str = "train",
    index: int = 0,
    test_fraction: float = 0.1,
) -> Record:
    """Example `index` of a task's split; the same arguments always give the same record."""
    spec = get_task(task)
    config = spec.config_cls() if config is None else config
    return make_record(
        task,
        spec.generate,
        config,
        seed=seed,
        split=split,
        index=index,
        test_fraction=test_fraction,
    )


__all__ = ["TASKS", "Task", "get_task", "generate_record", "split_of", "SPLITS", "canonical_split"]
