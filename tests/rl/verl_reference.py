"""numpy transcriptions of verl's reference code (verl/trainer/ppo/core_algos.py at
volcengine/verl b178a3cd, 2026-01-29) and of the authors' code where it differs, written
from that code and not from jaxrl4llm.rl: the tests compare the package against these.

Each function keeps the reference's order of operations and its constants (the 1e-8 of
verl's sequence means, the 1e-10 of its geo_mean IS weights). Rows are one prompt group
after another (verl's `index`), masks are {0, 1} float [B, T].
"""

from __future__ import annotations

import math

import numpy as np


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def agg_loss(loss_mat, mask, mode):
    """verl's agg_loss on one micro-batch (dp_size 1, no global batch info)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        seq = (loss_mat * mask).sum(-1)
        seq_mask = (mask.sum(-1) > 0).astype(float)
        return (seq * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        n = mask.sum(-1)
        seq = (loss_mat * mask).sum(-1) / (n + 1e-8)
        seq_mask = (n > 0).astype(float)
        return (seq * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum(-1).sum() / mask.shape[-1]
    raise ValueError(mode)


def cispo(old, logp, adv, mask, clip_low, clip_high):
    """compute_policy_loss_cispo's pg_losses and pg_clipfrac."""
    ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
    clipped = np.clip(ratio, 1 - clip_low, 1 + clip_high)
    pg = -clipped * adv * logp
    return pg, masked_mean((ratio != clipped).astype(float), mask)


def sapo(old, logp, adv, tau_pos, tau_neg):
    """compute_policy_loss_sapo's pg_losses (verl aggregates with seq-mean-token-mean)."""
    ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
    taus = np.where(adv > 0, tau_pos, tau_neg)
    gates = 1.0 / (1.0 + np.exp(-taus * (ratio - 1.0))) * (4.0 / taus)
    return -gates * adv


def gpg_loss(logp, adv):
    """compute_policy_loss_gpg's pg_losses."""
    return -logp * adv


def geo_mean(old, logp, adv, mask, clip_low, clip_high, is_weights=None):
    """compute_policy_loss_geo_mean: (pg_loss, per-row losses)."""
    neg_kl = logp - old
    sgn = np.sign(adv)
    clamp = np.clip(neg_kl, -clip_low, clip_high)
    kl_min = sgn * np.minimum(sgn * neg_kl, sgn * clamp)
    n = mask.sum(-1)
    ratio = np.exp((kl_min * mask).sum(-1) / (n + 1e-8))
    advantage = (adv * mask).sum(-1) / (n + 1e-8)
    losses = -advantage * ratio
    if is_weights is not None:
        losses = losses * np.exp((np.log(is_weights + 1e-10) * mask).sum(-1) / (n + 1e-8))
    return losses.mean(), losses


def clip_cov(old, logp, adv, mask, clip_low, clip_high, ratio_k, lb, ub, perm_of):
    """compute_policy_loss_clip_cov's pg_losses. perm_of(candidates) stands for
    torch.randperm over the candidate list: it returns their order."""
    ratio = np.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    cov = (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))
    cov[mask == 0] = -np.inf
    cov[clip_by_origin] = -np.inf
    clip_num = max(int(ratio_k * mask.sum()), 1)
    cand = np.argwhere((cov < ub) & (cov > lb) & (mask > 0))
    corr = np.ones_like(adv)
    if len(cand) > 0:
        chosen = cand[perm_of(cand)[: min(clip_num, len(cand))]]
        corr[chosen[:, 0], chosen[:, 1]] = 0
    return np.maximum(pg1, pg2) * corr, corr == 0


def kl_cov(old, logp, adv, mask, ratio_k, coef):
    """compute_policy_loss_kl_cov's pg_losses (ratio_k a fraction: verl's kl_cov_ratio)."""
    neg_kl = logp - old
    ratio = np.exp(neg_kl)
    pg = -adv * ratio
    pg_kl = -adv * ratio + coef * np.abs(neg_kl)
    valid = mask > 0
    idx = np.flatnonzero(valid.reshape(-1))
    a, lp = adv[valid], logp[valid]
    out = pg.copy()
    if min(ratio_k, len(a)) != 0:
        cov = (a - a.mean()) * (lp - lp.mean())
        k = max(1, int(len(cov) * ratio_k))
        top = idx[np.argsort(-cov, kind="stable")[:k]]
        out.reshape(-1)[top] = pg_kl.reshape(-1)[top]
    return out


def opo(scores, lengths, index):
    """compute_opo_outcome_advantage (per-row scalars)."""
    out = scores.astype(float).copy()
    for g in np.unique(index):
        rows = index == g
        if rows.sum() == 1:
            base = 0.0
        else:
            base = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
        out[rows] = scores[rows] - base
    return out


def grpo_passk(scores, index, eps=1e-6, norm=True):
    """compute_grpo_passk_outcome_advantage (per-row scalars; ties as torch.topk's first)."""
    out = np.zeros(len(scores))
    for g in np.unique(index):
        rows = np.flatnonzero(index == g)
        r = scores[rows]
        order = np.argsort(-r, kind="stable")
        adv = r[order[0]] - r[order[1]]
        if norm:
            adv = adv / (r.std(ddof=1) + eps)
        out[rows[order[0]]] = adv
    return out


def _comb(n, k):
    """scipy.special.comb(n, k) (exact=False) on integers: 0 when k > n or n < 0."""
    return 0.0 if n < 0 or k < 0 or k > n else float(math.comb(n, k))


def passk_authors(rewards_by_group, k):
    """The authors' calc_adv (RUCAIBox/Passk_Training code/passk_adv.py) per group of
    {0, 1} rewards, with its two np.where (a positive advantage of exactly 0 becomes the
    negative one)."""
    out = []
    for val in rewards_by_group:
        c, n = int((val == 1).sum()), len(val)
        rho = 1 - _comb(n - c, k) / _comb(n, k)
        sigma = math.sqrt(rho * (1 - rho))
        adv_p = (1 - rho) / (sigma + 1e-6)
        adv_n = (1 - rho - _comb(n - c - 1, k - 1) / _comb(n - 1, k - 1)) / (sigma + 1e-6)
        new_val = np.where(val == 1, adv_p, val)
        out.append(np.where(new_val == 0, adv_n, new_val))
    return np.concatenate(out)


def gpg_authors(rewards, G):
    """The GPG authors' advantage (AMAP-ML/GPG grpo_trainer.py, adjust_gd): r - group mean,
    the loss divided by inverse_alpha + 1e-5, inverse_alpha = min(1, #rows in groups with
    reward spread / #rows): returned as the advantage times 1 / (inverse_alpha + 1e-5)."""
    r = rewards.reshape(-1, G)
    adv = (r - r.mean(1, keepdims=True)).reshape(-1)
    valid = (r.std(1, ddof=1) > 0).sum() * G
    inverse_alpha = min(1.0, valid / rewards.size)
    return adv / (inverse_alpha + 1e-5)


def otb(rewards, mask, old_logp, sum_pi_sq, index, zero_tail=False, is_weights=None):
    """compute_optimal_token_baseline_advantage: (advantages, returns); token rewards are
    the score at the last valid token."""
    B, T = mask.shape
    tlr = np.zeros((B, T))
    lengths = mask.sum(-1).astype(int)
    for i in range(B):
        if lengths[i] > 0:
            tlr[i, lengths[i] - 1] = rewards[i]
    returns = np.flip(np.cumsum(np.flip(tlr * mask, -1), -1), -1)
    w = 1 - 2 * np.exp(old_logp) + sum_pi_sq
    if is_weights is not None:
        w = w * is_weights**2
    wc = np.cumsum(w * mask, -1)
    base = np.zeros((B, T))
    for g in np.unique(index):
        rows = np.flatnonzero(index == g)
        if len(rows) == 1:
            continue
        num = (returns[rows] * wc[rows] * mask[rows]).sum(0)
        den = (wc[rows] * mask[rows]).sum(0) + 1e-8
        base[rows] = num / den
        if zero_tail:
            lens = mask[rows].sum(-1)
            srt = np.sort(lens)
            longest = np.flatnonzero(lens == srt[-1])
            if len(longest) == 1 and srt[-1] > srt[-2]:
                base[rows[longest[0]], int(srt[-2]) :] = 0.0
    return (returns - base) * mask, returns
