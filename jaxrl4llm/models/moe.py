"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE): router, top-k, dropless grouped matmuls,
and on a mesh the experts split over the `expert` axis.

A token's router logits x W_r [E] give probabilities softmax(logits); the token runs the
`experts_per_token` experts of highest probability, weighted by those probabilities
(renormalised to sum to 1 when config.moe.norm_topk_prob), and the block returns the weighted
sum of their SwiGLU MLPs. Every token reaches all of its experts: the token copies are
sorted by expert and multiplied in one grouped matmul per projection (`lax.ragged_dot`, one
group of rows per expert), with no capacity and nothing dropped.

Routing replay: given the experts a token chose elsewhere (`experts_BTK`, e.g. in the
sampler), the block runs those experts instead of its own top-k, weighted by its own
router probabilities at them (renormalised as the family does), so gradients still reach
the router. The block returns what it chose (`Routing`), which such a caller records.

On a mesh (`_on_mesh`), each device holds E / expert of the experts (the
"experts" logical axis) and its own rows of tokens. Inside `shard_map`, the devices of one
expert group all-gather their tokens (with their choices and weights), each runs its own
experts on the tokens routed to them, and a reduce-scatter sums the experts' outputs back
onto the tokens' devices. XLA:CPU has no ragged all-to-all and a dense all-to-all is
dropless only with k * expert times the buffer, while these two collectives move
tokens x width x (expert - 1) each way per device: the bytes of an ideal all-to-all of
the k token copies when expert = k, fewer when expert < k (Qwen3-30B-A3B: k = 8).
Where the caller already runs per device over the experts' axes (a jax.shard_map body
manual over them, the paged engine's batch shards: sampling/paged_mesh.py), a layer holds
only its device's experts and `_manual_experts` makes the same exchange without a
shard_map of its own.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig

_F32 = jnp.float32
# The named scope of the expert exchange's collectives (the tokens' all-gather onto their
# experts' devices, the outputs' reduce-scatter back): planner/programs.py reads their bytes
# from the HLO by it.
EXCHANGE_SCOPE = "expert_exchange"


class Routing(NamedTuple):
    """What a MoE layer's router chose for each token: the experts it runs (int32, in
    descending router probability unless replayed) and the router logits (float32). Stacked
    over the MoE layers by transformer.routed_hidden_states ([L, B, T, ...])."""

    experts_BTK: jax.Array
    logits_BTE: jax.Array


def router_logits(x_BTD: jax.Array, router_DE: jax.Array) -> jax.Array:
    """x W_r in the router's dtype, accumulated and returned in float32."""
    return jnp.einsum(
        "btd,de->bte", x_BTD.astype(router_DE.dtype), router_DE, preferred_element_type=_F32
    )


def route(
    logits_BTE: jax.Array, k: int, normalize: bool, experts_BTK: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(experts_BTK int32, weights_BTK float32): the k most probable experts of each token,
    or the given `experts_BTK` (replay; a token given negative ids has no record and takes
    its own top-k), weighted by their router probabilities, renormalised over the k when
    `normalize` (transformers' norm_topk_prob)."""
    probs_BTE = jax.nn.softmax(logits_BTE.astype(_F32), axis=-1)
    weights_BTK, own_BTK = lax.top_k(probs_BTE, k)
    if experts_BTK is None:
        experts_BTK = own_BTK
    else:
        if experts_BTK.shape != logits_BTE.shape[:-1] + (k,):
            raise ValueError(
                f"Replayed experts of shape {experts_BTK.shape} do not match the tokens "
                f"{logits_BTE.shape[:-1]} x experts_per_token={k}."
            )
        replayed_BTK = experts_BTK.astype(jnp.int32)
        experts_BTK = jnp.where(replayed_BTK[..., :1] >= 0, replayed_BTK, own_BTK)
        weights_BTK = jnp.take_along_axis(probs_BTE, experts_BTK, axis=-1)
    if normalize:
        weights_BTK = weights_BTK / jnp.sum(weights_BTK, axis=-1, keepdims=True)
    return experts_BTK.astype(jnp.int32), weights_BTK


# Token copies (tokens x k) one pass of grouped matmuls holds at most: a longer input runs as
# a loop over chunks of tokens, each sorted and multiplied on its own and rematerialised in
# the backward pass, so the copies' activations (k times the tokens, at the experts' width)
# are bounded by a chunk whatever the batch (the same result: a token's output is its own).
EXPERT_CHUNK_COPIES = 32768


def expert_mlp(
    x_MD: jax.Array,
    experts_MK: jax.Array,
    weights_MK: jax.Array,
    w: tuple[jax.Array, jax.Array, jax.Array],
    first_expert: jax.Array | int = 0,
) -> jax.Array:
    """sum_k weights_MK[m, k] * MLP_{experts_MK[m, k]}(x_MD[m]) [M, D] float32, over the
    experts this call holds: w = (gate [G, D, F], up [G, D, F], down [G, F, D]) are experts
    first_expert .. first_expert + G - 1; copies routed to any other expert add nothing.

    The M * K token copies are sorted by expert (the others last), each projection is one
    grouped matmul over the groups, and the outputs go back to their tokens' rows; in chunks
    of at most EXPERT_CHUNK_COPIES copies."""
    M, K = experts_MK.shape
    chunk = max(1, EXPERT_CHUNK_COPIES // K)
    if M <= chunk:
        return _expert_mlp_block(x_MD, experts_MK, weights_MK, w, first_expert)
    n = -(-M // chunk)
    # Padded tokens: expert 0 at weight 0, so they add nothing; cut off at the end.
    pad = lambda a: jnp.pad(a, ((0, n * chunk - M),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
    chunks = tuple(pad(a).reshape((n, chunk) + a.shape[1:]) for a in (x_MD, experts_MK, weights_MK))
    block = jax.checkpoint(lambda xs: _expert_mlp_block(xs[0], xs[1], xs[2], w, first_expert))
    return lax.map(block, chunks).reshape(n * chunk, -1)[:M]


def _expert_mlp_block(
    x_MD: jax.Array,
    experts_MK: jax.Array,
    weights_MK: jax.Array,
    w: tuple[jax.Array, jax.Array, jax.Array],
    first_expert: jax.Array | int,
) -> jax.Array:
    """expert_mlp on one chunk of tokens."""
    gate, up, down = w
    G = gate.shape[0]
    M, K = experts_MK.shape
    local_A = experts_MK.reshape(M * K) - first_expert
    held_A = (local_A >= 0) & (local_A < G)
    group_A = jnp.where(held_A, local_A, G)  # group G: the copies of other calls' experts
    order_A = jnp.argsort(group_A, stable=True)
    sizes_G = jnp.bincount(group_A, length=G + 1)[:G].astype(jnp.int32)
    x_AD = x_MD[order_A // K].astype(gate.dtype)
    g_AF = lax.ragged_dot(x_AD, gate, sizes_G, preferred_element_type=_F32)
    u_AF = lax.ragged_dot(x_AD, up, sizes_G, preferred_element_type=_F32)
    h_AF = (jax.nn.silu(g_AF) * u_AF).astype(down.dtype)
    y_AD = lax.ragged_dot(h_AF, down, sizes_G, preferred_element_type=_F32)
    # Back to token order; rows past the groups are not defined by ragged_dot: masked.
    unsort_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(M * K, dtype=order_A.dtype))
    y_MKD = y_AD[unsort_A].reshape(M, K, down.shape[-1])  # (not -1: M may be 0)
    y_MKD = jnp.where(held_A.reshape(M, K, 1), y_MKD, 0.0)
    return jnp.sum(y_MKD * weights_MK.astype(_F32)[..., None], axis=1)


def moe_mlp(
    config: ModelConfig,
    lp: dict[str, Any],
    x_BTD: jax.Array,
    sharding: parallel.ActivationSharding | None = None,
    experts_BTK: jax.Array | None = None,
) -> tuple[jax.Array, Routing]:
    """The routed experts' output [B, T, D] float32 (without any shared expert) and the
    routing (the replayed `experts_BTK` when given)."""
    logits_BTE = parallel.constrain(
        router_logits(x_BTD, lp["router"]), ("batch", "length", None), sharding
    )
    experts_BTK, weights_BTK = route(
        logits_BTE, config.moe.experts_per_token, config.moe.norm_topk_prob, experts_BTK
    )
    w = (lp["expert_gate"], lp["expert_up"], lp["expert_down"])
    if w[0].shape[0] < config.moe.num_experts:
        y_BTD = _manual_experts(x_BTD, experts_BTK, weights_BTK, w, config, sharding)
    elif sharding is None:
        y_MD = expert_mlp(_rows(x_BTD), _rows(experts_BTK), _rows(weights_BTK), w)
        y_BTD = y_MD.reshape(x_BTD.shape)
    else:
        y_BTD = _on_mesh(x_BTD, experts_BTK, weights_BTK, w, sharding)
    return y_BTD, Routing(experts_BTK, logits_BTE)


def _rows(a_BT_: jax.Array) -> jax.Array:
    """A [B, T, ...] array as [B * T, ...] token rows."""
    return a_BT_.reshape((a_BT_.shape[0] * a_BT_.shape[1],) + a_BT_.shape[2:])


def _on_mesh(
    x_BTD: jax.Array,
    experts_BTK: jax.Array,
    weights_BTK: jax.Array,
    w: tuple[jax.Array, jax.Array, jax.Array],
    sharding: parallel.ActivationSharding,
) -> jax.Array:
    """expert_mlp under shard_map: rows over the batch's mesh axes, experts over theirs, the
    experts' MLP width over tensor (the module docstring says how tokens meet experts).
    FSDP's shards of the expert weights are gathered on entry, as the dense MLP's are."""
    mesh = sharding.mesh
    rows = parallel.mesh_axes(sharding.spec(("batch",), x_BTD.shape[:1])[0])
    in_spec = sharding.spec(("experts", None, "mlp"), w[0].shape)
    out_spec = sharding.spec(("experts", "mlp", None), w[2].shape)
    split = parallel.mesh_axes(in_spec[0])
    gather = tuple(a for a in split if a in rows)  # token rows of one expert group
    summed = parallel.mesh_axes(in_spec[2]) + tuple(a for a in split if a not in rows)
    held = w[0].shape[0] // math.prod(mesh.shape[a] for a in split)
    per_device = functools.partial(_exchange, gather, split, summed, held)
    row = jax.sharding.PartitionSpec(rows or None)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(row, row, row, in_spec, in_spec, out_spec),
        out_specs=row,
    )(x_BTD, experts_BTK, weights_BTK, *w)


def _manual_experts(
    x_BTD: jax.Array,
    experts_BTK: jax.Array,
    weights_BTK: jax.Array,
    w: tuple[jax.Array, jax.Array, jax.Array],
    config: ModelConfig,
    sharding: parallel.ActivationSharding | None,
) -> jax.Array:
    """The experts' output where this code already runs per device over the mesh axes that
    split the experts (a jax.shard_map body manual over them, e.g. paged_mesh.py's batch
    shards): `w` holds this device's experts and the rows are its own, so the devices of
    one expert group exchange their tokens as _on_mesh's do, with no shard_map of their own
    over those axes. Every device of the group must reach this call together. The experts'
    MLP width stays split over tensor where the body leaves that axis to the partitioner."""
    context = jax.sharding.get_abstract_mesh()
    rules = dict(parallel.DEFAULT_RULES if sharding is None else sharding.rules)
    split = tuple(a for a in parallel.mesh_axes(rules.get("experts")) if a in context.manual_axes)
    held = w[0].shape[0]
    if math.prod(context.shape[a] for a in split) * held != config.moe.num_experts:
        raise ValueError(
            f"The layer holds {held} of {config.moe.num_experts} experts, but the manual "
            f"mesh axes {split} do not split them so."
        )
    if sharding is None:
        return _exchange(split, split, (), held, x_BTD, experts_BTK, weights_BTK, *w)
    # The axes left to the partitioner (tensor): one more shard_map, over them only.
    in_spec = sharding.spec((None, None, "mlp"), w[0].shape)
    out_spec = sharding.spec((None, "mlp", None), w[2].shape)
    whole = jax.sharding.PartitionSpec()
    return jax.shard_map(
        functools.partial(_exchange, split, split, parallel.mesh_axes(in_spec[2]), held),
        mesh=context,
        in_specs=(whole, whole, whole, in_spec, in_spec, out_spec),
        out_specs=whole,
        axis_names=frozenset(a for a in context.axis_names if a not in context.manual_axes),
    )(x_BTD, experts_BTK, weights_BTK, *w)


def _exchange(
    gather: tuple[str, ...],
    split: tuple[str, ...],
    summed: tuple[str, ...],
    held: int,
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    *w_local: jax.Array,
) -> jax.Array:
    """One device's part: its rows' tokens gathered over `gather` (one expert group), its
    `held` experts (numbered by its place on `split`) run on those routed to them, the
    outputs reduce-scattered back to the tokens' devices and summed over `summed`."""
    if gather:
        with jax.named_scope(EXCHANGE_SCOPE):
            x, experts, weights = (
                lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, experts, weights)
            )
    first = lax.axis_index(split) * held if split else 0
    gate, up, down = w_local
    y_MD = expert_mlp(_rows(x), _rows(experts), _rows(weights), (gate, up, down), first)
    y_BTD = y_MD.reshape(x.shape)
    if gather:
        with jax.named_scope(EXCHANGE_SCOPE):
            y_BTD = lax.psum_scatter(y_BTD, gather, scatter_dimension=0, tiled=True)
    return lax.psum(y_BTD, summed) if summed else y_BTD
