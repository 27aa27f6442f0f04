"""Sequence packing for the update (--micro_batch_tokens=N): a mini-batch's (prompt,
completion) sequences concatenated into packed rows, micro-batches formed by a token budget.

The host packs (`pack`). A sequence is its real prompt tokens followed by its completion up to
its last real token (a tool's observation in a multi-turn trajectory, on observation_mask_BT,
stays in the sequence as context, off the loss mask; a completion with a gap in its sequence
mask is refused, since slots and positions advance together). With shared prompts (the layout's
share_prompts, the default) the rows whose real prompt tokens are equal form a group, packed
as one unit: the prompt less its last token once (a prefix segment), then one segment per
completion holding the prompt's last token and the completion, its positions continuing from
the prompt's. A completion's segment sees its group's prefix segment and, causally, itself
(attention.py's prefix segments): the padded shared-prefix forward's attention and positions
exactly, and each completion's first token is predicted in its own segment. A group longer
than a row is split by first-fit-decreasing into sub-groups, each with its own copy of the
prefix (still exact). Without shared prompts each sequence is its own unit.

A micro-batch is R rows of L slots on each data-parallel device ([devices x R, L]; R x L <=
N / devices, R a power of two, L a row-length bucket: 2^k or 1.5 x 2^k from the longest
sequence's bucket up to N / devices). First-fit-decreasing (longest first, ties by order;
deterministic) places the units into rows of L. (R, L) is the plan with the fewest modelled
FLOPs (`SlotFlops`: matmul FLOPs per slot and attention score FLOPs: L^2 per row where the
rows run full attention, else the block pairs the chunked kernel computes, which skips the
blocks no query of a block can see), and within 5% of those the fewest micro-batches (each
also reads every weight once). The device
runs only the `num_micro` micro-batches that hold rows. The update's programs depend on
(M, T, R, L) alone: a few per run, however the lengths vary.

On device (`packed_logprobs`) the rows run with segment and prefix ids; `unpack` reads each
sequence's completion logprobs back into the mini-batch's [M, T] layout, where the loss is the
padded update's, term for term. The update and the rollout's teacher-forced passes run packed
only where the packed plan's modelled FLOPs are below the padded plan's (`SlotFlops.padded`).

The rollout's teacher-forced passes (reference and old logprobs: `logprobs_jit`; PPO's values:
critic.packed_values_jit) run the whole batch packed the same way (`pack_on_mesh`), one
micro-batch after another, and `read_back` lays their per-slot values out as the padded
passes' [B, T] arrays.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models import decoder_layer, transformer
from jaxrl4llm.models.attention import AttentionConfig
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.train.update.logprobs import Sequences, logprobs_from_hidden
from jaxrl4llm.train.update.packing_plan import (
    Plan,
    completion_lengths,
    first_position,
    placements,
    plan,
    prompt_groups,
)
from jaxrl4llm.train.update.packing_plan import (
    SlotFlops as SlotFlops,  # packing.SlotFlops for callers
)

# PackedBatch's [K, R, L] slot arrays.
SLOT_FIELDS = ("tokens_KRL", "positions_KRL", "segments_KRL", "prefixes_KRL", "targets_KRL")


class PackedBatch(flax.struct.PyTreeNode):
    """A mini-batch's sequences packed: K micro-batches of R rows (R / data-parallel devices
    rows per device) x L slots; K = ceil(M / R), enough for one sequence per row."""

    tokens_KRL: jax.Array  # int32: the packed tokens, 0 past the row's last sequence
    positions_KRL: jax.Array  # int32: RoPE positions, restarting at each unit
    segments_KRL: jax.Array  # int32: 1, 2, ... per segment in its row; 0: no token
    prefixes_KRL: jax.Array  # int32: the segment a slot also sees (its group's shared
    #                                prompt; its own segment where it has none)
    targets_KRL: jax.Array  # int32: the token each slot predicts (the next one in its segment)
    micro_M: jax.Array  # int32: the micro-batch of mini-batch row m
    start_M: jax.Array  # int32: flat slot in that micro-batch's [R * L] that predicts
    #                           row m's completion token 0
    num_micro: jax.Array  # int32 scalar: micro-batches that hold rows (the rest are empty)


def _host_sequences(seqs: Sequences) -> tuple[np.ndarray, ...]:
    """Host copies of the prompt tokens and mask, completion tokens and sequence mask."""
    arrays = (
        seqs.prompt_tokens_BP,
        seqs.prompt_mask_BP,
        seqs.completion_tokens_BT,
        seqs.sequence_mask_BT,  # observation tokens are in the sequence, off the loss
    )
    return tuple(np.asarray(x) for x in jax.device_get(arrays))  # one transfer for all four


def _lay_out(
    chosen: Plan,
    prompt_tokens: np.ndarray,
    prompt_mask: np.ndarray,
    comp_tokens: np.ndarray,
    lengths: tuple[np.ndarray, np.ndarray],
    R: int,
    K: int,
) -> tuple[np.ndarray, ...]:
    """The plan's rows written out: tokens, positions, segments, prefixes, targets [K * R, L],
    and each mini-batch row's micro-batch and first-prediction slot [M]. `lengths`: each
    row's prompt and completion lengths."""
    L, M = chosen.length, prompt_tokens.shape[0]
    tokens, positions, segments, prefixes, targets = (
        np.zeros((K * R, L), np.int32) for _ in range(5)
    )
    micro, start = np.zeros(M, np.int32), np.zeros(M, np.int32)
    comp_len = lengths[1]
    for b, col, n, segment, prefix, unit, m in placements(chosen.units, chosen.rows, *lengths):
        prompt = prompt_tokens[unit.members[0]][prompt_mask[unit.members[0]]]
        if m is None:
            seq = prompt[:-1]
        else:
            own = prompt[unit.prefix :]  # the prompt's last token, or all of it
            seq = np.concatenate([own, comp_tokens[m][: comp_len[m]]])
            micro[m] = b // R
            start[m] = (b % R) * L + col + len(own) - 1
        tokens[b, col : col + n] = seq
        targets[b, col : col + n - 1] = seq[1:]
        positions[b, col : col + n] = first_position(unit, m) + np.arange(n)
        segments[b, col : col + n], prefixes[b, col : col + n] = segment, prefix
    return tokens, positions, segments, prefixes, targets, micro, start


def _check_contiguous(sequence_mask_MT: np.ndarray, comp_len: np.ndarray) -> None:
    """A completion with a gap (a token off its sequence mask before its last one) would
    pack with positions the padded passes do not give it (Sequences' docstring)."""
    contiguous_MT = np.arange(sequence_mask_MT.shape[1])[None] < comp_len[:, None]
    gaps = np.flatnonzero((sequence_mask_MT != contiguous_MT).any(axis=1))
    if gaps.size:
        raise ValueError(
            f"pack: completion rows {gaps[:8].tolist()} have tokens off sequence_mask_BT "
            "before their last real token; mark tokens the loss skips but the model reads "
            "(a tool's observation) in observation_mask_BT."
        )


def pack(
    seqs: Sequences,
    budget: int,
    data_parallel: int = 1,
    *,
    flops: SlotFlops,
    share_prompts: bool = True,
) -> PackedBatch:
    """Host side: the mini-batch `seqs` (all rows on this host) packed into micro-batches of
    `data_parallel` x R rows of L slots, at most `budget` tokens, by `plan` (module
    docstring); `share_prompts`: rows with equal prompts share one copy of it."""
    prompt_tokens, prompt_mask, comp_tokens, comp_mask = _host_sequences(seqs)
    M = prompt_tokens.shape[0]
    prompt_len, comp_len = prompt_mask.sum(axis=1), completion_lengths(comp_mask)
    _check_contiguous(comp_mask, comp_len)
    groups = prompt_groups(prompt_tokens, prompt_mask) if share_prompts else [[m] for m in range(M)]
    chosen = plan(groups, prompt_len, comp_len, budget, data_parallel, flops)
    R = data_parallel * chosen.rows_per_device
    K = -(-M // R)
    tokens, positions, segments, prefixes, targets, micro, start = _lay_out(
        chosen, prompt_tokens, prompt_mask, comp_tokens, (prompt_len, comp_len), R, K
    )
    shape = (K, R, chosen.length)
    return PackedBatch(
        tokens_KRL=jnp.asarray(tokens.reshape(shape)),
        positions_KRL=jnp.asarray(positions.reshape(shape)),
        segments_KRL=jnp.asarray(segments.reshape(shape)),
        prefixes_KRL=jnp.asarray(prefixes.reshape(shape)),
        targets_KRL=jnp.asarray(targets.reshape(shape)),
        micro_M=jnp.asarray(micro),
        start_M=jnp.asarray(start),
        num_micro=jnp.asarray(chosen.num_micro, jnp.int32),
    )


def pack_on_mesh(
    seqs: Sequences, budget: int, mesh: Mesh | None, *, flops: SlotFlops, share_prompts: bool = True
) -> PackedBatch:
    """`pack` for the data-parallel devices of `mesh` (None: one device), each micro-batch's
    rows placed over those devices, R each (equal token budgets per device)."""
    if mesh is None:
        return pack(seqs, budget, flops=flops, share_prompts=share_prompts)
    packed = pack(
        seqs,
        budget,
        parallel.data_parallel_size(mesh),
        flops=flops,
        share_prompts=share_prompts,
    )
    sharding = parallel.ActivationSharding(mesh)
    # [K, R, L]: each micro-batch's rows over the data-parallel devices.
    return jax.tree.map(
        lambda x: jax.device_put(x, sharding.named((None, "batch", None)[: x.ndim], x.shape)),
        packed,
    )


def for_update(batch: Any) -> Any:
    """The batch.UpdateBatch the packed update takes beside its PackedBatch: the prompts cut
    to no columns (the packed rows hold them), so the compiled update does not depend on
    the rollout's prompt bucket."""
    seqs = batch.seqs
    M = seqs.prompt_tokens_BP.shape[0]
    return batch.replace(
        seqs=seqs.replace(
            prompt_tokens_BP=jnp.zeros((M, 0), seqs.prompt_tokens_BP.dtype),
            prompt_mask_BP=jnp.zeros((M, 0), bool),
        )
    )


def real_share(packed: PackedBatch) -> tuple[int, int]:
    """(real tokens, token slots the packed update computes) of a packed mini-batch."""
    segments = np.asarray(jax.device_get(packed.segments_KRL))
    used = int(jax.device_get(packed.num_micro))
    return int((segments > 0).sum()), used * segments.shape[1] * segments.shape[2]


def packed_flops(packed: PackedBatch, flops: SlotFlops) -> float:
    """The modelled forward FLOPs of the micro-batches that hold rows."""
    _, R, L = packed.segments_KRL.shape
    used = int(jax.device_get(packed.num_micro))
    segments, prefixes, positions = (
        np.asarray(x[:used]).reshape(used * R, L)
        for x in jax.device_get((packed.segments_KRL, packed.prefixes_KRL, packed.positions_KRL))
    )
    return flops.packed(used, R, L, flops.row_blocks(segments, prefixes, positions))


def packed_logprobs(
    params: Any,
    config: ModelConfig,
    packed: PackedBatch,
    k: jax.Array,
    temperature: float,
    *,
    remat: bool = False,
    sharding: parallel.ActivationSharding | None = None,
    attention: AttentionConfig = AttentionConfig(),
) -> tuple[jax.Array, jax.Array]:
    """(logp_RL, entropy_RL) float32 of micro-batch k: at each slot, the logprob of the next
    token of its row and the entropy of that prediction (the sampler's definition)."""
    params = transformer.cast_for_compute(params, config)
    h_RLD = packed_hidden_states(
        params, config, packed, k, remat=remat, sharding=sharding, attention=attention
    )
    targets = parallel.constrain(packed.targets_KRL[k], ("batch", None), sharding)
    return logprobs_from_hidden(params, config, h_RLD, targets, temperature, sharding=sharding)


def packed_hidden_states(
    params: Any,
    config: ModelConfig,
    packed: PackedBatch,
    k: jax.Array,
    *,
    remat: bool = False,
    sharding: parallel.ActivationSharding | None = None,
    attention: AttentionConfig = AttentionConfig(),
) -> jax.Array:
    """h_RLD of micro-batch k (`params` already cast for compute): the last layer's hidden
    state (after the final norm) at each slot, the state that predicts the slot's target."""
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
        prefix_ids_BT=take(packed.prefixes_KRL),
        attention=attention,
    )
    return parallel.constrain(h_RLD, decoder_layer.H_AXES, sharding)


def read_back(
    per_micro: Callable[[jax.Array], jax.Array],
    packed: PackedBatch,
    mask_MT: jax.Array,
    sharding: parallel.ActivationSharding | None = None,
) -> jax.Array:
    """[M, T] float32, 0 off `mask_MT`: `per_micro(k)` (micro-batch k's [R, L] values, one
    per slot) read back per sequence, over the micro-batches that hold rows, one at a time
    (activations sized by the token budget)."""
    M, T = mask_MT.shape
    rows = lambda x: parallel.constrain(x, ("batch", None), sharding)  # noqa: E731

    def body(k: jax.Array, out_MT: jax.Array) -> jax.Array:
        mine_M1 = (packed.micro_M == k)[:, None]
        return rows(jnp.where(mine_M1, unpack(per_micro(k), packed.start_M, T), out_MT))

    out_MT = jax.lax.fori_loop(0, packed.num_micro, body, rows(jnp.zeros((M, T), jnp.float32)))
    return jnp.where(mask_MT, out_MT, 0.0)


@functools.partial(jax.jit, static_argnames=("config", "temperature", "sharding"))
def logprobs_jit(
    params: Any,
    config: ModelConfig,
    packed: PackedBatch,
    mask_MT: jax.Array,
    temperature: float,
    sharding: parallel.ActivationSharding | None = None,
) -> jax.Array:
    """The rollout's old-policy or reference logprobs [M, T] of the sequences `packed` holds,
    0 off `mask_MT` (the completion mask): logprobs.completion_logprobs_jit's values, computed
    on the packed rows. Its programs depend on (K, R, L, M, T) alone."""
    params = transformer.cast_for_compute(params, config)  # once, not once per micro-batch
    return read_back(
        lambda k: packed_logprobs(params, config, packed, k, temperature, sharding=sharding)[0],
        packed,
        mask_MT,
        sharding,
    )


def unpack(x_RL: jax.Array, start_M: jax.Array, length: int) -> jax.Array:
    """[M, length]: row m's completion values, read from the packed slots start_M[m] + t
    (clipped to the micro-batch; the caller masks rows of other micro-batches)."""
    flat = x_RL.reshape(-1)
    index = jnp.clip(start_M[:, None] + jnp.arange(length)[None, :], 0, flat.shape[0] - 1)
    return flat[index]
