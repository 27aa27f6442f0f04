"""Reward types shared by every verifier: a per-sample Verdict and the batch-level RewardBatch."""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

# Every reason a verifier may give. metrics() reports all of them (zeros included) so metric
# keys stay stable from step to step.
REASONS = (
    "correct",        # verified equal to the reference
    "wrong",          # an answer was found and parsed, and it is not the reference
    "no_answer",      # no final answer (no \boxed{...} / <answer> tag / number) in the completion
    "parse_error",    # an answer was found but could not be parsed (or is too long)
    "invalid_numbers",  # countdown: a number not given, or used more times than given
    "incomplete",     # knights & knaves: not every inhabitant was named in the answer
    "timeout",        # the verifier ran past its per-item timeout or the batch deadline
    "crash",          # the verifier worker died (and was replaced)
    "error",          # the verifier raised on this input
)


class Verdict(NamedTuple):
    correct: bool
    reason: str


class Verifier(Protocol):
    """A task verifier: one Verdict per (completion, record); never raises on model output."""

    def verify(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict]: ...


@dataclasses.dataclass(frozen=True)
class RewardBatch:
    rewards: np.ndarray   # float32 [B], after shaping
    correct: np.ndarray   # bool [B]
    reasons: list[str]    # [B], one of REASONS

    def __post_init__(self):
        if not (len(self.rewards) == len(self.correct) == len(self.reasons)):
            raise ValueError("RewardBatch fields must have the same length, got "
                             f"{len(self.rewards)}, {len(self.correct)}, {len(self.reasons)}")

    def __len__(self) -> int:
        return len(self.reasons)

    def metrics(self) -> dict[str, int]:
        """Counts per reason: every name in REASONS (zeros included) plus any other seen."""
        counts = Counter(self.reasons)
        return {reason: int(counts.get(reason, 0)) for reason in (*REASONS, *sorted(counts))}


def record_metadata(record: Any) -> Mapping[str, Any]:
    """The metadata mapping of a Record (or of a plain {prompt, answer, metadata} dict)."""
    if isinstance(record, Mapping):
        return record.get("metadata") or {}
    return getattr(record, "metadata", None) or {}


def record_answer(record: Any) -> str:
    value = record.get("answer") if isinstance(record, Mapping) else getattr(record, "answer")
    return "" if value is None else str(value)
