"""The built-in advantage estimators, registered by name (AlgorithmConfig.advantage): each
reads its knobs from the config and calls the pure estimator of advantages.py, value.py or
group_estimators.py on the rows of AdvantageInputs.signal_B."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxrl4llm.rl import advantages as adv_lib
from jaxrl4llm.rl import group_estimators as ge
from jaxrl4llm.rl import value as value_lib
from jaxrl4llm.rl.algorithm_config import AlgorithmConfig
from jaxrl4llm.rl.registry import AdvantageInputs, register_advantage

# (advantages [B] or [B, T], the critic's returns [B, T] or None)
Estimate = tuple[jnp.ndarray, "jnp.ndarray | None"]


def _group_stats(c: AlgorithmConfig, x: AdvantageInputs) -> dict[str, Any]:
    """The std knobs and the rows in the statistics, as keywords of the estimators."""
    return {"ddof": c.ddof, "eps": c.eps, "keep_B": x.signal_B}


@register_advantage("normalized")
def normalized(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    scopes: dict[str, Any] = {"mean": c.mean, "std": c.std, "axis_name": x.axis_name}
    adv = adv_lib.normalized_advantages(x.rewards_B, x.group_size, **scopes, **_group_stats(c, x))
    return adv, None


@register_advantage("rloo", min_group_size=2)
def rloo(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    return adv_lib.rloo_advantages(x.rewards_B, x.group_size, keep_B=x.signal_B), None


@register_advantage("positives", kl_in_reward=None)
def positives(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    return x.signal_B.astype(jnp.float32), None


@register_advantage("remax")
def remax(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    return x.rewards_B - _baseline(c, x.baseline_B, x.baseline_correct_B), None


@register_advantage("gae", kl_in_reward="own")
def gae(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    if x.values_BT is None:
        raise ValueError(
            "advantage='gae' (PPO) needs values_BT: the critic's values of the rollout."
        )
    gae_knobs: dict[str, Any] = {
        "gamma": c.gamma,
        "lam": c.lam,
        "kl_BT": x.kl_BT,
        "kl_coef": c.kl_coef,
    }
    adv, returns_BT = value_lib.ppo_advantages(
        x.rewards_B, x.values_BT, x.mask_BT, keep_B=x.signal_B, axis_name=x.axis_name, **gae_knobs
    )
    return adv, jnp.where(x.valid_B[:, None], returns_BT, 0.0)


def _reinforce_pp(c: AlgorithmConfig, x: AdvantageInputs, baseline: bool) -> Estimate:
    kl: dict[str, Any] = {"kl_BT": x.kl_BT, "kl_coef": c.kl_coef, "axis_name": x.axis_name}
    adv = adv_lib.reinforce_pp_advantages(
        x.rewards_B,
        x.mask_BT,
        group_size=x.group_size,
        baseline=baseline,
        **kl,
        **_group_stats(c, x),
    )
    return adv, None


@register_advantage("reinforce_pp", kl_in_reward="own")
def reinforce_pp(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    return _reinforce_pp(c, x, baseline=False)


@register_advantage("reinforce_pp_baseline", kl_in_reward="own", min_group_size=2)
def reinforce_pp_baseline(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    return _reinforce_pp(c, x, baseline=True)


@register_advantage("opo", min_group_size=2)
def opo(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    lengths_B = jnp.asarray(x.mask_BT, jnp.float32).sum(axis=1)
    return ge.opo_advantages(x.rewards_B, lengths_B, x.group_size, keep_B=x.signal_B), None


@register_advantage("grpo_passk", min_group_size=2)
def grpo_passk(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    stats = _group_stats(c, x)
    adv = ge.grpo_passk_advantages(
        x.rewards_B, x.group_size, std_normalize=c.std != "none", **stats
    )
    return adv, None


@register_advantage("passk", min_group_size=2)
def passk(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    assert c.passk_k is not None  # the config's checks require it with advantage='passk'
    adv = ge.passk_advantages(x.correct_B, x.group_size, c.passk_k, eps=c.eps, keep_B=x.signal_B)
    return adv, None


@register_advantage("gpg", min_group_size=2)
def gpg(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    adv = ge.gpg_advantages(x.rewards_B, x.group_size, keep_B=x.signal_B, axis_name=x.axis_name)
    return adv, None


@register_advantage("otb", kl_in_reward=None, min_group_size=2)
def otb(c: AlgorithmConfig, x: AdvantageInputs) -> Estimate:
    if x.logp_BT is None or x.sum_pi_squared_BT is None:
        raise ValueError(
            "advantage='otb' needs logp_BT (the sampling policy's logprobs) and "
            "sum_pi_squared_BT (its sum of squared probabilities over the vocabulary per token)."
        )
    adv, _ = ge.optimal_token_baseline_advantages(
        x.rewards_B,
        x.mask_BT,
        x.logp_BT,
        x.sum_pi_squared_BT,
        x.group_size,
        zero_tail=c.otb_zero_tail,
        keep_B=x.signal_B,
    )
    return adv, None


def binary_rewards(wrong_right: tuple[float, float], correct_B: jnp.ndarray) -> jnp.ndarray:
    """float32 [B]: config.binary_reward's (wrong, right) value for each verdict."""
    return jnp.where(correct_B, wrong_right[1], wrong_right[0]).astype(jnp.float32)


def _baseline(
    c: AlgorithmConfig, baseline_B: jnp.ndarray | None, baseline_correct_B: jnp.ndarray | None
) -> jnp.ndarray:
    """ReMax's baseline per row, mapped like the rewards when binary_reward is set."""
    if baseline_B is None or (c.binary_reward is not None and baseline_correct_B is None):
        raise ValueError(
            "advantage='remax' needs baseline_B (and baseline_correct_B with "
            "binary_reward): the reward and verdict of each prompt's greedy "
            "completion."
        )
    if c.binary_reward is None:
        return jnp.asarray(baseline_B, jnp.float32)
    return binary_rewards(c.binary_reward, jnp.asarray(baseline_correct_B, bool))
