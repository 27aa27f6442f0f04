"""Sampler-trainer mismatch: its metrics and the IS corrections (rl/correction.py), against
numpy transcriptions of verl's rollout correction (verl/trainer/ppo/rollout_corr_helper.py)
and OpenRLHF's PolicyLoss (openrlhf/models/loss.py), and wired through rl.policy_loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.rl import correction

B, T = 6, 7


def _inputs(seed=0, scale=0.8):
    """old / behaviour logprobs whose token ratios straddle [0.5, 2], ragged rows (one empty)."""
    rng = np.random.default_rng(seed)
    behaviour = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    old = (behaviour + rng.normal(0.0, scale, (B, T))).astype(np.float32)
    lengths = np.array([7, 5, 3, 1, 0, 6])
    mask = np.arange(T)[None, :] < lengths[:, None]
    return old, behaviour, mask


# ---- the published formulas, in numpy ------------------------------------------------------


def _np_level_log_ratio(old, behaviour, mask, level):
    """verl: log_ratio = old_log_prob - rollout_log_prob; token as is, sequence = masked sum,
    geometric = masked mean; clamped to +-SAFETY_BOUND (20) before exp."""
    d = np.where(mask, old.astype(np.float64) - behaviour, 0.0)
    if level == "sequence":
        d = np.repeat(d.sum(1, keepdims=True), T, axis=1)
    elif level == "geometric":
        n = np.maximum(mask.sum(1, keepdims=True), 1)
        d = np.repeat(d.sum(1, keepdims=True) / n, T, axis=1)
    return np.clip(d, -20.0, 20.0)


def _verl_tis(old, behaviour, mask, level, threshold):
    """compute_rollout_correction_weights: exp(safe log ratio) * response_mask, then
    .clamp(max=rollout_is_threshold)."""
    w = np.exp(_np_level_log_ratio(old, behaviour, mask, level)) * mask
    return np.minimum(w, threshold)


def _verl_rejection_mask(old, behaviour, mask, option, threshold):
    """compute_rollout_rejection_mask at volcengine/verl b178a3cd (2026-01-29): log_ratio =
    old_log_prob - rollout_log_prob clamped to [-SAFETY_BOUND, SAFETY_BOUND] per token,
    token_k1 = -log_ratio; token_k1 as is, seq_sum_k1 its masked sum, seq_mean_k1 its masked
    mean (sum / (n + 1e-8)); kept when log(lower) <= stat <= log(upper), the threshold
    "lower_upper" (one number u: lower = 1 / u); applied to the response mask."""
    lr = np.clip(old.astype(np.float64) - behaviour, -20.0, 20.0)
    k1 = -lr
    lower, upper = (float(x) for x in threshold.split("_", 1))
    if option == "token_k1":
        stat = k1
    else:
        total = (k1 * mask).sum(1, keepdims=True)
        if option == "seq_mean_k1":
            total = total / (mask.sum(1, keepdims=True) + 1e-8)
        stat = np.repeat(total, T, axis=1)
    return (stat >= np.log(lower)) & (stat <= np.log(upper)) & mask


def _verl_rs_mask(old, behaviour, mask, level, upper, lower):
    """verl's rejection of the same band, through rl.correction.verl_rejection."""
    kind = {"token": "mis", "sequence": "mis", "geometric": "geo_mask"}[level]
    option, threshold = correction.verl_rejection(
        kind, "token" if kind == "geo_mask" else level, lower, upper
    )
    return _verl_rejection_mask(old, behaviour, mask, option, threshold)


def _openrlhf_weights(kind, old, behaviour, mask, low, high):
    """PolicyLoss.forward, enable_vllm_is_correction, policy_loss_type="ppo":
    rollout_log_ratio = old_log_probs - rollout_log_probs (no clamp)."""
    r = np.exp(old.astype(np.float64) - behaviour)
    if kind == "icepop":
        return r * ((r >= low) & (r <= high))
    if kind == "tis":
        return np.clip(r, low, high)
    raise ValueError(kind)


def _weights(kind, old, behaviour, mask, **kw):
    w, corrected = rl.is_weights(
        kind, jnp.asarray(old), jnp.asarray(behaviour), jnp.asarray(mask), **kw
    )
    return np.asarray(w), np.asarray(corrected)


# ---- weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [2.0, 1.3])
def test_tis_matches_verl(level, cap):
    old, behaviour, mask = _inputs()
    w, corrected = _weights("tis", old, behaviour, mask, level=level, cap=cap)
    expected = _verl_tis(old, behaviour, mask, level, cap)
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)
    raw = np.exp(_np_level_log_ratio(old, behaviour, mask, level))
    np.testing.assert_array_equal(corrected, (raw > cap) & mask)
    assert corrected.any() and (~corrected & mask).any()  # the inputs exercise both sides


def test_token_tis_matches_openrlhf_with_a_zero_lower_threshold():
    old, behaviour, mask = _inputs(1)
    w, _ = _weights("tis", old, behaviour, mask, cap=2.0)
    expected = _openrlhf_weights("tis", old, behaviour, mask, 0.0, 2.0) * mask
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bounds", [(0.5, 2.0), (0.8, 1.5)])
def test_icepop_matches_openrlhf(bounds):
    old, behaviour, mask = _inputs(2)
    lo, hi = bounds
    w, corrected = _weights("icepop", old, behaviour, mask, lower=lo, upper=hi)
    expected = _openrlhf_weights("icepop", old, behaviour, mask, lo, hi) * mask
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)
    assert (w[mask] == 0).any() and (w[mask] > 0).any()
    np.testing.assert_array_equal(corrected, mask & (expected == 0))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_is_verl_is_weights_inside_its_rejection_mask(level):
    """mis = verl's rollout_is (threshold at the band's top, so nothing is truncated inside it)
    times its rollout_rs mask at the same level: the IS weight inside [lower, upper], else 0."""
    old, behaviour, mask = _inputs(3, scale=0.3)
    lo, hi = 0.6, 1.7
    w, corrected = _weights("mis", old, behaviour, mask, level=level, lower=lo, upper=hi)
    keep = _verl_rs_mask(old, behaviour, mask, level, hi, lo)
    expected = _verl_tis(old, behaviour, mask, level, hi) * keep
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(corrected, mask & ~keep)
    assert keep.any() and (mask & ~keep).any()


def test_token_mis_is_icepop():
    old, behaviour, mask = _inputs(4)
    np.testing.assert_array_equal(
        _weights("mis", old, behaviour, mask)[0], _weights("icepop", old, behaviour, mask)[0]
    )


def test_geo_mask_is_verl_geometric_rejection():
    old, behaviour, mask = _inputs(5, scale=0.3)
    lo, hi = 0.9, 1.1
    w, corrected = _weights("geo_mask", old, behaviour, mask, lower=lo, upper=hi)
    keep = _verl_rs_mask(old, behaviour, mask, "geometric", hi, lo)
    np.testing.assert_array_equal(w, keep.astype(np.float32))
    np.testing.assert_array_equal(corrected, mask & ~keep)
    # Whole sequences: every valid token of a row shares its fate.
    for i in range(B):
        assert len(set(keep[i][mask[i]].tolist())) <= 1
    assert keep.any() and (mask & ~keep).any()


def test_weights_have_no_gradient_and_survive_extreme_ratios():
    old, behaviour, mask = _inputs(6)
    old[0, 0] = behaviour[0, 0] + 80.0  # exp would overflow without the +-20 clamp
    old[1, 0] = behaviour[1, 0] - 80.0
    for kind, kw in [("tis", {"level": "sequence"}), ("mis", {}), ("geo_mask", {})]:

        def total(o):
            return rl.is_weights(kind, o, jnp.asarray(behaviour), jnp.asarray(mask), **kw)[0].sum()

        w = np.asarray(
            rl.is_weights(kind, jnp.asarray(old), jnp.asarray(behaviour), jnp.asarray(mask), **kw)[
                0
            ]
        )
        assert np.isfinite(w).all()
        assert not np.asarray(jax.grad(total)(jnp.asarray(old))).any()


# ---- metrics ---------------------------------------------------------------------------------


def test_mismatch_metrics_by_hand():
    old = np.array([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]], np.float32)
    behaviour = np.array([[-1.2, -0.9, -0.5], [-2.0, -9.0, -4.0]], np.float32)
    mask = np.array([[True, True, True], [True, False, False]])
    m = rl.finalize_metrics(
        rl.mismatch_metrics(jnp.asarray(old), jnp.asarray(behaviour), jnp.asarray(mask))
    )
    # |d| on valid tokens: 0.2, 1.1, 0, 1.0; ratios exp(d): 1.22, 0.33, 1, 0.37 -> 2 outside.
    assert m["mismatch/logp_abs_diff_mean"] == pytest.approx((0.2 + 1.1 + 0.0 + 1.0) / 4, 1e-6)
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(1.1, 1e-6)
    assert m["mismatch/ratio_outside_frac"] == pytest.approx(0.5)


def test_correction_metrics_count_tokens_and_sequences_in_the_loss():
    corrected = np.array([[1, 0, 0], [0, 0, 0], [0, 1, 1], [1, 1, 0]], bool)
    w_is = np.where(corrected, 0.0, 1.0).astype(np.float32)
    weights = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]], np.float32)  # row 3 out
    m = rl.finalize_metrics(
        rl.correction_metrics(jnp.asarray(w_is), jnp.asarray(corrected), jnp.asarray(weights))
    )
    assert m["is/corrected_token_frac"] == pytest.approx(3 / 8)
    assert m["is/corrected_seq_frac"] == pytest.approx(2 / 3)
    assert m["is/weight_mean"] == pytest.approx(5 / 8)


# ---- policy_loss -----------------------------------------------------------------------------


def _loss_and_grad(config, logp, behaviour, mask, adv):
    def f(lp):
        loss_sum, denom, metrics = rl.policy_loss(
            config,
            lp,
            None,
            jnp.asarray(adv),
            jnp.asarray(mask),
            behaviour_logp_BT=jnp.asarray(behaviour),
        )
        return loss_sum, (denom, metrics)

    (loss_sum, (denom, metrics)), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    return float(loss_sum), float(denom), rl.finalize_metrics(metrics), np.asarray(grad)


@pytest.mark.parametrize(
    "kind,kw",
    [("tis", dict(is_cap=1.5)), ("icepop", {}), ("tis", dict(is_level="sequence", is_cap=1.2))],
)
def test_policy_loss_weights_the_pg_term_on_policy(kind, kw):
    """On-policy (old_logp None) the ratio is 1, so loss_t = -A w_t and d loss / d logp_t =
    -A w_t on valid tokens, with w from the trainer's own (stop-gradient) logprobs; the
    denominator is the plain token count."""
    logp, behaviour, mask = _inputs(7, scale=0.5)
    adv = np.linspace(-1.0, 1.5, B).astype(np.float32)
    config = rl.AlgorithmConfig(is_correction=kind, **kw)
    loss_sum, denom, metrics, grad = _loss_and_grad(config, logp, behaviour, mask, adv)
    level = kw.get("is_level", "token")
    if kind == "tis":
        w = _verl_tis(logp, behaviour, mask, level, kw["is_cap"])
    else:
        w = _openrlhf_weights("icepop", logp, behaviour, mask, 0.5, 2.0) * mask
    assert denom == mask.sum()
    assert loss_sum == pytest.approx(float((-adv[:, None] * w * mask).sum()), rel=1e-5)
    np.testing.assert_allclose(grad, -adv[:, None] * w * mask, rtol=1e-5, atol=1e-6)
    d = np.abs(logp - behaviour)[mask]
    assert metrics["mismatch/logp_abs_diff_mean"] == pytest.approx(d.mean(), rel=1e-5)
    assert metrics["mismatch/logp_abs_diff_max"] == pytest.approx(d.max(), rel=1e-5)
    assert 0 < metrics["is/corrected_token_frac"] < 1


def test_policy_loss_uses_the_given_old_logprobs_for_the_ratio():
    """Off-policy the IS ratio is old_logp (recomputed by the trainer) over behaviour, not the
    current logp: changing logp leaves the weights alone."""
    old, behaviour, mask = _inputs(8)
    adv = np.ones(B, np.float32)
    config = rl.AlgorithmConfig(is_correction="icepop", clip_low=0.9, clip_high=100.0)
    logp = old + 0.01  # inside the PPO clip: loss_t = -A exp(logp - old) w_t
    loss_sum, _, _ = rl.policy_loss(
        config,
        jnp.asarray(logp),
        jnp.asarray(old),
        jnp.asarray(adv),
        jnp.asarray(mask),
        behaviour_logp_BT=jnp.asarray(behaviour),
    )
    w = _openrlhf_weights("icepop", old, behaviour, mask, 0.5, 2.0)
    expected = (-np.exp(logp.astype(np.float64) - old) * w * mask).sum()
    assert float(loss_sum) == pytest.approx(expected, rel=1e-5)


def test_without_correction_the_loss_is_unchanged_and_the_gap_still_logged():
    logp, behaviour, mask = _inputs(9)
    adv = np.linspace(-1.0, 1.0, B).astype(np.float32)
    plain = rl.AlgorithmConfig()
    a = rl.policy_loss(plain, jnp.asarray(logp), None, jnp.asarray(adv), jnp.asarray(mask))
    b = rl.policy_loss(
        plain,
        jnp.asarray(logp),
        None,
        jnp.asarray(adv),
        jnp.asarray(mask),
        behaviour_logp_BT=jnp.asarray(behaviour),
    )
    assert float(a[0]) == float(b[0])
    assert "mismatch/logp_abs_diff_mean" in b[2] and "is/corrected_token_frac" not in b[2]
    assert "mismatch/logp_abs_diff_mean" not in a[2]
    with pytest.raises(ValueError, match="behaviour_logp_BT"):
        rl.policy_loss(
            rl.AlgorithmConfig(is_correction="tis"),
            jnp.asarray(logp),
            None,
            jnp.asarray(adv),
            jnp.asarray(mask),
        )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(is_correction="bogus"), "is_correction='bogus'"),
        (dict(is_level="row"), "is_level='row'"),
        (dict(is_correction="tis", is_cap=0.0), "is_cap=0.0"),
        (dict(is_correction="mis", is_lower=2.0, is_upper=1.0), "is_lower=2.0"),
        (dict(is_correction="icepop", is_level="sequence"), "is_level='sequence' applies"),
        (dict(is_level="sequence"), "is_level='sequence' applies"),
    ],
)
def test_validate_names_the_knob(overrides, message):
    with pytest.raises(FlagError, match=message):
        rl.validate(rl.get_preset("grpo", **overrides), group_size=4)


def test_every_correction_validates():
    for kind in correction.CORRECTIONS:
        rl.validate(rl.get_preset("grpo", is_correction=kind), group_size=4)
    rl.validate(rl.get_preset("grpo", is_correction="mis", is_level="sequence"), group_size=4)


# ---- the translation to verl's rejection options -----------------------------------------


def test_verl_rejection_translation_is_pinned():
    """verl's k1 bounds are on mu / pi_old: the band [lower, upper] of the ratio pi_old / mu
    is verl's "1/upper_1/lower"."""
    assert correction.verl_rejection("mis", "token", 0.5, 3.0) == (
        "token_k1",
        "0.3333333333333333_2.0",
    )
    assert correction.verl_rejection("mis", "sequence", 0.8, 1.25) == ("seq_sum_k1", "0.8_1.25")
    assert correction.verl_rejection("icepop", "token", 0.0, 2.0) == ("token_k1", "0.5_inf")
    assert correction.verl_rejection("geo_mask", "token", 0.9, 1.2)[0] == "seq_mean_k1"
    with pytest.raises(ValueError, match="no verl rejection option"):
        correction.verl_rejection("tis", "token", 0.5, 2.0)


@pytest.mark.parametrize(
    "kind,level",
    [("mis", "token"), ("icepop", "token"), ("mis", "sequence"), ("geo_mask", "token")],
)
@pytest.mark.parametrize("band", [(0.5, 3.0), (0.7, 1.2), (0.0, 1.6)])
def test_an_asymmetric_band_keeps_verls_tokens_once_inverted(kind, level, band):
    old, behaviour, mask = _inputs(11, scale=0.5 if level == "token" else 0.15)
    lo, hi = band
    _, corrected = _weights(kind, old, behaviour, mask, level=level, lower=lo, upper=hi)
    option, threshold = correction.verl_rejection(kind, level, lo, hi)
    keep = _verl_rejection_mask(old, behaviour, mask, option, threshold)
    np.testing.assert_array_equal(corrected, mask & ~keep)
    # Copied without inverting, the asymmetric band keeps other tokens.
    naive = _verl_rejection_mask(old, behaviour, mask, option, f"{max(lo, 1e-12)!r}_{hi!r}")
    if lo > 0 and option == "token_k1":
        assert (naive != keep).any()


def test_sequence_statistics_clamp_each_token_first():
    """verl clamps each token's log-ratio to [-20, 20] before a sequence's sum or mean: a
    row with one token at d = +35 and the rest at -2 has the clamped sum 20 - 2 (n - 1)."""
    old, behaviour, mask = _inputs(12, scale=0.05)
    old[0, 0] = behaviour[0, 0] + 35.0
    old[0, 1:] = behaviour[0, 1:] - 2.0
    for kind, level in (("mis", "sequence"), ("geo_mask", "token")):
        _, corrected = _weights(kind, old, behaviour, mask, level=level, lower=0.5, upper=2.0)
        option, threshold = correction.verl_rejection(kind, level, 0.5, 2.0)
        keep = _verl_rejection_mask(old, behaviour, mask, option, threshold)
        np.testing.assert_array_equal(corrected, mask & ~keep)
    stat = np.asarray(
        correction.rejection_log_ratio(
            jnp.asarray(old), jnp.asarray(behaviour), jnp.asarray(mask), "sequence"
        )
    )
    assert stat[0, 0] == pytest.approx(20.0 - 2.0 * 6, rel=1e-5)
