"""The built-in policy losses, registered by name (AlgorithmConfig.objective): each reads its
hyperparameters from the config and calls the pure loss of losses.py / policy_losses.py."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm.rl import collectives, losses
from jaxrl4llm.rl import policy_losses as pl
from jaxrl4llm.rl.algorithm_config import AlgorithmConfig
from jaxrl4llm.rl.registry import PolicyInputs, register_policy_loss

Loss = tuple[jnp.ndarray, dict[str, jnp.ndarray]]


def _ratio_inputs(x: PolicyInputs) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(logp_BT, old_logp_BT, advantages_BT): the first arguments of every ratio loss."""
    return x.logp_BT, x.old_logp_BT, x.advantages_BT


def _clip(c: AlgorithmConfig) -> dict[str, Any]:
    return {"clip_low": c.clip_low, "clip_high": c.clip_high}


@register_policy_loss("clipped", dual_clip=True, sequence_ratio=True)
def clipped(c: AlgorithmConfig, x: PolicyInputs) -> Loss:
    """PPO's clipped surrogate (arXiv:1707.06347), with clip-higher and dual clip."""
    return losses.clipped_surrogate(*_ratio_inputs(x), dual_clip=c.dual_clip, **_clip(c))


# dual_clip acts on negative advantages only, and RAFT's are 1 or 0: nothing to refuse.
@register_policy_loss("nll", dual_clip=True)
def nll(c: AlgorithmConfig, x: PolicyInputs) -> Loss:
    """RAFT's -A log pi with A = 1 on positives (A = 0 on rows kept only for the
    denominator, rejected_rows='zero')."""
    return losses.nll_loss(x.logp_BT) * x.advantages_BT, {}


@register_policy_loss("cispo")
def cispo(c: AlgorithmConfig, x: PolicyInputs) -> Loss:
    return pl.cispo_loss(*_ratio_inputs(x), **_clip(c))


@register_policy_loss("sapo")
def sapo(c: AlgorithmConfig, x: PolicyInputs) -> Loss:
    return pl.sapo_loss(*_ratio_inputs(x), tau_pos=c.sapo_tau_pos, tau_neg=c.sapo_tau_neg)


@register_policy_loss("gmpo", sequence_level=True, aggs=("seq-mean-token-mean",))
def gmpo(c: AlgorithmConfig, x: PolicyInputs) -> Loss:
    return pl.gmpo_loss(*_ratio_inputs(x), x.mask_BT, **_clip(c))


def batch_key(x: PolicyInputs) -> jax.Array:
    """A PRNG key drawn from the batch itself (the bits of the sum of its old logprobs):
    reproducible, and different from batch to batch, for callers that pass no key."""
    s = collectives.total(jnp.where(x.mask_BT > 0, x.old_logp_BT, 0.0), x.axis_name)
    return jax.random.fold_in(jax.random.key(0), jax.lax.bitcast_convert_type(s, jnp.uint32))


@register_policy_loss("clip_cov", dual_clip=True)
def clip_cov(c: AlgorithmConfig, x: PolicyInputs) -> Loss:
    key = batch_key(x) if x.key is None else x.key
    band: dict[str, Any] = {
        "ratio": c.clip_cov_ratio,
        "lower": c.clip_cov_lb,
        "upper": c.clip_cov_ub,
    }
    logp_BT, old_logp_BT, advantages_BT = _ratio_inputs(x)
    return pl.clip_cov_loss(
        logp_BT,
        old_logp_BT,
        advantages_BT,
        x.mask_BT,
        key,
        dual_clip=c.dual_clip,
        axis_name=x.axis_name,
        **band,
        **_clip(c),
    )


@register_policy_loss("kl_cov")
def kl_cov(c: AlgorithmConfig, x: PolicyInputs) -> Loss:
    selection: dict[str, Any] = {
        "ratio": c.kl_cov_ratio,
        "coef": c.kl_cov_coef,
        "axis_name": x.axis_name,
    }
    return pl.kl_cov_loss(*_ratio_inputs(x), x.mask_BT, **selection)


@register_policy_loss("gpg")
def gpg(c: AlgorithmConfig, x: PolicyInputs) -> Loss:
    return pl.gpg_loss(x.logp_BT, x.advantages_BT)
