"""The decoder (Llama / Qwen2 / Qwen3 / Mistral, and the Qwen3-MoE / Qwen2-MoE mixtures of
experts) as pure functions over a params pytree.

Params are a nested dict of arrays; the per-layer weights are stacked along a leading
[L, ...] axis and run with `lax.scan`, so compile time does not grow with depth (a mixture
of experts with some dense layers runs them as a loop: layer_stack.py). Matmuls
take the params' dtype (float32 or bfloat16) and accumulate in float32; the residual
stream, norms, RoPE and softmax are float32; logits are float32. A config with a
`sliding_window` (Mistral) attends over that many tokens in every pass: the teacher-forced
forward, the shared-prefix forward, the sampler's prefill and its KV-cache decode steps.

    params = init_params(config, jax.random.key(0))
    logits_BTV, _ = forward(params, config, tokens_BT, positions_BT, mask_BT)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import parallel
from jaxrl4llm.models import layer_stack, lora, moe, schema
from jaxrl4llm.models.attention import AttentionConfig
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.decoder_layer import (
    H_AXES,
    Sharding,
    rms_norm,
    rope_tables,
)
from jaxrl4llm.models.kv_cache import KVCache
from jaxrl4llm.models.unembedding import unembed

Params = dict[str, Any]

_F32 = jnp.float32


# ----------------------------------------------------------------------------- parameters


def param_logical_axes(config: ModelConfig) -> Params:
    """The params tree with each leaf replaced by its logical axis names (see parallel.py)."""
    return schema.param_logical_axes(config)


def param_shapes(config: ModelConfig) -> Params:
    """The params tree with each leaf replaced by its shape tuple."""
    return schema.param_shapes(config)


def is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def init_params(config: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random params: normal(0, 0.02) matrices, unit norm scales, zero biases.

    Jitted (one compile instead of one per leaf); wrap in `jax.jit(..., out_shardings=...)`
    to create the params directly on a mesh.
    """
    return _init_params(config, key, jnp.dtype(dtype))


@jax.jit(static_argnums=(0, 2))
def _init_params(config: ModelConfig, key: jax.Array, dtype: Any) -> Params:
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=is_shape)
    names = [path[-1].key for path, _ in leaves]
    random = [not n.endswith(("norm", "bias")) for n in names]
    sizes = [int(np.prod(shape)) if r else 0 for (_, shape), r in zip(leaves, random)]
    # One RNG call for all matrices: a threefry per leaf costs seconds of compile each on CPU.
    flat = 0.02 * jax.random.normal(key, (sum(sizes),), _F32)
    offsets = np.cumsum([0] + sizes)
    out = []
    for (_, shape), name, r, start, size in zip(leaves, names, random, offsets, sizes):
        if r:
            out.append(flat[start : start + size].reshape(shape).astype(dtype))
        else:
            out.append((jnp.ones if name.endswith("norm") else jnp.zeros)(shape, dtype))
    return jax.tree.unflatten(treedef, out)


def cast_for_compute(params: Params, config: ModelConfig) -> Params:
    """The params a pass computes with: matrices in `config.compute_dtype` (None: unchanged),
    LoRA adapters in the dtype of the weight they adapt (lora.in_weight_dtype).

    Called at the start of each pass, inside jit (and inside the loss under `grad`, so the
    gradients of float32 master params come back float32). Norm scales and biases keep their
    dtype: they are tiny and the norms run in float32 anyway. Matmuls then take bfloat16
    operands with float32 accumulation, and logits / log-softmax stay float32 (`dot`).
    """
    if config.compute_dtype is not None:
        dtype = jnp.dtype(config.compute_dtype)

        def cast(path, w):
            small = str(getattr(path[-1], "key", "")).endswith(("norm", "bias"))
            floating = jnp.issubdtype(w.dtype, jnp.floating)  # not a LoRA dropout key
            return w if small or not floating or w.dtype == dtype else w.astype(dtype)

        params = jax.tree_util.tree_map_with_path(cast, params)
    # LoRA adapters are float32 whatever the base's dtype; they compute in their weight's.
    return lora.in_weight_dtype(params)


# ----------------------------------------------------------------------------- the model


def unstack_layers(params: Params, config: ModelConfig | None = None) -> Params:
    """See layer_stack.unstack_layers: per-layer weight buffers for decode loops."""
    return layer_stack.unstack_layers(params, config)


def unstacked_logical_axes(config: ModelConfig) -> Params:
    """The logical axes of `unstack_layers(params, config)`: each layer's own leaves."""
    return layer_stack.unstacked_logical_axes(config)


def routed_hidden_states(
    params: Params,
    config: ModelConfig,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    mask_BT: jax.Array,
    kv_cache: KVCache | None = None,
    cache_index: jax.Array | int | None = None,
    *,
    remat: bool = False,
    sharding: Sharding = None,
    attention: AttentionConfig = AttentionConfig(),
    segment_ids_BT: jax.Array | None = None,
    prefix_ids_BT: jax.Array | None = None,
    experts_LBTK: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None, moe.Routing | None]:
    """Runs the decoder stack; returns (h_BTD after the final norm, in the params' dtype;
    the updated cache or None; the routing of the mixture-of-experts layers, stacked
    [L_moe, B, T, ...], or None in a dense model). `hidden_states` returns the first two.

    positions_BT index RoPE (left-padded rows: cumsum(mask) - 1, clipped at 0). mask_BT marks
    real tokens. Without a cache, query i sees key j iff j <= i and mask_BT[:, j]. With a
    cache, the T new tokens fill slots [cache_index, cache_index + T) and query slot p sees
    slots s <= p whose cache mask is set. With `config.sliding_window` W, also only j > i - W
    (s > p - W): the token itself and the W - 1 before it, as in transformers' Mistral.

    params["layers"]: stacked or per-layer (layer_stack.py says how each runs). `sharding` (a
    mesh) constrains the activations (parallel.ActivationSharding); `attention` picks the
    attention implementation.

    `segment_ids_BT` (no cache): packed rows, several sequences per row; int32 ids, 0 where
    there is no token, each sequence's tokens contiguous with one id. Query i then also needs
    key j in its own segment (block-diagonal causal attention); positions_BT restart per
    segment (the caller's). `prefix_ids_BT` (with segment ids): each token's prefix segment,
    which it also sees: a completion packed after its group's shared prompt passes the
    prompt's id (its positions continue from the prompt's), every other token its own id.
    On packed rows the window counts positions_BT (j's position > i's - W), not slots.

    `experts_LBTK` (int, [L_moe, B, T, experts_per_token]): routing replay; each MoE layer
    runs these experts for each token instead of its router's top-k (models/moe.py).
    """
    mask_BT = mask_BT.astype(bool)
    _check_packed_rows(segment_ids_BT, prefix_ids_BT, kv_cache)
    # Packed rows: the window counts positions, which a shared prompt's later completions do
    # not follow slot by slot (masks.py).
    packed = None if segment_ids_BT is None else positions_BT
    layer = layer_stack.decoder_layer(config, sharding, attention, prefix_ids_BT, packed)
    rope = rope_tables(config, positions_BT)
    h_BTD, layers = embed_tokens(params, tokens_BT, sharding), params["layers"]
    if kv_cache is None:
        key_valid_BT = mask_BT if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
        h_BTD, routing = layer_stack.run_uncached(
            config, layer, rope, h_BTD, layers, key_valid_BT, experts_LBTK, remat
        )
        return _final_norm(params, config, h_BTD), None, routing
    cache_index = _check_cache_index(cache_index, kv_cache.max_len, tokens_BT.shape[1])
    h_BTD, cache, routing = layer_stack.run_cached(
        config, layer, rope, h_BTD, layers, mask_BT, kv_cache, cache_index, remat, experts_LBTK
    )
    return _final_norm(params, config, h_BTD), cache, routing


# (h_BTD, cache or None): routed_hidden_states without the routing.
hidden_states = layer_stack.without_routing(routed_hidden_states)


def _final_norm(params: Params, config: ModelConfig, h_BTD: jax.Array) -> jax.Array:
    """The final RMSNorm, back in the params' dtype."""
    return rms_norm(h_BTD, params["final_norm"], config.rms_norm_eps).astype(params["embed"].dtype)


def _check_packed_rows(
    segment_ids_BT: jax.Array | None, prefix_ids_BT: jax.Array | None, kv_cache: KVCache | None
) -> None:
    if prefix_ids_BT is not None and segment_ids_BT is None:
        raise ValueError("hidden_states: prefix_ids_BT needs segment_ids_BT (packed rows).")
    if segment_ids_BT is not None and kv_cache is not None:
        raise ValueError(
            "hidden_states: segment_ids_BT (packed rows) is for teacher-forced "
            "passes; it cannot be combined with a kv_cache."
        )


def _check_cache_index(
    cache_index: jax.Array | int | None, cache_len: int, new_tokens: int
) -> jax.Array | int:
    """`cache_index`, checked: given, and in the cache when static."""
    if cache_index is None:
        raise ValueError(
            "hidden_states/forward: kv_cache was given without cache_index; "
            "pass the first cache slot the new tokens go to."
        )
    if isinstance(cache_index, int) and not 0 <= cache_index <= cache_len - new_tokens:
        # (A traced index cannot be checked; dynamic_update_slice would clamp it.)
        raise ValueError(
            f"cache_index={cache_index} + {new_tokens} new tokens does not fit the "
            f"KV cache of {cache_len} slots; allocate a longer cache."
        )
    return cache_index


def embed_tokens(params: Params, tokens_BT: jax.Array, sharding: Sharding) -> jax.Array:
    """Token embeddings [B, T, D] float32, rows over the data-parallel axes."""
    h_BTD = jnp.take(params["embed"], tokens_BT, axis=0).astype(_F32)
    return parallel.constrain(h_BTD, H_AXES, sharding)


def routed_hidden_states_shared_prefix(
    params: Params,
    config: ModelConfig,
    prefix_tokens_GP: jax.Array,
    prefix_mask_GP: jax.Array,
    tokens_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    group: int,
    remat: bool = False,
    sharding: Sharding = None,
    attention: AttentionConfig = AttentionConfig(),
    experts_LGPK: jax.Array | None = None,
    experts_LBTK: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, tuple[moe.Routing, moe.Routing] | None]:
    """Teacher-forced hidden states of rows that share a prefix in blocks of `group` rows.

    Row b is `prefix_GP[b // group] ++ tokens_BT[b]` (B = G * group): a GRPO group is one
    prompt and `group` completions. The prefix runs once per block instead of once per row,
    and each row's tokens attend to its block's prefix keys. Equal (to float rounding) to
    `hidden_states` on the concatenated rows, columns split as (prefix [G, P, D], rest
    [B, T, D]); gradients through the shared prefix sum over the block, as they would.
    Prefixes are left-padded (`prefix_mask_GP`); `mask_BT` marks the rows' real tokens.

    Also returns the MoE layers' routing of the prefixes and of the rows (stacked over the
    MoE layers; None in a dense model); `hidden_states_shared_prefix` returns the first two.
    `experts_LGPK` / `experts_LBTK`: routing replay of the prefixes' / rows' tokens (both or
    neither; see routed_hidden_states).
    """
    G = prefix_tokens_GP.shape[0]
    _check_shared_prefix(G, tokens_BT.shape[0], group, experts_LGPK, experts_LBTK)
    prefix_mask_GP = prefix_mask_GP.astype(bool)
    mask_BT = mask_BT.astype(bool)
    positions_GP, positions_BT = _shared_prefix_positions(prefix_mask_GP, mask_BT, group)
    rope_p = rope_tables(config, positions_GP)
    rope_c = rope_tables(config, positions_BT)
    # A row's token t (key slot P + t) sees its block's real prefix tokens and its own real
    # tokens <= t.
    key_valid_BS = jnp.concatenate([jnp.repeat(prefix_mask_GP, group, axis=0), mask_BT], axis=1)
    body = _shared_prefix_layer(
        layer_stack.decoder_layer(config, sharding, attention),
        rope_p,
        rope_c,
        prefix_mask_GP,
        key_valid_BS,
        group,
        sharding,
    )
    carry = (
        embed_tokens(params, prefix_tokens_GP, sharding),
        embed_tokens(params, tokens_BT, sharding),
    )
    replay = None if experts_LGPK is None else (experts_LGPK, experts_LBTK)
    (hp_GPD, hc_BTD), routing = layer_stack.run_layers(
        config, body, carry, params["layers"], replay, remat
    )
    return _final_norm(params, config, hp_GPD), _final_norm(params, config, hc_BTD), routing


# (h_GPD, h_BTD): routed_hidden_states_shared_prefix without the routing.
hidden_states_shared_prefix = layer_stack.without_routing(routed_hidden_states_shared_prefix)


def _check_shared_prefix(
    G: int, B: int, group: int, experts_LGPK: jax.Array | None, experts_LBTK: jax.Array | None
) -> None:
    if G * group != B:
        raise ValueError(
            f"hidden_states_shared_prefix: {B} rows are not {G} prefixes x "
            f"group={group}; rows [i*group, (i+1)*group) must share prefix i."
        )
    if (experts_LGPK is None) != (experts_LBTK is None):
        raise ValueError(
            "hidden_states_shared_prefix: routing replay needs the experts of both the "
            "prefixes (experts_LGPK) and the rows (experts_LBTK)."
        )


def _shared_prefix_positions(
    prefix_mask_GP: jax.Array, mask_BT: jax.Array, group: int
) -> tuple[jax.Array, jax.Array]:
    """RoPE positions of the prefixes [G, P] and of the rows' tokens [B, T]: those of
    positions_from_mask over the concatenated rows."""
    positions_GP = positions_from_mask(prefix_mask_GP)
    prefix_len_B = jnp.repeat(prefix_mask_GP.sum(axis=1, dtype=jnp.int32), group)
    positions_BT = jnp.maximum(
        prefix_len_B[:, None] + jnp.cumsum(mask_BT.astype(jnp.int32), axis=1) - 1, 0
    )
    return positions_GP, positions_BT


def _shared_prefix_layer(
    layer: Callable[..., Any],
    rope_p: tuple[jax.Array, jax.Array],
    rope_c: tuple[jax.Array, jax.Array],
    prefix_mask_GP: jax.Array,
    key_valid_BS: jax.Array,
    group: int,
    sharding: Sharding,
) -> Callable[..., Any]:
    """The body over layers (layer_stack.run_layers): a layer over the prefixes, then over
    the rows, whose keys and values are their block's prefix keys and values ++ their own."""
    P = prefix_mask_GP.shape[1]
    rows = functools.partial(
        parallel.constrain, logical_axes=("batch", "kv_heads"), sharding=sharding
    )

    def body(carry, lp, experts):
        hp_GPD, hc_BTD = carry
        experts_GPK, experts_BTK = (None, None) if experts is None else experts
        hp_GPD, (kp, vp), routing_p = layer(
            hp_GPD,
            lp,
            rope_p,
            lambda k, v: (k.astype(v.dtype), v, prefix_mask_GP, 0, (k.astype(v.dtype), v)),
            experts_GPK,
        )

        def kv_rows(k, v):
            keys = jnp.concatenate([rows(jnp.repeat(kp, group, axis=0)), k.astype(v.dtype)], axis=3)
            values = jnp.concatenate([rows(jnp.repeat(vp, group, axis=0)), v], axis=2)
            return keys, values, key_valid_BS, P, None

        hc_BTD, _, routing_c = layer(hc_BTD, lp, rope_c, kv_rows, experts_BTK)
        routing = None if routing_p is None else (routing_p, routing_c)
        return (hp_GPD, hc_BTD), routing

    return body


def forward(
    params: Params,
    config: ModelConfig,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    mask_BT: jax.Array,
    kv_cache: KVCache | None = None,
    cache_index: jax.Array | int | None = None,
    *,
    remat: bool = False,
    sharding: Sharding = None,
    attention: AttentionConfig = AttentionConfig(),
) -> tuple[jax.Array, KVCache | None]:
    """Tokens -> (float32 logits_BTV, updated cache or None). See `hidden_states`."""
    h_BTD, new_cache = hidden_states(
        params,
        config,
        tokens_BT,
        positions_BT,
        mask_BT,
        kv_cache,
        cache_index,
        remat=remat,
        sharding=sharding,
        attention=attention,
    )
    return unembed(params, config, h_BTD, sharding), new_cache


def positions_from_mask(mask_BT: jax.Array) -> jax.Array:
    """RoPE positions for left-padded rows: cumsum(mask) - 1, clipped at 0."""
    return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def flops_per_token(config: ModelConfig) -> tuple[float, float, float]:
    """Forward matmul FLOPs (2 per multiply-add): (the decoder layers per token, the
    unembedding per token, attention per (query, key) pair over all layers). A mixture of
    experts counts the experts a token runs (and its router and shared expert)."""
    c = config
    projections = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    return (
        2.0 * (c.num_layers * projections + c.mlp_params(active=True)),
        2.0 * c.vocab_size * c.hidden_size,
        4.0 * c.num_layers * c.num_heads * c.head_dim,
    )


def forward_flops(config: ModelConfig, batch: int, seq_len: int) -> float:
    """Matmul FLOPs of one forward pass over [batch, seq_len] (causal attention counted full)."""
    layers, unembed, attn = flops_per_token(config)
    tokens = batch * seq_len
    return float(tokens * (layers + unembed) + batch * seq_len * seq_len * attn)
