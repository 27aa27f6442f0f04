"""Paper-fidelity conventions: rejected rows (drop / zero), exact zeros on flat groups under
jit, the entropy gradient with -inf logits, the k3 cap, the KL metric, invalid rows, and the
KL-in-reward of per-sequence estimators. Expected values are written from the formulas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl

compute_advantages = jax.jit(rl.compute_advantages, static_argnums=(0, 4))
policy_loss = jax.jit(rl.policy_loss, static_argnums=0)


# ---- rejected rows: drop vs zero ---------------------------------------------------------


def _random_batch(seed, G=4, P=6, T=5):
    rng = np.random.default_rng(seed)
    p_correct = rng.choice([0.0, 0.3, 0.7, 1.0], P)  # all-wrong / mixed / all-correct groups
    correct = rng.random((P, G)) < p_correct[:, None]
    lens = rng.integers(1, T + 1, P * G)
    mask = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
    return correct.reshape(-1), mask


def _toy_logp(B, T, seed=0, D=4, V=6):
    rng = np.random.default_rng(seed)
    W = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    tok = jnp.asarray(rng.integers(0, V, (B, T)))

    def logp_fn(W):
        return jnp.take_along_axis(jax.nn.log_softmax(x @ W, -1), tok[..., None], -1)[..., 0]

    return W, logp_fn


@pytest.mark.parametrize("preset", ["reinforce_rej", "raft_pp", "raft"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejected_rows_drop_over_zero_is_n_all_over_n_kept(preset, seed):
    """Same numerator; the token-mean denominator counts every valid token ("zero", Minimal-RL)
    or only the kept rows' ("drop"): loss and gradient differ by N_all / N_kept exactly."""
    G = 4
    correct, mask = _random_batch(seed, G)
    B, T = mask.shape
    groups = correct.reshape(-1, G)
    if preset == "reinforce_rej":  # mixed groups carry the signal
        kept = np.repeat(groups.any(1) & ~groups.all(1), G)
    else:  # RAFT(++): the correct samples
        kept = correct
    n_all, n_kept = mask.sum(), mask[kept].sum()
    assert 0 < n_kept < n_all
    W, logp_fn = _toy_logp(B, T, seed)
    results = {}
    for rows in ("drop", "zero"):
        cfg = rl.get_preset(preset, rejected_rows=rows)
        adv, keep, _ = compute_advantages(
            cfg, jnp.asarray(correct, jnp.float32), jnp.asarray(correct), jnp.asarray(mask), G
        )
        np.testing.assert_array_equal(
            np.asarray(keep), kept if rows == "drop" else np.ones(B, bool)
        )

        def loss(W, cfg=cfg, adv=adv, keep=keep):
            lp = logp_fn(W)
            s, d, _ = rl.policy_loss(
                cfg, lp, jax.lax.stop_gradient(lp), adv, jnp.asarray(mask), keep
            )
            return rl.finalize_loss(s, d)

        results[rows] = jax.jit(jax.value_and_grad(loss))(W)
    (l_drop, g_drop), (l_zero, g_zero) = results["drop"], results["zero"]
    ratio = float(n_all / n_kept)
    assert float(l_drop) == pytest.approx(ratio * float(l_zero), rel=1e-5)
    np.testing.assert_allclose(np.asarray(g_drop), ratio * np.asarray(g_zero), rtol=1e-4, atol=1e-7)
    assert float(jnp.abs(g_zero).max()) > 1e-4


def test_zero_rows_keep_their_kl_and_entropy_terms():
    """Minimal-RL's rejected rows stay in the KL and entropy terms (same response mask)."""
    correct = np.array([1, 1, 0, 0], bool)  # G=2: an all-correct and an all-wrong group
    mask = np.ones((4, 2), np.float32)
    cfg = rl.get_preset(
        "reinforce_rej", kl_in="loss", kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1
    )
    adv, keep, _ = compute_advantages(cfg, jnp.zeros(4), jnp.asarray(correct), jnp.asarray(mask), 2)
    assert np.all(np.asarray(adv) == 0) and np.all(np.asarray(keep))
    lp = jnp.full((4, 2), -1.0)
    s, d, _ = policy_loss(
        cfg,
        lp,
        lp,
        adv,
        jnp.asarray(mask),
        keep,
        ref_logp_BT=lp - 0.2,
        entropy_BT=jnp.full((4, 2), 3.0),
    )
    # per token: 0 (A = 0) + 0.5 * 0.2 - 0.1 * 3 = -0.2, over all 8 tokens.
    assert (float(s), float(d)) == pytest.approx((-1.6, 8.0))


# ---- flat groups: exact zeros under jit --------------------------------------------------

FLAT_VALUES = (1.0, 0.0, 0.1, 0.7, 1 / 3)  # one value per group; continuous ones too
BASELINE_PRESETS = (
    "grpo",
    "dr_grpo",
    "lite_ppo",
    "rloo",
    "reinforce_pp_baseline",
    "reinforce_rej",
    "gspo",
    "dapo",
    "remax",
    "cispo",
    "sapo",
    "gmpo",
    "clip_cov",
    "kl_cov",
    "gpg",
    "opo",
    "grpo_passk",
)


def _flat_value(name, r_B, correct_B):
    """What a flat group's rows get from each preset's formula, exactly."""
    if name in BASELINE_PRESETS or name == "reinforce_pp":
        # r - group mean = 0 (rej: rejected; ++: a flat batch whitens to 0)
        return np.zeros_like(r_B)
    if name == "reinforce":
        return np.where(correct_B, 1.0, -1.0)  # A = r in {-1, 1}, no baseline
    return correct_B.astype(np.float64)  # raft / raft_pp: A = 1 on positives


@pytest.mark.parametrize("G", range(2, 9))
# PPO has no group baseline (its critic's values are the baseline): tests/rl/test_value.py.
@pytest.mark.parametrize("name", sorted(set(rl.PRESETS) - {"ppo"}))
def test_flat_groups_get_exactly_their_formula_value_under_jit(name, G):
    r = np.repeat(np.asarray(FLAT_VALUES, np.float32), G)
    if name == "reinforce_pp":  # no baseline: only a flat batch gives 0
        r = np.full_like(r, 0.7)
    correct = r >= 0.5
    B, T = r.size, 6
    mask = (np.arange(T)[None] < (np.arange(B) % T + 1)[:, None]).astype(np.float32)
    lp = jnp.full((B, T), -0.5)
    cfg = rl.get_preset(name)
    adv, _, _ = compute_advantages(
        cfg,
        jnp.asarray(r),
        jnp.asarray(correct),
        jnp.asarray(mask),
        G,
        logp_BT=lp,
        ref_logp_BT=lp,  # KL exactly 0
        baseline_B=jnp.asarray(r),
    )  # ReMax: greedy = the flat value
    adv = np.asarray(adv, np.float64)
    want = _flat_value(name, r, correct)
    if adv.ndim == 2:
        want = want[:, None] * mask
    np.testing.assert_array_equal(adv, want)


@pytest.mark.parametrize("G", range(2, 9))
def test_issue_example_reinforce_pp_baseline_with_kl_in_reward(G):
    """Issue 14: [1]*G + [0]*G with KL 0 in the reward gave +-0.015 (G = 3) before the
    group mean was taken around a pivot; it must be exactly 0."""
    cfg = rl.get_preset("reinforce_pp_baseline", kl_in="reward", kl_estimator="k1", kl_coef=0.01)
    r = np.r_[np.ones(G), np.zeros(G)].astype(np.float32)
    mask = np.ones((2 * G, 4), np.float32)
    lp = jnp.full((2 * G, 4), -1.0)
    adv, _, _ = compute_advantages(
        cfg, jnp.asarray(r), jnp.asarray(r > 0), jnp.asarray(mask), G, logp_BT=lp, ref_logp_BT=lp
    )
    assert np.all(np.asarray(adv) == 0.0)


# ---- entropy gradient with -inf logits ---------------------------------------------------


def test_entropy_gradient_with_minus_inf_logits_is_finite_and_right():
    z = np.array(
        [
            [
                [1.0, -np.inf, 0.5, 2.0, -np.inf],
                [0.3, 0.3, 0.3, 0.3, 0.3],
                [-np.inf, -np.inf, 4.0, -1.0, 0.0],
            ]
        ],
        np.float32,
    )
    g = np.asarray(
        jax.jit(jax.grad(lambda x: rl.entropy_from_logits(x).sum()))(jnp.asarray(z)), np.float64
    )
    assert np.isfinite(g).all()
    # Closed form over the finite entries: dH/dz_j = -p_j (log p_j + H); 0 where z_j = -inf.
    for row, g_row in zip(z[0], g[0]):
        finite = np.isfinite(row)
        x = row[finite].astype(np.float64)
        p = np.exp(x - x.max())
        p /= p.sum()
        H = -(p * np.log(p)).sum()
        want = np.zeros_like(row, np.float64)
        want[finite] = -p * (np.log(p) + H)
        np.testing.assert_allclose(g_row, want, rtol=1e-5, atol=1e-7)
    assert np.abs(g[0, 1]).max() < 1e-7  # uniform: entropy at its maximum


# ---- the k3 cap, the KL metric -----------------------------------------------------------


def test_k3_is_capped_at_10_by_default():
    d = np.array([-30.0, -5.0, 0.5, 30.0], np.float32)
    logp, ref = jnp.asarray(d)[None], jnp.zeros((1, 4))
    raw = np.exp(-np.clip(d, -20, 20)) + np.clip(d, -20, 20) - 1  # k3 of the clamped log-ratio
    np.testing.assert_allclose(
        np.asarray(rl.kl_estimate(logp, ref, "k3"))[0], np.minimum(raw, 10.0), rtol=1e-5
    )
    np.testing.assert_allclose(np.asarray(rl.kl_estimate(logp, ref, "k3", None))[0], raw, rtol=1e-5)
    # Past the cap the KL term has no gradient (as verl / OpenRLHF).
    g = jax.grad(lambda x: rl.kl_estimate(x, ref, "k3").sum())(logp)
    assert float(g[0, 0]) == 0.0 and float(g[0, 1]) == 0.0 and float(g[0, 2]) != 0.0
    # The knob reaches the loss.
    lp = jnp.full((1, 2), -30.0)
    for cap, want in ((10.0, 10.0), (None, np.exp(20.0) - 21.0)):
        cfg = rl.get_preset("grpo", kl_coef=1.0, k3_clamp=cap)
        s, d_, _ = policy_loss(
            cfg, lp, lp, jnp.zeros(1), jnp.ones((1, 2)), ref_logp_BT=jnp.zeros((1, 2))
        )
        assert float(rl.finalize_loss(s, d_)) == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("kl_in,kl_coef", [(None, 0.0), ("loss", 0.001)])
def test_kl_ref_metric_has_one_name_with_or_without_a_kl_term(kl_in, kl_coef):
    cfg = rl.get_preset("raft_pp", kl_in=kl_in, kl_coef=kl_coef)
    lp = jnp.full((2, 3), -1.0)
    _, _, m = policy_loss(cfg, lp, lp, jnp.ones(2), jnp.ones((2, 3)), ref_logp_BT=lp - 0.3)
    assert float(rl.finalize_metrics(m)["policy/kl_ref"]) == pytest.approx(
        np.exp(-0.3) + 0.3 - 1, rel=1e-5
    )


# ---- rows without a reward leave every statistic -----------------------------------------


def test_invalid_rows_leave_the_batch_std():
    """lite_ppo's batch std over the valid rows only (a dropped prompt's group is invalid)."""
    r = np.array([1, 0, 0, 0, 1, 1, 0, 0, 5, 5, 5, 5], np.float32)  # the last group is dropped
    valid = np.r_[np.ones(8, bool), np.zeros(4, bool)]
    adv, keep, _ = compute_advantages(
        rl.get_preset("lite_ppo"),
        jnp.asarray(r),
        jnp.asarray(r > 0),
        jnp.ones((12, 2)),
        4,
        valid_B=jnp.asarray(valid),
    )
    centered = np.r_[0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    want = np.r_[centered / (r[:8].std(ddof=1) + 1e-6), np.zeros(4)]
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(keep), valid)


# ---- KL in the reward of per-sequence estimators (OpenRLHF's group_norm / rloo) ----------


def test_kl_in_reward_for_group_normalized_advantages():
    cfg = rl.get_preset("grpo", kl_in="reward", kl_estimator="k1", kl_coef=0.5)
    r = jnp.array([1.0, 0.0])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
    lp = jnp.zeros((2, 3))
    ref = -jnp.array([[0.1, 0.2, 9.0], [0.3, 0.3, 0.3]])  # k1 = logp - ref; 9.0 is padding
    adv, _, _ = compute_advantages(cfg, r, r > 0, mask, 2, logp_BT=lp, ref_logp_BT=ref)
    a = 0.5 / (np.sqrt(0.5) + 1e-6)  # group-normalised +-a
    want = np.array(
        [[a - 0.5 * 0.3, a - 0.5 * 0.2, 0.0], [-a - 0.5 * 0.9, -a - 0.5 * 0.6, -a - 0.5 * 0.3]]
    )
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5)


# ---- RAFT++ / Reinforce / Reinforce-Rej: the paper's per-sequence formula vs the code's ------


def _minimal_rl_loss(A_B, logp, old_logp, mask, eps=0.2, per_sequence=False):
    """Minimal-RL's verl `compute_policy_loss` (policy_loss=plusplus), numpy: per token
    max(-A rho, -A clip(rho, 1 - eps, 1 + eps)); `agg_loss` with loss_agg_mode="token-mean"
    over the response mask (every row, rejected ones at A = 0). per_sequence: the paper's
    eqs. 5 and 8 instead (Minimalist, arXiv 2504.11343, §2): 1/|D| sum_(x,a) 1/|a| sum_t."""
    rho = np.exp(logp - old_logp)
    A = A_B[:, None]
    per_token = np.maximum(-A * rho, -A * np.clip(rho, 1 - eps, 1 + eps))
    if per_sequence:
        return float(np.mean((per_token * mask).sum(1) / mask.sum(1)))
    return float((per_token * mask).sum() / mask.sum())


@pytest.mark.parametrize("preset", ["reinforce", "reinforce_rej", "raft_pp"])
def test_minimalist_presets_follow_the_codes_token_mean_not_the_papers_per_sequence_mean(preset):
    """The Minimalist paper writes Reinforce and RAFT++ per sequence (1/|a| inside the sum over
    samples); the authors' code takes one token mean over the batch. The presets follow the
    code; --agg=seq-mean-token-mean gives the paper's formula. Advantages by hand: Reinforce
    A = +1 / -1; Reinforce-Rej the same with all-correct and all-wrong groups at 0; RAFT++
    A = 1 on correct samples, 0 on the others."""
    G = 4
    correct = np.array([1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1], bool)
    B, T = correct.size, 6
    rng = np.random.default_rng(7)
    mask = (np.arange(T)[None] < rng.integers(1, T + 1, B)[:, None]).astype(np.float32)
    logp = rng.normal(-1.0, 0.3, (B, T)).astype(np.float32)
    old_logp = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)  # ratios off 1, clipped
    sign = np.where(correct, 1.0, -1.0)
    flat = np.repeat(correct.reshape(-1, G).all(1) | ~correct.reshape(-1, G).any(1), G)
    want_A = {
        "reinforce": sign,
        "reinforce_rej": np.where(flat, 0.0, sign),
        "raft_pp": correct.astype(np.float64),
    }[preset]
    for agg, per_sequence in (("token-mean", False), ("seq-mean-token-mean", True)):
        cfg = rl.get_preset(preset)
        assert cfg.agg == "token-mean" and cfg.rejected_rows == "zero"
        cfg = rl.get_preset(preset, agg=agg)
        adv, keep, _ = compute_advantages(
            cfg, jnp.asarray(correct, jnp.float32), jnp.asarray(correct), jnp.asarray(mask), G
        )
        np.testing.assert_array_equal(np.asarray(adv), want_A)
        s, d, _ = policy_loss(
            cfg, jnp.asarray(logp), jnp.asarray(old_logp), adv, jnp.asarray(mask), keep
        )
        want = _minimal_rl_loss(want_A, logp, old_logp, mask, per_sequence=per_sequence)
        assert float(rl.finalize_loss(s, d)) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert _minimal_rl_loss(want_A, logp, old_logp, mask) != pytest.approx(
        _minimal_rl_loss(want_A, logp, old_logp, mask, per_sequence=True), rel=1e-3
    )
