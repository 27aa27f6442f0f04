"""The baseline presets' math (GSPO, ReMax, DAPO), checked against numbers computed here by
hand / numpy from each paper's formula (never by calling the code's own formula)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl

# ---- GSPO (Zheng et al. 2025, arXiv:2507.18071) ---------------------------------------------

# Two sequences of 3 and 2 tokens (T = 3).
LOGP = np.array([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], np.float32)
OLD = np.array([[-1.1, -1.7, -0.6], [-0.4, -0.5, 0.0]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], bool)


def _gspo_by_hand(adv, eps_low, eps_high):
    """Eq. (5)-(7): s_i = (pi / pi_old)^(1/|y_i|) = exp(mean_t (logp - old_logp));
    J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)."""
    # Row 0: d = 0.1, -0.3, 0.1 -> mean -0.1/3; row 1: d = 0.1, -0.2 -> mean -0.05.
    log_s = np.array([(0.1 - 0.3 + 0.1) / 3, (0.1 - 0.2) / 2])
    s = np.exp(log_s)
    terms = np.minimum(s * adv, np.clip(s, 1 - eps_low, 1 + eps_high) * adv)
    clipped = terms != s * adv
    return -terms.mean(), s, clipped


@pytest.mark.parametrize("adv", [np.array([1.0, -2.0]), np.array([-0.5, 1.5])])
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.2)])
def test_gspo_loss_is_the_sequence_level_clipped_objective(adv, eps):
    config = rl.get_preset("gspo", clip_low=eps[0], clip_high=eps[1])
    loss_sum, denom, metrics = rl.policy_loss(
        config,
        jnp.asarray(LOGP),
        jnp.asarray(OLD),
        jnp.asarray(adv, jnp.float32),
        jnp.asarray(MASK),
    )
    want, s, clipped = _gspo_by_hand(adv, *eps)
    np.testing.assert_allclose(float(loss_sum / denom), want, rtol=1e-5)
    got = rl.finalize_metrics(metrics)
    # The ratio the loss clips is the sequence's, on every one of its tokens.
    np.testing.assert_allclose(
        [got["policy/ratio_min"], got["policy/ratio_max"]], [s.min(), s.max()], rtol=1e-5
    )
    # Clipped tokens: all 3 of row 0 and both of row 1 count when their row is clipped.
    np.testing.assert_allclose(
        got["policy/clip_frac"], (3 * clipped[0] + 2 * clipped[1]) / 5, atol=1e-6
    )


def test_gspo_gradient_is_the_length_normalised_sequence_gradient():
    """d J / d logp_it = s_i A_i / |y_i| / G on unclipped sequences (eq. 10), 0 on clipped
    ones and on padding."""
    adv = np.array([1.0, -2.0], np.float32)
    config = rl.get_preset("gspo", clip_low=0.2, clip_high=0.2)

    def loss(logp):
        loss_sum, denom, _ = rl.policy_loss(
            config, logp, jnp.asarray(OLD), jnp.asarray(adv), jnp.asarray(MASK)
        )
        return loss_sum / denom

    grad = np.asarray(jax.grad(loss)(jnp.asarray(LOGP)))
    s = np.exp([-0.1 / 3, -0.05])
    want = np.array([[-s[0] * 1.0 / 3 / 2] * 3, [s[1] * 2.0 / 2 / 2] * 2 + [0.0]])
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    # Sequence 0 clipped from above (A > 0, s > 1 + eps): no gradient there.
    grad = np.asarray(jax.grad(loss)(jnp.asarray(LOGP).at[0, 0].add(1.0)))
    np.testing.assert_allclose(grad[0], 0.0)
    np.testing.assert_allclose(grad[1], want[1], rtol=1e-5)


def test_gspo_does_not_clip_a_sequence_for_one_token_far_off():
    """One token's ratio e^0.9 would be clipped by PPO at 1.2; the sequence's geometric mean
    exp((0.9 - 0.6) / 3) = e^0.1 is inside [0.8, 1.2], so GSPO keeps its gradient."""
    logp = np.array([[-1.0, -2.0, -0.5]], np.float32)
    old = logp - np.array([[0.9, -0.3, -0.3]], np.float32)
    mask = np.ones((1, 3), bool)
    adv = jnp.ones((1,))
    token = rl.get_preset("gspo", importance="token", clip_low=0.2, clip_high=0.2)
    seq = rl.get_preset("gspo", clip_low=0.2, clip_high=0.2)
    for config, want in ((token, -(1.2 + math.exp(-0.3) * 2) / 3), (seq, -math.exp(0.1))):
        loss_sum, denom, _ = rl.policy_loss(
            config, jnp.asarray(logp), jnp.asarray(old), adv, jnp.asarray(mask)
        )
        np.testing.assert_allclose(float(loss_sum / denom), want, rtol=1e-5)


def test_gspo_preset_and_validation():
    c = rl.get_preset("gspo")
    assert (c.importance, c.clip_low, c.clip_high, c.agg) == (
        "sequence",
        3e-4,
        4e-4,
        "seq-mean-token-mean",
    )
    assert (c.mean, c.std, c.kl_in) == ("group", "group", None)
    with pytest.raises(ValueError, match="importance='seq'"):
        rl.validate(rl.get_preset("grpo", importance="seq"), 4)


# ---- ReMax (Li et al. 2023, arXiv:2310.10505) -----------------------------------------------


def test_remax_advantage_is_reward_minus_the_greedy_reward():
    """Algorithm 1: A_i = r(x, y_i) - r(x, y_greedy); two prompts, G = 2."""
    r = jnp.array([1.0, 0.0, 0.5, 1.0])
    greedy = jnp.array([1.0, 1.0, 0.0, 0.0])  # prompt 0's greedy reward 1, prompt 1's 0
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], bool)
    config = rl.get_preset("remax")
    adv, keep, _ = rl.compute_advantages(config, r, r > 0.5, mask, 2, baseline_B=greedy)
    np.testing.assert_allclose(np.asarray(adv), [0.0, -1.0, 0.5, 1.0])
    assert np.asarray(keep).all()
    # Loss at ratio 1: REINFORCE's -sum_t A_i over each sequence, averaged over the 4 sequences.
    logp = jnp.full((4, 3), -0.7)

    def loss(lp):
        s, d, _ = rl.policy_loss(config, lp, None, adv, mask, keep)
        return s / d

    assert float(loss(logp)) == pytest.approx(-(0 * 2 - 1 * 1 + 0.5 * 3 + 1 * 2) / 4)
    np.testing.assert_allclose(
        np.asarray(jax.grad(loss)(logp)),
        -np.array([[0, 0, 0], [-1, 0, 0], [0.5, 0.5, 0.5], [1, 1, 0]]) / 4,
        atol=1e-7,
    )


def test_remax_baseline_follows_binary_reward_and_is_required():
    r = jnp.array([3.0, 0.0, 0.0, 3.0])
    correct = jnp.array([True, False, False, True])
    mask = jnp.ones((4, 2), bool)
    config = rl.get_preset("remax", binary_reward=(-1.0, 1.0))
    adv, _, _ = rl.compute_advantages(
        config,
        r,
        correct,
        mask,
        2,
        baseline_B=jnp.zeros(4),
        baseline_correct_B=jnp.array([True, True, False, False]),
    )
    # r in {-1, 1}: [1, -1, -1, 1]; greedy [1, 1, -1, -1].
    np.testing.assert_allclose(np.asarray(adv), [0.0, -2.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="advantage='remax' needs baseline_B"):
        rl.compute_advantages(rl.get_preset("remax"), r, correct, mask, 2)
    with pytest.raises(ValueError, match="baseline_correct_B"):
        rl.compute_advantages(config, r, correct, mask, 2, baseline_B=jnp.zeros(4))


def test_remax_kl_in_reward_subtracts_the_kl_to_go():
    """With kl_in=reward (k1, beta 0.1): A_it = (r_i - b_i) - 0.1 * sum_{s >= t} d_is."""
    r = jnp.array([1.0, 0.0])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
    logp = jnp.array([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = logp - jnp.array([[0.1, 0.2, 0.3], [0.5, 0.5, 0.0]])
    config = rl.get_preset("remax", kl_in="reward", kl_estimator="k1", kl_coef=0.1)
    adv, _, _ = rl.compute_advantages(
        config, r, r > 0, mask, 2, logp_BT=logp, ref_logp_BT=ref, baseline_B=jnp.array([0.5, 0.5])
    )
    want = [
        [0.5 - 0.1 * 0.6, 0.5 - 0.1 * 0.5, 0.5 - 0.1 * 0.3],
        [-0.5 - 0.1 * 1.0, -0.5 - 0.1 * 0.5, 0.0],
    ]
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-6)


# ---- DAPO (Yu et al. 2025, arXiv:2503.14476) ------------------------------------------------


def test_dapo_clip_higher_and_token_mean_by_hand():
    """Eq. 10 with eps_low 0.2, eps_high 0.28, 1 / sum_i |o_i| over all tokens (eq. 12)."""
    config = rl.get_preset("dapo")
    adv = jnp.array([1.0, -1.0])
    # Row 0 (A > 0): ratio e^0.2 = 1.22 stays, e^0.3 = 1.35 is clipped to 1.28 (PPO's 1.2
    # would clip both); row 1 (A < 0): e^-0.3 = 0.74 is clipped to 0.8, e^0.1 stays.
    logp = jnp.zeros((2, 2))
    old = -jnp.array([[0.2, 0.3], [-0.3, 0.1]])
    mask = jnp.ones((2, 2), bool)
    s, d, m = rl.policy_loss(config, logp, old, adv, mask)
    per_token = [-math.exp(0.2), -1.28, 0.8, math.exp(0.1)]
    assert float(s / d) == pytest.approx(sum(per_token) / 4, rel=1e-5)
    got = rl.finalize_metrics(m)
    assert got["policy/clip_frac_high"] == pytest.approx(1 / 4)
    assert got["policy/clip_frac_low"] == pytest.approx(1 / 4)


def test_dapo_keeps_only_groups_with_both_verdicts():
    """Eq. 11: 0 < #correct < G; the rest leave the loss (their rows are resampled by the
    trainer when it can)."""
    correct = jnp.array([True, False, True, True, False, False])
    r = correct.astype(jnp.float32)
    adv, keep, met = rl.compute_advantages(
        rl.get_preset("dapo"), r, correct, jnp.ones((6, 2), bool), 2
    )
    np.testing.assert_array_equal(np.asarray(keep), [True, True, False, False, False, False])
    # GRPO's advantage of the mixed group: (1 - 0.5) / (std_ddof1 = 0.7071 + 1e-6).
    np.testing.assert_allclose(
        np.asarray(adv)[:2],
        [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)],
        rtol=1e-5,
    )
    assert rl.finalize_metrics(met)["adv/frac_groups_rejected"] == pytest.approx(2 / 3)
    c = rl.get_preset("dapo")
    assert (c.clip_low, c.clip_high, c.kl_in, c.reject_all_correct, c.reject_all_wrong) == (
        0.2,
        0.28,
        None,
        True,
        True,
    )
