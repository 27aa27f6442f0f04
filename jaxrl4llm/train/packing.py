"""Sequence packing for the update (--micro_batch_tokens=N): a mini-batch's (prompt,
completion) sequences concatenated into packed rows, micro-batches formed by a token budget.

The host packs (`pack`): each sequence is its real prompt tokens followed by its completion up
to its last real token (tokens inside the completion that are off its mask, e.g. a tool's
observation in a multi-turn trajectory, stay in the sequence as context: a completion's length
is its last set index + 1, never the mask's sum). A micro-batch is one packed row of L slots
per data-parallel device, so every device holds the same token budget (L <= N / devices).
L is a row-length bucket (2^k or 1.5 x 2^k, from the longest sequence's bucket up to
N / devices): of those within two octaves below the smaller of N / devices and the
mini-batch's tokens per device, the one that computes the fewest slots (`row_length`).
First-fit-decreasing (longest first, ties by row; deterministic) places the sequences into
rows of L slots. The device runs only the `num_micro` micro-batches that hold rows, so the
slots computed are num_micro x devices x L, whatever the mini-batch's padded shape. The
update's programs depend on (M, T, L) alone: a few row lengths per run (at most
2 log2(N / 16) + 2 in all), however the lengths vary.

On device (`packed_logprobs`) the rows run with segment ids (block-diagonal causal attention)
and positions restarting per sequence; `unpack` reads each sequence's completion logprobs back
into the mini-batch's [M, T] layout, where the loss is the padded update's, term for term.

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

from jaxrl4llm import parallel
from jaxrl4llm.models import transformer
from jaxrl4llm.sampling import buckets
from jaxrl4llm.train.logprobs import Sequences, logprobs_from_hidden

MIN_ROW_LENGTH = 16


class PackedBatch(flax.struct.PyTreeNode):
    """A mini-batch's sequences packed: up to K micro-batches of R rows (one per
    data-parallel device) x L slots; K = ceil(M / R), enough for one sequence per row."""

    tokens_KRL: jax.Array  # int32: the packed tokens, 0 past the row's last sequence
    positions_KRL: jax.Array  # int32: RoPE positions, restarting at each sequence
    segments_KRL: jax.Array  # int32: 1, 2, ... per sequence in its row; 0: no token
    targets_KRL: jax.Array  # int32: the token each slot predicts (the next one in its row)
    micro_M: jax.Array  # int32: the micro-batch of mini-batch row m
    start_M: jax.Array  # int32: flat slot in that micro-batch's [R * L] that predicts
    #                           row m's completion token 0
    num_micro: jax.Array  # int32 scalar: micro-batches that hold rows (the rest are empty)


def completion_lengths(mask_BT: np.ndarray) -> np.ndarray:
    """Host side: each row's completion length, its last real token's index + 1 (0 for an
    empty row); tokens off the mask before it (an observation inside a multi-turn
    completion) count."""
    mask_BT = np.asarray(mask_BT, bool)
    T = mask_BT.shape[1]
    last_from_end = np.argmax(mask_BT[:, ::-1], axis=1)
    return np.where(mask_BT.any(axis=1), T - last_from_end, 0)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, each summing to <= capacity): items longest first (ties by
    index), each into the first bin with room, else a new bin."""
    lengths = np.asarray(lengths)
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    room = np.zeros(len(lengths), np.int64)  # room[b] for the bins opened so far
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"A sequence of {n} tokens does not fit a packed row of {capacity}.")
        fits = np.flatnonzero(room[: len(bins)] >= n)
        if fits.size:
            bins[fits[0]].append(int(i))
            room[fits[0]] -= n
        else:
            room[len(bins)] = capacity - n
            bins.append([int(i)])
    return bins


def row_lengths(longest: int, cap: int) -> list[int]:
    """The row lengths a mini-batch whose longest sequence has `longest` tokens may pack
    into: 2^k and 1.5 * 2^k from the bucket of `longest` (at least MIN_ROW_LENGTH) below
    `cap`, then `cap` itself (the per-device budget, which the config check keeps >= every
    sequence)."""
    if longest > cap:
        raise ValueError(
            f"A sequence of {longest} tokens does not fit the per-device budget of {cap}."
        )
    lengths, L = [], buckets.two_per_octave(max(longest, MIN_ROW_LENGTH, 1))
    while L < cap:
        lengths.append(L)
        L = buckets.two_per_octave(L + 1)
    return lengths + [cap]


def row_length(lengths: np.ndarray, budget: int, data_parallel: int = 1) -> int:
    """L: of the `row_lengths` within two octaves below X = min(budget / data_parallel, the
    bucket of the mini-batch's tokens per device), the one whose first-fit-decreasing
    packing of `lengths` computes the fewest slots (micro-batches used x data_parallel x L;
    ties to the shorter row, whose block-diagonal attention costs less). Rows of at least
    X / 4 keep micro-batches large (a few per mini-batch, each near the budget), and the
    choice to a few lengths per run; the longest sequence's bucket when none is that short."""
    cap = budget // data_parallel
    candidates = row_lengths(int(np.max(lengths)), cap)
    total = int(np.sum(lengths))
    X = min(cap, buckets.two_per_octave(max(-(-total // data_parallel), 1)))
    best, best_slots = candidates[0], None
    for L in [L for L in candidates if X <= 4 * L and L <= X] or candidates[:1]:
        lower_bound = -(-total // (data_parallel * L)) * data_parallel * L
        if best_slots is not None and lower_bound >= best_slots:
            continue
        rows = len(first_fit_decreasing(lengths, L))
        slots = -(-rows // data_parallel) * data_parallel * L
        if best_slots is None or slots < best_slots:
            best, best_slots = L, slots
    return best


def pack(seqs: Sequences, budget: int, data_parallel: int = 1) -> PackedBatch:
    """Host side: the mini-batch `seqs` (all rows on this host) packed into micro-batches of
    `data_parallel` rows of `row_length` slots, at most `budget` tokens (module docstring)."""
    prompt_tokens, prompt_mask, comp_tokens, comp_mask = (
        np.asarray(jax.device_get(x))
        for x in (
            seqs.prompt_tokens_BP,
            seqs.prompt_mask_BP,
            seqs.completion_tokens_BT,
            seqs.sequence_mask_BT,  # observation tokens are in the sequence, off the loss
        )
    )
    M = prompt_tokens.shape[0]
    prompt_len, comp_len = prompt_mask.sum(axis=1), completion_lengths(comp_mask)
    R = data_parallel
    L = row_length(prompt_len + comp_len, budget, R)
    K = -(-M // R)
    tokens, positions, segments, targets = (np.zeros((K * R, L), np.int32) for _ in range(4))
    micro, start = np.zeros(M, np.int32), np.zeros(M, np.int32)
    bins = first_fit_decreasing(prompt_len + comp_len, L)
    for b, rows in enumerate(bins):
        col = 0
        for segment, m in enumerate(rows, start=1):
            seq = np.concatenate([prompt_tokens[m][prompt_mask[m]], comp_tokens[m][: comp_len[m]]])
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


def pack_on_mesh(seqs: Sequences, budget: int, mesh: Any) -> PackedBatch:
    """`pack` with one row per data-parallel device of `mesh` (None: one device), each
    micro-batch's rows placed over those devices (equal token budgets per device)."""
    if mesh is None:
        return pack(seqs, budget)
    packed = pack(seqs, budget, parallel.data_parallel_size(mesh))
    sharding = parallel.ActivationSharding(mesh)
    # [K, R, L]: each micro-batch's rows over the data-parallel devices, one row each.
    return jax.tree.map(
        lambda x: jax.device_put(x, sharding.named((None, "batch", None)[: x.ndim], x.shape)),
        packed,
    )


def for_update(batch: Any) -> Any:
    """The step.UpdateBatch the packed update takes beside its PackedBatch: the prompts cut
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
    h_RLD = packed_hidden_states(params, config, packed, k, remat=remat, sharding=sharding)
    targets = parallel.constrain(packed.targets_KRL[k], ("batch", None), sharding)
    return logprobs_from_hidden(params, config, h_RLD, targets, temperature, sharding=sharding)


def packed_hidden_states(
    params: Any,
    config: Any,
    packed: PackedBatch,
    k: jax.Array,
    *,
    remat: bool = False,
    sharding: parallel.ActivationSharding | None = None,
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
    )
    return parallel.constrain(h_RLD, transformer.H_AXES, sharding)


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
    config: Any,
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
