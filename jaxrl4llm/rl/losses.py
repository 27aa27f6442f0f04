"""Per-token losses, KL estimators, entropy, and exact (sum, denominator) aggregation.

Every loss here is a per-token [B, T] array; ``aggregate`` turns it into a pair
(loss_sum, denominator) whose two parts are each a plain sum over rows. Because both parts
are additive over rows, micro-batches combine EXACTLY into the mini-batch value:

    loss(mini-batch) = sum_k loss_sum_k / sum_k denominator_k

and since the denominator does not depend on the parameters, the trainer may either
(a) compute D = loss_denominator(mask_BT, keep_B, mode) once over the whole mini-batch
    (it only needs masks) and accumulate grad(loss_sum_k / D) over micro-batches, or
(b) accumulate grad(loss_sum_k) and sum_k denominator_k, and divide at the end.
Never average per-micro-batch means.

Per mode, with w_BT = mask_BT * keep_B[:, None], n_i = sum_t w_it and a row counted as a
sequence when n_i > 0:
  token-mean               sum(L w)                    / sum(w)
  seq-mean-token-mean      sum_i [sum_t L w / n_i]     / #sequences
  seq-mean-token-sum       sum(L w)                    / #sequences
  seq-mean-token-sum-norm  sum(L w)                    / (#sequences * max_tokens)
max_tokens defaults to T (the padded completion length); micro-batches sliced from one
padded [B, T] array share it, which keeps the combination exact.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl4llm.rl.metrics import Metric

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0  # the cap verl (low_var_kl) and OpenRLHF (compute_approx_kl) put on k3


def row_weights(mask_BT: jnp.ndarray, keep_B: jnp.ndarray | None) -> jnp.ndarray:
    w = jnp.asarray(mask_BT).astype(jnp.float32)
    if keep_B is not None:
        if keep_B.shape != w.shape[:1]:
            raise ValueError(
                f"keep_B has shape {keep_B.shape}, expected ({w.shape[0]},) to match "
                f"mask_BT {w.shape}."
            )
        w = w * jnp.asarray(keep_B).astype(jnp.float32)[:, None]
    return w


def broadcast_advantages(advantages: jnp.ndarray, shape_BT: tuple[int, ...]) -> jnp.ndarray:
    """float32 [B, T] advantages from [B] or [B, T], without gradient: an advantage is a
    weight of the policy gradient, never differentiated (a critic's included)."""
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    if adv.ndim == 1:
        adv = adv[:, None]
    if adv.shape not in ((shape_BT[0], 1), tuple(shape_BT)):
        raise ValueError(
            f"advantages have shape {advantages.shape}; expected [B]={shape_BT[:1]} "
            f"or [B, T]={shape_BT}."
        )
    return jnp.broadcast_to(adv, shape_BT)


def log_ratio(logp_BT: jnp.ndarray, old_logp_BT: jnp.ndarray) -> jnp.ndarray:
    """logp - old_logp in float32 (whatever the inputs' dtype) clamped to [-20, 20] so exp()
    stays finite."""
    d = jnp.asarray(logp_BT, jnp.float32) - jnp.asarray(old_logp_BT, jnp.float32)
    return jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clipped_surrogate(
    logp_BT: jnp.ndarray,
    old_logp_BT: jnp.ndarray,
    advantages: jnp.ndarray,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """Per-token PPO loss L = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)).

    rho = exp(clip(logp - old_logp, -20, 20)); A is [B] (broadcast over T) or [B, T].
    With dual_clip = c > 1, tokens with A < 0 use min(L, -c A).
    Returns (loss_BT, aux) with aux = ratio_BT and the bool [B, T] indicators
    clipped_low (A < 0, rho < 1 - clip_low), clipped_high (A > 0, rho > 1 + clip_high),
    dual_clipped (A < 0, rho > c).
    """
    adv = broadcast_advantages(advantages, logp_BT.shape)
    ratio = jnp.exp(log_ratio(logp_BT, old_logp_BT))
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    dual = jnp.zeros(loss.shape, bool)
    if dual_clip is not None:
        dual = (adv < 0) & (loss > -dual_clip * adv)
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    aux = {
        "ratio": ratio,
        "clipped_low": (adv < 0) & (ratio < 1.0 - clip_low),
        "clipped_high": (adv > 0) & (ratio > 1.0 + clip_high),
        "dual_clipped": dual,
    }
    return loss, aux


def sequence_old_logp(
    logp_BT: jnp.ndarray, old_logp_BT: jnp.ndarray, mask_BT: jnp.ndarray
) -> jnp.ndarray:
    """GSPO's sequence-level importance ratio as an "old logp" for ``clipped_surrogate``.

    s_i = exp(mean_t (logp_it - old_logp_it)) over row i's valid tokens (the length-normalised
    sequence ratio). Returns old'_BT = sg(logp) - sg(log s_i), so that logp - old' has the
    value log s_i on every token and the gradient of logp: GSPO-token's
    s_it = sg(s_i) pi(y_it) / sg(pi(y_it)), whose gradient under the per-sequence token mean
    is GSPO's s_i A_i (1/|y_i|) sum_t grad log pi(y_it) (arXiv:2507.18071, eqs. 5-7, 10-11).
    """
    m = jnp.asarray(mask_BT).astype(jnp.float32)
    logp_BT = jnp.asarray(logp_BT, jnp.float32)
    d = jnp.where(m > 0, logp_BT - jnp.asarray(old_logp_BT, jnp.float32), 0.0)
    log_s_B = d.sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
    return jax.lax.stop_gradient(logp_BT - log_s_B[:, None])


def nll_loss(logp_BT: jnp.ndarray) -> jnp.ndarray:
    """RAFT's supervised loss per token: -log pi(token), in float32."""
    return -jnp.asarray(logp_BT, jnp.float32)


def kl_estimate(
    logp_BT: jnp.ndarray,
    ref_logp_BT: jnp.ndarray,
    estimator: str = "k3",
    k3_clamp: float | None = K3_CLAMP,
) -> jnp.ndarray:
    """Per-token KL(pi || pi_ref) estimate, d = logp - ref_logp.

    k1 = d; k2 = d^2 / 2; k3 = exp(-d) + d - 1, evaluated on d clamped to [-20, 20] (the
    ratio's clamp, so exp(-d) cannot overflow) and then capped at k3_clamp (default 10, as
    verl's low_var_kl and OpenRLHF's compute_approx_kl; None = no cap). Without the cap one
    token at d = -20 contributes 4.9e8. k1 and k2 are not clamped. d is taken in float32
    whatever the inputs' dtype (in bfloat16, k3 at d = -0.01 rounds to 0).
    """
    d = jnp.asarray(logp_BT, jnp.float32) - jnp.asarray(ref_logp_BT, jnp.float32)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * jnp.square(d)
    if estimator == "k3":
        kl = k3(jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return kl if k3_clamp is None else jnp.minimum(kl, k3_clamp)
    raise ValueError(f"kl_estimator={estimator!r} is not one of {KL_ESTIMATORS}.")


def k3(d: jnp.ndarray) -> jnp.ndarray:
    """Schulman's k3 estimate of KL(pi || q) per token from d = log pi - log q:
    exp(-d) + d - 1 (>= 0, unbiased, low variance)."""
    return jnp.exp(-d) + d - 1.0


def entropy_from_logits(logits_BTV: jnp.ndarray) -> jnp.ndarray:
    """Per-token entropy -sum_v p log p, from logits via log_softmax (stable).

    -inf logits (masked vocabulary entries) are allowed: they have p = 0 and contribute
    nothing, to the value and to the gradient. Their log p is replaced by 0 *before* the
    product, so the backward pass never forms 0 * (-inf); masking only the product
    (where(p > 0, p * logp, 0)) would still send NaN into the whole row's gradient.
    """
    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    safe_logp = jnp.where(jnp.isfinite(logp), logp, 0.0)
    return -(jnp.exp(logp) * safe_logp).sum(axis=-1)


def _n_seqs(w_BT: jnp.ndarray) -> jnp.ndarray:
    return (w_BT.sum(axis=1) > 0).astype(jnp.float32).sum()


def loss_denominator(
    mask_BT: jnp.ndarray,
    keep_B: jnp.ndarray | None = None,
    mode: str = "token-mean",
    max_tokens: int | None = None,
) -> jnp.ndarray:
    """The denominator of ``aggregate`` alone (needs only masks): compute it once per mini-batch."""
    w = row_weights(mask_BT, keep_B)
    if mode == "token-mean":
        return w.sum()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return _n_seqs(w)
    if mode == "seq-mean-token-sum-norm":
        T = w.shape[1] if max_tokens is None else max_tokens
        return _n_seqs(w) * float(T)
    raise ValueError(f"agg mode {mode!r} is not one of {AGG_MODES}.")


def aggregate(
    loss_BT: jnp.ndarray,
    mask_BT: jnp.ndarray,
    keep_B: jnp.ndarray | None = None,
    mode: str = "token-mean",
    max_tokens: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(loss_sum, denominator) of a per-token loss; see the module docstring for the modes.

    Masked-out tokens and rejected rows are selected away with ``where`` (not multiplied),
    so whatever values they hold reach neither the sum nor the gradient.
    """
    w = row_weights(mask_BT, keep_B)
    denom = loss_denominator(mask_BT, keep_B, mode, max_tokens)
    lw = jnp.where(w > 0, loss_BT * w, 0.0)
    if mode == "seq-mean-token-mean":
        n_B = w.sum(axis=1)
        return (lw.sum(axis=1) / jnp.maximum(n_B, 1.0)).sum(), denom
    return lw.sum(), denom


def finalize_loss(loss_sum: jnp.ndarray, denominator: jnp.ndarray) -> jnp.ndarray:
    """loss_sum / denominator, 0 when everything was rejected (denominators are counts)."""
    return loss_sum / jnp.maximum(denominator, 1.0)


# ---- diagnostics ----------------------------------------------------------------------------


def token_metrics(
    w_BT: jnp.ndarray,
    keep_B: jnp.ndarray,
    *,
    ratio_BT: jnp.ndarray,
    log_ratio_BT: jnp.ndarray,
    clip_aux: dict[str, jnp.ndarray] | None = None,
    pg_loss_BT: jnp.ndarray | None = None,
    kl_ref_BT: jnp.ndarray | None = None,
    entropy_BT: jnp.ndarray | None = None,
) -> dict[str, Metric]:
    """The policy-loss diagnostics of one (micro-)batch, by final name: means over its valid
    kept tokens (w_BT > 0) or rows, and ratio extremes. Combine parts with combine_metrics.
    clip_aux: the loss's bool [B, T] indicators (see _indicator_metrics)."""
    valid = w_BT > 0
    n_tokens = valid.astype(jnp.float32).sum()

    def token_mean(x):
        return Metric.mean(jnp.where(valid, x, 0.0).astype(jnp.float32).sum(), n_tokens)

    n_rows = jnp.float32(w_BT.shape[0])
    m = {
        "policy/frac_rejected": Metric.mean(
            n_rows - jnp.asarray(keep_B).astype(jnp.float32).sum(), n_rows
        ),
        # k3 estimate of KL(pi || pi_old) on the sampled tokens: >= 0, low variance.
        "policy/approx_kl_old": token_mean(k3(log_ratio_BT)),
        "policy/ratio_min": Metric.min(jnp.where(valid, ratio_BT, jnp.inf).min()),
        "policy/ratio_max": Metric.max(jnp.where(valid, ratio_BT, -jnp.inf).max()),
    }
    m.update(_indicator_metrics(clip_aux or {}, token_mean))
    if pg_loss_BT is not None:
        m["policy/pg_loss"] = token_mean(pg_loss_BT)
    if kl_ref_BT is not None:
        m["policy/kl_ref"] = token_mean(kl_ref_BT)
    if entropy_BT is not None:
        m["policy/entropy"] = token_mean(entropy_BT)
    return m


# Indicator names whose metric keeps its established name.
_INDICATOR_NAMES = {"dual_clipped": "policy/dual_clip_frac"}


def _indicator_metrics(
    aux: dict[str, jnp.ndarray], token_mean: Callable[[jnp.ndarray], Metric]
) -> dict[str, Metric]:
    """Token fractions of a loss's bool indicators: clipped_low / clipped_high give
    policy/clip_frac(_low, _high), dual_clipped policy/dual_clip_frac, any other key k
    policy/k_frac. Non-bool entries (the ratio) are not indicators."""
    m = {}
    if "clipped_low" in aux and "clipped_high" in aux:
        m["policy/clip_frac"] = token_mean(aux["clipped_low"] | aux["clipped_high"])
        m["policy/clip_frac_low"] = token_mean(aux["clipped_low"])
        m["policy/clip_frac_high"] = token_mean(aux["clipped_high"])
    for k, v in aux.items():
        if k not in ("clipped_low", "clipped_high") and v.dtype == jnp.bool_:
            m[_INDICATOR_NAMES.get(k, f"policy/{k}_frac")] = token_mean(v)
    return m
