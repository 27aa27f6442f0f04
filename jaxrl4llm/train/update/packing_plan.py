"""Host-side planning of packed micro-batches (train/update/packing.py's module docstring):
the units first-fit-decreasing places into rows, the row-length buckets, the modelled FLOPs of a
plan (`SlotFlops`) and the plan with the fewest (`plan`), and where each segment of a plan's
rows goes (`placements`, `row_segments`). Plain numpy: nothing here runs on a device."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from jaxrl4llm.models import transformer
from jaxrl4llm.models.attention import AttentionConfig
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.masks import row_block_visibility
from jaxrl4llm.sampling import buckets

MIN_ROW_LENGTH = 16
# Plans within this factor of the fewest modelled FLOPs: the one with the fewest micro-batches.
NEAR_FEWEST_FLOPS = 1.05


@dataclasses.dataclass(frozen=True)
class SlotFlops:
    """Modelled forward matmul FLOPs (transformer.flops_per_token): per token through the
    decoder layers, per unembedded position, per attended (query, key) pair. The backward
    pass multiplies every plan's count alike, so forward FLOPs compare plans. Which pairs a
    packed row attends follows the attention implementation its rows run (`attention`,
    resolved for the model's head_dim and compute dtype, float32 where the config names none):
    the chunked kernel computes only the block pairs masks.block_visibility marks (with the
    model's sliding `window`), the others every [L, L] pair."""

    layers: float
    unembed: float
    pair: float
    attention: AttentionConfig = AttentionConfig()
    head_dim: int = 64
    dtype: str = "float32"
    window: int | None = None

    @classmethod
    def of(cls, config: ModelConfig, attention: AttentionConfig = AttentionConfig()) -> SlotFlops:
        dtype = config.compute_dtype or "float32"
        per_token = transformer.flops_per_token(config)
        return cls(*per_token, attention, config.head_dim, dtype, config.sliding_window)

    def row_blocks(
        self, segments_NL: np.ndarray, prefixes_NL: np.ndarray, positions_NL: np.ndarray
    ) -> np.ndarray | None:
        """Host side: each packed row's visible block pairs [N, query blocks, key blocks]
        where its rows run the chunked kernel (the window counting `positions_NL`); None
        where attention computes all [L, L]."""
        L = segments_NL.shape[1]
        # Packed rows always pass prefix ids (packed_hidden_states).
        impl = self.attention.resolve(L, L, self.head_dim, self.dtype, True, prefixed=True)
        if impl != "chunked" or not self.attention.skip_blocks:
            return None
        b = min(self.attention.packed_block, L)
        ids = np.stack([segments_NL, prefixes_NL], axis=-1)
        return row_block_visibility(
            segments_NL, ids, 0, b, b, self.window, xp=np, positions_BS=positions_NL
        )

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


def placements(
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


def first_position(unit: Unit, member: int | None) -> int:
    """The RoPE position of a segment's first slot: 0 for a shared prefix or a whole
    sequence, the prefix's length for a member (it continues its prompt)."""
    return 0 if member is None else unit.prefix


def row_segments(
    unit_list: list[Unit],
    rows: list[list[int]],
    length: int,
    prompt_len: np.ndarray,
    comp_len: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The segment ids, prefix ids and positions [rows, length] of a plan's rows
    (PackedBatch's)."""
    segments, prefixes, positions = (np.zeros((len(rows), length), np.int32) for _ in range(3))
    for b, col, n, segment, prefix, unit, m in placements(unit_list, rows, prompt_len, comp_len):
        segments[b, col : col + n], prefixes[b, col : col + n] = segment, prefix
        positions[b, col : col + n] = first_position(unit, m) + np.arange(n)
    return segments, prefixes, positions
