"""One pre-norm decoder layer and its parts: RMS norm, RoPE, the projections (with their
LoRA adapters), the MLP (dense, or a mixture of experts: models/moe.py) and the activations'
logical axes.

Matmuls take the weights' dtype and accumulate in float32 (`dot`); norms and RoPE run in
float32. `transformer` stacks these layers into the model's passes; the sampler's slot decoder
(`sampling.continuous`) runs them one token at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl4llm import parallel
from jaxrl4llm.models import attention as attn_lib
from jaxrl4llm.models import lora, moe
from jaxrl4llm.models.attention import AttentionConfig
from jaxrl4llm.models.config import ModelConfig

Params = dict[str, Any]

_F32 = jnp.float32
Sharding = parallel.ActivationSharding | None
# A layer's choice of attended keys (apply_layer): (k_BKHT, v_BKTH) -> (keys_BKHS,
# values_BKSH, key_valid_BS, offset, aux).
KVFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array, Any, Any]]


@dataclasses.dataclass(frozen=True)
class Attend:
    """A layer's own attention, given in a KVFn's place (the paged decode step's kernel,
    sampling/paged_step.py): fn(q_BTNH, k_BKHT, v_BKTH) -> (attn_BTM float32, aux), the
    queries and keys after RoPE, queries and values in the weights' dtype."""

    fn: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


# Logical axes of activations: rows over the data-parallel axes, the model width whole,
# heads / MLP over tensor (see parallel.ActivationSharding).
H_AXES = ("batch", "length", None)
_Q_AXES = ("batch", "length", "heads", None)
_KV_AXES = ("batch", "length", "kv_heads", None)
_MLP_AXES = ("batch", "length", "mlp")


def dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum in the weights' dtype, accumulated and returned in float32."""
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=_F32)


def _project(spec: str, x: jax.Array, lp: Params, name: str) -> jax.Array:
    """x times the layer's projection `name` (`dot(spec, ...)`), plus its LoRA adapter
    x A B when the layer has one (models/lora.py; B carries the alpha / rank scale). The
    adapter's input is dropped out when the layer carries a dropout key (training only)."""
    y = dot(spec, x, lp[name])
    if f"{name}_lora_a" not in lp:
        return y
    if lora.DROPOUT_KEY in lp:
        key = jax.random.fold_in(
            jax.random.wrap_key_data(lp[lora.DROPOUT_KEY]), lora.TARGETS.index(name)
        )
        keep = lp[lora.DROPOUT_KEEP]
        x = jnp.where(jax.random.uniform(key, x.shape) < keep, x.astype(_F32) / keep, 0.0)
    xa = dot("...i,ir->...r", x, lp[f"{name}_lora_a"])
    return y + dot("...r,ro->...o", xa, lp[f"{name}_lora_b"]).reshape(y.shape)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x = x.astype(_F32)
    x = x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return x * scale.astype(_F32)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [H/2] (float32, as transformers computes them), llama3-scaled."""
    h = config.head_dim
    inv = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, h, 2, dtype=np.float32) / h))
    inv = inv.astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(config: ModelConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    freqs_BTF = positions_BT.astype(_F32)[..., None] * jnp.asarray(rope_inv_freq(config))
    return jnp.cos(freqs_BTF), jnp.sin(freqs_BTF)


def _apply_rope(x_BTNH: jax.Array, cos_BTF: jax.Array, sin_BTF: jax.Array) -> jax.Array:
    """Rotates the two halves of each head (the HF "rotate_half" layout)."""
    x1, x2 = jnp.split(x_BTNH.astype(_F32), 2, axis=-1)
    cos, sin = cos_BTF[:, :, None, :], sin_BTF[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_layer(
    config: ModelConfig,
    h_BTD: jax.Array,
    lp: Params,
    cos_BTF: jax.Array,
    sin_BTF: jax.Array,
    kv_fn: KVFn | Attend,
    sharding: Sharding = None,
    attention: AttentionConfig = AttentionConfig(),
    query_prefix_BT: jax.Array | None = None,
    packed_positions_BT: jax.Array | None = None,
) -> tuple[jax.Array, Any, moe.Routing | None]:
    """One pre-norm decoder block: attention_block, then mlp_block (the router's own choice
    of experts in a MoE layer). Returns (h_BTD, kv_fn's aux, the layer's routing: None in a
    dense layer)."""
    h_BTD, aux = attention_block(
        config,
        h_BTD,
        lp,
        (cos_BTF, sin_BTF),
        kv_fn,
        sharding,
        attention,
        query_prefix_BT=query_prefix_BT,
        packed_positions_BT=packed_positions_BT,
    )
    h_BTD, routing = mlp_block(config, h_BTD, lp, sharding)
    return h_BTD, aux, routing


def attention_block(
    config: ModelConfig,
    h_BTD: jax.Array,
    lp: Params,
    rope: tuple[jax.Array, jax.Array],
    kv_fn: KVFn | Attend,
    sharding: Sharding,
    attention: AttentionConfig,
    *,
    query_prefix_BT: jax.Array | None = None,
    packed_positions_BT: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """h_BTD plus its pre-norm attention, and kv_fn's aux. rope: (cos_BTF, sin_BTF) of the
    tokens' positions (rope_tables). kv_fn an Attend: its own attention; else
    `kv_fn(k_BKHT, v_BKTH)` ->
    (keys_BKHS, values_BKSH, key_valid_BS, offset, aux) picks the attended keys: the new ones
    (no cache), the updated cache layer or a shared prefix ++ the new ones; query t sits at
    key slot t + offset. `query_prefix_BT`, `packed_positions_BT`: packed rows' prefix
    segments and positions, by which the window counts (attention.attention; self-attention,
    no cache)."""
    c = config
    act = functools.partial(parallel.constrain, sharding=sharding)
    h_BTD = act(h_BTD, H_AXES)
    x_BTD = rms_norm(h_BTD, lp["attn_norm"], c.rms_norm_eps)
    q = act(_project("btd,dnh->btnh", x_BTD, lp, "q"), _Q_AXES)
    k = act(_project("btd,dkh->btkh", x_BTD, lp, "k"), _KV_AXES)
    v = act(_project("btd,dkh->btkh", x_BTD, lp, "v"), _KV_AXES)
    if c.attention_bias:
        q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
    if c.qk_norm:
        q = rms_norm(q, lp["q_norm"], c.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    dtype = lp["q"].dtype
    q = _apply_rope(q, *rope)
    k = _apply_rope(k, *rope)
    k_BKHT, v_BKTH = k.transpose(0, 2, 3, 1), jnp.swapaxes(v.astype(dtype), 1, 2)
    if isinstance(kv_fn, Attend):
        attn_BTM, aux = kv_fn.fn(q.astype(dtype), k_BKHT, v_BKTH)
    else:
        keys, values, key_valid_BS, offset, aux = kv_fn(k_BKHT, v_BKTH)
        attn_BTM = attn_lib.attention(
            q.astype(dtype),
            keys,
            values,
            key_valid_BS,
            offset,
            attention,
            sharding,
            window=c.sliding_window,
            query_prefix_BT=query_prefix_BT,
            positions_BS=packed_positions_BT,
        )
    attn_BTM = act(attn_BTM, ("batch", "length", "heads"))
    # One [N*H, D] matrix (a free reshape): as "btnh,nhd" XLA transposed o every call.
    lp_o = {**lp, "o": lp["o"].reshape(-1, lp["o"].shape[-1])}
    return act(h_BTD + _project("btm,md->btd", attn_BTM, lp_o, "o"), H_AXES), aux


def mlp_block(
    config: ModelConfig,
    h_BTD: jax.Array,
    lp: Params,
    sharding: Sharding = None,
    experts_BTK: jax.Array | None = None,
) -> tuple[jax.Array, moe.Routing | None]:
    """h_BTD plus its pre-norm MLP, and the layer's routing (None in a dense layer). A layer
    whose params hold a router is a mixture of experts (models/moe.py): its tokens run
    `experts_BTK` when given (routing replay), else their router's top-k; a shared expert,
    where the family has one, adds sigmoid(x . shared_expert_gate) times its dense MLP."""
    act = functools.partial(parallel.constrain, sharding=sharding)
    x_BTD = rms_norm(h_BTD, lp["mlp_norm"], config.rms_norm_eps)
    if "router" not in lp:
        if experts_BTK is not None:
            raise ValueError("mlp_block: experts_BTK given for a dense layer (no router).")
        return act(h_BTD + _dense_mlp(x_BTD, lp, ("gate", "up", "down"), sharding), H_AXES), None
    y_BTD, routing = moe.moe_mlp(config, lp, x_BTD, sharding, experts_BTK)
    if "shared_gate" in lp:
        share_BT1 = jax.nn.sigmoid(dot("btd,d->bt", x_BTD, lp["shared_expert_gate"]))[..., None]
        shared = _dense_mlp(x_BTD, lp, ("shared_gate", "shared_up", "shared_down"), sharding)
        y_BTD = y_BTD + share_BT1 * shared
    return act(h_BTD + y_BTD, H_AXES), routing


def _dense_mlp(
    x_BTD: jax.Array, lp: Params, names: tuple[str, str, str], sharding: Sharding
) -> jax.Array:
    """The SwiGLU MLP down(silu(x gate) * x up) of the layer's projections `names`."""
    act = functools.partial(parallel.constrain, sharding=sharding)
    gate, up, down = names
    g = act(_project("btd,df->btf", x_BTD, lp, gate), _MLP_AXES)
    u = act(_project("btd,df->btf", x_BTD, lp, up), _MLP_AXES)
    return _project("btf,fd->btd", jax.nn.silu(g) * u, lp, down)
