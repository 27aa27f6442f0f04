"""The rollout's advantages on its global batch, jitted (StepPrograms.advantages)."""

from __future__ import annotations

import functools

import jax

from jaxrl4llm import rl
from jaxrl4llm.rl.metrics import Metric


@functools.partial(jax.jit, static_argnames=("config", "group_size"))
def advantages(
    rewards_B: jax.Array,
    correct_B: jax.Array,
    mask_BT: jax.Array,
    truncated_B: jax.Array,
    dropped_B: jax.Array,
    valid_B: jax.Array,
    logp_BT: jax.Array,
    ref_logp_BT: jax.Array | None,
    baseline_B: jax.Array | None = None,
    baseline_correct_B: jax.Array | None = None,
    values_BT: jax.Array | None = None,
    *,
    config: rl.AlgorithmConfig,
    group_size: int,
) -> tuple[jax.Array, jax.Array | None, jax.Array, dict[str, Metric]]:
    """(advantages_BT, returns_BT or None, keep_B, metrics) of the rollout's global batch:
    rl.compute_advantages_and_returns with the rows that have no reward left out."""
    # Rows without a reward (verification failed, or the prompt was skipped as too long) leave
    # the loss and every statistic (batch mean / std, whitening). returns_BT: None unless PPO.
    return rl.compute_advantages_and_returns(
        config,
        rewards_B,
        correct_B,
        mask_BT,
        group_size,
        truncated_B=truncated_B,
        logp_BT=logp_BT,
        ref_logp_BT=ref_logp_BT,
        valid_B=valid_B & ~dropped_B,
        baseline_B=baseline_B,
        baseline_correct_B=baseline_correct_B,
        values_BT=values_BT,
    )
