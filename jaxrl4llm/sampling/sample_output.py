"""What a sampler call returns: `SampleOutput`, the completions of a batch of rows with the
prompt block they follow (sampler.generate, continuous.py's slots, multiturn.py's turns)."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.sampling import trim
from jaxrl4llm.sampling.layout import prompt_completion_rows


class SampleOutput(flax.struct.PyTreeNode):
    """Completions of B = num_prompts * n rows (row p * n + g is sample g of prompt p).

    tokens_BT      int32 completion tokens; pad_id after the first stop token.
    logprobs_BT    float32 log_softmax(logits / temperature)[token] (0 where mask is False).
    mask_BT        bool: the model's tokens, up to and including the first stop token.
    lengths_B      int32 number of completion tokens (sum of mask_BT; in a multi-turn
                   rollout, model and observation tokens).
    truncated_B    bool: hit max_new_tokens (or its row cap) without emitting a stop token.
    prompt_tokens_BP / prompt_mask_BP   the left-padded prompt block the completions follow;
                   concatenated with tokens_BT / mask_BT they give the teacher-forced input.
    dropped_B      bool: the prompt was longer than the limit and skipped (long_prompts="drop");
                   such rows have no completion (mask all False).
    num_steps      int32 scalar: decode steps run (<= max_new_tokens; = the longest row).
    slot_steps     int32 scalar: rows computed, summed over the decode steps (finished rows
                   are compacted away, see decode.py): the decode loop's work.
    engine_stats   the paged engine's counts (paged.PagedStats: decode steps, live rows and
                   pages in use summed over them, tokens decoded, preemptions), else None.
    observation_BT bool or None: multi-turn rollouts (multiturn.py): the observation tokens
                   appended between model turns: in the sequence, off mask_BT (no logprob,
                   off the loss). None: single-turn (every real token is the model's).
    prompt_experts_BPLK / experts_BTLK   a mixture of experts' routing record (the sampler
                   asked to record it), else None: the experts [L_moe, K] each prompt token
                   and each completion token ran; completion column t is written when a
                   row that goes on feeds token t, so its last token's is 0 (no logprob
                   reads it; replay lets that token route itself).
    """

    tokens_BT: jax.Array
    logprobs_BT: jax.Array
    mask_BT: jax.Array
    lengths_B: jax.Array
    truncated_B: jax.Array
    prompt_tokens_BP: jax.Array
    prompt_mask_BP: jax.Array
    dropped_B: jax.Array
    num_steps: jax.Array
    slot_steps: jax.Array | None = None
    observation_BT: jax.Array | None = None
    engine_stats: Any = None
    prompt_experts_BPLK: jax.Array | None = None
    experts_BTLK: jax.Array | None = None

    @property
    def num_dropped(self) -> int:
        return int(np.sum(np.asarray(self.dropped_B)))

    def trimmed(self, length: int) -> "SampleOutput":
        """The first `length` completion columns (>= every row's length: nothing real is cut),
        so teacher-forced passes run on the batch's own longest completion, not
        max_new_tokens (see buckets.bucket_completion_length)."""
        return self.replace(
            tokens_BT=trim.cut_columns(self.tokens_BT, length),
            logprobs_BT=trim.cut_columns(self.logprobs_BT, length),
            mask_BT=trim.cut_columns(self.mask_BT, length),
            observation_BT=trim.cut_columns(self.observation_BT, length),
            experts_BTLK=trim.cut_columns(self.experts_BTLK, length),
        )

    @property
    def sequence_mask_BT(self) -> jax.Array:
        """bool: every real completion token, the model's and the observations'."""
        if self.observation_BT is None:
            return self.mask_BT
        return self.mask_BT | self.observation_BT

    def sequences(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(tokens, mask, positions) of prompt + completion, [B, P + T], for a teacher-forced
        forward whose logits at column P - 1 + t predict completion token t."""
        return prompt_completion_rows(
            self.prompt_tokens_BP, self.prompt_mask_BP, self.tokens_BT, self.sequence_mask_BT
        )


@jax.jit
def from_engine(
    out: Any,
    prompt_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    active_B: jax.Array,
) -> SampleOutput:
    """A slot or paged engine's output (continuous.SlotOutput, paged_state.PagedOutput: per
    row tokens, logprobs, length, done; the paged engine's routing record if any) as a
    SampleOutput (num_steps: the longest row)."""
    N = out.tokens_RT.shape[1]
    return SampleOutput(
        tokens_BT=out.tokens_RT,
        logprobs_BT=out.logprobs_RT,
        mask_BT=jnp.arange(N)[None, :] < out.length_R[:, None],
        lengths_B=out.length_R,
        truncated_B=active_B & ~out.done_R,
        prompt_tokens_BP=prompt_BP,
        prompt_mask_BP=prompt_mask_BP.astype(bool),
        dropped_B=jnp.zeros(active_B.shape, bool),
        num_steps=jnp.maximum(jnp.max(out.length_R), 1),
        slot_steps=out.slot_steps,
        engine_stats=getattr(out, "stats", None),
        prompt_experts_BPLK=getattr(out, "prompt_experts_RPLK", None),
        experts_BTLK=getattr(out, "experts_RTLK", None),
    )
