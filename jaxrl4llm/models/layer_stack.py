"""Running the decoder's layers in order (transformer.py's passes): `lax.scan` over stacked
layers that are all alike, a Python loop otherwise or with a KV cache, and each layer's
slice of the params; each layer returns its routing when it is a mixture of experts.

params["layers"] may be stacked [L, ...] or a tuple of per-layer dicts (`unstack_layers`).
Per-layer weights are stacked over the layers that have them (schema.Leaf.layers): in a
mixture of experts whose mlp_only_layers / decoder_sparse_step leave some layers dense,
the experts are stacked over the MoE layers and the dense MLP over the others, so such a
model runs its layers as a loop; one whose layers are all MoE (or all dense) scans them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, ParamSpec

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl4llm.models import moe, schema
from jaxrl4llm.models.attention import AttentionConfig
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.decoder_layer import Sharding, attention_block, mlp_block
from jaxrl4llm.models.kv_cache import KVCache

Params = dict[str, Any]
Rope = tuple[jax.Array, jax.Array]
# layer(h_BTD, lp, rope, kv_fn, experts_BTK=None) -> (h_BTD, kv_fn's aux, routing or None).
Layer = Callable[..., tuple[jax.Array, Any, moe.Routing | None]]
# body(carry, layer params, the layer's replayed experts or None) -> (carry, the layer's
# routing or None).
LayerBody = Callable[[Any, Params, Any], tuple[Any, Any]]


def is_uniform(config: ModelConfig) -> bool:
    """Whether every layer has the same weights (all dense, or all a mixture of experts)."""
    return len(config.moe_layers) in (0, config.num_layers)


def layer_params(config: ModelConfig, layers: Any, index: int) -> Params:
    """Layer `index`'s weights: its entry of a tuple of per-layer dicts, or its slice of each
    stacked leaf that this layer has (keys schema does not know, LoRA adapters and dropout
    keys, are stacked over every layer)."""
    if isinstance(layers, (tuple, list)):
        return layers[index]
    out = {}
    for name, w in layers.items():
        held = config.layers_of(schema.LAYER_KIND.get(name, "all"))
        if index in held:
            out[name] = jax.tree.map(lambda a, j=held.index(index): a[j], w)
    return out


def unstack_layers(params: Params, config: ModelConfig | None = None) -> Params:
    """params with "layers" as a tuple of per-layer dicts instead of stacked [L, ...] arrays.

    For decode loops on CPU: XLA upcasts the dynamic slice that `lax.scan` takes of stacked
    bfloat16 weights to float32 (a float32 copy of every weight, then a slow dot), and a slice
    taken inside the loop is copied every step. Slicing once before the loop gives each layer
    its own buffer, read in place. Costs one copy of the layer weights while it lives.
    Layers that are not all alike (see the module docstring) need `config`."""
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        return params
    if config is None:
        sizes = {w.shape[0] for w in jax.tree.leaves(layers)}
        if len(sizes) != 1:
            raise ValueError(
                f"unstack_layers: the stacked layer weights have {sorted(sizes)} layers "
                "(dense and MoE layers stacked apart); pass the model's config."
            )
        L = sizes.pop()
        per_layer = tuple(jax.tree.map(lambda w, i=i: w[i], layers) for i in range(L))
    else:
        per_layer = tuple(layer_params(config, layers, i) for i in range(config.num_layers))
    return {**params, "layers": per_layer}


def unstacked_logical_axes(config: ModelConfig) -> Params:
    """The logical axes of `unstack_layers(params, config)`: each layer's own leaves."""
    axes = schema.param_logical_axes(config)
    per_layer = tuple(
        {
            name: a[1:]
            for name, a in axes["layers"].items()
            if i in config.layers_of(schema.LAYER_KIND[name])
        }
        for i in range(config.num_layers)
    )
    return {**axes, "layers": per_layer}


def layer_inputs(config: ModelConfig, layers: Any, experts_L: Any) -> Iterator[tuple[Params, Any]]:
    """(weights, replayed experts or None) of each layer in order; `experts_L` (a pytree of
    arrays or None) is stacked over the MoE layers."""
    moe_index = {i: j for j, i in enumerate(config.moe_layers)}
    for i in range(config.num_layers):
        j = moe_index.get(i)
        experts = None
        if experts_L is not None and j is not None:
            experts = jax.tree.map(lambda a, j=j: a[j], experts_L)
        yield layer_params(config, layers, i), experts


def run_layers(
    config: ModelConfig,
    body: LayerBody,
    carry: Any,
    layers: Any,
    experts_L: Any,
    remat: bool = False,
) -> tuple[Any, Any]:
    """`carry` through body over the layers: a scan over stacked layers all alike, else a
    loop. Returns (carry, the MoE layers' routings stacked [L_moe, ...], None without any).
    `experts_L`: the experts each MoE layer replays, stacked over the MoE layers."""
    check_replay(config, experts_L)
    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    if not isinstance(layers, (tuple, list)) and is_uniform(config):
        return lax.scan(lambda c, xs: body(c, *xs), carry, (layers, experts_L))
    routings = []
    for lp, experts in layer_inputs(config, layers, experts_L):
        carry, routing = body(carry, lp, experts)
        if routing is not None:
            routings.append(routing)
    return carry, stack(routings)


def stack(routings: list[Any]) -> Any:
    """Per-layer routings (pytrees alike) stacked along a new leading axis (None: none)."""
    return jax.tree.map(lambda *a: jnp.stack(a), *routings) if routings else None


def check_replay(config: ModelConfig, experts_L: Any) -> None:
    """Replayed experts need MoE layers, one [L_moe, ...] slice each."""
    if experts_L is None:
        return
    L = len(config.moe_layers)
    sizes = {a.shape[0] for a in jax.tree.leaves(experts_L)}
    if not L or sizes != {L}:
        raise ValueError(
            f"Replayed experts stacked over {sorted(sizes)} layers; the model has {L} "
            "mixture-of-experts layers (routing replay needs one slice per MoE layer)."
        )


def decoder_layer(
    config: ModelConfig,
    sharding: Sharding,
    attention: AttentionConfig,
    query_prefix_BT: jax.Array | None = None,
    packed_positions_BT: jax.Array | None = None,
) -> Layer:
    """One decoder layer (decoder_layer.attention_block, then mlp_block: the routing is None
    in a dense layer) with the pass's settings bound."""

    def layer(h_BTD, lp, rope, kv_fn, experts_BTK=None):
        h_BTD, aux = attention_block(
            config,
            h_BTD,
            lp,
            rope,
            kv_fn,
            sharding,
            attention,
            query_prefix_BT=query_prefix_BT,
            packed_positions_BT=packed_positions_BT,
        )
        h_BTD, routing = mlp_block(config, h_BTD, lp, sharding, experts_BTK)
        return h_BTD, aux, routing

    return layer


def run_uncached(
    config: ModelConfig,
    layer: Layer,
    rope: Rope,
    h_BTD: jax.Array,
    layers: Any,
    key_valid_BT: jax.Array,
    experts_LBTK: jax.Array | None,
    remat: bool,
) -> tuple[jax.Array, moe.Routing | None]:
    """The stack without a cache: each layer's queries attend to its own keys."""

    def body(h, lp, experts):
        kv_fn = lambda k, v: (k.astype(v.dtype), v, key_valid_BT, 0, None)  # noqa: E731
        h, _, routing = layer(h, lp, rope, kv_fn, experts)
        return h, routing

    return run_layers(config, body, h_BTD, layers, experts_LBTK, remat)


def run_cached(
    config: ModelConfig,
    layer: Layer,
    rope: Rope,
    h_BTD: jax.Array,
    layers: Any,
    mask_BT: jax.Array,
    kv_cache: KVCache,
    cache_index: jax.Array | int,
    remat: bool,
    experts_LBTK: jax.Array | None,
) -> tuple[jax.Array, KVCache, moe.Routing | None]:
    """The stack with a cache: a Python loop, the new tokens' keys and values written into
    each layer's buffer at slot cache_index."""
    check_replay(config, experts_LBTK)
    i0 = jnp.asarray(cache_index, jnp.int32)
    # A static index stays static: the kernels need their causal offset at trace time.
    offset = cache_index if isinstance(cache_index, int) else i0
    cache_mask_BS = lax.dynamic_update_slice(kv_cache.mask_BS, mask_BT, (0, i0))

    def body(h, lp, k_cache, v_cache, experts):
        def kv_fn(k, v):
            k_new = lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, i0))
            v_new = lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, i0, 0))
            return k_new, v_new, cache_mask_BS, offset, (k_new, v_new)

        return layer(h, lp, rope, kv_fn, experts)

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    ks, vs, routings = [], [], []
    inputs = layer_inputs(config, layers, experts_LBTK)
    for (lp, experts), k_cache, v_cache in zip(inputs, kv_cache.k_BKHS, kv_cache.v_BKSH):
        h_BTD, (k_cache, v_cache), routing = body(h_BTD, lp, k_cache, v_cache, experts)
        ks.append(k_cache)
        vs.append(v_cache)
        routings += [routing] if routing is not None else []
    cache = KVCache(k_BKHS=tuple(ks), v_BKSH=tuple(vs), mask_BS=cache_mask_BS)
    return h_BTD, cache, stack(routings)


_P = ParamSpec("_P")


def without_routing(routed: Callable[_P, tuple[Any, ...]]) -> Callable[_P, tuple[Any, ...]]:
    """`routed` returning all its outputs but the last (the routing), same arguments."""

    @functools.wraps(routed)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> tuple[Any, ...]:
        return routed(*args, **kwargs)[:-1]

    return run
