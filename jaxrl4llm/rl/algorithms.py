"""The two entry points of the RL math: ``compute_advantages`` (once per rollout batch) and
``policy_loss`` (per micro-batch), with ``loss_denominator``.

The trainer calls only these; what they compute is set by an ``AlgorithmConfig``
(algorithm_config.py, with ``validate`` and the knobs' choices; all importable from here too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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
    r_B, valid, signal = _rewards_and_signal(c, rewards_B, correct_B, group_size, valid_B)
    keep = _loss_rows(c, valid, signal, truncated_B)
    kl_BT = _reward_kl(c, logp_BT, ref_logp_BT)
    adv, returns_BT = _estimate(
        c,
        _EstimatorInputs(
            rewards_B=r_B,
            mask_BT=mask_BT,
            group_size=group_size,
            signal_B=signal,
            valid_B=valid,
            kl_BT=kl_BT,
            baseline_B=baseline_B,
            baseline_correct_B=baseline_correct_B,
            values_BT=values_BT,
        ),
    )
    adv = _sequence_kl_in_reward(c, adv, mask_BT, kl_BT)
    # Rows without a learning signal carry A = 0 (rejected ones are masked out under "drop";
    # under "zero" this is what keeps them in the loss without a policy gradient).
    learn = signal & keep
    adv = jnp.where(learn if adv.ndim == 1 else learn[:, None], adv, 0.0)
    return adv, returns_BT, keep, _advantage_metrics(adv, learn, signal, mask_BT, group_size)


def _rewards_and_signal(
    c: AlgorithmConfig,
    rewards_B: jnp.ndarray,
    correct_B: jnp.ndarray,
    group_size: int,
    valid_B: jnp.ndarray | None,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(rewards float32 [B], valid_B, signal_B): the rewards (binary_reward maps the verdicts),
    the rows with a reward, and the rows with a learning signal (group rejection, RAFT's
    selection)."""
    correct = jnp.asarray(correct_B, bool)
    r_B = jnp.asarray(rewards_B, jnp.float32)
    valid = jnp.ones(correct.shape, bool) if valid_B is None else jnp.asarray(valid_B, bool)
    correct = correct & valid
    if c.binary_reward is not None:
        r_B = _binary_rewards(c.binary_reward, correct)
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
    return r_B, valid, signal


def _loss_rows(
    c: AlgorithmConfig, valid: jnp.ndarray, signal: jnp.ndarray, truncated_B: jnp.ndarray | None
) -> jnp.ndarray:
    """keep_B: the rows in the loss (rejected_rows, then the overlong filter)."""
    keep = valid if c.rejected_rows == "zero" else signal
    if c.overlong_filter:
        if truncated_B is None:
            raise ValueError(
                "overlong_filter=True needs truncated_B (the sampler's 'hit max_new_tokens' flags)."
            )
        keep = keep & filters.overlong_keep_mask(truncated_B)
    return keep


def _reward_kl(
    c: AlgorithmConfig, logp_BT: jnp.ndarray | None, ref_logp_BT: jnp.ndarray | None
) -> jnp.ndarray | None:
    """The per-token KL that enters the reward (kl_in='reward'), else None."""
    if c.kl_in != "reward" or c.kl_coef == 0:
        return None
    if logp_BT is None or ref_logp_BT is None:
        raise ValueError(
            "kl_in='reward' needs logp_BT (sampling policy) and ref_logp_BT (reference model)."
        )
    return losses.kl_estimate(logp_BT, ref_logp_BT, c.kl_estimator, c.k3_clamp)


@dataclasses.dataclass(frozen=True)
class _EstimatorInputs:
    """What an advantage estimator may read of one rollout batch (signal_B: the rows in its
    statistics)."""

    rewards_B: jnp.ndarray
    mask_BT: jnp.ndarray
    group_size: int
    signal_B: jnp.ndarray
    valid_B: jnp.ndarray
    kl_BT: jnp.ndarray | None
    baseline_B: jnp.ndarray | None
    baseline_correct_B: jnp.ndarray | None
    values_BT: jnp.ndarray | None


# An estimator returns (advantages [B] or [B, T], the critic's returns or None).
_Estimate = tuple[jnp.ndarray, "jnp.ndarray | None"]


def _normalized(c: AlgorithmConfig, x: _EstimatorInputs) -> _Estimate:
    adv = adv_lib.normalized_advantages(
        x.rewards_B, x.group_size, mean=c.mean, std=c.std, ddof=c.ddof, eps=c.eps, keep_B=x.signal_B
    )
    return adv, None


def _rloo(c: AlgorithmConfig, x: _EstimatorInputs) -> _Estimate:
    return adv_lib.rloo_advantages(x.rewards_B, x.group_size, keep_B=x.signal_B), None


def _positives(c: AlgorithmConfig, x: _EstimatorInputs) -> _Estimate:
    return x.signal_B.astype(jnp.float32), None


def _remax(c: AlgorithmConfig, x: _EstimatorInputs) -> _Estimate:
    return x.rewards_B - _baseline(c, x.baseline_B, x.baseline_correct_B), None


def _gae(c: AlgorithmConfig, x: _EstimatorInputs) -> _Estimate:
    if x.values_BT is None:
        raise ValueError(
            "advantage='gae' (PPO) needs values_BT: the critic's values of the rollout."
        )
    adv, returns_BT = value_lib.ppo_advantages(
        x.rewards_B,
        x.values_BT,
        x.mask_BT,
        gamma=c.gamma,
        lam=c.lam,
        kl_BT=x.kl_BT,
        kl_coef=c.kl_coef,
        keep_B=x.signal_B,
    )
    return adv, jnp.where(x.valid_B[:, None], returns_BT, 0.0)


def _reinforce_pp(c: AlgorithmConfig, x: _EstimatorInputs) -> _Estimate:
    adv = adv_lib.reinforce_pp_advantages(
        x.rewards_B,
        x.mask_BT,
        kl_BT=x.kl_BT,
        kl_coef=c.kl_coef,
        group_size=x.group_size,
        baseline=c.advantage == "reinforce_pp_baseline",
        keep_B=x.signal_B,
        ddof=c.ddof,
        eps=c.eps,
    )
    return adv, None


# config.advantage -> its estimator.
_ESTIMATORS: dict[str, Callable[[AlgorithmConfig, _EstimatorInputs], _Estimate]] = {
    "normalized": _normalized,
    "rloo": _rloo,
    "positives": _positives,
    "remax": _remax,
    "gae": _gae,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp,
}


def _estimate(c: AlgorithmConfig, x: _EstimatorInputs) -> _Estimate:
    """The advantages (and the critic's returns) of config.advantage's estimator."""
    estimator = _ESTIMATORS.get(c.advantage)
    if estimator is None:
        raise ValueError(f"advantage={c.advantage!r}: choose one of {ADVANTAGES}.")
    return estimator(c, x)


def _sequence_kl_in_reward(
    c: AlgorithmConfig, adv: jnp.ndarray, mask_BT: jnp.ndarray, kl_BT: jnp.ndarray | None
) -> jnp.ndarray:
    """OpenRLHF's KL-in-reward for per-sequence estimators: A at the last token, -beta KL on
    every token, returns with gamma = 1: A_it = A_i - beta sum_{s >= t} KL_is. Other
    estimators took the KL themselves (or there is none): adv unchanged."""
    if kl_BT is None or c.advantage not in SEQUENCE_ADVANTAGES:
        return adv
    m = jnp.asarray(mask_BT, jnp.float32)
    return adv_lib.returns_to_go(adv_lib.token_rewards(adv, m, kl_BT, c.kl_coef))


def _advantage_metrics(
    adv: jnp.ndarray,
    learn: jnp.ndarray,
    signal: jnp.ndarray,
    mask_BT: jnp.ndarray,
    group_size: int,
) -> dict[str, Metric]:
    """The "adv/..." metrics, over the rows that learn (a per-token advantage is averaged over
    its row's tokens)."""
    lf = learn.astype(jnp.float32)
    n_learn = jnp.maximum(lf.sum(), 1.0)
    adv_B = (
        adv
        if adv.ndim == 1
        else adv.sum(1) / jnp.maximum(jnp.asarray(mask_BT, jnp.float32).sum(1), 1.0)
    )
    return {
        "adv/frac_groups_rejected": Metric.mean(
            filters.rejected_group_fraction(signal, group_size)
        ),
        "adv/frac_rows_kept": Metric.mean(lf.mean()),
        "adv/adv_mean": Metric.mean((adv_B * lf).sum() / n_learn),
        "adv/adv_abs_mean": Metric.mean((jnp.abs(adv_B) * lf).sum() / n_learn),
    }


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
    return _binary_rewards(c.binary_reward, jnp.asarray(baseline_correct_B, bool))


def _binary_rewards(wrong_right: tuple[float, float], correct_B: jnp.ndarray) -> jnp.ndarray:
    """float32 [B]: config.binary_reward's (wrong, right) value for each verdict."""
    return jnp.where(correct_B, wrong_right[1], wrong_right[0]).astype(jnp.float32)


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
    if c.objective != "nll" and c.importance == "sequence":
        old_logp_BT = losses.sequence_old_logp(logp_BT, old_logp_BT, mask_BT)
    pg_BT, aux = _policy_term(c, logp_BT, old_logp_BT, advantages)
    pg_BT, is_metrics = _importance_corrected(
        c, pg_BT, trainer_logp_BT, behaviour_logp_BT, mask_BT, w
    )
    total_BT, kl_BT = _with_kl_and_entropy(c, pg_BT, logp_BT, ref_logp_BT, entropy_BT)
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


def _policy_term(
    c: AlgorithmConfig, logp_BT: jnp.ndarray, old_logp_BT: jnp.ndarray, advantages: jnp.ndarray
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray] | None]:
    """(per-token policy loss, the clipping's aux or None): RAFT's -A logp (objective="nll")
    or the clipped surrogate."""
    if c.objective == "nll":
        # A = 0 on rows kept only for the denominator (rejected_rows="zero").
        return (
            losses.nll_loss(logp_BT) * losses.broadcast_advantages(advantages, logp_BT.shape),
            None,
        )
    return losses.clipped_surrogate(
        logp_BT,
        old_logp_BT,
        advantages,
        clip_low=c.clip_low,
        clip_high=c.clip_high,
        dual_clip=c.dual_clip,
    )


def _importance_corrected(
    c: AlgorithmConfig,
    pg_BT: jnp.ndarray,
    trainer_logp_BT: jnp.ndarray,
    behaviour_logp_BT: jnp.ndarray | None,
    mask_BT: jnp.ndarray,
    w: jnp.ndarray,
) -> tuple[jnp.ndarray, dict[str, Metric]]:
    """(policy term weighted by config.is_correction, the "mismatch/..." and "is/..." metrics)."""
    is_metrics: dict[str, Metric] = {}
    if behaviour_logp_BT is not None:
        is_metrics = correction.mismatch_metrics(trainer_logp_BT, behaviour_logp_BT, mask_BT)
    if c.is_correction is None:
        return pg_BT, is_metrics
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
    return pg_BT, is_metrics


def _with_kl_and_entropy(
    c: AlgorithmConfig,
    pg_BT: jnp.ndarray,
    logp_BT: jnp.ndarray,
    ref_logp_BT: jnp.ndarray | None,
    entropy_BT: jnp.ndarray | None,
) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """(per-token loss: pg + kl_coef * KL_ref when kl_in='loss' - entropy_coef * H, KL_ref or
    None without ref_logp_BT)."""
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
    return total_BT, kl_BT
