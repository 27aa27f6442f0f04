"""PPO with a critic: GAE over token rewards, verl's masked whitening, the clipped value loss.

Pure jax.numpy. Shapes follow the package: B rows, T completion tokens; values_BT[t] is the
critic's V(s_t), read at the same column as the logprob of token t (the state before it).
Token rewards come from ``advantages.token_rewards``: the outcome reward at the last real
token, minus kl_coef * KL_t on every real token when the KL is in the reward.

Conventions (as verl's compute_gae_advantage_return / compute_value_loss, core_algos.py):
  * GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, with
    V and A past the last real token taken as 0; masked positions are skipped (they carry
    the next real position's V and A), returns R_t = A_t + V_t; A and R are 0 off the mask.
  * The advantages are then whitened over every real token of the kept rows:
    (A - mean) * rsqrt(var + 1e-8), var unbiased (verl's masked_whiten); a batch whose
    advantages are all equal whitens to 0 (the package's "no spread" rule).
  * Value loss per token: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2),
    aggregated like the policy loss (losses.aggregate: exact over micro-batches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl4llm.rl import advantages as adv_lib
from jaxrl4llm.rl import losses
from jaxrl4llm.rl.metrics import Metric

WHITEN_EPS = 1e-8  # verl's masked_whiten: rsqrt(var + 1e-8)


def gae_advantages(
    token_rewards_BT: jnp.ndarray,
    values_BT: jnp.ndarray,
    mask_BT: jnp.ndarray,
    *,
    gamma: float,
    lam: float,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(advantages_BT, returns_BT) by generalized advantage estimation (Schulman et al. 2016),
    before whitening; both are 0 off the mask."""
    m = jnp.asarray(mask_BT, jnp.float32)
    r = jnp.asarray(token_rewards_BT, jnp.float32)
    v = jnp.asarray(values_BT, jnp.float32)

    def step(carry, xs):
        next_v, next_a = carry
        r_t, v_t, m_t = xs
        a_t = r_t + gamma * next_v - v_t + gamma * lam * next_a
        # A masked position passes the next real position's V and A through unchanged.
        carry = (jnp.where(m_t > 0, v_t, next_v), jnp.where(m_t > 0, a_t, next_a))
        return carry, carry[1]

    # zeros_like keeps the rows' sharding type (shard_map's scan needs carry in = carry out).
    zeros_B = jnp.zeros_like(r[:, 0])
    _, adv_TB = jax.lax.scan(step, (zeros_B, zeros_B), (r.T, v.T, m.T), reverse=True)
    adv_BT = adv_TB.T * m
    return adv_BT, (adv_BT + v) * m


def masked_whiten(
    values_BT: jnp.ndarray,
    weights_BT: jnp.ndarray,
    eps: float = WHITEN_EPS,
    axis_name: str | None = None,
) -> jnp.ndarray:
    """(x - mean) * rsqrt(var + eps) over the weighted entries of the batch (every shard of
    axis_name; var with ddof=1, as verl's masked_whiten); 0 elsewhere, and 0 everywhere when
    those entries are all equal."""
    w = jnp.asarray(weights_BT, jnp.float32)
    mu, std, flat = adv_lib._stats(values_BT, w, None, 1, axis_name)
    out = jnp.where(flat, 0.0, (values_BT - mu) * jax.lax.rsqrt(jnp.square(std) + eps))
    return jnp.where(w > 0, out, 0.0)


def ppo_advantages(
    rewards_B: jnp.ndarray,
    values_BT: jnp.ndarray,
    mask_BT: jnp.ndarray,
    *,
    gamma: float,
    lam: float,
    kl_BT: jnp.ndarray | None = None,
    kl_coef: float = 0.0,
    keep_B: jnp.ndarray | None = None,
    axis_name: str | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """PPO's (advantages_BT, returns_BT): token rewards (r at the last real token, minus
    kl_coef * KL_t on every real token), GAE, advantages whitened over the kept rows' real
    tokens. keep_B rows leave the whitening statistics; their advantages are 0 (their
    returns stay, so the critic may still learn from them)."""
    m = jnp.asarray(mask_BT, jnp.float32)
    r_BT = adv_lib.token_rewards(rewards_B, m, kl_BT, kl_coef)
    adv_BT, ret_BT = gae_advantages(r_BT, values_BT, m, gamma=gamma, lam=lam)
    w_BT = losses.row_weights(m, keep_B)
    return masked_whiten(adv_BT, w_BT, axis_name=axis_name), ret_BT


def value_loss(
    values_BT: jnp.ndarray,
    old_values_BT: jnp.ndarray,
    returns_BT: jnp.ndarray,
    mask_BT: jnp.ndarray,
    keep_B: jnp.ndarray | None = None,
    *,
    value_clip: float | None = 0.2,
    agg: str = "token-mean",
    max_tokens: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, dict[str, Metric]]:
    """(loss_sum, denominator, metrics) of PPO's clipped value loss on one (micro-)batch.

    Per token 0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = V_old + clip(V - V_old,
    -value_clip, value_clip); value_clip None = the unclipped 0.5 * (V - R)^2. Combine
    micro-batches like policy_loss (sum the loss sums, one denominator of the mini-batch).
    """
    v = jnp.asarray(values_BT, jnp.float32)
    ret = jax.lax.stop_gradient(jnp.asarray(returns_BT, jnp.float32))
    unclipped_BT = jnp.square(v - ret)
    if value_clip is None:
        loss_BT, clipped_BT = unclipped_BT, jnp.zeros(v.shape, bool)
    else:
        old = jax.lax.stop_gradient(jnp.asarray(old_values_BT, jnp.float32))
        v_clipped = jnp.clip(v, old - value_clip, old + value_clip)
        clipped_sq_BT = jnp.square(v_clipped - ret)
        loss_BT = jnp.maximum(unclipped_BT, clipped_sq_BT)
        clipped_BT = clipped_sq_BT > unclipped_BT
    loss_sum, denom = losses.aggregate(0.5 * loss_BT, mask_BT, keep_B, agg, max_tokens)
    w = losses.row_weights(mask_BT, keep_B)
    n = w.sum()

    def token_mean(x):
        return Metric.mean(jax.lax.stop_gradient((jnp.asarray(x, jnp.float32) * w).sum()), n)

    metrics = {
        "critic/clip_frac": token_mean(clipped_BT),
        "critic/values_mean": token_mean(v),
        "critic/returns_mean": token_mean(ret),
        "critic/abs_error": token_mean(jnp.abs(v - ret)),
    }
    return loss_sum, denom, metrics
