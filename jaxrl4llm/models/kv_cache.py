"""The decoder's KV cache: per-layer key and value buffers and the mask of filled slots.

The passes (`transformer.hidden_states` / `forward` with a cache) write the new tokens' keys
and values at `cache_index`; the sampler's decode loops carry the cache between steps.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl4llm.models.config import ModelConfig


class KVCache(flax.struct.PyTreeNode):
    """Keys [B, K, H, S] and values [B, K, S, H] for S cache slots, one array per layer;
    `mask_BS` marks slots holding real tokens.

    Per-layer buffers (not one stacked [L, ...] array) let a decode loop update each layer in
    place and read it without slicing a copy out of the stack. The layouts make both attention
    einsums plain row-major matmuls over the cache as stored: scores [G, H] @ [H, S], outputs
    [G, S] @ [S, H] (no per-step transpose; a transposed-operand dot is ~5x slower on CPU).
    """

    k_BKHS: tuple[jax.Array, ...]
    v_BKSH: tuple[jax.Array, ...]
    mask_BS: jax.Array

    @property
    def max_len(self) -> int:
        return self.mask_BS.shape[1]


K_CACHE_LOGICAL_AXES = ("batch", "kv_heads", "head_dim", "length")
V_CACHE_LOGICAL_AXES = ("batch", "kv_heads", "length", "head_dim")


def init_kv_cache(
    config: ModelConfig, batch_size: int, max_len: int, dtype: Any = jnp.float32
) -> KVCache:
    """An empty cache: zeros, and no slot marked as holding a token."""
    B, K, S, H = batch_size, config.num_kv_heads, max_len, config.head_dim
    L = config.num_layers
    return KVCache(
        k_BKHS=tuple(jnp.zeros((B, K, H, S), dtype) for _ in range(L)),
        v_BKSH=tuple(jnp.zeros((B, K, S, H), dtype) for _ in range(L)),
        mask_BS=jnp.zeros((batch_size, max_len), bool),
    )
