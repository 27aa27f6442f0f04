"""Advantage estimators: normalized (group/batch), RLOO, REINFORCE++, Reinforce.

Pure jax.numpy. Rewards are per sequence, shape [B]; a group is G contiguous rows
(B = P * G). Sequence-level estimators return [B]; REINFORCE++ returns [B, T].

Conventions (see docs/algorithms.md):
  * std uses a ``ddof`` knob (default 1, like torch.std) and ``eps`` is added to the std:
    A = (r - mu) / (sigma + eps), eps default 1e-6.
  * A scope (group or batch) whose kept rewards are all equal, or which has no more kept
    rows than ``ddof``, has no spread: under std scaling by that scope its advantages are 0
    (not (r - mu) / eps).
  * ``keep_B`` removes rows from every statistic; advantages of removed rows are 0.
  * ``axis_name``: under shard_map over the batch axis, the batch statistics (batch mean and
    std, whitening) combine every shard (exact); group statistics need whole groups per shard.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl4llm.rl import collectives

MEANS = ("group", "batch", "none")
STDS = ("group", "batch", "none")


def to_groups(x_B: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """[B, ...] -> [P, G, ...]; groups are G contiguous rows."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}.")
    if x_B.shape[0] % group_size != 0:
        raise ValueError(
            f"batch size {x_B.shape[0]} is not a multiple of group_size={group_size}; "
            "each prompt must contribute exactly group_size contiguous rows."
        )
    return x_B.reshape((x_B.shape[0] // group_size, group_size) + x_B.shape[1:])


def _weights(x: jnp.ndarray, keep: jnp.ndarray | None) -> jnp.ndarray:
    if keep is None:
        return jnp.ones(x.shape, jnp.float32)
    if keep.shape != x.shape:
        raise ValueError(f"keep_B has shape {keep.shape}, expected {x.shape} (one flag per row).")
    return keep.astype(jnp.float32)


def _sum(x, axis, axis_name):
    return collectives.total(x, axis_name) if axis is None else x.sum(axis=axis, keepdims=True)


def _extremes(x, w, axis, axis_name):
    hi_x, lo_x = jnp.where(w > 0, x, -jnp.inf), jnp.where(w > 0, x, jnp.inf)
    if axis is None:
        return collectives.maximum(hi_x, axis_name), collectives.minimum(lo_x, axis_name)
    return hi_x.max(axis=axis, keepdims=True), lo_x.min(axis=axis, keepdims=True)


def _stats(x, w, axis, ddof, axis_name=None):
    """Weighted mean, std (with ddof) and a 'no spread' flag along ``axis`` (keepdims; None:
    the whole batch, every shard of ``axis_name``).

    The mean is taken around a pivot, one of the kept values: mu = pivot + mean(x - pivot).
    When the kept values are all equal every x - pivot is exactly 0, so mu equals them
    exactly and x - mu is exactly 0 whatever the compiler does with the division (XLA may
    multiply by a rounded reciprocal or fuse a multiply-add; a plain sum / n then leaves
    x - mu ~ 1e-8, which whitening divides by ~1e-6).
    """
    n = _sum(w, axis, axis_name)
    hi, lo = _extremes(x, w, axis, axis_name)
    pivot = jnp.where(n > 0, hi, 0.0)
    offset = jnp.where(w > 0, x - pivot, 0.0)
    mu = pivot + _sum(offset, axis, axis_name) / jnp.maximum(n, 1.0)
    dof = n - ddof
    sq = _sum(jnp.where(w > 0, jnp.square(x - mu), 0.0), axis, axis_name)
    var = sq / jnp.where(dof > 0, dof, 1.0)
    std = jnp.where(dof > 0, jnp.sqrt(var), 0.0)
    # Exact constancy test (max == min) rather than std < tol: a scope of equal values has
    # no spread, whatever rounding left in its std.
    flat = (hi <= lo) | (dof <= 0)
    return mu, std, flat


def normalized_advantages(
    rewards_B: jnp.ndarray,
    group_size: int,
    *,
    mean: str = "group",
    std: str = "group",
    ddof: int = 1,
    eps: float = 1e-6,
    keep_B: jnp.ndarray | None = None,
    axis_name: str | None = None,
) -> jnp.ndarray:
    """A_i = (r_i - mu) / (sigma + eps) with mu, sigma from the chosen scopes. Returns [B].

    mean in {"group", "batch", "none"} (none: mu = 0); std in {"group", "batch", "none"}
    (none: sigma = 1 and no eps). GRPO = (group, group), Dr. GRPO = (group, none),
    Lite PPO = (group, batch), Reinforce = (none, none).
    """
    if mean not in MEANS:
        raise ValueError(f"mean={mean!r} is not one of {MEANS}.")
    if std not in STDS:
        raise ValueError(f"std={std!r} is not one of {STDS}.")
    r_B = jnp.asarray(rewards_B, jnp.float32)
    w_B = _weights(r_B, keep_B)
    r_PG, w_PG = to_groups(r_B, group_size), to_groups(w_B, group_size)
    g_mu, g_std, g_flat = (
        a.repeat(group_size, axis=1).reshape(-1) for a in _stats(r_PG, w_PG, 1, ddof)
    )
    b_mu, b_std, b_flat = _stats(r_B, w_B, None, ddof, axis_name)

    mu = {"group": g_mu, "batch": b_mu, "none": 0.0}[mean]
    centered = r_B - mu
    if std == "none":
        adv = centered
    else:
        sigma, flat = (g_std, g_flat) if std == "group" else (b_std, b_flat)
        adv = jnp.where(flat, 0.0, centered / (sigma + eps))
    return jnp.where(w_B > 0, adv, 0.0)


def reinforce_advantages(rewards_B: jnp.ndarray, keep_B: jnp.ndarray | None = None) -> jnp.ndarray:
    """Plain Reinforce: A = r (0 on rejected rows). Returns [B]."""
    r_B = jnp.asarray(rewards_B, jnp.float32)
    return jnp.where(_weights(r_B, keep_B) > 0, r_B, 0.0)


def rloo_advantages(
    rewards_B: jnp.ndarray, group_size: int, keep_B: jnp.ndarray | None = None
) -> jnp.ndarray:
    """RLOO: A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_j r_j). Returns [B].

    Needs group_size >= 2 (a singleton group has no leave-one-out baseline). With keep_B, j runs
    over the group's kept rows; a kept row alone in its group gets A = 0.
    """
    if group_size < 2:
        raise ValueError(
            f"RLOO needs group_size >= 2 (got {group_size}); use advantage='normalized' instead."
        )
    r_B = jnp.asarray(rewards_B, jnp.float32)
    w_B = _weights(r_B, keep_B)
    r_PG, w_PG = to_groups(r_B, group_size), to_groups(w_B, group_size)
    # r_i - (S - r_i) / (n - 1) = n / (n - 1) * (r_i - S / n) over the group's n kept rows
    # (all G when none is removed); the centred form is exactly 0 for a flat group.
    mu_PG = _stats(r_PG, w_PG, 1, 0)[0]
    n_PG = w_PG.sum(axis=1, keepdims=True)
    adv_PG = (r_PG - mu_PG) * (n_PG / jnp.maximum(n_PG - 1.0, 1.0))
    adv_B = jnp.where(n_PG > 1, adv_PG, 0.0).reshape(-1)
    return jnp.where(w_B > 0, adv_B, 0.0)


def last_token_onehot(mask_BT: jnp.ndarray) -> jnp.ndarray:
    """[B, T] float: 1 at the last valid token of each row (all zeros for an empty row)."""
    m = jnp.asarray(mask_BT).astype(bool)
    T = m.shape[1]
    last_T = T - 1 - jnp.argmax(m[:, ::-1], axis=1)
    onehot = jnp.arange(T)[None, :] == last_T[:, None]
    return (onehot & m.any(axis=1, keepdims=True)).astype(jnp.float32)


def token_rewards(
    rewards_B: jnp.ndarray,
    mask_BT: jnp.ndarray,
    kl_BT: jnp.ndarray | None = None,
    kl_coef: float = 0.0,
) -> jnp.ndarray:
    """REINFORCE++ token rewards: r at the last valid token, minus kl_coef * KL_t on every valid
    token."""
    m = jnp.asarray(mask_BT, jnp.float32)
    tok = jnp.asarray(rewards_B, jnp.float32)[:, None] * last_token_onehot(m)
    if kl_BT is not None:
        tok = tok - kl_coef * jnp.where(m > 0, kl_BT, 0.0)
    return tok * m


def returns_to_go(token_rewards_BT: jnp.ndarray) -> jnp.ndarray:
    """G_t = sum_{s >= t} reward_s (gamma = 1), a reversed cumulative sum over T."""
    return jnp.flip(jnp.cumsum(jnp.flip(token_rewards_BT, axis=1), axis=1), axis=1)


def whiten(
    values_BT: jnp.ndarray,
    weights_BT: jnp.ndarray,
    *,
    ddof: int = 1,
    eps: float = 1e-6,
    axis_name: str | None = None,
) -> jnp.ndarray:
    """(x - mean) / (std + eps) over all weighted (valid) entries of the batch (every shard of
    axis_name); 0 elsewhere."""
    w = jnp.asarray(weights_BT, jnp.float32)
    mu, std, flat = _stats(values_BT, w, None, ddof, axis_name)
    out = jnp.where(flat, 0.0, (values_BT - mu) / (std + eps))
    return jnp.where(w > 0, out, 0.0)


def reinforce_pp_advantages(
    rewards_B: jnp.ndarray,
    mask_BT: jnp.ndarray,
    *,
    kl_BT: jnp.ndarray | None = None,
    kl_coef: float = 0.0,
    group_size: int = 1,
    baseline: bool = False,
    keep_B: jnp.ndarray | None = None,
    ddof: int = 1,
    eps: float = 1e-6,
    axis_name: str | None = None,
) -> jnp.ndarray:
    """REINFORCE++ (baseline=False) and REINFORCE++-baseline (baseline=True). Returns [B, T].

    token reward = r at the last valid token - kl_coef * KL_t on every valid token;
    returns G_t with gamma = 1; whitened over every valid token of the kept rows.
    The baseline variant first subtracts the group mean of r (needs group_size >= 2).
    """
    r_B = jnp.asarray(rewards_B, jnp.float32)
    w_B = _weights(r_B, keep_B)
    if baseline:
        if group_size < 2:
            raise ValueError(
                "REINFORCE++-baseline needs group_size >= 2 "
                "(the group mean of a single sample is itself)."
            )
        mu_PG = _stats(to_groups(r_B, group_size), to_groups(w_B, group_size), 1, 0)[0]
        r_B = r_B - mu_PG.repeat(group_size, axis=1).reshape(-1)
    m = jnp.asarray(mask_BT, jnp.float32)
    ret_BT = returns_to_go(token_rewards(r_B, m, kl_BT, kl_coef))
    return whiten(ret_BT, m * w_B[:, None], ddof=ddof, eps=eps, axis_name=axis_name)
