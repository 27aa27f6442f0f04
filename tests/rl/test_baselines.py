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
    loss_sum, denom, metrics = rl.policy_loss(config, jnp.asarray(LOGP), jnp.asarray(OLD),
                                              jnp.asarray(adv, jnp.float32), jnp.asarray(MASK))
    want, s, clipped = _gspo_by_hand(adv, *eps)
    np.testing.assert_allclose(float(loss_sum / denom), want, rtol=1e-5)
    got = rl.finalize_metrics(metrics)
    # The ratio the loss clips is the sequence's, on every one of its tokens.
    np.testing.assert_allclose([got["policy/ratio_min"], got["policy/ratio_max"]],
                               [s.min(), s.max()], rtol=1e-5)
    # Clipped tokens: all 3 of row 0 and both of row 1 count when their row is clipped.
    np.testing.assert_allclose(got["policy/clip_frac"], (3 * clipped[0] + 2 * clipped[1]) / 5,
                               atol=1e-6)


def test_gspo_gradient_is_the_length_normalised_sequence_gradient():
    """d J / d logp_it = s_i A_i / |y_i| / G on unclipped sequences (eq. 10), 0 on clipped
    ones and on padding."""
    adv = np.array([1.0, -2.0], np.float32)
    config = rl.get_preset("gspo", clip_low=0.2, clip_high=0.2)

    def loss(logp):
        loss_sum, denom, _ = rl.policy_loss(config, logp, jnp.asarray(OLD), jnp.asarray(adv),
                                            jnp.asarray(MASK))
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
        loss_sum, denom, _ = rl.policy_loss(config, jnp.asarray(logp), jnp.asarray(old), adv,
                                            jnp.asarray(mask))
        np.testing.assert_allclose(float(loss_sum / denom), want, rtol=1e-5)


def test_gspo_preset_and_validation():
    c = rl.get_preset("gspo")
    assert (c.importance, c.clip_low, c.clip_high, c.agg) == (
        "sequence", 3e-4, 4e-4, "seq-mean-token-mean")
    assert (c.mean, c.std, c.kl_in) == ("group", "group", None)
    with pytest.raises(ValueError, match="importance='seq'"):
        rl.validate(rl.get_preset("grpo", importance="seq"), 4)
