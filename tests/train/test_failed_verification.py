"""Rows whose verification failed (timeout / crash) leave the loss and every group statistic.

Expected values are computed by hand with numpy over the verified rows only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.train.update import advantages

G, T = 4, 3
REWARDS = np.array(
    [
        1.0,
        0.0,
        1.0,
        0.0,  # group 0: the last row failed (reward 0 = unscored)
        1.0,
        1.0,
        1.0,
        0.0,
    ],  # group 1: the last row failed; verified rows all correct
    np.float32,
)
CORRECT = REWARDS > 0
VALID = np.array([True, True, True, False, True, True, True, False])
MASK = np.ones((8, T), np.float32)


def _np_group_normalized(r, valid, ddof=1, eps=1e-6):
    out = np.zeros_like(r)
    for g in range(len(r) // G):
        rows = slice(g * G, (g + 1) * G)
        x = r[rows][valid[rows]]
        std = x.std(ddof=ddof)
        adv = np.zeros(G) if np.all(x == x[0]) else (r[rows] - x.mean()) / (std + eps)
        out[rows] = np.where(valid[rows], adv, 0.0)
    return out


def _advantages(config, valid=VALID):
    adv, _, keep, metrics = advantages.advantages(  # (_: PPO's returns, None here)
        jnp.asarray(REWARDS),
        jnp.asarray(CORRECT),
        jnp.asarray(MASK),
        jnp.zeros(8, bool),
        jnp.zeros(8, bool),
        jnp.asarray(valid),
        jnp.zeros((8, T)),
        None,
        config=config,
        group_size=G,
    )
    return adv, keep, metrics


def test_failed_rows_leave_the_group_mean_and_std():
    adv, keep, _ = _advantages(rl.presets.grpo())
    np.testing.assert_allclose(adv, _np_group_normalized(REWARDS, VALID), atol=1e-5)
    # group 0 over [1, 0, 1]: mean 2/3, std sqrt(1/3); the failed row's 0 would pull both.
    np.testing.assert_allclose(
        adv[:3], [np.sqrt(1 / 3), -2 / np.sqrt(3), np.sqrt(1 / 3)], atol=1e-5
    )
    np.testing.assert_array_equal(keep, VALID)


def test_failed_rows_do_not_decide_group_rejection_or_rloo():
    # Group 1's verified rows are all correct: rejected as all-correct despite the failed row.
    config = rl.get_preset("reinforce_rej", rejected_rows="drop")
    _, keep, _ = _advantages(config)
    np.testing.assert_array_equal(keep, [True, True, True, False] + [False] * 4)
    # The preset keeps rejected rows in the loss with A = 0 (Minimal-RL); failed rows stay out.
    adv, keep, _ = _advantages(rl.get_preset("reinforce_rej"))
    np.testing.assert_array_equal(keep, VALID)
    np.testing.assert_array_equal(np.asarray(adv), [1, -1, 1, 0] + [0] * 4)
    adv, keep, _ = _advantages(rl.get_preset("rloo"))
    # Leave-one-out means over the verified [1, 0, 1]: 0.5, 1, 0.5.
    np.testing.assert_allclose(adv[:3], [1 - 0.5, 0 - 1.0, 1 - 0.5], atol=1e-6)
    np.testing.assert_allclose(adv[4:7], 0.0, atol=1e-6)  # 1 - mean of two other 1s
    np.testing.assert_array_equal(keep, VALID)


def test_a_failed_row_does_not_enter_the_loss():
    config = rl.presets.grpo()
    adv, keep, _ = _advantages(config)
    logp, ref_logp = jnp.full((8, T), -1.0), jnp.full((8, T), -1.1)

    def loss(logp_BT):
        total, denom, _ = rl.policy_loss(
            config, logp_BT, None, adv, jnp.asarray(MASK), keep, ref_logp_BT=ref_logp
        )
        return total / denom

    grad = jax.grad(loss)(logp)
    np.testing.assert_array_equal(np.asarray(grad)[~VALID], 0.0)
    assert np.abs(np.asarray(grad)[VALID]).sum() > 0
    shifted = logp.at[3].set(5.0).at[7].set(-9.0)  # anything on the failed rows
    assert float(loss(shifted)) == pytest.approx(float(loss(logp)))
