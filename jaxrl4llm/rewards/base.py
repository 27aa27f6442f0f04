"""Reward types shared by every verifier: a per-sample Verdict, a pool Job, the RewardBatch."""

from __future__ import annotations

import abc
import dataclasses
from collections import Counter
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import numpy as np
from absl import logging

# Every reason a verifier may give. metrics() reports all of them (zeros included) so metric
# keys stay stable from step to step.
REASONS = (
    "correct",  # verified equal to the reference
    "wrong",  # an answer was found and parsed, and it is not the reference
    "no_answer",  # no final answer (no \boxed{...} / <answer> tag / number) in the completion
    "parse_error",  # an answer was found but could not be parsed (or is too long)
    "invalid_numbers",  # countdown: a number not given, or used more times than given
    "incomplete",  # knights & knaves: not every inhabitant was named in the answer
    "timeout",  # the verifier ran past its per-item timeout or the batch deadline
    "crash",  # the verifier worker died (and was replaced)
    "error",  # the verifier raised on this input
)
# Verification did not finish: the row has no score. It is masked out of the loss and out of
# every group / batch statistic (RewardBatch.failed), never trained on as "wrong".
FAILED_REASONS = ("timeout", "crash", "error")


class Verdict(NamedTuple):
    correct: bool
    reason: str
    score: float | None = None  # partial credit in [0, 1] (code: tests passed); None: 0 or 1
    detail: str = ""  # what decided it (code: the first failing test)


JOB_COST_S = 0.1  # a verification's allowance in the batch deadline (math: ~16 ms loaded)


class Job(NamedTuple):
    """Verification work for a pool worker: `fn(*args)` returns a REASONS name, or a
    (reason, score, detail) triple (the fields of a Verdict after `correct`).

    `fn` is a module-level function (pickled by reference); `args` are plain, hashable values,
    so identical jobs in a batch (a group's repeated answers) run once. `cost_s`: what the
    job adds to its batch's deadline (divided among the workers; pool.VerifierPool.run).
    """

    fn: Callable[..., str | tuple[str, float, str]]
    args: tuple
    cost_s: float = JOB_COST_S


class Verifier(Protocol):
    """A task verifier: per (completion, record), a Verdict decided on the spot (only cheap,
    linear-time string work) or a Job for the pool. Raises only on a bad record (data)."""

    def plan(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict | Job]: ...

    def answer_key(self, completion: str, record: Any) -> str | None:
        """The final answer as this verifier reads it, normalised so that equal answers have
        equal keys (maj@k votes on them); None when there is no answer."""
        ...


class PlansPerCompletion(abc.ABC):
    """For verifiers that decide each completion alone (`plan_one`: a Verdict now, or a Job
    the pool runs): their batch plan and their in-process check follow from it."""

    @abc.abstractmethod
    def plan_one(self, completion: str, record: Any) -> Verdict | Job:
        """The completion's verdict, or the Job that decides it."""

    def plan(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict | Job]:
        return [self.plan_one(c, r) for c, r in zip(completions, records)]

    def verify_one(self, completion: str, record: Any) -> Verdict:
        item = self.plan_one(completion, record)
        return run_in_process(item) if isinstance(item, Job) else item


def verdict_of(value: Any) -> Verdict | None:
    """The Verdict a job returned (a REASONS name or a (reason, score, detail) triple), else
    None (not a verdict: an error of the verifier)."""
    if isinstance(value, tuple) and len(value) == 3 and value[0] in REASONS:
        return Verdict(value[0] == "correct", *value)
    if isinstance(value, str) and value in REASONS:
        return Verdict(value == "correct", value)
    return None


def run_in_process(job: Job) -> Verdict:
    """A job's verdict computed here, without deadlines (tests, tools; training uses the pool)."""
    value = job.fn(*job.args)
    verdict = verdict_of(value)
    if verdict is None:
        raise ValueError(f"{job.fn.__name__} returned {value!r}, not a verdict")
    return verdict


def run_plan(pool: Any, plan: Sequence[Verdict | Job]) -> list[Verdict]:
    """Verdicts for a plan: each distinct Job runs once in `pool` (a VerifierPool), under its
    per-item deadline and a batch deadline that scales with the jobs' costs. A job that times
    out, crashes or raises gives a Verdict whose reason is in FAILED_REASONS; those are
    counted and logged here."""
    verdicts: list[Any] = list(plan)
    rows: dict[Job, list[int]] = {}
    for i, item in enumerate(plan):
        if isinstance(item, Job):
            rows.setdefault(item, []).append(i)
    if not rows:
        return verdicts
    results = pool.run([(job.fn, job.args) for job in rows], [job.cost_s for job in rows])
    failures: Counter = Counter()
    first_failure = None
    for indices, result in zip(rows.values(), results):
        found = verdict_of(result.value) if result.status == "ok" else None
        if found is not None:
            verdict = found
        else:
            reason = result.status if result.status in FAILED_REASONS else "error"
            verdict = Verdict(False, reason)
        if verdict.reason in FAILED_REASONS:
            failures[verdict.reason] += len(indices)
            first_failure = first_failure or f"{verdict.reason}: {result.value}"
        for i in indices:
            verdicts[i] = verdict
    if failures:
        logging.warning(
            "Verification did not finish for %d of %d rows (%s; first: %s). These rows are "
            "left out of the loss and of the group statistics. If this is frequent, raise the "
            "reward item_timeout_s / batch_timeout_s or num_workers.",
            sum(failures.values()),
            len(verdicts),
            ", ".join(f"{k} {v}" for k, v in sorted(failures.items())),
            first_failure,
        )
    return verdicts


@dataclasses.dataclass(frozen=True)
class RewardBatch:
    rewards: np.ndarray  # float32 [B], after shaping
    correct: np.ndarray  # bool [B]
    reasons: list[str]  # [B], one of REASONS
    details: list[str] = dataclasses.field(default_factory=list)  # [B] or [] (none given)

    def __post_init__(self):
        if not (len(self.rewards) == len(self.correct) == len(self.reasons)):
            raise ValueError(
                "RewardBatch fields must have the same length, got "
                f"{len(self.rewards)}, {len(self.correct)}, {len(self.reasons)}"
            )
        if self.details and len(self.details) != len(self.reasons):
            raise ValueError(
                f"RewardBatch has {len(self.details)} details for {len(self.reasons)} rows"
            )

    def __len__(self) -> int:
        return len(self.reasons)

    def take(self, rows: Sequence[int] | np.ndarray) -> RewardBatch:
        """The rows `rows`, in that order."""
        return RewardBatch(
            rewards=self.rewards[rows],
            correct=self.correct[rows],
            reasons=[self.reasons[i] for i in rows],
            details=[self.details[i] for i in rows] if self.details else [],
        )

    def join(self, *others: RewardBatch) -> RewardBatch:
        """This batch's rows followed by each of `others`'."""
        batches = (self, *others)
        return RewardBatch(
            rewards=np.concatenate([b.rewards for b in batches]),
            correct=np.concatenate([b.correct for b in batches]),
            reasons=[r for b in batches for r in b.reasons],
            details=(
                [d for b in batches for d in (b.details or [""] * len(b))]
                if any(b.details for b in batches)
                else []
            ),
        )

    @property
    def failed(self) -> np.ndarray:
        """bool [B]: rows whose verification did not finish (timeout, crash, error). They are
        not scores: their reward is 0 and training masks them out (loss and statistics)."""
        return np.array([r in FAILED_REASONS for r in self.reasons], dtype=bool)

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
