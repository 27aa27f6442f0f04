"""Closed-form values of the advantage estimators on hand-built batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl

EPS = 1e-6
# Jitted aliases: one compile per shape is far cheaper than first-time eager dispatch on CPU.
norm = jax.jit(
    rl.normalized_advantages, static_argnums=1, static_argnames=("mean", "std", "ddof", "eps")
)
rloo = jax.jit(rl.rloo_advantages, static_argnums=1)
rpp = jax.jit(rl.reinforce_pp_advantages, static_argnames=("group_size", "baseline", "ddof", "eps"))


def _np(x):
    return np.asarray(x, np.float64)


def test_grpo_group_group_ddof1_and_zero_std_group():
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = norm(r, 4, mean="group", std="group")
    s = np.sqrt(1.0 / 3.0)  # ddof=1 std of [1, 0, 0, 1]
    want = [0.5 / (s + EPS), -0.5 / (s + EPS), -0.5 / (s + EPS), 0.5 / (s + EPS), 0, 0, 0, 0]
    np.testing.assert_allclose(_np(a), want, rtol=1e-6, atol=1e-7)


def test_ddof0_matches_numpy_population_std():
    r = jnp.array([1.0, 0.0, 0.0, 1.0])
    a = norm(r, 4, mean="group", std="group", ddof=0)
    np.testing.assert_allclose(_np(a), np.array([1, -1, -1, 1]) * 0.5 / (0.5 + EPS), rtol=1e-6)


def test_pm1_rewards_group_normalized():
    r = jnp.array([1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    a = norm(r, 4)
    s = np.sqrt(4.0 / 3.0)
    want = np.array([1, -1, -1, 1, 0, 0, 0, 0]) / (s + EPS)
    np.testing.assert_allclose(_np(a), want, rtol=1e-6, atol=1e-7)


def test_dr_grpo_mean_only():
    r = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    a = norm(r, 4, mean="group", std="none")
    np.testing.assert_allclose(_np(a), [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5], atol=1e-7)


def test_lite_ppo_group_mean_batch_std():
    r = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    a = norm(jnp.asarray(r), 4, mean="group", std="batch")
    centered = np.array([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    np.testing.assert_allclose(_np(a), centered / (r.std(ddof=1) + EPS), rtol=1e-6)
    assert abs(r.std(ddof=1) - 0.5175491695) < 1e-9  # the hand-computed value


def test_batch_statistics_respect_keep_mask():
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 7.0, 5.0])
    keep = jnp.array([True] * 4 + [False] * 4)
    a = norm(r, 4, mean="batch", std="batch", keep_B=keep)
    s = np.sqrt(1.0 / 3.0)
    np.testing.assert_allclose(
        _np(a),
        [0.5 / (s + EPS), -0.5 / (s + EPS), -0.5 / (s + EPS), 0.5 / (s + EPS), 0, 0, 0, 0],
        rtol=1e-6,
    )
    # Without the keep mask the 5s and 7 dominate the statistics: different numbers.
    b = norm(r, 4, mean="batch", std="batch")
    assert float(b[0]) < 0


def test_zero_std_group_is_zero_even_with_batch_mean():
    # r - batch mean is non-zero for the constant group; group-std scaling must still give 0.
    r = jnp.array([1.0, 0.0, 3.0, 3.0])
    a = norm(r, 2, mean="batch", std="group")
    assert float(a[2]) == 0.0 and float(a[3]) == 0.0
    np.testing.assert_allclose(
        _np(a[:2]), np.array([1 - 1.75, 0 - 1.75]) / (np.sqrt(0.5) + EPS), rtol=1e-6
    )


def test_constant_fractional_rewards_give_exact_zero():
    # 0.1 is not exact in float32; the std may round to a tiny non-zero value; A must be 0.
    a = norm(jnp.full((6,), 0.1), 3, mean="none", std="group")
    assert np.all(_np(a) == 0.0)


def test_singleton_groups():
    r = jnp.array([1.0, 0.0, 1.0, 0.0])
    a = norm(r, 1, mean="batch", std="batch")
    s = np.sqrt(1.0 / 3.0)
    np.testing.assert_allclose(_np(a), np.array([0.5, -0.5, 0.5, -0.5]) / (s + EPS), rtol=1e-6)
    # group std of a single sample is undefined with ddof=1: treated as no spread -> 0.
    assert np.all(_np(norm(r, 1, mean="none", std="group")) == 0.0)
    np.testing.assert_allclose(_np(norm(r, 1, mean="none", std="none")), [1, 0, 1, 0])


def test_reinforce_is_reward_and_zero_on_rejected():
    r = jnp.array([1.0, -1.0, 0.5])
    np.testing.assert_allclose(_np(rl.reinforce_advantages(r)), [1.0, -1.0, 0.5])
    np.testing.assert_allclose(
        _np(rl.reinforce_advantages(r, jnp.array([True, False, True]))), [1.0, 0.0, 0.5]
    )


def test_rloo_leave_one_out():
    a = rloo(jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), 3)
    np.testing.assert_allclose(
        _np(a), [1 - 0.0, 0 - 0.5, 0 - 0.5, 1 - 0.5, 1 - 0.5, 0 - 1.0], atol=1e-6
    )
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo(jnp.ones(4), 1)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        norm(jnp.ones(5), 2)
    with pytest.raises(ValueError, match="mean='median'"):
        norm(jnp.ones(4), 2, mean="median")
    with pytest.raises(ValueError, match="keep_B"):
        norm(jnp.ones(4), 2, keep_B=jnp.ones(3, bool))


def test_last_token_and_returns():
    m = jnp.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(_np(rl.last_token_onehot(m)), [[0, 1, 0], [0, 0, 1], [0, 0, 0]])
    np.testing.assert_allclose(_np(rl.returns_to_go(jnp.array([[1.0, 2.0, 3.0]]))), [[6, 5, 3]])


def test_reinforce_pp_no_kl():
    m = jnp.array([[1, 1, 0], [1, 1, 1]])
    a = rpp(jnp.array([1.0, 0.0]), m)
    vals = np.array([1.0, 1.0, 0.0, 0.0, 0.0])  # returns on the 5 valid tokens
    mu, s = vals.mean(), vals.std(ddof=1)
    assert abs(s - np.sqrt(0.3)) < 1e-12
    want = np.array([[1 - mu, 1 - mu, 0], [-mu, -mu, -mu]]) / (s + EPS)
    want[0, 2] = 0.0
    np.testing.assert_allclose(_np(a), want, rtol=1e-5, atol=1e-6)


def test_reinforce_pp_with_kl_in_reward():
    m = jnp.array([[1, 1, 0], [1, 1, 1]])
    kl = jnp.array([[0.1, 0.2, 9.0], [0.3, 0.3, 0.3]])  # 9.0 sits on padding and must be ignored
    tok = rl.token_rewards(jnp.array([1.0, 0.0]), m, kl, 0.5)
    np.testing.assert_allclose(_np(tok), [[-0.05, 0.9, 0.0], [-0.15, -0.15, -0.15]], atol=1e-6)
    vals = np.array([0.85, 0.9, -0.45, -0.3, -0.15])  # returns-to-go on the valid tokens
    a = rpp(jnp.array([1.0, 0.0]), m, kl_BT=kl, kl_coef=0.5)
    w = (vals - vals.mean()) / (vals.std(ddof=1) + EPS)
    np.testing.assert_allclose(
        _np(a), [[w[0], w[1], 0.0], [w[2], w[3], w[4]]], rtol=1e-5, atol=1e-6
    )


def test_reinforce_pp_baseline_subtracts_group_mean_and_respects_keep():
    m = jnp.ones((4, 2))
    keep = jnp.array([True, True, False, False])
    a = rpp(jnp.array([1.0, 0.0, 5.0, 5.0]), m, group_size=2, baseline=True, keep_B=keep)
    # r - group mean = [.5, -.5]; returns on 2 tokens: [.5, .5], [-.5, -.5]; whitened over 4 tokens.
    vals = np.array([0.5, 0.5, -0.5, -0.5])
    w = vals / (vals.std(ddof=1) + EPS)
    np.testing.assert_allclose(_np(a), [[w[0], w[1]], [w[2], w[3]], [0, 0], [0, 0]], rtol=1e-5)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rpp(jnp.ones(2), jnp.ones((2, 2)), baseline=True, group_size=1)


def test_advantages_jit():
    r = jnp.array([1.0, 0.0, 0.0, 1.0])
    f = jax.jit(
        rl.normalized_advantages, static_argnums=1, static_argnames=("mean", "std", "ddof", "eps")
    )
    np.testing.assert_allclose(_np(f(r, 2, mean="group", std="group")), _np(norm(r, 2)), rtol=1e-6)
    g = jax.jit(
        rl.reinforce_pp_advantages, static_argnames=("group_size", "baseline", "ddof", "eps")
    )
    out = g(r, jnp.ones((4, 3)), kl_BT=jnp.zeros((4, 3)), kl_coef=0.1, group_size=2, baseline=True)
    assert out.shape == (4, 3) and np.isfinite(_np(out)).all()
