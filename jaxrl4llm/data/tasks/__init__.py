"""Procedural reasoning tasks: name -> (config dataclass, generator). Deterministic per seed."""
from __future__ import annotations

from typing import Any, NamedTuple

from jaxrl4llm.data.records import DataError, Record
from jaxrl4llm.data.tasks import arithmetic, countdown, knights_knaves
from jaxrl4llm.data.tasks.common import SPLITS, canonical_split, make_record, split_of


class Task(NamedTuple):
    config_cls: type
    generate: Any  # (config, random.Random) -> (question, answer, metadata)


TASKS: dict[str, Task] = {
    "arithmetic": Task(arithmetic.ArithmeticConfig, arithmetic.generate),
    "countdown": Task(countdown.CountdownTaskConfig, countdown.generate),
    "knights_knaves": Task(knights_knaves.KnightsKnavesConfig, knights_knaves.generate),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise DataError(f"unknown synthetic task {name!r}; valid: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def generate_record(task: str, config: Any = None, *, seed: int = 0, split: str = "train",
                    index: int = 0, test_fraction: float = 0.1) -> Record:
    """Example `index` of a task's split; the same arguments always give the same record."""
    spec = get_task(task)
    config = spec.config_cls() if config is None else config
    return make_record(task, spec.generate, config, seed=seed, split=split, index=index,
                       test_fraction=test_fraction)


__all__ = ["TASKS", "Task", "get_task", "generate_record", "split_of", "SPLITS",
           "canonical_split"]
