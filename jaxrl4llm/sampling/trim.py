"""Trimming completions, each rule written once.

A sampled row's completion is `tokens_BT[r, :lengths_B[r]]`: the tokens up to and including
the first stop token (none when the row was truncated at max_new_tokens), then padding.

* `text_token_ids`: what a completion's text decodes from: its tokens less the stop token
  (Sampler.decode).
* `cut_columns`: [B, T, ...] arrays cut to their first `length` completion columns
  (SampleOutput.trimmed, train.update.batch.UpdateBatch.trimmed). The length the
  teacher-forced passes and the update cut to is buckets.bucket_completion_length of the
  longest row, so only padding is cut.
"""

from __future__ import annotations

from typing import overload

import jax
import numpy as np


def text_token_ids(
    tokens_BT: np.ndarray, lengths_B: np.ndarray, truncated_B: np.ndarray
) -> list[np.ndarray | None]:
    """Each row's completion tokens without its stop token (a truncated row has none and keeps
    all of its tokens); None for a row without a completion (e.g. a dropped prompt's)."""
    return [
        tokens_BT[r, : int(n) - (0 if truncated else 1)] if n else None
        for r, (n, truncated) in enumerate(zip(lengths_B, truncated_B))
    ]


@overload
def cut_columns(x_BT: None, length: int) -> None: ...


@overload
def cut_columns(x_BT: jax.Array, length: int) -> jax.Array: ...


def cut_columns(x_BT: jax.Array | None, length: int) -> jax.Array | None:
    """The first `length` completion columns of a [B, T, ...] array (None stays None)."""
    return None if x_BT is None else x_BT[:, :length]
