"""The update's mini-batches of one rollout batch: PPO epochs, row order and each
mini-batch's completion length (a pure function of the batch and the config)."""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import buckets
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.update import packing
from jaxrl4llm.train.update.batch import UpdateBatch, length_classes, micro_batch_order


class PackingChoice(NamedTuple):
    """--micro_batch_tokens: the packed mini-batch where its plan's modelled FLOPs are below
    the padded update's (else None: it runs padded) and that FLOP ratio (packed / padded)."""

    batch: packing.PackedBatch | None
    flops_ratio: float


class MiniBatch(NamedTuple):
    """One optimizer update's rows. `length_classes`: the completion lengths its
    micro-batches may run at (() = the mini-batch's own length); `tokens`: (real completion
    tokens, completion positions the update computes), None where rows are not all on this
    host; `packing` (--micro_batch_tokens): the packing choice, and where it packed, `tokens`
    counts real prompt + completion tokens against the packed slots the update computes."""

    batch: UpdateBatch
    length_classes: tuple[int, ...]
    tokens: tuple[int, int] | None
    packing: PackingChoice | None = None


def minibatches(
    batch: UpdateBatch,
    config: TrainConfig,
    key: jax.Array,
    mesh: Mesh | None,
    model_config: ModelConfig | None = None,
) -> Iterator[MiniBatch]:
    """Yields every PPO epoch's mini-batches (rows reshuffled per epoch when split).

    A mini-batch runs on its own longest completion, bucketed: the rollout's batch is already
    cut to the longest row of all, a mini-batch of fewer rows is often shorter still (the
    columns cut are padding, so the update is unchanged). With --micro_batch_length_classes
    > 1 its rows are also ordered so that each micro-batch holds rows of similar length
    (batch.micro_batch_order; rows leave their prompt groups), and each micro-batch runs at
    the first of the length classes that holds it (the update's sum over micro-batches does
    not depend on the order). With --micro_batch_tokens the mini-batch is packed instead
    (train/update/packing.py), uncut, where that models fewer FLOPs on `model_config` than its
    padded update."""
    B, M = config.batch_size, config.mini_batch
    num_micro = M // config.micro_batch
    mask_BT = batch.seqs.completion_mask_BT
    # Multi-host: the rows are global and not all here; only the rollout's cut applies.
    lengths_B = (
        np.asarray(jax.device_get(batch.seqs.lengths_B())) if mask_BT.is_fully_addressable else None
    )
    sort = lengths_B is not None and sorts_by_length(config)
    reshuffle = config.reshuffles_rows
    # Sorted rows leave their prompt groups: a group's rows differ in length (on SmolLM2 at
    # T = 1 nearly every group of 4 holds a row near the limit), and the columns saved by
    # sorting rows outweigh running each prompt once per group (bench_rollout.py).
    layout = batch.layout.shuffled() if reshuffle or sort else batch.layout
    epochs = config.update.ppo_epochs if reshuffle else 1
    for epoch in range(epochs):
        order = (
            np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), B))
            if reshuffle
            else np.arange(B)
        )
        for start in range(0, B, M):
            rows = order[start : start + M]
            if sort:
                assert lengths_B is not None  # sort implies it
                rows = rows[micro_batch_order(lengths_B[rows], num_micro)]
            mini_batch = (
                batch if not reshuffle and not sort else _take_rows(batch, rows, layout, mesh)
            )
            if lengths_B is None:
                yield MiniBatch(mini_batch, (), None)
                continue
            lengths = lengths_B[rows]
            if config.update.micro_batch_tokens:
                assert model_config is not None, "packing compares FLOPs on the model's shapes"
                yield _packed_or_padded(
                    mini_batch, lengths, config, num_micro, sort, mesh, model_config
                )
                continue
            yield _cut_to_length(mini_batch, lengths, config, num_micro, sort)


def _take_rows(batch: UpdateBatch, rows: np.ndarray, layout: Any, mesh: Mesh | None) -> UpdateBatch:
    mini_batch = jax.tree.map(lambda x: x[rows], batch).replace(layout=layout)
    if mesh is None:
        return mini_batch
    return jax.tree.map(
        lambda x: jax.device_put(x, parallel.batch_sharding(mesh, x.ndim)), mini_batch
    )


def _cut_to_length(
    mini_batch: UpdateBatch, lengths: np.ndarray, config: TrainConfig, num_micro: int, sort: bool
) -> MiniBatch:
    """The mini-batch cut to its longest completion (bucketed), with its length classes and
    (real tokens, computed positions)."""
    T = _cut_length(mini_batch, lengths, config)
    mini_batch = mini_batch.trimmed(T)
    classes = length_classes(T, config.update.micro_batch_length_classes) if sort else ()
    # Micro-batch k holds the rows k, k + num_micro, ... (step.accumulate).
    longest_k = lengths.reshape(-1, num_micro).max(axis=0)
    runs_at = (
        np.asarray(classes)[np.searchsorted(classes, longest_k)]
        if classes
        else np.full(num_micro, T)
    )
    rows = len(lengths)
    return MiniBatch(
        mini_batch, classes, (int(lengths.sum()), int(runs_at.sum()) * (rows // num_micro))
    )


def _cut_length(mini_batch: UpdateBatch, lengths: np.ndarray, config: TrainConfig) -> int:
    """The completion columns a padded update of these rows runs: the longest row, bucketed,
    at most the batch's own width."""
    longest = buckets.bucket_completion_length(int(lengths.max()), config.rollout.max_new_tokens)
    return min(longest, mini_batch.seqs.completion_mask_BT.shape[1])


def _packed_or_padded(
    mini_batch: UpdateBatch,
    lengths: np.ndarray,
    config: TrainConfig,
    num_micro: int,
    sort: bool,
    mesh: Mesh | None,
    model_config: ModelConfig,
) -> MiniBatch:
    """The mini-batch with its sequences packed (not cut: the packed rows hold no padding,
    and the uncut [M, T] layout keeps the update's programs few) where its modelled FLOPs
    are below the padded update's (the mini-batch cut to its longest completion, each
    group's prompt once where the update shares it); else the padded one, cut only then.
    Both carry the choice and the FLOP ratio."""
    flops = packing.SlotFlops.of(model_config)
    layout = mini_batch.layout
    packed = packing.pack_on_mesh(
        mini_batch.seqs,
        config.update.micro_batch_tokens,
        mesh,
        flops=flops,
        share_prompts=layout.share_prompts,
    )
    seqs = mini_batch.seqs
    M, T = seqs.completion_tokens_BT.shape[0], _cut_length(mini_batch, lengths, config)
    data_parallel = 1 if mesh is None else parallel.data_parallel_size(mesh)
    padded_flops = flops.padded(
        M, seqs.prompt_tokens_BP.shape[1], T, layout.prompt_group(M, num_micro, data_parallel)
    )
    ratio = packing.packed_flops(packed, flops) / padded_flops
    if ratio < 1:
        return MiniBatch(mini_batch, (), packing.real_share(packed), PackingChoice(packed, ratio))
    padded = _cut_to_length(mini_batch, lengths, config, num_micro, sort)
    return padded._replace(packing=PackingChoice(None, ratio))


def sorts_by_length(config: TrainConfig) -> bool:
    """Whether a mini-batch's rows are ordered by length into micro-batches of similar
    length (--micro_batch_length_classes > 1 and several micro-batches; one host only)."""
    num_micro = config.mini_batch // config.micro_batch
    return num_micro > 1 and config.update.micro_batch_length_classes > 1
