"""The policy losses beside PPO's clipped surrogate (losses.py): CISPO, SAPO, GMPO, Clip-Cov,
KL-Cov and GPG, each a per-token loss [B, T] with its bool [B, T] indicators.

Pure jax.numpy; log-ratios, ratios and losses in float32 whatever the inputs' dtype, the
log-ratio clamped to [-20, 20] before exp (as losses.log_ratio). ``advantages`` is [B]
(broadcast over T) or [B, T] and never differentiated. Each matches the loss of verl's
``core_algos.py`` of the same name (docs/algorithms.md gives the formulas, defaults and
differences); ``policy_loss`` adds the KL and entropy terms, the sampler-trainer correction
and the aggregation.

Every hyperparameter may be a traced value (a schedule does not recompile); Clip-Cov and
KL-Cov take an ``axis_name`` for their batch-wide selection (exact under shard_map).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl4llm.rl import collectives, losses

Aux = dict[str, jnp.ndarray]


def _ratio(logp_BT: jnp.ndarray, old_logp_BT: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    d = losses.log_ratio(logp_BT, old_logp_BT)
    return d, jnp.exp(d)


def cispo_loss(
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray,
    advantages: jnp.ndarray,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.2,
) -> tuple[jnp.ndarray, Aux]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, Sec. 3.1, the CISPO objective): a REINFORCE token loss
    weighted by the clipped, stop-gradient IS ratio,
        L = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi.
    Every token keeps its gradient (the clip bounds the weight, it drops no token).
    clip_low >= 1: no lower bound (the paper's setting). aux: clipped_low / clipped_high
    (r below / above the band, whatever the sign of A)."""
    adv = losses.broadcast_advantages(advantages, logp_BT.shape)
    _, ratio = _ratio(logp_BT, old_logp_BT)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    loss = -weight * adv * jnp.asarray(logp_BT, jnp.float32)
    aux = {"clipped_low": ratio < 1.0 - clip_low, "clipped_high": ratio > 1.0 + clip_high}
    return loss, aux


def sapo_gate(ratio_BT: jnp.ndarray, tau_BT: jnp.ndarray) -> jnp.ndarray:
    """SAPO's soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau: f(1) = 2 / tau and
    f'(1) = 1 (the unclipped surrogate's gradient on policy), decaying away from r = 1."""
    return jax.nn.sigmoid(tau_BT * (ratio_BT - 1.0)) * (4.0 / tau_BT)


def sapo_loss(
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray,
    advantages: jnp.ndarray,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[jnp.ndarray, Aux]:
    """SAPO (arXiv:2511.20347, the SAPO objective and its gate f_{i,t}): the hard clip
    replaced by a soft, temperature-controlled gate, L = -f(r) A with f = sapo_gate,
    tau = tau_pos where A > 0 and tau_neg where A <= 0 (a faster decay for negative tokens,
    tau_neg > tau_pos). aux: none."""
    adv = losses.broadcast_advantages(advantages, logp_BT.shape)
    _, ratio = _ratio(logp_BT, old_logp_BT)
    tau = jnp.where(adv > 0, jnp.asarray(tau_pos, jnp.float32), jnp.asarray(tau_neg, jnp.float32))
    return -sapo_gate(ratio, tau) * adv, {}


def gpg_loss(logp_BT: jnp.ndarray, advantages: jnp.ndarray) -> tuple[jnp.ndarray, Aux]:
    """GPG (arXiv:2504.02546, the GPG objective): the plain policy gradient L = -A log pi, no
    ratio, no clip (on-policy by construction). aux: none."""
    adv = losses.broadcast_advantages(advantages, logp_BT.shape)
    return -adv * jnp.asarray(logp_BT, jnp.float32), {}


def gmpo_loss(
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray,
    advantages: jnp.ndarray,
    mask_BT: jnp.ndarray,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> tuple[jnp.ndarray, Aux]:
    """GMPO (arXiv:2507.20673, the GMPO objective): the geometric mean of the token ratios of a
    sequence, each clipped in log space on the pessimistic side of A,
        L_i = -A_i exp(mean_t sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -clip_low, clip_high))),
    d_t = logp - old_logp over the row's valid tokens (mask_BT) and A_i the row's token-mean
    advantage. Returns L_i on every token of row i (aggregate with seq-mean-token-mean: the
    mean over sequences). aux: clipped_high (A > 0) / clipped_low (A < 0), tokens whose d_t
    lies outside [-clip_low, clip_high]."""
    m = jnp.asarray(mask_BT, jnp.float32)
    adv_BT = losses.broadcast_advantages(advantages, logp_BT.shape)
    d, _ = _ratio(logp_BT, old_logp_BT)
    sign = jnp.sign(adv_BT)
    d_clip = jnp.clip(d, -clip_low, clip_high)
    d_min = sign * jnp.minimum(sign * d, sign * d_clip)
    n_B = jnp.maximum(m.sum(axis=1), 1.0)
    log_ratio_B = jnp.where(m > 0, d_min, 0.0).sum(axis=1) / n_B
    adv_B = jnp.where(m > 0, adv_BT, 0.0).sum(axis=1) / n_B
    loss_B = -adv_B * jnp.exp(log_ratio_B)
    clipped = d != d_clip
    aux = {"clipped_low": clipped & (adv_BT < 0), "clipped_high": clipped & (adv_BT > 0)}
    return jnp.broadcast_to(loss_B[:, None], logp_BT.shape), aux


def token_covariance(
    logp_BT: jnp.ndarray,
    advantages: jnp.ndarray,
    mask_BT: jnp.ndarray,
    axis_name: str | None = None,
) -> jnp.ndarray:
    """(A - mean A) (log pi - mean log pi) per token, the means over the batch's valid tokens
    (mask_BT > 0, every shard with axis_name): the covariance terms that drive the entropy
    change (arXiv:2505.22617, the covariance of its entropy-dynamics theorem). Without
    gradient; 0 off the mask."""
    valid = jnp.asarray(mask_BT, jnp.float32) > 0
    adv = losses.broadcast_advantages(advantages, logp_BT.shape)
    logp = jax.lax.stop_gradient(jnp.asarray(logp_BT, jnp.float32))
    n = jnp.maximum(collectives.total(valid.astype(jnp.float32), axis_name), 1.0)

    def centred(x):
        return x - collectives.total(jnp.where(valid, x, 0.0), axis_name) / n

    return jnp.where(valid, centred(adv) * centred(logp), 0.0)


def _selection_size(ratio: float, valid: jnp.ndarray, axis_name: str | None) -> jnp.ndarray:
    """max(floor(ratio * #valid tokens of the batch), 1), as verl's int(ratio * n)."""
    n = collectives.total(valid.astype(jnp.float32), axis_name)
    return jnp.maximum(jnp.floor(ratio * n), 1.0)


def clip_cov_draws(
    key: jax.Array, shape_BT: tuple[int, ...], axis_name: str | None = None
) -> jnp.ndarray:
    """The uniform draws [B, T] that order Clip-Cov's candidates: one draw per token of the
    unsharded batch from `key`, this shard's rows of it (so a sharded batch draws as the
    unsharded one)."""
    B, T = shape_BT
    shards = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    u = jax.random.uniform(key, (B * shards, T))
    start = 0 if axis_name is None else jax.lax.axis_index(axis_name) * B
    return jax.lax.dynamic_slice_in_dim(u, start, B, axis=0)


def clip_cov_loss(
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray,
    advantages: jnp.ndarray,
    mask_BT: jnp.ndarray,
    key: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio: float = 2e-4,
    lower: float = 1.0,
    upper: float = 5.0,
    axis_name: str | None = None,
) -> tuple[jnp.ndarray, Aux]:
    """Clip-Cov (arXiv:2505.22617, Clip-Cov): PPO's clipped surrogate with the
    gradient of a few high-covariance tokens detached. Candidates: valid tokens the clip
    left alone whose token_covariance lies in (lower, upper); of them, the
    min(max(floor(ratio * #valid), 1), #candidates) with the largest clip_cov_draws(key) are
    selected and their loss set to 0 (verl multiplies it by 0: no value, no gradient).
    aux: the surrogate's indicators and cov_selected."""
    loss, aux = losses.clipped_surrogate(
        logp_BT,
        old_logp_BT,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    valid = jnp.asarray(mask_BT, jnp.float32) > 0
    cov = token_covariance(logp_BT, advantages, mask_BT, axis_name)
    clipped = aux["clipped_low"] | aux["clipped_high"]
    candidate = valid & ~clipped & (cov > lower) & (cov < upper)
    draws = jnp.where(candidate, clip_cov_draws(key, logp_BT.shape, axis_name), -jnp.inf)
    rank = collectives.rank_descending(draws, axis_name)
    selected = candidate & (rank < _selection_size(ratio, valid, axis_name))
    aux = dict(aux, cov_selected=selected)
    del aux["ratio"]
    return jnp.where(selected, 0.0, loss), aux


def kl_cov_loss(
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray,
    advantages: jnp.ndarray,
    mask_BT: jnp.ndarray,
    *,
    ratio: float = 2e-3,
    coef: float = 1.0,
    axis_name: str | None = None,
) -> tuple[jnp.ndarray, Aux]:
    """KL-Cov (arXiv:2505.22617, KL-Cov): the unclipped surrogate -A r, plus
    coef * |log r| on the max(floor(ratio * #valid), 1) valid tokens of largest
    token_covariance (ties by position). aux: cov_selected."""
    adv = losses.broadcast_advantages(advantages, logp_BT.shape)
    d, r = _ratio(logp_BT, old_logp_BT)
    valid = jnp.asarray(mask_BT, jnp.float32) > 0
    cov = jnp.where(valid, token_covariance(logp_BT, advantages, mask_BT, axis_name), -jnp.inf)
    rank = collectives.rank_descending(cov, axis_name)
    selected = valid & (rank < _selection_size(ratio, valid, axis_name))
    loss = -adv * r + jnp.where(selected, coef * jnp.abs(d), 0.0)
    return loss, {"cov_selected": selected}
