"""Sequence packing for the update (--micro_batch_tokens=N): a mini-batch's (prompt,
completion) sequences concatenated into packed rows, micro-batches formed by a token budget.

The host packs (`pack`). A sequence is its real prompt tokens followed by its completion up to
its last real token (tokens inside the completion that are off its mask, e.g. a tool's
observation in a multi-turn trajectory, stay in the sequence as context: a completion's length
is its last set index + 1, never the mask's sum). With shared prompts (the layout's
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

import dataclasses
import functools
from typing import Any, Callable, Iterator

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import parallel
from jaxrl4llm.models import decoder_layer, transformer
from jaxrl4llm.models.attention import AttentionConfig, row_block_visibility
from jaxrl4llm.sampling import buckets
from jaxrl4llm.train.logprobs import Sequences, logprobs_from_hidden

MIN_ROW_LENGTH = 16
# Plans within this factor of the fewest modelled FLOPs: the one with the fewest micro-batches.
NEAR_FEWEST_FLOPS = 1.05


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


@dataclasses.dataclass(frozen=True)
class SlotFlops:
    """Modelled forward matmul FLOPs (transformer.flops_per_token): per token through the
    decoder layers, per unembedded position, per attended (query, key) pair. The backward
    pass multiplies every plan's count alike, so forward FLOPs compare plans. Which pairs a
    packed row attends follows the attention implementation its rows run (`attention`,
    resolved for the model's head_dim and compute dtype): the chunked kernel computes only the
    block pairs attention.block_visibility marks, the others every [L, L] pair."""

    layers: float
    unembed: float
    pair: float
    attention: AttentionConfig = AttentionConfig()
    head_dim: int = 64
    dtype: str = "float32"

    @classmethod
    def of(cls, config: Any, attention: AttentionConfig = AttentionConfig()) -> SlotFlops:
        dtype = config.compute_dtype or "float32"
        return cls(*transformer.flops_per_token(config), attention, config.head_dim, dtype)

    def row_blocks(self, segments_NL: np.ndarray, prefixes_NL: np.ndarray) -> np.ndarray | None:
        """Host side: each packed row's visible block pairs [N, query blocks, key blocks]
        where its rows run the chunked kernel; None where attention computes all [L, L]."""
        L = segments_NL.shape[1]
        impl = self.attention.resolve(L, L, self.head_dim, self.dtype, segmented=True)
        if impl != "chunked" or not self.attention.skip_blocks:
            return None
        b = min(self.attention.packed_block, L)
        ids = np.stack([segments_NL, prefixes_NL], axis=-1)
        return row_block_visibility(segments_NL, ids, 0, b, b, None, xp=np)

    def packed(
        self, micro: int, rows: int, length: int, row_blocks: np.ndarray | None = None
    ) -> float:
        """`micro` micro-batches of `rows` packed rows of `length` slots: every slot
        unembedded; attention over every row's [L, L] pairs, or with `row_blocks` (the first
        rows' `row_blocks`, the rest empty) over the block pairs some row of a micro-batch
        needs, for each of its rows (the kernel runs a block pair for the whole batch)."""
        pairs = float(micro * rows * length * length)
        if row_blocks is not None:
            n, n_q, n_k = row_blocks.shape
            needed = np.zeros((micro * rows, n_q, n_k), bool)
            needed[:n] = row_blocks
            blocks = needed.reshape(micro, rows, n_q, n_k).any(axis=1).sum()
            pairs = float(blocks * rows * min(self.attention.packed_block, length) ** 2)
        return micro * rows * length * (self.layers + self.unembed) + pairs * self.pair

    def padded(self, rows: int, prompt: int, completion: int, prompt_group: int) -> float:
        """The padded pass over `rows` rows of a `prompt`-column prompt block and a
        `completion`-column completion (logprobs.completion_hidden_states): with
        `prompt_group` > 1 each group's prompt once, its completions attending to prompt +
        completion keys; else each row's prompt + completion less its last token."""
        P, T = prompt, completion
        unembedded = rows * T * self.unembed
        if prompt_group > 1:
            prompts = rows // prompt_group * (P * self.layers + P * P * self.pair)
            return prompts + rows * T * (self.layers + (P + T) * self.pair) + unembedded
        n = P + T - 1
        return rows * (n * self.layers + n * n * self.pair) + unembedded


@dataclasses.dataclass(frozen=True)
class Unit:
    """What first-fit-decreasing places in a row: a shared prompt's first `prefix` tokens
    (0: none) and the sequences of `members` (mini-batch rows), `size` slots in all."""

    prefix: int
    members: tuple[int, ...]
    size: int


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


def prompt_groups(prompt_tokens_BP: np.ndarray, prompt_mask_BP: np.ndarray) -> list[list[int]]:
    """Host side: the rows whose real prompt tokens are equal, in order of first appearance
    (equal prompts have equal keys and values, so one copy serves every row of a group)."""
    groups: dict[bytes, list[int]] = {}
    for m in range(prompt_tokens_BP.shape[0]):
        key = np.asarray(prompt_tokens_BP[m][prompt_mask_BP[m]], np.int64).tobytes()
        groups.setdefault(key, []).append(m)
    return list(groups.values())


def units(
    groups: list[list[int]], prompt_len: np.ndarray, comp_len: np.ndarray, length: int
) -> list[Unit]:
    """The units of `groups` for rows of `length` slots: a group of several rows whose
    prompt has >= 2 tokens shares its prompt (split into sub-groups, each with its own
    prefix, where it does not fit one row); every other row is a unit of its own."""
    out: list[Unit] = []
    for rows in groups:
        p = int(prompt_len[rows[0]])
        if len(rows) == 1 or p < 2:
            out.extend(Unit(0, (m,), int(prompt_len[m] + comp_len[m])) for m in rows)
            continue
        member = 1 + comp_len[rows]  # the prompt's last token + the completion
        for part in first_fit_decreasing(member, length - (p - 1)):
            out.append(Unit(p - 1, tuple(rows[i] for i in part), p - 1 + int(member[part].sum())))
    return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """A packing: rows of `length` slots, `rows_per_device` of them per device in a
    micro-batch, `rows` (lists of unit indices into `units`), modelled `flops`."""

    length: int
    rows_per_device: int
    units: list[Unit]
    rows: list[list[int]]
    num_micro: int
    flops: float


def plan(
    groups: list[list[int]],
    prompt_len: np.ndarray,
    comp_len: np.ndarray,
    budget: int,
    data_parallel: int,
    flops: SlotFlops,
) -> Plan:
    """The (R, L) packing with the fewest modelled FLOPs; within NEAR_FEWEST_FLOPS of
    those, the fewest micro-batches, then the fewest FLOPs, then the shorter row."""
    cap = budget // data_parallel
    plans = []
    for L in row_lengths(int(np.max(prompt_len + comp_len)), cap):
        unit_list = units(groups, prompt_len, comp_len, L)
        rows = first_fit_decreasing(np.array([u.size for u in unit_list]), L)
        blocks = flops.row_blocks(*row_segments(unit_list, rows, L, prompt_len, comp_len))
        R = 1
        while R * L <= cap:
            per_micro = data_parallel * R
            num_micro = -(-len(rows) // per_micro)
            cost = flops.packed(num_micro, per_micro, L, blocks)
            plans.append(Plan(L, R, unit_list, rows, num_micro, cost))
            R *= 2
    fewest = min(p.flops for p in plans)
    near = [p for p in plans if p.flops <= NEAR_FEWEST_FLOPS * fewest]
    return min(near, key=lambda p: (p.num_micro, p.flops, p.length))


def _host_sequences(seqs: Sequences) -> tuple[np.ndarray, ...]:
    """Host copies of the prompt tokens and mask, completion tokens and sequence mask."""
    arrays = (
        seqs.prompt_tokens_BP,
        seqs.prompt_mask_BP,
        seqs.completion_tokens_BT,
        seqs.sequence_mask_BT,  # observation tokens are in the sequence, off the loss
    )
    return tuple(np.asarray(x) for x in jax.device_get(arrays))  # one transfer for all four


def _placements(
    unit_list: list[Unit], rows: list[list[int]], prompt_len: np.ndarray, comp_len: np.ndarray
) -> Iterator[tuple[int, int, int, int, int, Unit, int | None]]:
    """Where each segment of a plan's rows goes: (row, first slot, slots, segment id, the
    segment it also sees, the unit, its member m or None for the unit's shared prefix)."""
    for b, unit_indices in enumerate(rows):
        col, segment = 0, 0
        for unit in (unit_list[u] for u in unit_indices):
            shared = 0
            if unit.prefix:  # the shared prompt less its last token; every member sees it
                segment = shared = segment + 1
                yield b, col, unit.prefix, segment, segment, unit, None
                col += unit.prefix
            for m in unit.members:
                # The prompt's last token (all of it without a prefix) and the completion.
                n = int(prompt_len[m]) - unit.prefix + int(comp_len[m])
                segment += 1
                yield b, col, n, segment, shared or segment, unit, m
                col += n


def row_segments(
    unit_list: list[Unit],
    rows: list[list[int]],
    length: int,
    prompt_len: np.ndarray,
    comp_len: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The segment ids and prefix ids [rows, length] of a plan's rows (PackedBatch's)."""
    segments, prefixes = (np.zeros((len(rows), length), np.int32) for _ in range(2))
    for b, col, n, segment, prefix, _, _ in _placements(unit_list, rows, prompt_len, comp_len):
        segments[b, col : col + n], prefixes[b, col : col + n] = segment, prefix
    return segments, prefixes


def _lay_out(
    chosen: Plan,
    prompt_tokens: np.ndarray,
    prompt_mask: np.ndarray,
    comp_tokens: np.ndarray,
    comp_len: np.ndarray,
    R: int,
    K: int,
) -> tuple[np.ndarray, ...]:
    """The plan's rows written out: tokens, positions, segments, prefixes, targets [K * R, L],
    and each mini-batch row's micro-batch and first-prediction slot [M]."""
    L, M = chosen.length, prompt_tokens.shape[0]
    prompt_len = prompt_mask.sum(axis=1)
    tokens, positions, targets = (np.zeros((K * R, L), np.int32) for _ in range(3))
    segments, prefixes = (np.zeros((K * R, L), np.int32) for _ in range(2))
    n_rows = len(chosen.rows)
    segments[:n_rows], prefixes[:n_rows] = row_segments(
        chosen.units, chosen.rows, L, prompt_len, comp_len
    )
    micro, start = np.zeros(M, np.int32), np.zeros(M, np.int32)
    placed = _placements(chosen.units, chosen.rows, prompt_len, comp_len)
    for b, col, n, _, _, unit, m in placed:
        prompt = prompt_tokens[unit.members[0]][prompt_mask[unit.members[0]]]
        if m is None:
            seq, first_position = prompt[:-1], 0
        else:
            own = prompt[unit.prefix :]  # the prompt's last token, or all of it
            seq, first_position = np.concatenate([own, comp_tokens[m][: comp_len[m]]]), unit.prefix
            micro[m] = b // R
            start[m] = (b % R) * L + col + len(own) - 1
        tokens[b, col : col + n] = seq
        targets[b, col : col + n - 1] = seq[1:]
        positions[b, col : col + n] = first_position + np.arange(n)
    return tokens, positions, segments, prefixes, targets, micro, start


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
    groups = prompt_groups(prompt_tokens, prompt_mask) if share_prompts else [[m] for m in range(M)]
    chosen = plan(groups, prompt_len, comp_len, budget, data_parallel, flops)
    R = data_parallel * chosen.rows_per_device
    K = -(-M // R)
    tokens, positions, segments, prefixes, targets, micro, start = _lay_out(
        chosen, prompt_tokens, prompt_mask, comp_tokens, comp_len, R, K
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
    seqs: Sequences, budget: int, mesh: Any, *, flops: SlotFlops, share_prompts: bool = True
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


def packed_flops(packed: PackedBatch, flops: SlotFlops) -> float:
    """The modelled forward FLOPs of the micro-batches that hold rows."""
    _, R, L = packed.segments_KRL.shape
    used = int(jax.device_get(packed.num_micro))
    segments, prefixes = (
        np.asarray(x[:used]).reshape(used * R, L)
        for x in jax.device_get((packed.segments_KRL, packed.prefixes_KRL))
    )
    return flops.packed(used, R, L, flops.row_blocks(segments, prefixes))


def packed_logprobs(
    params: Any,
    config: Any,
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
    config: Any,
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
