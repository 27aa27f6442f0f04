"""Math answers: extract the final answer, fast-path exact matches, math-verify in a pool.

math-verify parses LaTeX with its own sympy parser (never `sympify` on raw text) and guards
itself with SIGALRM, which only works in a main thread: that is why it runs inside the pool's
workers, each its own process, with the pool's wall-clock guard around it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxrl4llm.rewards import extract
from jaxrl4llm.rewards.base import Verdict, record_answer
from jaxrl4llm.rewards.pool import PoolConfig, VerifierPool

ANSWER_MODES = ("boxed", "lenient")


def verify_in_worker(pred: str, gold: str, timeout_s: int) -> str:
    """Runs in a pool worker: "correct" | "wrong" | "parse_error" | "timeout"."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout_s)
        # no_fallback: an unparseable prediction is a parse_error, not a raw-string "answer"
        pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout_s,
                            fallback_mode="no_fallback", raise_on_error=True)
        if not pred_parsed:
            return "parse_error"
        ok = verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s, raise_on_error=True)
    except TimeoutException:
        return "timeout"
    except (Exception, RecursionError):  # noqa: BLE001 - sympy fails in many ways on junk
        return "parse_error"
    return "correct" if ok else "wrong"


@dataclasses.dataclass(frozen=True)
class MathConfig:
    answer_mode: str = "boxed"     # "boxed": last \boxed{}; "lenient": else the last number
    max_answer_chars: int = 1000   # longer extracted answers are a parse_error, not a sympy job
    pool: PoolConfig = PoolConfig()

    def __post_init__(self):
        if self.answer_mode not in ANSWER_MODES:
            raise ValueError(f"unknown answer_mode {self.answer_mode!r}; valid: "
                             f"{', '.join(ANSWER_MODES)}")


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
        self._pool: VerifierPool | None = None

    @property
    def pool(self) -> VerifierPool:
        if self._pool is None:  # lazily: the default arithmetic task never needs it
            self._pool = VerifierPool(self.config.pool)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def verify(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict]:
        verdicts: list[Verdict | None] = [None] * len(completions)
        jobs: dict[tuple[str, str], list[int]] = {}  # same answer in a group -> one job
        for i, (completion, record) in enumerate(zip(completions, records)):
            pred = extract_math_answer(completion, self.config.answer_mode)
            if pred is None or not pred.strip():
                verdicts[i] = Verdict(False, "no_answer")
                continue
            if len(pred) > self.config.max_answer_chars:
                verdicts[i] = Verdict(False, "parse_error")
                continue
            pred = extract.normalize_unicode(pred)
            gold = extract.normalize_unicode(extract.gold_answer(record_answer(record)))
            verdicts[i] = fast_verdict(pred, gold)
            if verdicts[i] is None:
                jobs.setdefault((pred, gold), []).append(i)
        if jobs:
            inner_timeout = max(1, int(self.config.pool.item_timeout_s / 3))
            keys = list(jobs)
            results = self.pool.run([(verify_in_worker, (p, g, inner_timeout)) for p, g in keys])
            for key, result in zip(keys, results):
                if result.status == "ok":
                    verdict = Verdict(result.value == "correct", result.value)
                else:  # "timeout" | "crash" | "error": reward as wrong, counted by reason
                    verdict = Verdict(False, result.status)
                for i in jobs[key]:
                    verdicts[i] = verdict
        return verdicts  # type: ignore[return-value]
