"""Training signals of a mixture of experts' routers, from the routing a pass returns
(transformer.routed_hidden_states: experts_LBTK and logits_LBTE, stacked over the MoE
layers): the load-balancing and z auxiliary losses and the per-batch expert-load and
routing-flip metrics. Each takes the rows' token mask [B, T] (None: every token real).
The losses are terms a trainer adds to its objective when asked; nothing here adds them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _weights_LBT(shape_LBT: tuple[int, ...], mask_BT: jax.Array | None) -> jax.Array:
    """Each (layer, token)'s weight: 1 for a real token, 0 for padding."""
    if mask_BT is None:
        return jnp.ones(shape_LBT, _F32)
    return jnp.broadcast_to(mask_BT.astype(_F32), shape_LBT)


def load_balancing_loss(
    logits_LBTE: jax.Array,
    k: int,
    mask_BT: jax.Array | None = None,
    experts_LBTK: jax.Array | None = None,
) -> jax.Array:
    """The Switch Transformer auxiliary loss as transformers computes it for Qwen-MoE
    (load_balancing_loss_func): E * sum_e f_e * P_e over all MoE layers' real tokens, f_e
    the assignments to expert e per token (each token's top-k of its router probabilities,
    or `experts_LBTK` when given, e.g. a replayed routing), P_e its mean router probability.
    k when perfectly balanced; only P_e carries a gradient."""
    E = logits_LBTE.shape[-1]
    probs_LBTE = jax.nn.softmax(logits_LBTE.astype(_F32), axis=-1)
    if experts_LBTK is None:
        experts_LBTK = jax.lax.top_k(probs_LBTE, k)[1]
    w_LBT = _weights_LBT(logits_LBTE.shape[:-1], mask_BT)
    tokens = jnp.sum(w_LBT)
    counts_E = jnp.einsum("lbtke,lbt->e", jax.nn.one_hot(experts_LBTK, E, dtype=_F32), w_LBT)
    prob_E = jnp.einsum("lbte,lbt->e", probs_LBTE, w_LBT)
    return E * jnp.sum((counts_E / tokens) * (prob_E / tokens))


def router_z_loss(logits_LBTE: jax.Array, mask_BT: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: the mean over MoE layers and real tokens of
    logsumexp(router logits)^2, which keeps the logits small."""
    z_LBT = jax.nn.logsumexp(logits_LBTE.astype(_F32), axis=-1)
    w_LBT = _weights_LBT(z_LBT.shape, mask_BT)
    return jnp.sum(w_LBT * z_LBT**2) / jnp.sum(w_LBT)


class ExpertLoad(NamedTuple):
    """Tokens routed to each expert of each MoE layer, over a batch's real tokens:
    the most any expert received and the mean (real tokens x k / E); max / mean is 1 when
    balanced and E / k when every token picks the same experts."""

    max_tokens: jax.Array
    mean_tokens: jax.Array


def expert_load(
    experts_LBTK: jax.Array, num_experts: int, mask_BT: jax.Array | None = None
) -> ExpertLoad:
    """ExpertLoad of a routing record (max over the layers and experts, mean over both)."""
    w_LBT = _weights_LBT(experts_LBTK.shape[:-1], mask_BT)
    one_hot_LBTKE = jax.nn.one_hot(experts_LBTK, num_experts, dtype=_F32)
    counts_LE = jnp.einsum("lbtke,lbt->le", one_hot_LBTKE, w_LBT)
    return ExpertLoad(jnp.max(counts_LE), jnp.mean(counts_LE))


def routing_flip_fraction(
    experts_a_LBTK: jax.Array, experts_b_LBTK: jax.Array, mask_BT: jax.Array | None = None
) -> jax.Array:
    """The share of (MoE layer, real token) pairs whose set of experts differs between two
    routing records (the order within the top-k does not count), e.g. the sampler's and the
    trainer's."""
    a = jnp.sort(experts_a_LBTK, axis=-1)
    b = jnp.sort(experts_b_LBTK, axis=-1)
    flipped_LBT = jnp.any(a != b, axis=-1).astype(_F32)
    w_LBT = _weights_LBT(flipped_LBT.shape, mask_BT)
    return jnp.sum(w_LBT * flipped_LBT) / jnp.sum(w_LBT)
