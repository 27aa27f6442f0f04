"""Shape buckets: round prompt lengths and batch sizes up so the sampler compiles rarely.

Every distinct (batch, prompt length, max_new_tokens, sampling config) is one compiled
program. A training run has a fixed batch (prompts x group size) and prompts of varying
length, so lengths go to two sizes per octave (2^k and 1.5 * 2^k: a handful of programs, at
most a third of a block's positions padding) and batches to a few sizes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from jaxrl4llm.config.errors import UserError

MIN_PROMPT_BUCKET = 16
LONG_PROMPT_MODES = ("error", "drop")


class PromptTooLongError(UserError, ValueError):
    """Prompts over the prompt-length limit with long_prompts="error" (a user error: the
    message names the flags that fix it)."""


def two_per_octave(n: int) -> int:
    """The smallest 2^k or 1.5 * 2^k that is >= n (n >= 1): at most a third of it is padding."""
    octave = 1 << (n - 1).bit_length()  # the next power of two >= n
    return octave * 3 // 4 if octave >= 4 and n <= octave * 3 // 4 else octave


def bucket_prompt_length(length: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """The prompt block's width: the next 2^k or 1.5 * 2^k >= length (at least `minimum`);
    multiples of 1024 past 1024.

    Two widths per octave, as for completions: prompts of 33-48 tokens run at 48, not 64, so
    the prefill, the KV cache and every teacher-forced pass compute at most a third more
    prompt positions than the longest prompt has (a power of two alone allowed twice). The
    price is up to twice as many compiled prompt widths in a run whose prompts vary a lot.
    """
    if length < 0:
        raise ValueError(f"Prompt length {length} is negative.")
    n = max(length, minimum, 1)
    if n > 1024:
        return 1024 * math.ceil(n / 1024)
    return two_per_octave(n)


def bucket_batch_size(batch: int, multiple: int = 1) -> int:
    """Powers of two up to 8, then multiples of 8; always a multiple of `multiple`.

    `multiple` is the number of data-parallel shards the batch is split over.
    """
    if batch < 1:
        raise ValueError(f"Batch size {batch} must be at least 1 (no prompts were given?).")
    b = 1 << (batch - 1).bit_length() if batch <= 8 else 8 * math.ceil(batch / 8)
    return multiple * math.ceil(b / multiple)


MIN_COMPLETION_BUCKET = 16


def bucket_completion_length(
    length: int, max_new_tokens: int, minimum: int = MIN_COMPLETION_BUCKET
) -> int:
    """The padded completion length the teacher-forced passes and the update run on: the
    longest completion of the batch rounded up to 2^k or 1.5 * 2^k (at least `minimum`),
    capped at max_new_tokens. Two lengths per octave: at most a third of the computed
    positions past the longest row are padding, and a run compiles at most
    2 * log2(max_new_tokens / minimum) + 1 update programs."""
    if not 0 <= length <= max_new_tokens:
        raise ValueError(
            f"Completion length {length} is outside [0, max_new_tokens={max_new_tokens}]."
        )
    return min(two_per_octave(max(length, minimum, 1)), max_new_tokens)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """A bucketed, left-padded [B, P] prompt block; rows past num_rows are batch padding."""

    prompt_BP: np.ndarray
    mask_BP: np.ndarray
    active_B: np.ndarray
    dropped_B: np.ndarray
    prompt_index_B: np.ndarray
    sample_index_B: np.ndarray
    num_rows: int


def prepare_batch(
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    max_prompt_len: int,
    long_prompts: str,
    pad_id: int,
    vocab_size: int,
    batch_multiple: int = 1,
    min_prompt_bucket: int = MIN_PROMPT_BUCKET,
) -> PromptBatch:
    """Host side: repeat each prompt n times, left-pad into a bucketed [B, P] block."""
    if long_prompts not in LONG_PROMPT_MODES:
        raise ValueError(f"long_prompts={long_prompts!r} must be one of {LONG_PROMPT_MODES}.")
    if n < 1:
        raise ValueError(f"n={n} samples per prompt must be at least 1.")
    lists = _checked_prompts(prompts, vocab_size)
    too_long = np.array([p.size > max_prompt_len for p in lists])
    if too_long.any() and long_prompts == "error":
        i = int(np.argmax(too_long))
        raise PromptTooLongError(
            f"{int(too_long.sum())} of {len(lists)} prompts are longer than --max_prompt_tokens="
            f"{max_prompt_len} (prompt {i} has {lists[i].size} tokens). Shorten them, raise "
            "--max_prompt_tokens (or lower --max_new_tokens), or pass --long_prompts=drop to "
            "skip and count them."
        )
    num_rows = len(lists) * n
    B = bucket_batch_size(num_rows, batch_multiple)
    kept = [p.size for p, long in zip(lists, too_long) if not long] or [1]
    P = bucket_prompt_length(max(kept), min_prompt_bucket)
    return _left_padded(lists, too_long, n, B, P, pad_id)


def _checked_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[np.ndarray]:
    """The prompts as int64 arrays; refuses none at all, an empty one or an id outside the
    vocabulary."""
    lists = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    if not lists:
        raise ValueError("No prompts were given: pass at least one list of token ids.")
    for i, p in enumerate(lists):
        if p.size == 0:
            raise ValueError(
                f"Prompt {i} is empty; every prompt needs at least one token "
                "(e.g. BOS or a chat template)."
            )
        bad = p[(p < 0) | (p >= vocab_size)]
        if bad.size:
            raise ValueError(
                f"Prompt {i} holds token id {int(bad[0])} outside [0, {vocab_size}): "
                "was it tokenized for another model?"
            )
    return lists


def _left_padded(
    lists: list[np.ndarray], too_long: np.ndarray, n: int, B: int, P: int, pad_id: int
) -> PromptBatch:
    """The [B, P] block: n rows per prompt, each left-padded (too long ones dropped)."""
    prompt_BP = np.full((B, P), pad_id, np.int32)
    mask_BP = np.zeros((B, P), bool)
    mask_BP[:, -1] = True  # inactive rows hold one pad token so attention stays defined
    active_B = np.zeros(B, bool)
    dropped_B = np.zeros(B, bool)
    prompt_index_B = np.full(B, len(lists), np.int32)  # batch padding: past every prompt
    sample_index_B = np.zeros(B, np.int32)
    for i, p in enumerate(lists):
        rows = slice(i * n, (i + 1) * n)
        prompt_index_B[rows] = i
        sample_index_B[rows] = np.arange(n)
        if too_long[i]:
            dropped_B[rows] = True
            continue
        prompt_BP[rows, P - p.size :] = p
        mask_BP[rows, P - p.size :] = True
        active_B[rows] = True
    return PromptBatch(
        prompt_BP, mask_BP, active_B, dropped_B, prompt_index_B, sample_index_B, len(lists) * n
    )
