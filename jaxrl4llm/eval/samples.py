"""Per-sample records of an evaluation: one JSON object per completion (the evaluator's
`sink`; `experiments.evaluate --samples_out` writes them as JSON Lines with `SamplesWriter`).

Every record has every key (KEYS):

    set           the --eval_sets NAME, or "eval_data" for the --eval_data prompts
    prompt_index  the prompt's index within its set (0-based, the order of the split)
    prompt        the prompt text the sampler encodes: the record's chat messages (instruction,
                  system prompt, example) through the tokenizer's chat template
    answer        the record's reference answer ("" when it has none)
    metadata      the record's metadata, the rest of what the verifier reads (the task name,
                  a countdown's numbers, a code task's tests)
    sample        0 .. K-1 for the sampled completions, "greedy" for the greedy one
    completion    the completion text (stop token excluded)
    answer_key    the final answer maj@k votes on (null: none found)
    correct       the verdict
    reward        the reward (after shaping)
    status        why: the reward function's reason (rewards.base.REASONS: "correct",
                  "wrong", "no_answer", ...) or a multi-turn trajectory's last turn status
    detail        what decided it where the verifier says (a code task's first failing
                  test), else ""
    tokens        completion tokens, the stop token included
    truncated     the completion hit max_new_tokens without a stop token
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl4llm.rewards.base import record_answer, record_metadata
from jaxrl4llm.sampling.context import RolloutContext
from jaxrl4llm.sampling.rounds import ScoredRows

KEYS = (
    "set",
    "prompt_index",
    "prompt",
    "answer",
    "metadata",
    "sample",
    "completion",
    "answer_key",
    "correct",
    "reward",
    "status",
    "detail",
    "tokens",
    "truncated",
)
HELD_OUT = "eval_data"  # the set name of the --eval_data prompts

# Receives each scored batch's records, in order, as the evaluation runs.
Sink = Callable[[list[dict[str, Any]]], None]


def _statuses(verdicts: Any, n: int) -> tuple[list[str | None], list[str]]:
    """Each row's status and detail: a reward function's reasons and details, or a multi-turn
    trajectory's last turn status."""
    reasons = getattr(verdicts, "reasons", None)
    if reasons is not None:
        return list(reasons), list(getattr(verdicts, "details", None) or [""] * n)
    stats = getattr(verdicts, "stats", None)
    if stats is not None:
        return [str(s) for s in stats.final_status_B], [""] * n
    return [None] * n, [""] * n


def sample_records(
    ctx: RolloutContext,
    records: Sequence[Any],
    rows: ScoredRows,
    answer_keys: Sequence[str | None],
    set_name: str,
    first_index: int,
    *,
    greedy: bool,
) -> list[dict[str, Any]]:
    """One record per row of `rows`, the G = layout.group_size completions of each of
    `records` (prompt indices first_index, first_index + 1, ...); `greedy`: the rows are the
    greedy completions (G = 1)."""
    group = rows.samples.layout.group_size
    texts, verdicts = rows.samples.texts, rows.verdicts
    lengths = rows.samples.host(rows.samples.out.lengths_B)
    truncated = rows.samples.host(rows.samples.out.truncated_B)
    status, detail = _statuses(verdicts, len(texts))
    prompts = [ctx.sampler.tokenizer.apply_chat_template(ctx.data.messages(r)) for r in records]
    out = []
    for row, text in enumerate(texts):
        p, g = divmod(row, group)
        values = (
            set_name,
            first_index + p,
            prompts[p],
            record_answer(records[p]),
            dict(record_metadata(records[p])),
            "greedy" if greedy else g,
            text,
            answer_keys[row],
            bool(verdicts.correct[row]),
            float(verdicts.rewards[row]),
            status[row],
            detail[row],
            int(lengths[row]),
            bool(truncated[row]),
        )
        out.append(dict(zip(KEYS, values)))
    return out


def _plain(value: Any) -> Any:
    """A numpy scalar or array in a record's metadata as its Python value (else its str)."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return str(value)


class SamplesWriter:
    """A sink writing the records to `path` as JSON Lines, one batch at a time, flushed, so an
    interrupted evaluation keeps what it scored. Creates the parent folder; opening raises
    OSError where that or the file cannot be written."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "w", encoding="utf-8")

    def __call__(self, records: list[dict[str, Any]]) -> None:
        self._file.writelines(
            json.dumps(r, ensure_ascii=False, default=_plain) + "\n" for r in records
        )
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SamplesWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
