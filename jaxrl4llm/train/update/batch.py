"""The update's batch: what a mini-batch of the rollout holds (`UpdateBatch`, rows aligned)
and how its rows order into micro-batches of similar length (`length_classes`,
`micro_batch_order`); train/update/step.py runs the jitted update on it."""

from __future__ import annotations

import flax.struct
import jax
import numpy as np

from jaxrl4llm.sampling import trim
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.train.update.logprobs import Sequences


class UpdateBatch(flax.struct.PyTreeNode):
    """What the update needs of a rollout, rows aligned: [M, ...] for a mini-batch of M."""

    seqs: Sequences
    advantages: jax.Array  # [M] or [M, T] float32 (0 on rejected rows)
    keep_B: jax.Array  # bool [M]: rows that enter the loss
    old_logp_BT: jax.Array | None  # None: on-policy (one update per rollout), ratio = 1
    ref_logp_BT: jax.Array | None  # None unless a KL to the reference is used
    old_values_BT: jax.Array | None = None  # PPO: the critic's values in the rollout
    returns_BT: jax.Array | None = None  # PPO: the critic's targets (GAE returns)
    # The sampler's logprobs of the tokens (None when pi_old is them): the gap to the
    # trainer's is logged, and --is_correction reweights by it.
    behaviour_logp_BT: jax.Array | None = None
    # the rows' groups
    layout: RowLayout = flax.struct.field(pytree_node=False, default=RowLayout())

    def trimmed(self, length: int) -> UpdateBatch:
        """The batch cut to its first `length` completion columns. With no row longer than
        `length` the cut columns are padding (off every mask), so the loss, its gradient and
        the metrics are unchanged (the sequence-length constant of seq-mean-token-sum-norm
        is pinned by TrainConfig.update_algorithm, not read from the shape)."""
        T = self.seqs.completion_tokens_BT.shape[1]
        if length >= T:
            return self
        cut = lambda x: trim.cut_columns(x, length)  # noqa: E731
        return self.replace(
            seqs=self.seqs.replace(
                completion_tokens_BT=cut(self.seqs.completion_tokens_BT),
                completion_mask_BT=cut(self.seqs.completion_mask_BT),
                observation_mask_BT=cut(self.seqs.observation_mask_BT),
                experts_BTLK=cut(self.seqs.experts_BTLK),
            ),
            advantages=cut(self.advantages) if self.advantages.ndim == 2 else self.advantages,
            old_logp_BT=cut(self.old_logp_BT),
            ref_logp_BT=cut(self.ref_logp_BT),
            old_values_BT=cut(self.old_values_BT),
            returns_BT=cut(self.returns_BT),
            behaviour_logp_BT=cut(self.behaviour_logp_BT),
        )


def length_classes(length: int, num_classes: int) -> tuple[int, ...]:
    """The completion lengths (ascending) a micro-batch of a mini-batch cut to `length`
    columns may run at: `length`, then halving, at most `num_classes` of them and none below
    16 (shorter programs save little). () when there is only one."""
    classes = sorted({max(min(16, length), -(-length // 2**i)) for i in range(num_classes)})
    return tuple(classes) if len(classes) > 1 else ()


def micro_batch_order(lengths_R: np.ndarray, num_micro: int) -> np.ndarray:
    """A permutation of a mini-batch's R rows (host side) after which the strided micro-batches
    of `accumulate` (micro-batch k = rows k, k + num_micro, ...) hold the rows sorted by
    length: micro-batch 0 the longest R / num_micro rows, the last the shortest."""
    R = lengths_R.shape[0]
    if R % num_micro:
        raise ValueError(f"{R} rows do not split into {num_micro} micro-batches.")
    by_length = np.argsort(-np.asarray(lengths_R), kind="stable")
    # Position b * num_micro + k (row b of micro-batch k) <- sorted row k * (R / num_micro) + b.
    return by_length.reshape(num_micro, R // num_micro).T.reshape(-1)
