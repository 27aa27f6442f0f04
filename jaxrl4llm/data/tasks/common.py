"""What every procedural task shares: per-example seeding and the hash-based held-out split.

An example's split is a pure function of its question text (a blake2b hash bucket), and each
split only keeps examples of its own bucket, so train and test can never share a question.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable

from jaxrl4llm.data.records import DataError, Record

SPLITS = ("train", "test")
SPLIT_ALIASES = {
    "train": "train",
    "test": "test",
    "validation": "test",
    "eval": "test",
    "heldout": "test",
}
MAX_ATTEMPTS = 10_000

# (config, rng) -> (question, answer, task-specific metadata)
Generator = Callable[[Any, random.Random], tuple[str, str, dict[str, Any]]]


def canonical_split(split: str) -> str:
    if split not in SPLIT_ALIASES:
        raise DataError(
            f"unknown split {split!r} for a synthetic task; valid: {', '.join(SPLIT_ALIASES)}"
        )
    return SPLIT_ALIASES[split]


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def split_of(task: str, question: str, test_fraction: float) -> str:
    """ "test" for the hash bucket [0, test_fraction) of (task, question), else "train"."""
    return "test" if _hash64(f"{task}\n{question}") / 2.0**64 < test_fraction else "train"


def example_rng(task: str, seed: int, split: str, index: int) -> random.Random:
    """An independent, reproducible stream per (task, seed, split, index): random access."""
    return random.Random(_hash64(f"{task}/{seed}/{split}/{index}"))


def make_record(
    task: str,
    generate: Generator,
    config: Any,
    *,
    seed: int,
    split: str,
    index: int,
    test_fraction: float,
) -> Record:
    """Example `index` of `split`: drawn until its question hashes into that split."""
    split = canonical_split(split)
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = example_rng(task, seed, split, index)
    for _ in range(MAX_ATTEMPTS):
        question, answer, meta = generate(config, rng)
        if split_of(task, question, test_fraction) == split:
            metadata = {
                "task": task,
                "split": split,
                "id": f"{task}/{split}/{seed}/{index}",
                **meta,
            }
            return Record(prompt=question, answer=answer, metadata=metadata)
    raise DataError(
        f"{task}: no {split} example in {MAX_ATTEMPTS} draws with {config}; the "
        "problem space is too small for this test_fraction: raise the difficulty knobs"
    )
