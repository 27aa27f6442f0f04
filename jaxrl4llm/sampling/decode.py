"""The model's cache passes (prefill of a prompt block, one decode step, and one with a cache
slot per row: slot_decode_step) and the decode loop after prefill: one token per row per step,
finished rows compacted away.

RL completions have a long tail of lengths: most rows stop early while a few run to the
limit. The loop exits when every row is done, and in between it runs in levels of B, B/2,
B/4, ... slots: when at most half of the current slots are still live, the live rows (and
their KV cache rows, keys, positions) are gathered into a batch half the size and decoding
goes on there. Decode cost is then about proportional to the live rows instead of B for the
whole longest row. Each slot knows its row (`row_S`), and every output is written at that row,
so the result equals decoding all B rows to the end (each row's tokens depend only on its
own prompt, cache and key).

Per-row caps (LoopState.cap_S) end a row at its own token limit: it stops decoding like a
row that emitted a stop token, but is not done (its output reads as truncated).

Compaction gathers rows across the batch, which on a mesh would move cache rows between
devices; with a mesh (or fewer than 2 * MIN_COMPACT_ROWS rows, or at most MIN_COMPACT_ROWS new
tokens) the loop keeps all B slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models import decoder_layer, kv_cache, lora, moe, transformer, unembedding
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.layer_stack import stack as stack_layers
from jaxrl4llm.sampling import strategies
from jaxrl4llm.sampling.strategies import SamplingConfig

# The smallest batch a level compacts to: below it a decode step costs about the weights'
# read whatever the rows, so halving the batch again saves little.
MIN_COMPACT_ROWS = 8


def cache_dtype_for(params: Any) -> Any:
    """The KV cache's dtype for the weights `params` computes with (`cache_dtype_of`)."""
    return cache_dtype_of(params["embed"].dtype)


def cache_dtype_of(compute_dtype: Any, backend: str | None = None) -> Any:
    """The weights' compute dtype, except float32 on CPU: there XLA upcasts every bfloat16
    cache write to float32 out of place (a copy of the layer's cache per step), and float32
    attention over the cache costs about the same as bfloat16. `backend` (default: jax's)
    lets a planner on CPU choose as the planned accelerator's run would."""
    backend = backend or parallel.backend()
    return jnp.float32 if backend == "cpu" else jnp.dtype(compute_dtype)


def routed_experts(routing: moe.Routing | None) -> jax.Array | None:
    """The experts a pass's tokens ran, [B, T, L_moe, K] in the smallest integer dtype that
    holds the expert ids (uint8 up to 256 experts): what the sampler records for routing
    replay (rows first, so they slice, chunk and gather like the tokens). None: dense."""
    if routing is None:
        return None
    experts_LBTK = routing.experts_BTK
    dtype = expert_id_dtype(routing.logits_BTE.shape[-1])
    return jnp.moveaxis(experts_LBTK, 0, 2).astype(dtype)


def expert_id_dtype(num_experts: int) -> Any:
    """The routing record's dtype: the smallest integer dtype holding the expert ids."""
    return jnp.uint8 if num_experts <= 256 else jnp.int16


def prefill(
    params: Any,
    model_config: ModelConfig,
    prompt_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    cache: kv_cache.KVCache,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, kv_cache.KVCache, jax.Array | None]:
    """Writes the left-padded prompt block into cache slots [0, P); returns the logits of each
    row's last prompt token [B, V] (only that column is unembedded), the cache and the
    prompt tokens' experts (routed_experts; None in a dense model)."""
    positions_BP = transformer.positions_from_mask(prompt_mask_BP)
    h_BPD, new_cache, routing = transformer.routed_hidden_states(
        params, model_config, prompt_BP, positions_BP, prompt_mask_BP, cache, 0, sharding=sharding
    )
    assert new_cache is not None  # hidden_states returns the cache it is given, updated
    logits_BV = unembedding.unembed(params, model_config, h_BPD[:, -1:], sharding)[:, 0]
    return logits_BV, new_cache, routed_experts(routing)


def prefill_first_tokens(
    params: Any,
    model_config: ModelConfig,
    prompt_GP: jax.Array,
    prompt_mask_GP: jax.Array,
    cache: kv_cache.KVCache,
    keys_B: jax.Array,
    sampling: SamplingConfig,
    greedy_B: jax.Array | None,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, jax.Array, kv_cache.KVCache, jax.Array | None]:
    """Prefills each group's prompt once (G prompts, cache of G rows) for B = G * g rows
    (rows [i*g, (i+1)*g) continue prompt i), copies its cache rows and logits to its g rows
    and samples every row's first completion token with fold_in(row_key, 0): returns
    (tokens [B], logprobs [B], the cache of B rows, the prompt tokens' experts [B, P, L, K]
    or None in a dense model)."""
    B = keys_B.shape[0]
    group = B // prompt_GP.shape[0]
    logits_BV, cache, experts = prefill(
        params, model_config, prompt_GP, prompt_mask_GP, cache, sharding
    )
    if group > 1:
        logits_BV, cache, experts = jax.tree.map(
            lambda x: jnp.repeat(x, group, axis=0), (logits_BV, cache, experts)
        )
    first_keys_B = jax.vmap(jax.random.fold_in)(keys_B, jnp.zeros((B,), jnp.uint32))
    tok_B, lp_B = strategies.sample(logits_BV, first_keys_B, sampling, greedy_B)
    return tok_B, lp_B, cache, experts


# The named scope of the weights' layout change before the loops: its collectives are the
# once-per-call weight gathers (tools/plan.py finds them by it in the HLO's metadata).
WEIGHTS_SCOPE = "decode_weights"
# The named scope of the paged engine's choice to prefill a block of groups: a conditional
# in its decode loop that runs once per block admitted, not once per step (paged.loop_bounds;
# the planner counts it so).
PREFILL_SCOPE = "paged_prefill"


def loop_params(
    params: Any, model_config: ModelConfig, sharding: parallel.ActivationSharding | None
) -> Any:
    """The weights the sampler computes with, made once before prefill and the decode loops:
    matrices in the compute dtype, one buffer per layer (transformer.unstack_layers) and, on a
    mesh, laid out for the decode matmuls (parallel.without_batch_axes: the FSDP shards
    gathered, tensor parallelism kept), which then need no collective on a weight.

    Left in their storage layout, the weights are gathered where they are used: the SPMD
    partitioner puts each gather inside the decode loop's body, once per generated token
    (only the CPU compiler hoists them out). The gathered copy costs every device the
    model's bytes / tensor while the program runs."""
    with jax.named_scope(WEIGHTS_SCOPE):
        # LoRA adapters folded into the weights: decoding then runs no adapter matmuls, and
        # the folded weights are the per-layer copy made here anyway (docs/performance.md).
        params = transformer.unstack_layers(
            transformer.cast_for_compute(lora.fold(params), model_config), model_config
        )
        if sharding is None:
            return params
        layout = parallel.ActivationSharding(
            sharding.mesh, parallel.without_batch_axes(sharding.rules)
        )
        axes = transformer.unstacked_logical_axes(model_config)
        return parallel.constrain_tree(params, axes, layout)


# The static settings both compiled samplers take (sampler.generate_tokens,
# continuous.generate_slots), each adding its own.
STATIC_SETTINGS = ("model_config", "sampling", "max_new_tokens", "mesh", "rules", "prompt_group")


def loop_setup(
    params: Any,
    model_config: ModelConfig,
    mesh: Mesh | None,
    rules: parallel.LogicalRules,
    cache_dtype: Any = None,
    laid_out: bool = False,
) -> tuple[Any, parallel.ActivationSharding | None, Any]:
    """What both compiled samplers start from: (the weights laid out once for the decode
    loops (loop_params; `laid_out`: the caller did it), the activation sharding on `mesh`
    (None without one), the KV cache's dtype: `cache_dtype`, by default cache_dtype_for the
    weights)."""
    sharding = None if mesh is None else parallel.ActivationSharding(mesh, rules)
    # Gathered once here, or the partitioner gathers every weight in every decode step.
    params = params if laid_out else loop_params(params, model_config, sharding)
    return params, sharding, cache_dtype or cache_dtype_for(params)


def decode_step(
    params: Any,
    model_config: ModelConfig,
    token_B: jax.Array,
    position_B: jax.Array,
    cache: kv_cache.KVCache,
    cache_index: jax.Array,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, kv_cache.KVCache, jax.Array | None]:
    """Feeds one token per row at slot `cache_index`; returns (next-token logits [B, V], cache,
    the fed tokens' experts [B, 1, L, K] or None in a dense model)."""
    B = token_B.shape[0]
    h_B1D, new_cache, routing = transformer.routed_hidden_states(
        params,
        model_config,
        token_B[:, None],
        position_B[:, None],
        jnp.ones((B, 1), bool),
        cache,
        cache_index,
        sharding=sharding,
    )
    assert new_cache is not None  # hidden_states returns the cache it is given, updated
    logits_BV = unembedding.unembed(params, model_config, h_B1D, sharding)[:, 0]
    return logits_BV, new_cache, routed_experts(routing)


def slot_decode_step(
    params: Any,
    model_config: ModelConfig,
    token_S: jax.Array,
    position_S: jax.Array,
    write_S: jax.Array,
    cache: kv_cache.KVCache,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, kv_cache.KVCache]:
    """decode.decode_step with a cache slot per row: row i's token goes to slot write_S[i]
    and attends to its row's filled slots up to it (and, with a sliding window W, only the
    last W). Returns (next-token logits [S, V], cache). params["layers"]: per-layer dicts."""
    n, L = token_S.shape[0], cache.max_len
    slot_n = jnp.arange(n)
    key_L = jnp.arange(L)
    mask_SL = cache.mask_BS.at[slot_n, write_S].set(True)
    valid_SL = mask_SL & (key_L[None, :] <= write_S[:, None])
    window = model_config.sliding_window
    if window is not None:
        valid_SL &= key_L[None, :] > write_S[:, None] - window

    def kv_fn(k_SKH1, v_SK1H, k_cache, v_cache):
        k_new = k_cache.at[slot_n, :, :, write_S].set(k_SKH1[..., 0].astype(k_cache.dtype))
        v_new = v_cache.at[slot_n, :, write_S, :].set(v_SK1H[:, :, 0].astype(v_cache.dtype))
        return k_new, v_new, valid_SL, L - 1, (k_new, v_new)

    kv_fns = [
        functools.partial(kv_fn, k_cache=k, v_cache=v) for k, v in zip(cache.k_BKHS, cache.v_BKSH)
    ]
    logits_SV, new, _ = one_token_pass(params, model_config, token_S, position_S, kv_fns, sharding)
    ks, vs = zip(*new)
    return logits_SV, kv_cache.KVCache(k_BKHS=tuple(ks), v_BKSH=tuple(vs), mask_BS=mask_SL)


def one_token_pass(
    params: Any,
    model_config: ModelConfig,
    token_S: jax.Array,
    position_S: jax.Array,
    kv_fns: Sequence[decoder_layer.KVFn | decoder_layer.Attend],
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, list[Any], jax.Array | None]:
    """One token per row through the layers, layer l's attended keys chosen by kv_fns[l]
    (decoder_layer.apply_layer), whose masks hold the per-row causal and window rules (the
    query sits past every key). Returns (next-token logits [S, V], each kv_fn's aux, the fed
    tokens' experts [S, 1, L, K]: routed_experts, None in a dense model)."""
    layer_config = dataclasses.replace(model_config, sliding_window=None)
    cos, sin = decoder_layer.rope_tables(model_config, position_S[:, None])
    h = transformer.embed_tokens(params, token_S[:, None], sharding)
    auxes, routings = [], []
    for lp, kv_fn in zip(params["layers"], kv_fns):
        h, aux, routing = decoder_layer.apply_layer(layer_config, h, lp, cos, sin, kv_fn, sharding)
        auxes.append(aux)
        routings += [] if routing is None else [routing]
    h = decoder_layer.rms_norm(h, params["final_norm"], model_config.rms_norm_eps)
    logits_SV = unembedding.unembed(
        params, model_config, h.astype(params["embed"].dtype), sharding
    )[:, 0]
    return logits_SV, auxes, routed_experts(stack_layers(routings))


def is_stop(tokens_B: jax.Array, stop_ids_S: jax.Array) -> jax.Array:
    return jnp.any(tokens_B[:, None] == stop_ids_S[None, :], axis=-1)


class LoopState(flax.struct.PyTreeNode):
    """Per slot (_S, the current level's batch) and per row (_R, the block's B rows)."""

    step: jax.Array  # index of the completion token produced next
    cache: kv_cache.KVCache  # [S, ...] rows of the live slots
    last_S: jax.Array  # the token produced at step - 1 (fed in this step)
    position_S: jax.Array  # its RoPE position
    done_S: jax.Array  # emitted a stop token (or an inactive row)
    row_S: jax.Array  # the row each slot decodes
    keys_S: jax.Array  # that row's key
    length_R: jax.Array
    done_R: jax.Array
    tokens_RT: jax.Array
    logprobs_RT: jax.Array
    slot_steps: jax.Array  # int32: sum over decode steps of the slots computed
    greedy_S: jax.Array | None = None  # rows that decode greedily (ReMax's baseline row)
    cap_S: jax.Array | None = None  # the row's own token limit (<= max_new_tokens)
    # Routing record (a mixture of experts, when asked): the prompt tokens' experts and each
    # completion token's, column t written when a live row feeds token t (its last never is).
    prompt_experts_RPLK: jax.Array | None = None
    experts_RTLK: jax.Array | None = None


def live(s: LoopState) -> jax.Array:
    """Slots whose row still decodes: no stop token yet and (with caps) under its own cap."""
    return ~s.done_S if s.cap_S is None else ~s.done_S & (s.step < s.cap_S)


def levels(rows: int, compact: bool, floor: int = MIN_COMPACT_ROWS) -> tuple[int, ...]:
    """Slot counts of the successive levels: rows, rows/2, ... down to `floor`."""
    sizes = [rows]
    while compact and sizes[-1] % 2 == 0 and sizes[-1] // 2 >= floor:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def _compact(s: LoopState, size: int) -> LoopState:
    """The `size` slots holding every live row (live first, then finished ones as filler)."""
    order = jnp.argsort(~live(s), stable=True)[:size]
    take = lambda x: jnp.take(x, order, axis=0)  # noqa: E731
    return s.replace(
        cache=jax.tree.map(take, s.cache),
        last_S=take(s.last_S),
        position_S=take(s.position_S),
        done_S=take(s.done_S),
        row_S=take(s.row_S),
        keys_S=take(s.keys_S),
        greedy_S=None if s.greedy_S is None else take(s.greedy_S),
        cap_S=None if s.cap_S is None else take(s.cap_S),
    )


def decode(
    params: Any,
    state: LoopState,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    stop_ids_S: jax.Array,
    pad_id: jax.Array,
    prompt_len: int,
    max_new_tokens: int,
    sharding: parallel.ActivationSharding | None,
    compact: bool,
) -> LoopState:
    """Runs the decode loop from `state` (after the first token) to the end."""
    N = max_new_tokens
    # Short completions leave little to save; they skip the extra loops' compile time.
    sizes = levels(state.row_S.shape[0], compact and sharding is None and N > MIN_COMPACT_ROWS)
    body = functools.partial(
        _decode_body,
        params,
        model_config=model_config,
        sampling=sampling,
        stop_ids_S=stop_ids_S,
        pad_id=pad_id,
        prompt_len=prompt_len,
        sharding=sharding,
        # One level: slot i is row i throughout, and outputs are written in place by slices
        # (a scatter into batch-sharded buffers could make the partitioner gather them).
        in_place=len(sizes) == 1,
    )

    def more_live_than(floor: int, s: LoopState) -> jax.Array:
        return (s.step < N) & (jnp.sum(live(s)) > floor)

    for level, size in enumerate(sizes):
        if level:
            state = _compact(state, size)
        # Stay at this level while the live rows do not fit the next one.
        floor = sizes[level + 1] if level + 1 < len(sizes) else 0
        state = jax.lax.while_loop(functools.partial(more_live_than, floor), body, state)
    return state


def _write(
    buf_RT: jax.Array, row_S: jax.Array, step: jax.Array, x_S: jax.Array, in_place: bool
) -> jax.Array:
    """buf_RT with each slot's x (a scalar or an array per slot) written at its row's column
    `step`."""
    if in_place:
        start = (0, step) + (0,) * (x_S.ndim - 1)
        return jax.lax.dynamic_update_slice(buf_RT, x_S[:, None], start)
    return buf_RT.at[row_S, step].set(x_S)


def _decode_body(
    params: Any,
    s: LoopState,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    stop_ids_S: jax.Array,
    pad_id: jax.Array,
    prompt_len: int,
    sharding: parallel.ActivationSharding | None,
    in_place: bool,
) -> LoopState:
    """One decode step of every slot. Finished rows still in a slot keep feeding tokens
    (harmless: they only attend to themselves) and write pad / 0 at their own row."""
    logits_SV, cache, experts_S1LK = decode_step(
        params, model_config, s.last_S, s.position_S, s.cache, prompt_len + s.step - 1, sharding
    )
    live_S = live(s)
    if s.experts_RTLK is not None:  # the fed token is completion token step - 1
        assert experts_S1LK is not None  # recorded only for a mixture of experts
        # Only a live row's fed token is one it goes on from (not its last, not padding):
        # the record then does not depend on which finished rows a level kept.
        fed_SLK = jnp.where(live_S[:, None, None], experts_S1LK[:, 0], 0)
        s = s.replace(experts_RTLK=_write(s.experts_RTLK, s.row_S, s.step - 1, fed_SLK, in_place))
    keys_S = jax.vmap(jax.random.fold_in)(s.keys_S, jnp.full(s.row_S.shape, s.step, jnp.uint32))
    tok_S, lp_S = strategies.sample(logits_SV, keys_S, sampling, s.greedy_S)
    tok_S = jnp.where(live_S, tok_S, pad_id)
    lp_S = jnp.where(live_S, lp_S, 0.0)
    # A row stopped by its cap stays not done (truncated), even if pad is a stop id.
    done_S = s.done_S | (live_S & is_stop(tok_S, stop_ids_S))
    return s.replace(
        step=s.step + 1,
        cache=cache,
        last_S=tok_S,
        position_S=s.position_S + 1,
        done_S=done_S,
        length_R=(
            s.length_R + live_S.astype(jnp.int32)
            if in_place
            else s.length_R.at[s.row_S].add(live_S.astype(jnp.int32))
        ),
        done_R=done_S if in_place else s.done_R.at[s.row_S].set(done_S),
        tokens_RT=_write(s.tokens_RT, s.row_S, s.step, tok_S, in_place),
        logprobs_RT=_write(s.logprobs_RT, s.row_S, s.step, lp_S, in_place),
        slot_steps=s.slot_steps + s.row_S.shape[0],
    )
