"""The sampler-trainer gap: its measure, and its correction by importance sampling (IS).

The sampler's logprobs of the tokens it drew ("behaviour", log mu) and the trainer's
teacher-forced logprobs of the same tokens (log pi_old) differ by float rounding alone: the
decode step and the full forward sum in different orders, and a bfloat16 sampler rounds more.
Per token d_t = old_logp_t - behaviour_logp_t, and rho_t = exp(d_t) is the IS ratio
pi_old / mu that corrects the policy gradient of samples drawn from mu.

A correction is a per-token weight w_t on the policy-gradient term of the loss, computed
without gradient (it changes the measure, not the objective); the loss denominator is unchanged.
r is the ratio at a level (log-ratios clipped to [-20, 20] before exp, as verl):
  token     r_t = exp(d_t)
  sequence  r_i = exp(sum_t d_t)          (the sequence's likelihood ratio)
  geometric g_i = exp(mean_t d_t)         (its per-token geometric mean)
and the weights:
  tis       w = min(r, cap)                          truncated IS (token or sequence)
  mis       w = r * 1[lower <= r <= upper]           masked IS (token or sequence)
  icepop    w = r_t * 1[lower <= r_t <= upper]       IcePop: masked IS per token
  geo_mask  w = 1[lower <= g_i <= upper]             geometric-mean sequence masking
The band is tested on rejection_log_ratio (each token's d clamped to [-20, 20] before a
sequence's sum or mean, as verl's rejection mask); verl_rejection translates a band into
verl's options (its bounds apply to the inverse ratio).
docs/algorithms.md ("Sampler-trainer mismatch") cites the formulas of verl and OpenRLHF.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl4llm.rl.metrics import Metric

CORRECTIONS = ("tis", "mis", "icepop", "geo_mask", None)
IS_LEVELS = ("token", "sequence")
# Corrections whose ratio is taken at --is_level; icepop is per token, geo_mask per sequence.
LEVELLED = ("tis", "mis")
SAFETY_BOUND = 20.0  # log-ratio clip before exp (verl's SAFETY_BOUND)
MISMATCH_BAND = (0.5, 2.0)  # ratios outside it are counted by mismatch/ratio_outside_frac


def _masked(x_BT: jnp.ndarray, mask_BT: jnp.ndarray) -> jnp.ndarray:
    return jnp.where(jnp.asarray(mask_BT, bool), x_BT, 0.0)


def level_log_ratio(
    old_logp_BT: jnp.ndarray, behaviour_logp_BT: jnp.ndarray, mask_BT: jnp.ndarray, level: str
) -> jnp.ndarray:
    """log r [B, T] at `level` ("token", "sequence": the row's sum, "geometric": its mean over
    valid tokens, broadcast over T), clipped to [-20, 20]; 0 at padding."""
    d = _masked(old_logp_BT - behaviour_logp_BT, mask_BT)
    if level == "token":
        log_r = d
    elif level == "sequence":
        log_r = jnp.broadcast_to(d.sum(axis=1, keepdims=True), d.shape)
    elif level == "geometric":
        n = jnp.maximum(jnp.asarray(mask_BT, jnp.float32).sum(axis=1, keepdims=True), 1.0)
        log_r = jnp.broadcast_to(d.sum(axis=1, keepdims=True) / n, d.shape)
    else:
        raise ValueError(f"level={level!r}: choose token, sequence or geometric.")
    return _masked(jnp.clip(log_r, -SAFETY_BOUND, SAFETY_BOUND), mask_BT)


def is_weights(
    correction: str,
    old_logp_BT: jnp.ndarray,
    behaviour_logp_BT: jnp.ndarray,
    mask_BT: jnp.ndarray,
    *,
    level: str = "token",
    cap: float = 2.0,
    lower: float = 0.5,
    upper: float = 2.0,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(w_BT, corrected_BT): the correction's per-token weights (stop-gradient, 0 at padding)
    and where it changed the plain IS ratio's use (bool: truncated, or masked to 0).

    `level` applies to tis and mis; icepop is per token and geo_mask per sequence whatever it
    says. See the module docstring for the formulas."""
    level = {"icepop": "token", "geo_mask": "geometric"}.get(correction, level)
    if correction not in CORRECTIONS or correction is None:
        raise ValueError(f"is_correction={correction!r}: choose one of {CORRECTIONS[:-1]}.")
    old_logp_BT, behaviour_logp_BT = jax.lax.stop_gradient((old_logp_BT, behaviour_logp_BT))
    valid = jnp.asarray(mask_BT, bool)
    r = jnp.exp(level_log_ratio(old_logp_BT, behaviour_logp_BT, mask_BT, level))
    if correction == "tis":
        corrected = r > cap
        w = jnp.minimum(r, cap)
    else:
        log_s = rejection_log_ratio(old_logp_BT, behaviour_logp_BT, mask_BT, level)
        inside = (log_s >= jnp.log(lower)) & (log_s <= jnp.log(upper))
        corrected = ~inside
        w = inside.astype(jnp.float32) * (1.0 if correction == "geo_mask" else r)
    return jnp.where(valid, w, 0.0), corrected & valid


def rejection_log_ratio(
    old_logp_BT: jnp.ndarray, behaviour_logp_BT: jnp.ndarray, mask_BT: jnp.ndarray, level: str
) -> jnp.ndarray:
    """The statistic the band of mis, icepop and geo_mask is tested on, as verl's
    compute_rollout_rejection_mask: each token's d clamped to [-20, 20] *before* the row's
    sum ("sequence") or mean ("geometric"), not clamped after (a weight's log-ratio,
    level_log_ratio, clamps the sum instead). [B, T], 0 at padding."""
    m = jnp.asarray(mask_BT, jnp.float32)
    d = _masked(jnp.clip(old_logp_BT - behaviour_logp_BT, -SAFETY_BOUND, SAFETY_BOUND), m > 0)
    if level == "token":
        return d
    s_B1 = d.sum(axis=1, keepdims=True)
    if level == "geometric":
        s_B1 = s_B1 / jnp.maximum(m.sum(axis=1, keepdims=True), 1.0)
    return _masked(jnp.broadcast_to(s_B1, d.shape), m > 0)


# is_correction (and is_level) -> verl's rollout_rs option of the same rejection.
VERL_REJECTION = {("mis", "token"): "token_k1", ("mis", "sequence"): "seq_sum_k1"}
VERL_REJECTION.update({("icepop", "token"): "token_k1", ("geo_mask", "token"): "seq_mean_k1"})


def verl_rejection(correction: str, level: str, lower: float, upper: float) -> tuple[str, str]:
    """(rollout_rs, rollout_rs_threshold) of verl's compute_rollout_rejection_mask that keeps
    the same tokens as (correction, level, [lower, upper]). verl's k1 statistic is
    -log(pi_old / mu), so its band "lo_up" bounds the inverse ratio mu / pi_old: the band
    [lower, upper] on the ratio is verl's "1/upper_1/lower" (lower = 0: an upper bound inf);
    a symmetric band [1/u, u] reads the same both ways, an asymmetric one does not."""
    option = VERL_REJECTION.get((correction, level))
    if option is None:
        raise ValueError(
            f"is_correction={correction!r} with is_level={level!r} has no verl rejection "
            f"option; choose one of {sorted(VERL_REJECTION)}."
        )
    inv_upper = "inf" if lower == 0 else repr(1.0 / lower)
    return option, f"{1.0 / upper!r}_{inv_upper}"


def mismatch_metrics(
    old_logp_BT: jnp.ndarray, behaviour_logp_BT: jnp.ndarray, mask_BT: jnp.ndarray
) -> dict[str, Metric]:
    """The gap on every sampled token: mismatch/logp_abs_diff_mean (token mean of
    |old_logp - behaviour_logp|), mismatch/logp_abs_diff_max, mismatch/ratio_outside_frac
    (tokens whose ratio exp(old_logp - behaviour_logp) is outside [0.5, 2])."""
    valid = jnp.asarray(mask_BT, bool)
    d = jax.lax.stop_gradient(_masked(old_logp_BT - behaviour_logp_BT, valid))
    n = valid.astype(jnp.float32).sum()
    lo, hi = MISMATCH_BAND
    # exp(d) outside [lo, hi] <=> d outside [log lo, log hi] (no overflow for any d).
    outside = valid & ((d < jnp.log(lo)) | (d > jnp.log(hi)))
    return {
        "mismatch/logp_abs_diff_mean": Metric.mean(jnp.abs(d).sum(), n),
        "mismatch/logp_abs_diff_max": Metric.max(jnp.where(valid, jnp.abs(d), -jnp.inf).max()),
        "mismatch/ratio_outside_frac": Metric.mean(outside.astype(jnp.float32).sum(), n),
    }


def correction_metrics(
    w_BT: jnp.ndarray, corrected_BT: jnp.ndarray, weights_BT: jnp.ndarray
) -> dict[str, Metric]:
    """Of the tokens in the loss (weights_BT > 0, i.e. valid tokens of kept rows):
    is/corrected_token_frac (truncated or masked), is/corrected_seq_frac (rows with at least
    one such token, of the rows with a token in the loss), is/weight_mean (mean IS weight)."""
    valid = weights_BT > 0
    n_tokens = valid.astype(jnp.float32).sum()
    hit = corrected_BT & valid
    rows = valid.any(axis=1)
    return {
        "is/corrected_token_frac": Metric.mean(hit.astype(jnp.float32).sum(), n_tokens),
        "is/corrected_seq_frac": Metric.mean(
            hit.any(axis=1).astype(jnp.float32).sum(), rows.astype(jnp.float32).sum()
        ),
        "is/weight_mean": Metric.mean(jnp.where(valid, w_BT, 0.0).sum(), n_tokens),
    }


def geometric_row_weights(w_BT: jnp.ndarray, mask_BT: jnp.ndarray) -> jnp.ndarray:
    """A per-sequence loss's IS weight [B, T]: the geometric mean of the row's token weights,
    exp(mean_t log(w_t + 1e-10)) over its valid tokens, on every token (verl's weighting of
    its geo_mean loss: a masked token, w = 0, pulls the row's weight towards 0)."""
    m = jnp.asarray(mask_BT, jnp.float32)
    log_w = jnp.where(m > 0, jnp.log(w_BT + 1e-10), 0.0)
    g_B = jnp.exp(log_w.sum(axis=1) / (m.sum(axis=1) + 1e-8))
    return jnp.broadcast_to(g_B[:, None], m.shape)
