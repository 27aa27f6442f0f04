"""The two entry points of the RL math: ``compute_advantages`` (once per rollout batch) and
``policy_loss`` (per micro-batch), with ``loss_denominator``.

The trainer calls only these; what they compute is set by an ``AlgorithmConfig``
(algorithm_config.py, with ``validate`` and the knobs' choices; all importable from here too):
its ``advantage`` and ``objective`` name entries of the registries (registry.py), the built-in
ones in estimators.py and objectives.py.

jit: ``config`` and ``group_size`` fix shapes and branches; pass them static
(``jax.jit(rl.compute_advantages, static_argnames=("config", "group_size"))``,
``jax.jit(rl.policy_loss, static_argnames="config")``), or pass ``config`` as an ordinary
argument to trace its float hyperparameters (a kl_coef or clip schedule then compiles once).
``axis_name`` (a static string) names the batch axis under shard_map: batch-wide statistics
and the metrics then combine every shard.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm.rl import advantages as adv_lib
from jaxrl4llm.rl import (
    correction,
    estimators,
    filters,
    losses,
    objectives,  # noqa: F401  (the built-in losses register on import)
    registry,
)
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
from jaxrl4llm.rl.metrics import Metric, reduce_metrics
from jaxrl4llm.rl.shapes import batch_shape, expect_BT, expect_float, expect_shape

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
    *,
    truncated_B: jnp.ndarray | None = None,
    logp_BT: jnp.ndarray | None = None,
    ref_logp_BT: jnp.ndarray | None = None,
    valid_B: jnp.ndarray | None = None,
    baseline_B: jnp.ndarray | None = None,
    baseline_correct_B: jnp.ndarray | None = None,
    sum_pi_squared_BT: jnp.ndarray | None = None,
    values_BT: jnp.ndarray | None = None,
    axis_name: str | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, Metric]]:
    """(advantages [B] or [B, T], keep_B, metrics): ``compute_advantages_and_returns`` without
    the critic's returns (see it for every argument). Under jit, group_size is static
    (``static_argnames=("config", "group_size")``, or config traced; axis_name static too)."""
    # Every argument, by name.
    adv, _, keep, metrics = compute_advantages_and_returns(**locals())
    return adv, keep, metrics


def compute_advantages_and_returns(
    config: AlgorithmConfig,
    rewards_B: jnp.ndarray,
    correct_B: jnp.ndarray,
    mask_BT: jnp.ndarray,
    group_size: int,
    **rollout: jnp.ndarray | str | None,
) -> tuple[jnp.ndarray, jnp.ndarray | None, jnp.ndarray, dict[str, Metric]]:
    """Advantages for one rollout batch. Returns (advantages [B] or [B, T] (float32, without
    gradient), returns_BT (the critic's targets; None unless advantage="gae"), keep_B bool,
    metrics: rl.metrics.Metric values by final name, "adv/...").

    Arguments (B rows = P prompts x group_size contiguous rows, T completion tokens):
    rewards_B float [B], correct_B bool [B] (the verifier's verdicts), mask_BT [B, T] (bool
    or {0, 1}), and these keywords (``compute_advantages`` lists them in its signature):
    truncated_B bool [B]: hit max_new_tokens (needed by config.overlong_filter).
    logp_BT, ref_logp_BT float [B, T]: the sampling policy's and the reference's logprobs
        (kl_in='reward' needs both; advantage='otb' needs logp_BT).
    valid_B bool [B] (default all True): rows with a reward at all. A row without one leaves
        the loss and every statistic, and its group is judged (all-correct / all-wrong, best
        of group) by its valid rows only.
    baseline_B, baseline_correct_B [B]: advantage="remax" only: each row's baseline reward
        and verdict, those of its prompt's greedy completion (binary_reward maps the verdict).
    sum_pi_squared_BT float [B, T]: advantage="otb" only: sum_v pi_v^2 of the sampling
        policy at each token.
    values_BT float [B, T]: advantage="gae" only: the critic's values (V(s_t) at token t).
    axis_name: the batch axis under shard_map (each shard holds whole groups).

    keep_B marks the rows that enter the loss. Group rejection and RAFT's selection decide
    which rows carry a learning signal and enter the statistics (batch mean/std, whitening);
    a row they reject is out of the loss (rejected_rows="drop") or in it with A = 0
    (rejected_rows="zero"). Overlong filtering only removes rows from the loss, so a
    truncated sample still counts in its group's statistics (as in DAPO).
    """
    args = _rollout_args(rollout, rewards_B, correct_B, mask_BT)
    c = config
    r_B, valid, signal = _rewards_and_signal(c, rewards_B, correct_B, group_size, args["valid_B"])
    keep = _loss_rows(c, valid, signal, args["truncated_B"])
    entry = registry.advantage_entry(c.advantage)
    x = registry.AdvantageInputs(
        rewards_B=r_B,
        correct_B=jnp.asarray(correct_B, bool) & valid,
        mask_BT=jnp.asarray(mask_BT, jnp.float32),
        group_size=group_size,
        signal_B=signal,
        valid_B=valid,
        kl_BT=_reward_kl(c, args["logp_BT"], args["ref_logp_BT"]),
        **{k: args[k] for k in _ESTIMATOR_ARGS},
    )
    adv, returns_BT = entry.fn(c, x)
    if entry.kl_in_reward == "sequence":
        adv = _sequence_kl_in_reward(c, adv, x.mask_BT, x.kl_BT)
    # Rows without a learning signal carry A = 0 (rejected ones are masked out under "drop";
    # under "zero" this is what keeps them in the loss without a policy gradient).
    learn = signal & keep
    adv = jnp.where(learn if adv.ndim == 1 else learn[:, None], adv, 0.0)
    metrics = _advantage_metrics(adv, learn, signal, x.mask_BT, group_size)
    return jax.lax.stop_gradient(adv), returns_BT, keep, reduce_metrics(metrics, x.axis_name)


# The keywords of compute_advantages (and of compute_advantages_and_returns).
_ROLLOUT_ARGS = (
    "truncated_B",
    "logp_BT",
    "ref_logp_BT",
    "valid_B",
    "baseline_B",
    "baseline_correct_B",
    "sum_pi_squared_BT",
    "values_BT",
    "axis_name",
)
# Those an estimator reads as they are (AdvantageInputs fields).
_ESTIMATOR_ARGS = (
    "baseline_B",
    "baseline_correct_B",
    "values_BT",
    "logp_BT",
    "sum_pi_squared_BT",
    "axis_name",
)


def _rollout_args(
    rollout: dict[str, Any], rewards_B: jnp.ndarray, correct_B: jnp.ndarray, mask_BT: jnp.ndarray
) -> dict[str, Any]:
    """Every keyword of _ROLLOUT_ARGS (None where not given), each array checked against
    mask_BT's [B, T] (the error names the argument that disagrees)."""
    unknown = sorted(set(rollout) - set(_ROLLOUT_ARGS))
    if unknown:
        raise TypeError(f"unknown argument(s) {unknown}; valid: {', '.join(_ROLLOUT_ARGS)}.")
    args = {k: rollout.get(k) for k in _ROLLOUT_ARGS}
    B, T = batch_shape("mask_BT", mask_BT)
    for name, x in (("rewards_B", rewards_B), ("correct_B", correct_B)):
        expect_shape(name, x, (B,), "[B], one per row of mask_BT")
    for name in ("truncated_B", "valid_B", "baseline_B", "baseline_correct_B"):
        expect_shape(name, args[name], (B,), "[B], one per row of mask_BT")
    for name in ("logp_BT", "ref_logp_BT", "sum_pi_squared_BT", "values_BT"):
        expect_BT(name, args[name], "mask_BT", (B, T))
    return args


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
        r_B = estimators.binary_rewards(c.binary_reward, correct)
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


def _is_zero(x: object) -> bool:
    """A coefficient known to be 0 (a traced one may be anything: its term stays)."""
    return isinstance(x, (int, float)) and x == 0


def _term_input(coef: object, x: jnp.ndarray | None, message: str) -> jnp.ndarray | None:
    """x when the term of `coef` applies, else None: a nonzero number needs its input x
    (else ValueError(message)); a traced coefficient applies when x is given."""
    if _is_zero(coef):
        return None
    if x is None and isinstance(coef, (int, float)):
        raise ValueError(message)
    return x


def _reward_kl(
    c: AlgorithmConfig, logp_BT: jnp.ndarray | None, ref_logp_BT: jnp.ndarray | None
) -> jnp.ndarray | None:
    """The per-token KL that enters the reward (kl_in='reward'), else None."""
    message = "kl_in='reward' needs logp_BT (sampling policy) and ref_logp_BT (reference model)."
    ref = _term_input(c.kl_coef, ref_logp_BT, message) if c.kl_in == "reward" else None
    if ref is None:
        return None
    if logp_BT is None:
        raise ValueError(message)
    return losses.kl_estimate(logp_BT, ref, c.kl_estimator, c.k3_clamp)


def _sequence_kl_in_reward(
    c: AlgorithmConfig, adv: jnp.ndarray, mask_BT: jnp.ndarray, kl_BT: jnp.ndarray | None
) -> jnp.ndarray:
    """OpenRLHF's KL-in-reward for per-sequence estimators: A at the last token, -beta KL on
    every token, returns with gamma = 1: A_it = A_i - beta sum_{s >= t} KL_is."""
    if kl_BT is None:
        return adv
    return adv_lib.returns_to_go(adv_lib.token_rewards(adv, mask_BT, kl_BT, c.kl_coef))


def _advantage_metrics(
    adv: jnp.ndarray,
    learn: jnp.ndarray,
    signal: jnp.ndarray,
    mask_BT: jnp.ndarray,
    group_size: int,
) -> dict[str, Metric]:
    """The "adv/..." metrics, over the rows that learn (a per-token advantage is averaged over
    its row's tokens), as (total, count) so that shards combine exactly."""
    lf = learn.astype(jnp.float32)
    n_learn = lf.sum()
    adv_B = adv if adv.ndim == 1 else adv.sum(1) / jnp.maximum(mask_BT.sum(1), 1.0)
    kept_P = adv_lib.to_groups(signal, group_size).any(axis=1).astype(jnp.float32)
    return {
        "adv/frac_groups_rejected": Metric.mean(kept_P.size - kept_P.sum(), kept_P.size),
        "adv/frac_rows_kept": Metric.mean(lf.sum(), lf.size),
        "adv/adv_mean": Metric.mean((adv_B * lf).sum(), n_learn),
        "adv/adv_abs_mean": Metric.mean((jnp.abs(adv_B) * lf).sum(), n_learn),
    }


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
    key: jax.Array | None = None,
    axis_name: str | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, Metric]]:
    """(loss_sum, denominator, metrics) of one (micro-)batch; keep_B=None keeps every row.

    Per token: config.objective's registered loss (e.g. the clipped surrogate) + kl_coef *
    KL_ref (kl_in='loss') - entropy_coef * H, aggregated with config.agg; float32 whatever
    the inputs' dtype, advantages without gradient. old_logp_BT=None: on-policy (ratio 1).
    ref_logp_BT: the KL to the reference, always logged ("policy/kl_ref"). Combine
    micro-batches by summing loss_sum and denominator (or divide each loss_sum by
    loss_denominator() of the mini-batch); merge the Metric values with combine_metrics.
    behaviour_logp_BT: the sampler's logprobs of the tokens: the gap is logged
    ("mismatch/...") and config.is_correction weights the policy term ("is/...").
    key: objective 'clip_cov''s draw (None: a key drawn from the batch itself).
    axis_name: the batch axis under shard_map: Clip-Cov / KL-Cov select over every shard and
    the metrics are the whole batch's; loss_sum and denominator stay this shard's (psum them).
    """
    c = config
    _check_loss_inputs(logp_BT, old_logp_BT, advantages, mask_BT, keep_B)
    _check_like_logp(
        logp_BT, ref_logp_BT=ref_logp_BT, entropy_BT=entropy_BT, behaviour_logp_BT=behaviour_logp_BT
    )
    x, trainer_logp_BT, keep_B = _policy_inputs(
        c, logp_BT, old_logp_BT, advantages, mask_BT, keep_B, key, axis_name
    )
    entry = registry.policy_loss_entry(c.objective)
    pg_BT, aux = entry.fn(c, x)
    pg_BT, is_metrics = _importance_corrected(
        c, entry, pg_BT, trainer_logp_BT, behaviour_logp_BT, mask_BT, x.mask_BT
    )
    total_BT, kl_BT = _with_kl_and_entropy(c, pg_BT, x.logp_BT, ref_logp_BT, entropy_BT)
    loss_sum, denom = losses.aggregate(total_BT, mask_BT, keep_B, c.agg, c.max_tokens)
    d = losses.log_ratio(x.logp_BT, x.old_logp_BT)
    metrics = losses.token_metrics(
        x.mask_BT,
        keep_B,
        ratio_BT=jnp.exp(d),
        log_ratio_BT=d,
        clip_aux=aux,
        pg_loss_BT=pg_BT,
        kl_ref_BT=kl_BT,
        entropy_BT=entropy_BT,
    )
    metrics = jax.tree_util.tree_map(jax.lax.stop_gradient, {**metrics, **is_metrics})
    return loss_sum, denom, reduce_metrics(metrics, axis_name)


def _policy_inputs(
    c: AlgorithmConfig,
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray | None,
    advantages: jnp.ndarray,
    mask_BT: jnp.ndarray,
    keep_B: jnp.ndarray | None,
    key: jax.Array | None,
    axis_name: str | None,
) -> tuple[registry.PolicyInputs, jnp.ndarray, jnp.ndarray]:
    """(the loss's inputs in float32, the trainer's pi_old before GSPO's sequence ratio,
    keep_B with None as all rows)."""
    logp_BT = jnp.asarray(logp_BT, jnp.float32)
    old = logp_BT if old_logp_BT is None else jnp.asarray(old_logp_BT, jnp.float32)
    trainer_logp_BT = jax.lax.stop_gradient(old)
    if keep_B is None:
        keep_B = jnp.ones(logp_BT.shape[:1], bool)
    if c.importance == "sequence":
        old = losses.sequence_old_logp(logp_BT, old, mask_BT)
    x = registry.PolicyInputs(
        logp_BT=logp_BT,
        old_logp_BT=jax.lax.stop_gradient(old),
        advantages_BT=losses.broadcast_advantages(advantages, logp_BT.shape),
        mask_BT=losses.row_weights(mask_BT, keep_B),
        key=key,
        axis_name=axis_name,
    )
    return x, trainer_logp_BT, keep_B


def _check_loss_inputs(
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray | None,
    advantages: jnp.ndarray,
    mask_BT: jnp.ndarray,
    keep_B: jnp.ndarray | None,
) -> None:
    """The policy term's arrays against logp_BT's [B, T], naming the one that disagrees."""
    expect_float("logp_BT", logp_BT)
    B, T = _check_like_logp(logp_BT, old_logp_BT=old_logp_BT)
    expect_shape(
        "mask_BT", mask_BT, (B, T), "[B, T] like logp_BT; a mask that broadcasts scales the loss"
    )
    expect_shape("keep_B", keep_B, (B,), "[B], one per row of logp_BT")
    if tuple(jnp.shape(advantages)) not in ((B,), (B, T)):
        raise ValueError(
            f"advantages have shape {jnp.shape(advantages)}; expected [B]={(B,)} or "
            f"[B, T]={(B, T)}."
        )


def _check_like_logp(logp_BT: jnp.ndarray, **arrays_BT: jnp.ndarray | None) -> tuple[int, int]:
    """(B, T) of logp_BT; each given float [B, T] array must have that shape."""
    B, T = batch_shape("logp_BT", logp_BT)
    for name, x in arrays_BT.items():
        expect_BT(name, x, "logp_BT", (B, T))
    return B, T


def _importance_corrected(
    c: AlgorithmConfig,
    entry: registry.PolicyLoss,
    pg_BT: jnp.ndarray,
    trainer_logp_BT: jnp.ndarray,
    behaviour_logp_BT: jnp.ndarray | None,
    mask_BT: jnp.ndarray,
    w: jnp.ndarray,
) -> tuple[jnp.ndarray, dict[str, Metric]]:
    """(policy term weighted by config.is_correction, the "mismatch/..." and "is/..." metrics).
    A per-sequence loss takes the geometric mean of its row's weights (as verl's geo_mean)."""
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
        jnp.asarray(behaviour_logp_BT, jnp.float32),
        mask_BT,
        level=c.is_level,
        cap=c.is_cap,
        lower=c.is_lower,
        upper=c.is_upper,
    )
    if entry.sequence_level:
        is_w_BT = correction.geometric_row_weights(is_w_BT, mask_BT)
    is_metrics.update(correction.correction_metrics(is_w_BT, corrected_BT, w))
    return pg_BT * is_w_BT, is_metrics


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
    message = "kl_in='loss' with kl_coef > 0 needs ref_logp_BT (reference-model log-probs)."
    kl_in_loss_BT = _term_input(c.kl_coef, kl_BT, message) if c.kl_in == "loss" else None
    if kl_in_loss_BT is not None:
        total_BT = total_BT + c.kl_coef * kl_in_loss_BT
    message = "entropy_coef != 0 needs entropy_BT (losses.entropy_from_logits of the logits)."
    entropy_in_loss_BT = _term_input(c.entropy_coef, entropy_BT, message)
    if entropy_in_loss_BT is not None:
        total_BT = total_BT - c.entropy_coef * jnp.asarray(entropy_in_loss_BT, jnp.float32)
    return total_BT, kl_BT
