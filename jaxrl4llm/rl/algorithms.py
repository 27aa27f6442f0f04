"""The two entry points of the RL math: ``compute_advantages`` (once per rollout batch) and
``policy_loss`` (per micro-batch), with ``loss_denominator``.

The trainer calls only these; what they compute is set by an ``AlgorithmConfig``
(algorithm_config.py, with ``validate`` and the knobs' choices; all importable from here too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl4llm.rl import advantages as adv_lib
from jaxrl4llm.rl import correction, filters, losses
from jaxrl4llm.rl import value as value_lib
from jaxrl4llm.rl.algorithm_config import (
    ADVANTAGES,
    IMPORTANCE,
    KL_PLACES,
    OBJECTIVES,
    REJECTED_ROWS,
    SEQUENCE_ADVANTAGES,
    AlgorithmConfig,
    validate,
)
from jaxrl4llm.rl.metrics import Metric

# The config's names are re-exported: ``from jaxrl4llm.rl.algorithms import X`` keeps working.
__all__ = [
    "ADVANTAGES",
    "IMPORTANCE",
    "KL_PLACES",
    "OBJECTIVES",
    "REJECTED_ROWS",
    "SEQUENCE_ADVANTAGES",
    "AlgorithmConfig",
    "compute_advantages",
    "compute_advantages_and_returns",
    "loss_denominator",
    "policy_loss",
    "validate",
]


def compute_advantages(
    config: AlgorithmConfig,
    rewards_B: jnp.ndarray,
    correct_B: jnp.ndarray,
    mask_BT: jnp.ndarray,
    group_size: int,
    **kwargs: jnp.ndarray | None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, Metric]]:
    """Advantages for one rollout batch: (advantages [B] or [B, T], keep_B bool, metrics);
    ``compute_advantages_and_returns`` without the critic's returns (same arguments)."""
    adv, _, keep, metrics = compute_advantages_and_returns(
        config, rewards_B, correct_B, mask_BT, group_size, **kwargs
    )
    return adv, keep, metrics


def compute_advantages_and_returns(
    config: AlgorithmConfig,
    rewards_B: jnp.ndarray,
    correct_B: jnp.ndarray,
    mask_BT: jnp.ndarray,
    group_size: int,
    *,
    truncated_B: jnp.ndarray | None = None,
    logp_BT: jnp.ndarray | None = None,
    ref_logp_BT: jnp.ndarray | None = None,
    valid_B: jnp.ndarray | None = None,
    baseline_B: jnp.ndarray | None = None,
    baseline_correct_B: jnp.ndarray | None = None,
    values_BT: jnp.ndarray | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray | None, jnp.ndarray, dict[str, Metric]]:
    """Advantages for one rollout batch. Returns (advantages [B] or [B, T], returns_BT (the
    critic's targets; None unless advantage="gae"), keep_B bool, metrics: rl.metrics.Metric
    values by final name, "adv/...").

    keep_B marks the rows that enter the loss. Group rejection and RAFT's selection decide
    which rows carry a learning signal and enter the statistics (batch mean/std, whitening);
    a row they reject is out of the loss (rejected_rows="drop") or in it with A = 0
    (rejected_rows="zero"). Overlong filtering (truncated_B, when config.overlong_filter)
    only removes rows from the loss, so a truncated sample still counts in its group's
    statistics (as in DAPO). kl_in='reward' needs logp_BT (the sampling policy) and
    ref_logp_BT.
    valid_B (bool [B], default all True): rows with a reward at all. A row without one (its
    verification timed out or crashed, or its prompt was dropped as too long) leaves the loss
    and every statistic, and its group is judged (all-correct / all-wrong, best of group) by
    its valid rows only.
    baseline_B, baseline_correct_B: advantage="remax" only: each row's baseline reward and
    verdict, those of its prompt's greedy completion (binary_reward maps the verdict).
    values_BT: advantage="gae" only: the critic's values of the rollout (V(s_t) at token t).
    """
    c = config
    correct = jnp.asarray(correct_B, bool)
    r_B = jnp.asarray(rewards_B, jnp.float32)
    valid = jnp.ones(correct.shape, bool) if valid_B is None else jnp.asarray(valid_B, bool)
    correct = correct & valid
    if c.binary_reward is not None:
        r_B = jnp.where(correct, c.binary_reward[1], c.binary_reward[0]).astype(jnp.float32)
    signal = valid & filters.group_keep_mask(
        correct,
        group_size,
        reject_all_correct=c.reject_all_correct,
        reject_all_wrong=c.reject_all_wrong,
        valid_B=valid,
    )
    if c.advantage == "positives":
        signal &= filters.raft_positives(
            jnp.where(valid, r_B, -jnp.inf), correct, group_size, select=c.positives
        )
    keep = valid if c.rejected_rows == "zero" else signal
    if c.overlong_filter:
        if truncated_B is None:
            raise ValueError(
                "overlong_filter=True needs truncated_B (the sampler's 'hit max_new_tokens' flags)."
            )
        keep = keep & filters.overlong_keep_mask(truncated_B)

    kl_BT, returns_BT = None, None
    if c.kl_in == "reward" and c.kl_coef != 0:
        if logp_BT is None or ref_logp_BT is None:
            raise ValueError(
                "kl_in='reward' needs logp_BT (sampling policy) and ref_logp_BT (reference model)."
            )
        kl_BT = losses.kl_estimate(logp_BT, ref_logp_BT, c.kl_estimator, c.k3_clamp)
    if c.advantage == "normalized":
        adv = adv_lib.normalized_advantages(
            r_B, group_size, mean=c.mean, std=c.std, ddof=c.ddof, eps=c.eps, keep_B=signal
        )
    elif c.advantage == "rloo":
        adv = adv_lib.rloo_advantages(r_B, group_size, keep_B=signal)
    elif c.advantage == "positives":
        adv = signal.astype(jnp.float32)
    elif c.advantage == "remax":
        adv = r_B - _baseline(c, baseline_B, baseline_correct_B)
    elif c.advantage == "gae":
        if values_BT is None:
            raise ValueError(
                "advantage='gae' (PPO) needs values_BT: the critic's values of the rollout."
            )
        adv, returns_BT = value_lib.ppo_advantages(
            r_B,
            values_BT,
            mask_BT,
            gamma=c.gamma,
            lam=c.lam,
            kl_BT=kl_BT,
            kl_coef=c.kl_coef,
            keep_B=signal,
        )
        returns_BT = jnp.where(valid[:, None], returns_BT, 0.0)
    elif c.advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        adv = adv_lib.reinforce_pp_advantages(
            r_B,
            mask_BT,
            kl_BT=kl_BT,
            kl_coef=c.kl_coef,
            group_size=group_size,
            baseline=c.advantage == "reinforce_pp_baseline",
            keep_B=signal,
            ddof=c.ddof,
            eps=c.eps,
        )
    else:
        raise ValueError(f"advantage={c.advantage!r}: choose one of {ADVANTAGES}.")
    if kl_BT is not None and c.advantage in SEQUENCE_ADVANTAGES:
        # OpenRLHF's KL-in-reward for per-sequence estimators: A at the last token, -beta KL
        # on every token, returns with gamma = 1: A_it = A_i - beta sum_{s >= t} KL_is.
        m = jnp.asarray(mask_BT, jnp.float32)
        adv = adv_lib.returns_to_go(adv_lib.token_rewards(adv, m, kl_BT, c.kl_coef))
    # Rows without a learning signal carry A = 0 (rejected ones are masked out under "drop";
    # under "zero" this is what keeps them in the loss without a policy gradient).
    learn = signal & keep
    adv = jnp.where(learn if adv.ndim == 1 else learn[:, None], adv, 0.0)

    lf = learn.astype(jnp.float32)
    n_learn = jnp.maximum(lf.sum(), 1.0)
    adv_B = (
        adv
        if adv.ndim == 1
        else adv.sum(1) / jnp.maximum(jnp.asarray(mask_BT, jnp.float32).sum(1), 1.0)
    )
    metrics = {
        "adv/frac_groups_rejected": Metric.mean(
            filters.rejected_group_fraction(signal, group_size)
        ),
        "adv/frac_rows_kept": Metric.mean(lf.mean()),
        "adv/adv_mean": Metric.mean((adv_B * lf).sum() / n_learn),
        "adv/adv_abs_mean": Metric.mean((jnp.abs(adv_B) * lf).sum() / n_learn),
    }
    return adv, returns_BT, keep, metrics


def _baseline(
    c: AlgorithmConfig, baseline_B: jnp.ndarray | None, baseline_correct_B: jnp.ndarray | None
) -> jnp.ndarray:
    """ReMax's baseline per row, mapped like the rewards when binary_reward is set."""
    if baseline_B is None or (c.binary_reward is not None and baseline_correct_B is None):
        raise ValueError(
            "advantage='remax' needs baseline_B (and baseline_correct_B with "
            "binary_reward): the reward and verdict of each prompt's greedy "
            "completion."
        )
    if c.binary_reward is None:
        return jnp.asarray(baseline_B, jnp.float32)
    return jnp.where(
        jnp.asarray(baseline_correct_B, bool), c.binary_reward[1], c.binary_reward[0]
    ).astype(jnp.float32)


def loss_denominator(
    config: AlgorithmConfig, mask_BT: jnp.ndarray, keep_B: jnp.ndarray | None = None
) -> jnp.ndarray:
    """The mini-batch denominator of ``policy_loss`` (compute once, before splitting
    micro-batches)."""
    return losses.loss_denominator(mask_BT, keep_B, config.agg, config.max_tokens)


def policy_loss(
    config: AlgorithmConfig,
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray | None,
    advantages: jnp.ndarray,
    mask_BT: jnp.ndarray,
    keep_B: jnp.ndarray | None = None,
    *,
    ref_logp_BT: jnp.ndarray | None = None,
    entropy_BT: jnp.ndarray | None = None,
    behaviour_logp_BT: jnp.ndarray | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, Metric]]:
    """(loss_sum, denominator, metrics) of one (micro-)batch; keep_B=None keeps every row.

    loss per token = policy term (clipped surrogate, or RAFT's -A logp with A = 1 on positives)
    + kl_coef * KL_ref (when kl_in='loss') - entropy_coef * H, aggregated with config.agg.
    With ref_logp_BT, the KL to the reference is always a metric ("policy/kl_ref", the
    config's estimator), whether or not it is in the loss. old_logp_BT=None means
    on-policy (ratio 1, gradient still flows through logp_BT). Combine micro-batches by
    summing loss_sum and denominator (or divide each loss_sum by loss_denominator() of the
    whole mini-batch). `metrics` are rl.metrics.Metric values by final name ("policy/..."):
    merge parts with combine_metrics and read them with finalize_metrics.

    behaviour_logp_BT: the sampler's logprobs of the same tokens. With them the gap
    old_logp - behaviour_logp is logged ("mismatch/...", old_logp = sg(logp_BT) on-policy),
    and config.is_correction weights the policy-gradient term per token (correction.py;
    "is/..." metrics); is_correction needs them.
    """
    c = config
    if old_logp_BT is None:
        old_logp_BT = jax.lax.stop_gradient(logp_BT)
    # The trainer's pi_old of the sampled tokens, before GSPO turns it into a sequence ratio.
    trainer_logp_BT = old_logp_BT
    if keep_B is None:
        keep_B = jnp.ones(logp_BT.shape[:1], bool)
    w = losses.row_weights(mask_BT, keep_B)
    if c.objective == "nll":
        # A = 0 on rows kept only for the denominator (rejected_rows="zero").
        pg_BT, aux = (
            losses.nll_loss(logp_BT) * losses.broadcast_advantages(advantages, logp_BT.shape),
            None,
        )
    else:
        if c.importance == "sequence":
            old_logp_BT = losses.sequence_old_logp(logp_BT, old_logp_BT, mask_BT)
        pg_BT, aux = losses.clipped_surrogate(
            logp_BT,
            old_logp_BT,
            advantages,
            clip_low=c.clip_low,
            clip_high=c.clip_high,
            dual_clip=c.dual_clip,
        )
    is_metrics: dict[str, Metric] = {}
    if behaviour_logp_BT is not None:
        is_metrics = correction.mismatch_metrics(trainer_logp_BT, behaviour_logp_BT, mask_BT)
    if c.is_correction is not None:
        if behaviour_logp_BT is None:
            raise ValueError(
                f"is_correction={c.is_correction!r} needs behaviour_logp_BT (the "
                "sampler's logprobs of the sampled tokens)."
            )
        is_w_BT, corrected_BT = correction.is_weights(
            c.is_correction,
            trainer_logp_BT,
            behaviour_logp_BT,
            mask_BT,
            level=c.is_level,
            cap=c.is_cap,
            lower=c.is_lower,
            upper=c.is_upper,
        )
        pg_BT = pg_BT * is_w_BT
        is_metrics.update(correction.correction_metrics(is_w_BT, corrected_BT, w))
    total_BT = pg_BT
    kl_BT = None
    if ref_logp_BT is not None:
        kl_BT = losses.kl_estimate(logp_BT, ref_logp_BT, c.kl_estimator, c.k3_clamp)
    if c.kl_in == "loss" and c.kl_coef != 0:
        if kl_BT is None:
            raise ValueError(
                "kl_in='loss' with kl_coef > 0 needs ref_logp_BT (reference-model log-probs)."
            )
        total_BT = total_BT + c.kl_coef * kl_BT
    if c.entropy_coef != 0:
        if entropy_BT is None:
            raise ValueError(
                "entropy_coef != 0 needs entropy_BT (losses.entropy_from_logits of "
                "the policy logits)."
            )
        total_BT = total_BT - c.entropy_coef * entropy_BT
    loss_sum, denom = losses.aggregate(total_BT, mask_BT, keep_B, c.agg, c.max_tokens)
    d = losses.log_ratio(logp_BT, old_logp_BT)
    metrics = losses.token_metrics(
        w,
        keep_B,
        ratio_BT=jnp.exp(d),
        log_ratio_BT=d,
        clip_aux=aux,
        pg_loss_BT=pg_BT,
        kl_ref_BT=kl_BT,
        entropy_BT=entropy_BT,
    )
    metrics.update(is_metrics)
    metrics = jax.tree_util.tree_map(jax.lax.stop_gradient, metrics)
    return loss_sum, denom, metrics
