"""The evaluation protocols over a [prompts, K] table of per-sample results: avg@k, unbiased
pass@k, maj@k (and greedy accuracy from the greedy results). Pure numpy; the evaluator
(eval/evaluator.py) fills the tables, eval/sets.py parses which metrics a set asks for."""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from jaxrl4llm.eval.sets import metric_k


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 - C(n-c, k) / C(n, k), computed stably."""
    if not 0 < k <= num_samples:
        raise ValueError(f"pass@k needs 0 < k <= n; got k={k}, n={num_samples}.")
    if num_samples - num_correct < k:
        return 1.0
    # prod_{i=n-c+1}^{n} (1 - k/i), the product form that avoids huge binomials.
    i = np.arange(num_samples - num_correct + 1, num_samples + 1)
    return float(1.0 - np.prod(1.0 - k / i))


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent non-empty answer (ties: the one seen first)."""
    counts = collections.Counter(a for a in answers if a)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a and counts[a] == best)


def majority_correct(
    answers_PK: Sequence[Sequence[str | None]], correct_PK: np.ndarray, k: int
) -> np.ndarray:
    """bool [P]: whether the majority answer of each prompt's first k samples is correct."""
    out = []
    for answers, correct in zip(answers_PK, correct_PK):
        best = majority_answer(list(answers[:k]))
        out.append(best is not None and bool(correct[list(answers[:k]).index(best)]))
    return np.array(out, dtype=bool)


def summarize(
    correct_PK: np.ndarray,
    ks: Sequence[int] = (1,),
    maj_correct_P: np.ndarray | None = None,
    prefix: str = "",
) -> dict[str, float]:
    """avg@k (mean correctness of all samples) and pass@k for each k over a [P, K] table.

    `maj_correct_P` (optional) marks prompts whose majority answer is correct -> maj@K.
    """
    correct_PK = np.asarray(correct_PK, dtype=bool)
    if correct_PK.ndim != 2 or correct_PK.shape[0] == 0:
        raise ValueError(f"Expected a non-empty [prompts, samples] table, got {correct_PK.shape}.")
    num_prompts, k_max = correct_PK.shape
    out = {f"{prefix}avg@{k_max}": float(correct_PK.mean())}
    num_correct_P = correct_PK.sum(axis=1)
    for k in ks:
        if k > k_max:
            raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {k_max}.")
        out[f"{prefix}pass@{k}"] = float(
            np.mean([pass_at_k(k_max, int(c), k) for c in num_correct_P])
        )
    if maj_correct_P is not None:
        out[f"{prefix}maj@{k_max}"] = float(np.mean(np.asarray(maj_correct_P, dtype=bool)))
    out[f"{prefix}num_prompts"] = float(num_prompts)
    return out


def set_metrics(
    metrics: Sequence[str],
    greedy_P: np.ndarray | None,
    correct_PK: np.ndarray,
    answers_PK: Sequence[Sequence[str | None]],
) -> dict[str, float]:
    """Each of `metrics` (greedy, avg@k, pass@k, maj@k) from the greedy results [P] and the
    K-sample table [P, K] (the first k samples of each prompt for avg@k / maj@k; unbiased
    pass@k from all K)."""
    out = {}
    for metric in metrics:
        if metric == "greedy":
            assert greedy_P is not None, "the greedy metric needs the greedy results"
            out[metric] = float(np.mean(greedy_P))
            continue
        kind, k = metric.split("@")[0], metric_k(metric)
        if kind == "avg":
            out[metric] = float(np.mean(correct_PK[:, :k]))
        elif kind == "pass":
            K = correct_PK.shape[1]
            out[metric] = float(np.mean([pass_at_k(K, int(c), k) for c in correct_PK.sum(1)]))
        else:
            out[metric] = float(np.mean(majority_correct(answers_PK, correct_PK, k)))
    return out
