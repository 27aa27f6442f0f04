"""Group estimators beside GRPO's normalised advantage (advantages.py): OPO's optimal
baseline, GRPO for pass@k (verl's and the analytical one), GPG's scaled advantage and the
optimal token baseline.

Pure jax.numpy, float32; a group is G contiguous rows. ``keep_B`` removes rows from every
statistic (a rejected row is as if it had not been sampled) and their advantages are 0. A
group left with one kept row has baseline 0 in OPO and the token baseline (verl's convention
for a singleton group) and no advantage in the others; a group whose kept rewards are all
equal gets exactly 0 wherever its baseline is its mean.
docs/algorithms.md gives each one's formula, reference and differences.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl4llm.rl import collectives
from jaxrl4llm.rl.advantages import _weights, returns_to_go, to_groups, token_rewards


def _per_row(x_P1: jnp.ndarray, group_size: int) -> jnp.ndarray:
    return jnp.repeat(x_P1.reshape(-1), group_size)


def _grouped(
    r_B: jnp.ndarray, keep_B: jnp.ndarray | None, group_size: int
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(rewards float32 [B], weights [B], both as [P, G])."""
    r = jnp.asarray(r_B, jnp.float32)
    w = _weights(r, keep_B)
    return r, w, to_groups(r, group_size), to_groups(w, group_size)


def opo_advantages(
    rewards_B: jnp.ndarray,
    lengths_B: jnp.ndarray,
    group_size: int,
    keep_B: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """OPO (arXiv:2505.23585, its optimal reward baseline): A_i = r_i - b with the
    length-weighted group mean b = sum_j |o_j| r_j / sum_j |o_j| (the optimal baseline with
    the gradient norm approximated by the length); no std division. [B]."""
    r, w, r_PG, w_PG = _grouped(rewards_B, keep_B, group_size)
    len_PG = to_groups(jnp.asarray(lengths_B, jnp.float32), group_size) * w_PG
    # b around a kept reward (the pivot): a flat group's b is exactly its reward.
    pivot_P1 = jnp.where(w_PG > 0, r_PG, -jnp.inf).max(axis=1, keepdims=True)
    pivot_P1 = jnp.where(jnp.isfinite(pivot_P1), pivot_P1, 0.0)
    num_P1 = (len_PG * (r_PG - pivot_P1)).sum(axis=1, keepdims=True)
    den_P1 = len_PG.sum(axis=1, keepdims=True)
    b_P1 = pivot_P1 + num_P1 / jnp.where(den_P1 > 0, den_P1, 1.0)
    b_P1 = jnp.where(w_PG.sum(axis=1, keepdims=True) > 1, b_P1, 0.0)
    return jnp.where(w > 0, r - _per_row(b_P1, group_size), 0.0)


def grpo_passk_advantages(
    rewards_B: jnp.ndarray,
    group_size: int,
    *,
    std_normalize: bool = True,
    ddof: int = 1,
    eps: float = 1e-6,
    keep_B: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """verl's GRPO for pass@k (compute_grpo_passk_outcome_advantage, after arXiv:2503.19595):
    only each group's best row learns, A = r_max - r_second, divided by (group std + eps)
    when std_normalize (verl's norm_adv_by_std_in_grpo); every other row 0. A group with a
    tied best (or fewer than 2 kept rows) gets 0 everywhere. [B]."""
    r, w, r_PG, w_PG = _grouped(rewards_B, keep_B, group_size)
    masked = jnp.where(w_PG > 0, r_PG, -jnp.inf)
    best_P = jnp.argmax(masked, axis=1)
    top_P = masked.max(axis=1)
    second_P = jnp.where(jnp.arange(group_size)[None] == best_P[:, None], -jnp.inf, masked).max(1)
    n_P = w_PG.sum(axis=1)
    gap_P = jnp.where(n_P >= 2, top_P - second_P, 0.0)
    if std_normalize:
        mu_P = jnp.where(w_PG > 0, r_PG, 0.0).sum(1) / jnp.maximum(n_P, 1.0)
        var_P = jnp.where(w_PG > 0, jnp.square(r_PG - mu_P[:, None]), 0.0).sum(1)
        std_P = jnp.sqrt(var_P / jnp.maximum(n_P - ddof, 1.0))
        gap_P = gap_P / (std_P + eps)
    is_best_PG = jnp.arange(group_size)[None] == best_P[:, None]
    return jnp.where(w > 0, jnp.where(is_best_PG, gap_P[:, None], 0.0).reshape(-1), 0.0)


def _comb_ratio(n: jnp.ndarray, c: jnp.ndarray, k: int) -> jnp.ndarray:
    """C(n - c, k) / C(n, k) = prod_{j<k} (n - c - j) / (n - j), 0 when n - c < k."""
    out = jnp.ones(n.shape, jnp.float32)
    for j in range(k):
        out = out * jnp.maximum(n - c - j, 0.0) / jnp.maximum(n - j, 1.0)
    return out


def passk_advantages(
    correct_B: jnp.ndarray,
    group_size: int,
    k: int,
    *,
    eps: float = 1e-6,
    keep_B: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """Pass@k training with the analytical advantage (arXiv:2508.10751, its analytical
    derivation; the authors' passk_adv.py): in a group of n kept rows, c correct,
        R = 1 - C(n - c, k) / C(n, k),  sigma = sqrt(R (1 - R)),
        A_pos = (1 - R) / (sigma + eps),
        A_neg = (1 - R - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / (sigma + eps).
    Reads the verdicts (correct_B), not the reward values. A group with fewer than k kept
    rows gets 0. k is static (it sets the number of factors). [B]."""
    correct = jnp.asarray(correct_B, bool)
    w = _weights(correct.astype(jnp.float32), keep_B)
    w_PG = to_groups(w, group_size)
    n_P = w_PG.sum(axis=1)
    c_P = (to_groups(correct.astype(jnp.float32), group_size) * w_PG).sum(axis=1)
    rho_P = 1.0 - _comb_ratio(n_P, c_P, k)
    sigma_P = jnp.sqrt(rho_P * (1.0 - rho_P))
    pos_P = (1.0 - rho_P) / (sigma_P + eps)
    neg_P = (1.0 - rho_P - _comb_ratio(n_P - 1.0, c_P, k - 1)) / (sigma_P + eps)
    adv_PG = jnp.where(to_groups(correct, group_size), pos_P[:, None], neg_P[:, None])
    adv_PG = jnp.where((n_P >= k)[:, None], adv_PG, 0.0)
    return jnp.where(w > 0, adv_PG.reshape(-1), 0.0)


def gpg_advantages(
    rewards_B: jnp.ndarray,
    group_size: int,
    keep_B: jnp.ndarray | None = None,
    axis_name: str | None = None,
) -> jnp.ndarray:
    """GPG (arXiv:2504.02546, its corrected advantage, F_norm = 1): A_i = alpha (r_i - group
    mean), alpha = B / (B - M) with B the kept rows of the batch and M those in groups whose
    kept rewards are all equal (no gradient); alpha = 1 when no group has spread. Batch-wide:
    pass axis_name under shard_map. [B]."""
    r, w, r_PG, w_PG = _grouped(rewards_B, keep_B, group_size)
    n_P1 = w_PG.sum(axis=1, keepdims=True)
    hi = jnp.where(w_PG > 0, r_PG, -jnp.inf).max(axis=1, keepdims=True)
    lo = jnp.where(w_PG > 0, r_PG, jnp.inf).min(axis=1, keepdims=True)
    pivot = jnp.where(n_P1 > 0, hi, 0.0)
    mu_P1 = pivot + jnp.where(w_PG > 0, r_PG - pivot, 0.0).sum(1, keepdims=True) / jnp.maximum(
        n_P1, 1.0
    )
    spread_P1 = hi > lo
    n_rows = collectives.total(w, axis_name)
    n_learning = collectives.total(jnp.where(spread_P1, n_P1, 0.0), axis_name)
    alpha = jnp.where(n_learning > 0, n_rows / jnp.maximum(n_learning, 1.0), 1.0)
    centred = jnp.where(spread_P1, r_PG - mu_P1, 0.0)
    return jnp.where(w > 0, alpha * centred.reshape(-1), 0.0)


def optimal_token_baseline_advantages(
    rewards_B: jnp.ndarray,
    mask_BT: jnp.ndarray,
    logp_BT: jnp.ndarray,
    sum_pi_squared_BT: jnp.ndarray,
    group_size: int,
    *,
    is_weights_BT: jnp.ndarray | None = None,
    zero_tail: bool = False,
    eps: float = 1e-8,
    keep_B: jnp.ndarray | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """verl's optimal token baseline (compute_optimal_token_baseline_advantage): per token
    t, B_t = sum_i G_it W_it / (sum_i W_it + eps) over the group's kept rows, with G the
    return (the outcome reward on every token) and W_it = sum_{j<=t} (1 - 2 pi_ij + sum_v
    pi_ijv^2) the cumulative path-variance proxy (pi_ij = exp(logp_BT), the sampling policy's
    probability; sum_pi_squared_BT its sum of squared probabilities over the vocabulary);
    with is_weights_BT, W's terms are scaled by w^2. zero_tail: the unique longest row of a
    group gets B = 0 past the second-longest length. Returns (advantages_BT, returns_BT)."""
    r, w, _, w_PG = _grouped(rewards_B, keep_B, group_size)
    m = jnp.asarray(mask_BT, jnp.float32) * w[:, None]
    G_BT = returns_to_go(token_rewards(r, m))
    step_BT = 1.0 - 2.0 * jnp.exp(jnp.asarray(logp_BT, jnp.float32)) + sum_pi_squared_BT
    if is_weights_BT is not None:
        step_BT = step_BT * jnp.square(is_weights_BT)
    W_PGT = to_groups(jnp.cumsum(step_BT * m, axis=1) * m, group_size)
    G_PGT, m_PGT = to_groups(G_BT, group_size), to_groups(m, group_size)
    num_PT = (G_PGT * W_PGT).sum(axis=1)
    base_PT = num_PT / (W_PGT.sum(axis=1) + eps)
    base_PGT = jnp.where(
        (w_PG.sum(axis=1) > 1)[:, None, None], jnp.broadcast_to(base_PT[:, None], G_PGT.shape), 0.0
    )
    if zero_tail:
        base_PGT = _zero_tail(base_PGT, m_PGT)
    adv_BT = ((G_PGT - base_PGT) * m_PGT).reshape(G_BT.shape)
    return adv_BT, G_BT


def _zero_tail(base_PGT: jnp.ndarray, m_PGT: jnp.ndarray) -> jnp.ndarray:
    """verl's handle_zero_tail: B = 0 on the unique longest row past the second length."""
    len_PG = m_PGT.sum(axis=2)
    longest_P = len_PG.max(axis=1)
    is_longest_PG = len_PG == longest_P[:, None]
    second_P = jnp.where(is_longest_PG, -1.0, len_PG).max(axis=1)
    unique_P = (is_longest_PG.sum(axis=1) == 1) & (longest_P > second_P)
    t_T = jnp.arange(m_PGT.shape[2], dtype=jnp.float32)
    tail_PGT = is_longest_PG[:, :, None] & (t_T[None, None] >= second_P[:, None, None])
    return jnp.where(unique_P[:, None, None] & tail_PGT, 0.0, base_PGT)
