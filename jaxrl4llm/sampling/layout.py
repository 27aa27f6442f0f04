"""How a rollout batch's rows are laid out, decided once and carried with the batch.

Group i is rows [i*G, (i+1)*G): the G samples of prompt i (`buckets.prepare_batch` lays the
sampler's rows out so). A row is the left-padded prompt followed by the completion. Every
consumer reads the layout instead of assuming it: the sampler (prefill once per group), the
reward call (one record per row), the advantages (group statistics), the teacher-forced
passes and the update (a group's prompt runs once).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, TypeVar

import jax
import jax.numpy as jnp

from jaxrl4llm.models import transformer

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """group_size: G, samples per prompt. share_prompts: passes that read the prompt run it
    once per group. grouped: rows still sit in their groups (False once they are reshuffled,
    e.g. into PPO mini-batches)."""

    group_size: int = 1
    share_prompts: bool = True
    grouped: bool = True

    def repeat(self, items: Sequence[T]) -> list[T]:
        """One entry per row: each prompt's item G times in a row (e.g. records to score)."""
        return [x for x in items for _ in range(self.group_size)]

    def prompt_group(self, rows: int, slices: int = 1, data_parallel: int = 1) -> int:
        """Rows per prompt run for a pass over `rows` rows split into `slices` slices: G when
        prompts are shared and every slice holds whole groups on each of its `data_parallel`
        devices, else 1 (a group split across devices would replicate its prompt and
        all-reduce it)."""
        G = self.group_size
        if (
            not (self.share_prompts and self.grouped)
            or rows % slices
            or (rows // slices) % (G * data_parallel)
        ):
            return 1
        return G

    def shuffled(self) -> "RowLayout":
        """The layout of a batch whose rows were reordered: no longer in groups."""
        return dataclasses.replace(self, grouped=False)


def prompt_completion_rows(
    prompt_tokens_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    completion_tokens_BT: jax.Array,
    completion_mask_BT: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens, mask, positions) [B, P + T] of prompt ++ completion rows, for a teacher-forced
    forward whose logits at column P - 1 + t predict completion token t."""
    tokens = jnp.concatenate([prompt_tokens_BP, completion_tokens_BT], axis=1)
    mask = jnp.concatenate([prompt_mask_BP, completion_mask_BT], axis=1)
    return tokens, mask, transformer.positions_from_mask(mask)
