"""jaxrl4llm.rl: the RL math for LLM reasoning as pure, jittable jax.numpy (depends on jax only).

To use only the math in another codebase, install the distribution jaxrl4llm-rl (this package
and the two pure-Python modules of jaxrl4llm.config it imports; requires jax and numpy only)
from a checkout of the repository:

    pip install ./packaging/rl
    python -c "import jaxrl4llm.rl"      # imports jax and numpy, nothing else (tested)

docs/library.md is a walk-through with a standalone training loop.

Shapes: B rows = P prompts x G samples (a group is G contiguous rows), T completion tokens.
A verifier yields ``rewards_B`` (float) and ``correct_B`` (bool): filters read ``correct``,
advantages read the reward. Masks are bool or {0,1} float [B, T]; ``keep_B`` is bool [B].

Public API (stable):

Presets (presets.py), the config (algorithm_config.py) and the two entry points (algorithms.py)
    AlgorithmConfig(...)                       frozen dataclass of every knob, checked when built
                                               (hashable: a static jit arg; a pytree whose float
                                               knobs may be traced: TRACED_FIELDS)
    get_preset(name, **overrides) -> AlgorithmConfig
        names: grpo, dr_grpo, reinforce, reinforce_rej, reinforce_pp, reinforce_pp_baseline,
        lite_ppo, rloo, raft, raft_pp, gspo, remax, dapo, ppo, cispo, sapo, gmpo, clip_cov,
        kl_cov, gpg, opo, grpo_passk  (PRESETS maps name -> constructor)
    validate(config, group_size) -> config      adds the group-size checks; ValueError naming
                                               the knob and the fix
    compute_advantages(config, rewards_B, correct_B, mask_BT, group_size, *,
                       truncated_B=None, logp_BT=None, ref_logp_BT=None, valid_B=None,
                       baseline_B=None, baseline_correct_B=None, sum_pi_squared_BT=None,
                       values_BT=None, axis_name=None)
        -> (advantages [B] or [B, T] (no gradient), keep_B, metrics)
        keep_B: rows in the loss; rows rejected by a filter are out of it (rejected_rows="drop")
        or in it with A = 0 (rejected_rows="zero", Minimal-RL's convention); valid_B=False
        rows (no reward) leave the loss and every statistic. baseline_B: ReMax's greedy reward.
        sum_pi_squared_BT: advantage="otb"'s sum of squared probabilities. axis_name: the
        batch axis under shard_map (batch statistics and metrics then span every shard).
    compute_advantages_and_returns(same arguments) -> (advantages, returns_BT, keep_B, metrics)
        the same, with the critic's targets for advantage="gae" (PPO; values_BT: the critic's
        V(s_t) of the rollout); returns_BT is None for every other estimator.
    policy_loss(config, logp_BT, old_logp_BT, advantages, mask_BT, keep_B=None, *,
                ref_logp_BT=None, entropy_BT=None, behaviour_logp_BT=None, key=None,
                axis_name=None)
        -> (loss_sum, denominator, metrics)
        config.objective's registered loss plus the KL and entropy terms, in float32.
        old_logp_BT=None means on-policy (ratio 1); pass entropy_BT (entropy_from_logits)
        whenever the logits are at hand: it is then always logged, and enters the loss when
        entropy_coef != 0. With ref_logp_BT the KL to the reference is logged as
        "policy/kl_ref" whether or not it is in the loss. With behaviour_logp_BT (the
        sampler's logprobs) the sampler-trainer gap is logged ("mismatch/...") and
        config.is_correction applies. key: Clip-Cov's draw (None: drawn from the batch).
    loss_denominator(config, mask_BT, keep_B=None) -> denominator of the whole mini-batch
    Arguments are checked for rank, shape and dtype (the error names the argument).

Registries (registry.py): the estimators and losses by name
    register_advantage(name, *, kl_in_reward="sequence", min_group_size=1)(fn)
        fn(config, AdvantageInputs) -> (advantages, returns_BT or None)
    register_policy_loss(name, *, sequence_level=False, aggs=None, dual_clip=False,
                         sequence_ratio=False)(fn)
        fn(config, PolicyInputs) -> (loss_BT, bool [B, T] indicators)
    the built-in ones register in estimators.py and objectives.py; the names are the values
    of config.advantage / config.objective (and of the trainer's flags).

Policy losses (policy_losses.py), each (loss_BT, aux)
    cispo_loss, sapo_loss (sapo_gate), gmpo_loss, clip_cov_loss (clip_cov_draws), kl_cov_loss,
    gpg_loss, token_covariance(logp_BT, advantages, mask_BT, axis_name=None)

Group estimators (group_estimators.py)
    opo_advantages(rewards_B, lengths_B, group_size, keep_B=None)
    grpo_passk_advantages(rewards_B, group_size, *, std_normalize, ddof, eps, keep_B)
    passk_advantages(correct_B, group_size, k, *, eps, keep_B)
    gpg_advantages(rewards_B, group_size, keep_B=None, axis_name=None)
    optimal_token_baseline_advantages(rewards_B, mask_BT, logp_BT, sum_pi_squared_BT,
        group_size, *, is_weights_BT=None, zero_tail=False, eps=1e-8, keep_B=None)

Advantages (advantages.py)
    normalized_advantages(rewards_B, group_size, *, mean, std, ddof=1, eps=1e-6, keep_B=None,
                          axis_name=None) -> [B]
    rloo_advantages(rewards_B, group_size, keep_B=None) -> [B]
    reinforce_advantages(rewards_B, keep_B=None) -> [B]
    reinforce_pp_advantages(rewards_B, mask_BT, *, kl_BT=None, kl_coef=0., group_size=1,
                            baseline=False, keep_B=None, ddof=1, eps=1e-6) -> [B, T]
    token_rewards, returns_to_go, whiten, last_token_onehot, to_groups

PPO's critic math (value.py)
    gae_advantages(token_rewards_BT, values_BT, mask_BT, *, gamma, lam)
        -> (advantages_BT, returns_BT)
    masked_whiten(values_BT, weights_BT, eps=1e-8): verl's (x - mean) * rsqrt(var + eps), var ddof=1
    ppo_advantages(rewards_B, values_BT, mask_BT, *, gamma, lam, kl_BT=None, kl_coef=0.,
                   keep_B=None)
        -> (whitened advantages_BT, returns_BT)
    value_loss(values_BT, old_values_BT, returns_BT, mask_BT, keep_B=None, *, value_clip=0.2,
               agg="token-mean", max_tokens=None) -> (loss_sum, denominator, metrics)

Filters (filters.py)
    keep_mask(correct_B, group_size, *, reject_all_correct=False, reject_all_wrong=False,
              truncated_B=None) -> bool [B]
    group_keep_mask, overlong_keep_mask, all_correct_groups, all_wrong_groups
    rejected_group_fraction(keep_B, group_size) -> scalar
    raft_positives(rewards_B, correct_B, group_size, *, select="correct"|"best") -> bool [B]

Losses (losses.py)
    clipped_surrogate(logp_BT, old_logp_BT, advantages, *, clip_low, clip_high, dual_clip=None)
        -> (loss_BT, aux)
    sequence_old_logp(logp_BT, old_logp_BT, mask_BT): GSPO's sequence ratio as an old logp
    nll_loss(logp_BT), kl_estimate(logp_BT, ref_logp_BT, "k1"|"k2"|"k3", k3_clamp=10.0), k3(d),
    entropy_from_logits(logits_BTV), log_ratio(logp_BT, old_logp_BT)
    aggregate(loss_BT, mask_BT, keep_B=None, mode="token-mean", max_tokens=None)
        -> (sum, denominator)
    losses.loss_denominator(mask_BT, keep_B=None, mode=..., max_tokens=None)
        (rl.loss_denominator takes a config),
    finalize_loss(sum, denominator)

Sampler-trainer mismatch (correction.py): d = old_logp (trainer) - behaviour_logp (sampler)
    verl_rejection(correction, level, lower, upper) -> verl's (rollout_rs, rollout_rs_threshold)
        of the same band (verl bounds the inverse ratio); rejection_log_ratio: the band's
        statistic (each token clamped to [-20, 20] before a sequence's sum or mean)
    is_weights(correction, old_logp_BT, behaviour_logp_BT, mask_BT, *, level="token", cap=2.,
               lower=0.5, upper=2.) -> (w_BT, corrected_BT)
        the per-token weight of the policy-gradient term (stop-gradient): "tis" min(r, cap),
        "mis" r 1[lower <= r <= upper] (r per token or sequence), "icepop" (mis per token),
        "geo_mask" 1[lower <= exp(mean_t d) <= upper]; policy_loss applies it when
        config.is_correction is set and behaviour_logp_BT is given
    mismatch_metrics(old_logp_BT, behaviour_logp_BT, mask_BT) -> {"mismatch/...": Metric}
    correction_metrics(w_BT, corrected_BT, weights_BT) -> {"is/...": Metric}
    level_log_ratio(old_logp_BT, behaviour_logp_BT, mask_BT, level), CORRECTIONS, IS_LEVELS

Metrics (metrics.py)
    Metric(total, count, reduce): a metric of part of a batch with its reduction (sum, mean,
        min, max); the entry points return {final name: Metric}, e.g. "policy/entropy"
    combine_metrics(a, b) (by each metric's reduction), finalize_metrics(m) -> {name: value},
    reduce_metrics(m, axis_name): one shard's metrics -> the whole batch's

How the trainer combines micro-batches (exact, for every aggregation mode):
    Both parts of every (loss_sum, denominator) pair are sums over rows, so for micro-batches k of
    one mini-batch: loss = sum_k loss_sum_k / sum_k denominator_k. The denominator depends only on
    masks, so either compute D = loss_denominator(config, mask_BT, keep_B) over the whole
    mini-batch before splitting and accumulate grad(loss_sum_k / D), or accumulate
    grad(loss_sum_k) and denominator_k and divide once at the end. Never average per-micro-batch
    means. Micro-batches must be row slices of one padded [B, T] array (same T) for
    "seq-mean-token-sum-norm" with max_tokens=None. Merge metrics with combine_metrics, then
    finalize_metrics for logging.

docs/algorithms.md gives every preset's formula, flags and paper, and compares the conventions
with verl, OpenRLHF and TRL.
"""

from __future__ import annotations

from jaxrl4llm.rl import (
    advantages,
    algorithm_config,
    algorithms,
    collectives,
    correction,
    estimators,
    filters,
    group_estimators,
    losses,
    metrics,
    objectives,
    policy_losses,
    presets,
    registry,
    value,
)
from jaxrl4llm.rl.advantages import (
    last_token_onehot,
    normalized_advantages,
    reinforce_advantages,
    reinforce_pp_advantages,
    returns_to_go,
    rloo_advantages,
    to_groups,
    token_rewards,
    whiten,
)
from jaxrl4llm.rl.algorithm_config import AlgorithmConfig, validate
from jaxrl4llm.rl.algorithms import (
    compute_advantages,
    compute_advantages_and_returns,
    loss_denominator,
    policy_loss,
)
from jaxrl4llm.rl.correction import (
    CORRECTIONS,
    IS_LEVELS,
    correction_metrics,
    is_weights,
    level_log_ratio,
    mismatch_metrics,
)
from jaxrl4llm.rl.filters import (
    all_correct_groups,
    all_wrong_groups,
    group_keep_mask,
    keep_mask,
    overlong_keep_mask,
    raft_positives,
    rejected_group_fraction,
)
from jaxrl4llm.rl.group_estimators import (
    gpg_advantages,
    grpo_passk_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    passk_advantages,
)
from jaxrl4llm.rl.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    aggregate,
    clipped_surrogate,
    entropy_from_logits,
    finalize_loss,
    k3,
    kl_estimate,
    log_ratio,
    nll_loss,
)
from jaxrl4llm.rl.metrics import Metric, combine_metrics, finalize_metrics, reduce_metrics
from jaxrl4llm.rl.policy_losses import (
    cispo_loss,
    clip_cov_loss,
    gmpo_loss,
    gpg_loss,
    kl_cov_loss,
    sapo_gate,
    sapo_loss,
    token_covariance,
)
from jaxrl4llm.rl.presets import PRESETS, get_preset
from jaxrl4llm.rl.registry import (
    AdvantageInputs,
    PolicyInputs,
    register_advantage,
    register_policy_loss,
)
from jaxrl4llm.rl.value import gae_advantages, masked_whiten, ppo_advantages, value_loss

__all__ = [
    "advantages",
    "algorithm_config",
    "algorithms",
    "filters",
    "losses",
    "metrics",
    "presets",
    "value",
    "Metric",
    "k3",
    "compute_advantages_and_returns",
    "gae_advantages",
    "masked_whiten",
    "ppo_advantages",
    "value_loss",
    "AlgorithmConfig",
    "PRESETS",
    "get_preset",
    "validate",
    "compute_advantages",
    "policy_loss",
    "loss_denominator",
    "normalized_advantages",
    "rloo_advantages",
    "reinforce_advantages",
    "reinforce_pp_advantages",
    "token_rewards",
    "returns_to_go",
    "whiten",
    "last_token_onehot",
    "to_groups",
    "keep_mask",
    "group_keep_mask",
    "overlong_keep_mask",
    "all_correct_groups",
    "all_wrong_groups",
    "rejected_group_fraction",
    "raft_positives",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "clipped_surrogate",
    "nll_loss",
    "kl_estimate",
    "entropy_from_logits",
    "log_ratio",
    "aggregate",
    "finalize_loss",
    "combine_metrics",
    "finalize_metrics",
    "correction",
    "CORRECTIONS",
    "IS_LEVELS",
    "is_weights",
    "mismatch_metrics",
    "correction_metrics",
    "level_log_ratio",
    "collectives",
    "estimators",
    "group_estimators",
    "objectives",
    "policy_losses",
    "registry",
    "reduce_metrics",
    "cispo_loss",
    "sapo_loss",
    "sapo_gate",
    "gmpo_loss",
    "clip_cov_loss",
    "kl_cov_loss",
    "gpg_loss",
    "token_covariance",
    "opo_advantages",
    "grpo_passk_advantages",
    "passk_advantages",
    "gpg_advantages",
    "optimal_token_baseline_advantages",
    "register_advantage",
    "register_policy_loss",
    "AdvantageInputs",
    "PolicyInputs",
]
