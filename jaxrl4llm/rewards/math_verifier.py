"""Math answers: extract the final answer, fast-path exact matches, math-verify in a pool.

math-verify parses LaTeX with its own sympy parser (never `sympify` on raw text) and guards
itself with SIGALRM, which only works in a main thread: that is why it runs inside the pool's
workers, each its own process, with the pool's wall-clock guard around it. Extraction and the
exact-match fast path run in the trainer: linear-time string work on at most
`max_answer_chars` characters after extraction (tools/bench_extract.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from jaxrl4llm.rewards import extract
from jaxrl4llm.rewards.base import Job, Verdict, record_answer

ANSWER_MODES = ("boxed", "lenient")
BUDGET_FRACTION = 0.9  # of the pool's item deadline for math-verify; the rest is IPC + unpickling


def verify_in_worker(pred: str, gold: str, budget_s: float) -> str:
    """Runs in a pool worker: "correct" | "wrong" | "parse_error" | "timeout".

    math-verify's three phases (parse gold, parse prediction, compare) share `budget_s`: each
    gets the whole seconds left (its SIGALRM takes integers), so the item fails with its own
    "timeout" before the pool's wall clock kills the worker.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    deadline = time.monotonic() + budget_s

    def seconds_left() -> int | None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutException("math-verify budget spent")
        return int(left) if left >= 1 else None  # < 1 s: no alarm, the pool's guard holds

    try:
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=seconds_left())
        # no_fallback: an unparseable prediction is a parse_error, not a raw-string "answer"
        pred_parsed = parse(
            f"\\boxed{{{pred}}}",
            parsing_timeout=seconds_left(),
            fallback_mode="no_fallback",
            raise_on_error=True,
        )
        if not pred_parsed:
            return "parse_error"
        ok = verify(gold_parsed, pred_parsed, timeout_seconds=seconds_left(), raise_on_error=True)
    except TimeoutException:
        return "timeout"
    except (Exception, RecursionError):  # noqa: BLE001 - sympy fails in many ways on junk
        return "parse_error"
    return "correct" if ok else "wrong"


@dataclasses.dataclass(frozen=True)
class MathConfig:
    answer_mode: str = "boxed"  # "boxed": last \boxed{}; "lenient": else the last number
    max_answer_chars: int = 1000  # longer extracted answers are a parse_error, not a sympy job
    budget_s: float = 4.5  # math-verify's time per item (< the pool's item deadline)

    def __post_init__(self):
        if self.answer_mode not in ANSWER_MODES:
            raise ValueError(
                f"unknown answer_mode {self.answer_mode!r}; valid: {', '.join(ANSWER_MODES)}"
            )

    @classmethod
    def for_item_deadline(cls, item_timeout_s: float, **options: Any) -> MathConfig:
        """math-verify's budget derived from the pool's per-item deadline."""
        return cls(budget_s=BUDGET_FRACTION * item_timeout_s, **options)


def extract_math_answer(completion: str, answer_mode: str = "boxed") -> str | None:
    answer = extract.extract_boxed(completion)
    if answer is None and answer_mode == "lenient":
        answer = extract.extract_last_number(completion)
    return answer


def fast_verdict(pred: str, gold: str) -> Verdict | None:
    """A verdict without sympy when the strings decide it, else None (-> the pool)."""
    p, g = extract.normalize_answer(pred), extract.normalize_answer(gold)
    if p == g and p:
        return Verdict(True, "correct")
    p_int, g_int = extract.as_integer(p), extract.as_integer(g)
    if p_int is not None and g_int is not None:
        return Verdict(p_int == g_int, "correct" if p_int == g_int else "wrong")
    p_dec, g_dec = extract.as_decimal(p), extract.as_decimal(g)
    if p_dec is not None and g_dec is not None and p_dec == g_dec:
        return Verdict(True, "correct")
    return None  # unequal decimals go to math-verify, which rounds


class MathVerifier:
    """Verifies completions against `record.answer` (a number, LaTeX, or a GSM8K/MATH solution)."""

    def __init__(self, config: MathConfig = MathConfig()):
        self.config = config

    def plan_one(self, completion: str, record: Any) -> Verdict | Job:
        pred = extract_math_answer(completion, self.config.answer_mode)
        if pred is None or not pred.strip():
            return Verdict(False, "no_answer")
        if len(pred) > self.config.max_answer_chars:
            return Verdict(False, "parse_error")
        pred = extract.normalize_unicode(pred)
        gold = extract.normalize_unicode(extract.gold_answer(record_answer(record)))
        verdict = fast_verdict(pred, gold)
        return (
            verdict
            if verdict is not None
            else Job(verify_in_worker, (pred, gold, self.config.budget_s))
        )

    def answer_key(self, completion: str, record: Any) -> str | None:
        """The answer maj@k votes on: the extracted final answer, normalised as for the
        exact-match fast path ("1,000" and "1000" vote together)."""
        pred = extract_math_answer(completion, self.config.answer_mode)
        if pred is None or len(pred) > self.config.max_answer_chars:
            return None
        return extract.normalize_answer(extract.normalize_unicode(pred)) or None

    def plan(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict | Job]:
        """A Verdict where the strings decide it, else a math-verify Job for the pool."""
        return [self.plan_one(c, r) for c, r in zip(completions, records)]
