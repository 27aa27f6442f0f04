"""PPO's critic math (rl/value.py) against a hand computation and against the reference
implementations, transcribed below in torch:

* verl, volcengine/verl at commit 012be9d9dcb7c38499f23616142870d2682757fc:
  verl/trainer/ppo/core_algos.py compute_gae_advantage_return (the version that skips
  masked positions) and compute_value_loss (loss_agg_mode "token-mean"), and
  verl/utils/torch_functional.py masked_whiten (masked_var unbiased, rsqrt(var + 1e-8)).
* OpenRLHF, OpenRLHF/OpenRLHF at commit 01359b469bab646981001011e4b58109aeb789d5:
  openrlhf/trainer/ppo_utils/experience_maker.py get_advantages_and_returns (values and
  rewards multiplied by the action mask, then GAE over every position).
"""

import numpy as np
import pytest
import torch

from jaxrl4llm import rl

# ---- the references, transcribed ----------------------------------------------------------


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam, advantages_reversed = 0, 0, []
    gen_len = token_level_rewards.shape[-1]
    for t in reversed(range(gen_len)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return verl_masked_whiten(advantages, response_mask), returns


def verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    variance = (((values - mean) ** 2) * mask).sum() / mask.sum()
    variance = variance * mask.sum() / (mask.sum() - 1)  # unbiased (Bessel)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_value_loss(vpreds, returns, values, response_mask, cliprange_value):
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * (clipped_vf_losses * response_mask).sum() / response_mask.sum()
    vf_clipfrac = (
        torch.gt(vf_losses2, vf_losses1).float() * response_mask
    ).sum() / response_mask.sum()
    return vf_loss, vf_clipfrac


def openrlhf_gae(values, rewards, action_mask, gamma, lambd):
    lastgaelam, advantages_reversed = 0, []
    response_length = rewards.size(1)
    values = action_mask * values
    rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def _random_batch(seed, B=6, T=9):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, B)
    mask = np.arange(T)[None, :] < lengths[:, None]  # right-padded completions
    token_rewards = rng.normal(size=(B, T)).astype(np.float32) * mask
    values = rng.normal(size=(B, T)).astype(np.float32)
    return token_rewards, values, mask


# ---- by hand ------------------------------------------------------------------------------


def test_three_token_gae_by_hand():
    """gamma 0.9, lam 0.5, outcome reward 1 at the last token, V = (0.5, 0.2, 0.4):
    delta_2 = 1 - 0.4 = 0.6                   A_2 = 0.6
    delta_1 = 0.9 * 0.4 - 0.2 = 0.16          A_1 = 0.16 + 0.45 * 0.6 = 0.43
    delta_0 = 0.9 * 0.2 - 0.5 = -0.32         A_0 = -0.32 + 0.45 * 0.43 = -0.1265
    R = A + V = (0.3735, 0.63, 1.0). A second row, padded after one token with V_0 = 0.3 and
    reward -1: A_0 = -1 - 0.3 = -1.3, R_0 = -1; its padding stays 0."""
    values = np.array([[0.5, 0.2, 0.4], [0.3, 7.0, 7.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
    rewards_BT = rl.token_rewards(np.array([1.0, -1.0]), mask)
    adv, ret = rl.gae_advantages(rewards_BT, values, mask, gamma=0.9, lam=0.5)
    np.testing.assert_allclose(adv, [[-0.1265, 0.43, 0.6], [-1.3, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[0.3735, 0.63, 1.0], [-1.0, 0, 0]], atol=1e-6)
    # Whitened over the 4 real tokens: mean -0.09908..., unbiased var.
    a = np.array([-0.1265, 0.43, 0.6, -1.3])
    expected = (a - a.mean()) / np.sqrt(a.var(ddof=1) + 1e-8)
    white = rl.masked_whiten(adv, mask)
    np.testing.assert_allclose(np.asarray(white)[mask], expected, atol=1e-5)
    assert np.all(np.asarray(white)[~mask] == 0)


def test_three_token_value_loss_by_hand():
    """R = (0.3735, 0.63, 1.0), V_old = (0.5, 0.2, 0.4), V = (0.9, 0.2, 0.9), clip 0.2:
    t0: (0.9 - R)^2 = 0.27720225 vs (0.7 - R)^2 = 0.10660225 -> 0.27720225 (not clipped)
    t1: both (0.2 - 0.63)^2 = 0.1849
    t2: (0.9 - 1)^2 = 0.01 vs (0.6 - 1)^2 = 0.16 -> 0.16 (the clipped one)
    token-mean: 0.5 * 0.62210225 / 3 = 0.103683708...; clip_frac 1/3."""
    ret = np.array([[0.3735, 0.63, 1.0]], np.float32)
    old = np.array([[0.5, 0.2, 0.4]], np.float32)
    new = np.array([[0.9, 0.2, 0.9]], np.float32)
    mask = np.ones((1, 3), bool)
    loss_sum, denom, metrics = rl.value_loss(new, old, ret, mask, value_clip=0.2)
    np.testing.assert_allclose(loss_sum / denom, 0.5 * 0.62210225 / 3, rtol=1e-6)
    np.testing.assert_allclose(rl.finalize_metrics(metrics)["critic/clip_frac"], 1 / 3, rtol=1e-6)
    unclipped = rl.value_loss(new, old, ret, mask, value_clip=None)
    np.testing.assert_allclose(
        unclipped[0] / unclipped[1], 0.5 * (0.27720225 + 0.1849 + 0.01) / 3, rtol=1e-6
    )


# ---- against the references on random inputs ----------------------------------------------


@pytest.mark.parametrize("seed,gamma,lam", [(0, 1.0, 0.95), (1, 0.99, 1.0), (2, 0.9, 0.0)])
def test_gae_matches_verl_and_openrlhf(seed, gamma, lam):
    r, v, mask = _random_batch(seed)
    adv, ret = rl.gae_advantages(r, v, mask, gamma=gamma, lam=lam)
    white = rl.masked_whiten(adv, mask)
    t = lambda x: torch.tensor(np.asarray(x, np.float64))  # noqa: E731
    verl_adv, verl_ret = verl_gae(t(r), t(v), t(mask), gamma, lam)
    orl_adv, orl_ret = openrlhf_gae(t(v), t(r), t(mask), gamma, lam)
    np.testing.assert_allclose(
        np.asarray(white)[mask], verl_adv.numpy()[mask], rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(ret)[mask], verl_ret.numpy()[mask], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(adv)[mask], orl_adv.numpy()[mask], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret)[mask], orl_ret.numpy()[mask], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(adv)[~mask] == 0) and np.all(np.asarray(ret)[~mask] == 0)


@pytest.mark.parametrize("seed,clip", [(3, 0.2), (4, 0.5), (5, 0.05)])
def test_value_loss_matches_verl(seed, clip):
    _, old, mask = _random_batch(seed)
    rng = np.random.default_rng(seed + 100)
    new = old + rng.normal(scale=0.4, size=old.shape).astype(np.float32)
    ret = rng.normal(size=old.shape).astype(np.float32)
    loss_sum, denom, metrics = rl.value_loss(new, old, ret, mask, value_clip=clip)
    t = lambda x: torch.tensor(np.asarray(x, np.float64))  # noqa: E731
    vf_loss, clipfrac = verl_value_loss(t(new), t(ret), t(old), t(mask), clip)
    np.testing.assert_allclose(loss_sum / denom, vf_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(
        rl.finalize_metrics(metrics)["critic/clip_frac"], clipfrac.item(), rtol=1e-6
    )
    assert 0 < clipfrac.item() < 1  # both branches of the max were exercised


def test_value_loss_gradient_is_zero_where_the_clip_binds():
    """Where the clipped error is the larger, the loss is constant in V (its gradient 0)."""
    import jax

    ret = np.array([[1.0, 1.0]], np.float32)
    old = np.array([[0.4, 0.4]], np.float32)
    mask = np.ones((1, 2), bool)

    def loss(v):
        s, d, _ = rl.value_loss(v, old, ret, mask, value_clip=0.2)
        return s / d

    g = jax.grad(loss)(np.array([[0.9, 0.5]], np.float32))
    # t0 clipped (V_old + 0.2 = 0.6 is further from R than 0.9): 0;
    # t1 inside the clip range: d/dV of 0.5 (V - 1)^2 / 2 tokens = 0.5 (0.5 - 1) = -0.25.
    np.testing.assert_allclose(g, [[0.0, -0.25]], atol=1e-6)


def test_ppo_preset_advantages_are_gae_on_kl_shaped_rewards():
    """compute_advantages_and_returns for the ppo preset = token rewards r - 0.01 k1 KL, GAE
    (gamma 1, lam 0.95) and verl's whitening, computed here with the verl transcription."""
    r_tok, v, mask = _random_batch(7, B=4, T=5)
    rng = np.random.default_rng(8)
    logp = -rng.random(mask.shape).astype(np.float32)
    ref = -rng.random(mask.shape).astype(np.float32)
    rewards = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    config = rl.validate(rl.get_preset("ppo"), 4)
    adv, ret, keep, _ = rl.compute_advantages_and_returns(
        config, rewards, rewards > 0, mask, 4, logp_BT=logp, ref_logp_BT=ref, values_BT=v
    )
    last = mask.sum(1) - 1
    token = -0.01 * (logp - ref) * mask
    token[np.arange(4), last] += rewards
    t = lambda x: torch.tensor(np.asarray(x, np.float64))  # noqa: E731
    verl_adv, verl_ret = verl_gae(t(token), t(v), t(mask), 1.0, 0.95)
    np.testing.assert_allclose(np.asarray(adv)[mask], verl_adv.numpy()[mask], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret)[mask], verl_ret.numpy()[mask], rtol=1e-5, atol=1e-5)
    assert keep.all()
    # Every other estimator has no critic targets.
    assert (
        rl.compute_advantages_and_returns(rl.get_preset("grpo"), rewards, rewards > 0, mask, 4)[1]
        is None
    )


def test_gae_without_values_is_a_clear_error():
    with pytest.raises(ValueError, match="values_BT"):
        rl.compute_advantages(
            rl.get_preset("ppo", kl_coef=0.0, kl_in=None),
            np.ones(4),
            np.ones(4, bool),
            np.ones((4, 2), bool),
            4,
        )


@pytest.mark.parametrize(
    "knob,value,message",
    [("gamma", 1.5, "gamma"), ("lam", -0.1, "lam"), ("value_clip", 0.0, "value_clip")],
)
def test_bad_gae_knobs_name_themselves(knob, value, message):
    with pytest.raises(ValueError, match=message):
        rl.validate(rl.get_preset("ppo", **{knob: value}), 4)
