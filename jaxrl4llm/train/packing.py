"""Sequence packing for the update (--micro_batch_tokens=N): a mini-batch's (prompt,
completion) sequences concatenated into packed rows, micro-batches formed by a token budget.

The host packs (`pack`): each sequence is its real prompt tokens followed by its real
completion tokens; first-fit-decreasing (longest first, ties by row; deterministic) places
them into rows of L = prompt columns + completion columns slots (every sequence fits one
row), and R rows form a micro-batch of R x L <= N tokens (R a multiple of the data-parallel
size, so every device holds the same token budget). Shapes depend only on (M, P, T, N): the
packed update compiles no more programs than the padded one. A mini-batch needs at most
ceil(M / R) micro-batches (a row holds at least one sequence); the device runs only the
`num_micro` that hold rows.

On device (`packed_logprobs`) the rows run with segment ids (block-diagonal causal attention)
and positions restarting per sequence; `unpack` reads each sequence's completion logprobs back
into the mini-batch's [M, T] layout, where the loss is the padded update's, term for term.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import parallel
from jaxrl4llm.models import transformer
from jaxrl4llm.train.logprobs import Sequences, logprobs_from_hidden


class PackedBatch(flax.struct.PyTreeNode):
    """A mini-batch's sequences packed: K = ceil(M / R) micro-batches of R rows x L slots."""

    tokens_KRL: jax.Array  # int32: the packed tokens, 0 past the row's last sequence
    positions_KRL: jax.Array  # int32: RoPE positions, restarting at each sequence
    segments_KRL: jax.Array  # int32: 1, 2, ... per sequence in its row; 0: no token
    targets_KRL: jax.Array  # int32: the token each slot predicts (the next one in its row)
    micro_M: jax.Array  # int32: the micro-batch of mini-batch row m
    start_M: jax.Array  # int32: flat slot in that micro-batch's [R * L] that predicts
    #                           row m's completion token 0
    num_micro: jax.Array  # int32 scalar: micro-batches that hold rows (the rest are empty)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, each summing to <= capacity): items longest first (ties by
    index), each into the first bin with room, else a new bin."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"A sequence of {n} tokens does not fit a packed row of {capacity}.")
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(int(i))
                room[b] -= n
                break
        else:
            bins.append([int(i)])
            room.append(capacity - n)
    return bins


def rows_per_micro_batch(budget: int, row_length: int, data_parallel: int) -> int:
    """R: packed rows of `row_length` slots per micro-batch within `budget` tokens, a multiple
    of `data_parallel` (at least one row per device)."""
    return max(data_parallel, budget // row_length // data_parallel * data_parallel)


def pack(seqs: Sequences, budget: int, data_parallel: int = 1) -> PackedBatch:
    """Host side: the mini-batch `seqs` (all rows on this host) packed into micro-batches of at
    most `budget` tokens (see the module docstring)."""
    prompt_tokens, prompt_mask, comp_tokens, comp_mask = (
        np.asarray(jax.device_get(x))
        for x in (
            seqs.prompt_tokens_BP,
            seqs.prompt_mask_BP,
            seqs.completion_tokens_BT,
            seqs.sequence_mask_BT,  # observation tokens are in the sequence, off the loss
        )
    )
    M, P = prompt_tokens.shape
    L = P + comp_tokens.shape[1]
    R = rows_per_micro_batch(budget, L, data_parallel)
    K = -(-M // R)
    prompt_len = prompt_mask.sum(axis=1)
    comp_len = comp_mask.sum(axis=1)
    tokens, positions, segments, targets = (np.zeros((K * R, L), np.int32) for _ in range(4))
    micro, start = np.zeros(M, np.int32), np.zeros(M, np.int32)
    bins = first_fit_decreasing(prompt_len + comp_len, L)
    for b, rows in enumerate(bins):
        col = 0
        for segment, m in enumerate(rows, start=1):
            seq = np.concatenate([prompt_tokens[m][prompt_mask[m]], comp_tokens[m][comp_mask[m]]])
            n = len(seq)
            tokens[b, col : col + n] = seq
            targets[b, col : col + n - 1] = seq[1:]
            positions[b, col : col + n] = np.arange(n)
            segments[b, col : col + n] = segment
            micro[m] = b // R
            start[m] = (b % R) * L + col + prompt_len[m] - 1
            col += n
    shape = (K, R, L)
    return PackedBatch(
        tokens_KRL=jnp.asarray(tokens.reshape(shape)),
        positions_KRL=jnp.asarray(positions.reshape(shape)),
        segments_KRL=jnp.asarray(segments.reshape(shape)),
        targets_KRL=jnp.asarray(targets.reshape(shape)),
        micro_M=jnp.asarray(micro),
        start_M=jnp.asarray(start),
        num_micro=jnp.asarray(-(-len(bins) // R), jnp.int32),
    )


def real_share(packed: PackedBatch) -> tuple[int, int]:
    """(real tokens, token slots the packed update computes) of a packed mini-batch."""
    segments = np.asarray(jax.device_get(packed.segments_KRL))
    used = int(jax.device_get(packed.num_micro))
    return int((segments > 0).sum()), used * segments.shape[1] * segments.shape[2]


def packed_logprobs(
    params: Any,
    config: Any,
    packed: PackedBatch,
    k: jax.Array,
    temperature: float,
    *,
    remat: bool = False,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(logp_RL, entropy_RL) float32 of micro-batch k: at each slot, the logprob of the next
    token of its row and the entropy of that prediction (the sampler's definition)."""
    params = transformer.cast_for_compute(params, config)
    take = lambda x: parallel.constrain(x[k], ("batch", None), sharding)  # noqa: E731
    segments = take(packed.segments_KRL)
    h_RLD, _ = transformer.hidden_states(
        params,
        config,
        take(packed.tokens_KRL),
        take(packed.positions_KRL),
        segments > 0,
        remat=remat,
        sharding=sharding,
        segment_ids_BT=segments,
    )
    h_RLD = parallel.constrain(h_RLD, transformer.H_AXES, sharding)
    return logprobs_from_hidden(
        params, config, h_RLD, take(packed.targets_KRL), temperature, sharding=sharding
    )


def unpack(x_RL: jax.Array, start_M: jax.Array, length: int) -> jax.Array:
    """[M, length]: row m's completion values, read from the packed slots start_M[m] + t
    (clipped to the micro-batch; the caller masks rows of other micro-batches)."""
    flat = x_RL.reshape(-1)
    index = jnp.clip(start_M[:, None] + jnp.arange(length)[None, :], 0, flat.shape[0] - 1)
    return flat[index]
