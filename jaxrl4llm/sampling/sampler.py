"""The jitted KV-cache sampler: prefill of left-padded prompts, then a lax.while_loop decode.

One compiled program per shape bucket (batch, prompt length, max_new_tokens, sampling config):

  prefill  one forward over the [B, P] prompt block writes cache slots [0, P) and gives the
           logits of each row's last prompt token (only that position is unembedded);
  decode   a while loop feeds one token per step into the preallocated cache (per layer,
           P + max_new_tokens - 1 slots; see kv_cache.KVCache) and stops when every row
           has emitted a stop token or max_new_tokens tokens exist (the cache is then full);
           finished rows are compacted away in levels of halving batches (decode.py).

The cache is created inside the program and carried by the loop, so XLA updates it in place;
it never crosses the jit boundary and needs no donation. With a mesh it is sharded over
batch (data, fsdp) and kv heads (tensor), and the activations are constrained to the batch
layout (parallel.ActivationSharding). `max_rows` runs the rows in strided chunks one after
another inside the same program (every chunk spans every device), so the cache and the
activations are sized by one chunk.

Logprobs are log_softmax(logits / temperature) at the sampled token, before top-k / top-p
truncation (temperature 1 for greedy); see strategies.py. Row r draws with
fold_in(row_key[r], step), so a row's samples do not depend on the rest of the batch.

`generate`, the host entry, lays the rows out (row_io.py) and runs this program or
continuous.py's; both return a `SampleOutput` (sample_output.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models import kv_cache
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import buckets, continuous, decode
from jaxrl4llm.sampling.decode import cache_dtype_for as _cache_dtype
from jaxrl4llm.sampling.decode import decode_step, prefill  # noqa: F401  (re-exported)
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.row_io import place_rows, prompt_rows
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.sampling.strategies import SamplingConfig

LONG_PROMPT_MODES = buckets.LONG_PROMPT_MODES


def cache_sharding(
    sharding: parallel.ActivationSharding, cache: kv_cache.KVCache
) -> kv_cache.KVCache:
    """The cache's tree with a sharding at every leaf (`replace` swaps all three fields)."""
    k = sharding.named(kv_cache.K_CACHE_LOGICAL_AXES, cache.k_BKHS[0].shape)
    v = sharding.named(kv_cache.V_CACHE_LOGICAL_AXES, cache.v_BKSH[0].shape)
    layers = len(cache.k_BKHS)
    return cache.replace(
        k_BKHS=(k,) * layers,
        v_BKSH=(v,) * layers,
        mask_BS=sharding.named(("batch", "length"), cache.mask_BS.shape),
    )


def stop_id_array(stop_ids: Sequence[int]) -> np.ndarray:
    """Stop ids as an int32 array padded with -1 to a multiple of 8 (few distinct shapes)."""
    ids = sorted({int(s) for s in stop_ids})
    out = np.full(8 * max(1, -(-len(ids) // 8)), -1, np.int32)
    out[: len(ids)] = ids
    return out


@functools.partial(
    jax.jit,
    static_argnames=(
        "model_config",
        "sampling",
        "max_new_tokens",
        "mesh",
        "rules",
        "prompt_group",
        "num_chunks",
        "cache_dtype",
        "compact",
    ),
)
def generate_tokens(
    params: Any,
    prompt_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    active_B: jax.Array,
    row_keys_B: jax.Array,
    stop_ids_S: jax.Array,
    pad_id: jax.Array,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    prompt_group: int = 1,
    num_chunks: int = 1,
    cache_dtype: Any = None,
    greedy_B: jax.Array | None = None,
    compact: bool = True,
    row_caps_B: jax.Array | None = None,
) -> SampleOutput:
    """The compiled sampler over one bucket. Rows must hold at least one prompt token
    (left-padded); inactive rows (batch padding, dropped prompts) produce nothing.
    stop_ids_S (int32, -1 = unused slot) and pad_id are traced, so they cost no recompiles.
    `prompt_group` > 1: rows [i*g, (i+1)*g) hold the same prompt (n samples of it), so the
    prompt is prefilled once and its cache rows copied to the group. `num_chunks` > 1: the
    rows run as that many strided chunks of whole groups, one after another (a row's
    samples do not depend on the other rows, so the output is the same). `cache_dtype`
    (default: see _cache_dtype) is the KV cache's dtype. `greedy_B` (bool, optional): rows
    that decode greedily (see strategies.sample). `compact`: decode finished rows away in
    levels of halving batches (decode.py; not on a mesh). `row_caps_B` (int32, optional,
    1..max_new_tokens): each row's own token limit; a row stopped by it is truncated."""
    B = prompt_BP.shape[0]
    if B % (num_chunks * prompt_group):
        raise ValueError(
            f"generate_tokens: {B} rows do not split into {num_chunks} chunks of "
            f"whole groups of {prompt_group}."
        )
    sharding = None if mesh is None else parallel.ActivationSharding(mesh, rules)
    # Per-layer buffers in the decode matmuls' layout, made once here, not in every step.
    params = decode.loop_params(params, model_config, sharding)
    run = functools.partial(
        _generate_rows,
        params,
        stop_ids_S=stop_ids_S,
        pad_id=pad_id,
        model_config=model_config,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        sharding=sharding,
        prompt_group=prompt_group,
        cache_dtype=cache_dtype or _cache_dtype(params),
        compact=compact,
    )
    rows = (prompt_BP, prompt_mask_BP, active_B, row_keys_B)
    options: dict[str, Any] = {
        name: x for name, x in (("greedy_B", greedy_B), ("row_caps_B", row_caps_B)) if x is not None
    }
    if num_chunks == 1:
        return run(*rows, **options)
    chunks = jax.tree.map(
        lambda x: parallel.constrain(
            parallel.split_strided(x, num_chunks, prompt_group), (None, "batch"), sharding
        ),
        (rows, options),
    )
    out = jax.lax.map(lambda xs: run(*xs[0], **xs[1]), chunks)
    merged = jax.tree.map(
        lambda x: parallel.merge_strided(x, prompt_group),
        out.replace(num_steps=None, slot_steps=None),
    )
    return merged.replace(num_steps=jnp.max(out.num_steps), slot_steps=jnp.sum(out.slot_steps))


def _generate_rows(
    params: Any,
    prompt_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    active_B: jax.Array,
    row_keys_B: jax.Array,
    greedy_B: jax.Array | None = None,
    row_caps_B: jax.Array | None = None,
    *,
    stop_ids_S: jax.Array,
    pad_id: jax.Array,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    sharding: parallel.ActivationSharding | None,
    prompt_group: int,
    cache_dtype: Any,
    compact: bool,
) -> SampleOutput:
    """Prefill + decode loop over one block of rows (see generate_tokens)."""
    B, P = prompt_BP.shape
    N = max_new_tokens
    g = prompt_group
    cache = kv_cache.init_kv_cache(model_config, B // g, P + N - 1, cache_dtype)
    tok_B, lp_B, cache = decode.prefill_first_tokens(
        params,
        model_config,
        prompt_BP[::g],
        prompt_mask_BP[::g],
        cache,
        row_keys_B,
        sampling,
        greedy_B,
        sharding,
    )
    if sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding(sharding, cache))

    tok_B = jnp.where(active_B, tok_B, pad_id)
    done_B = ~active_B | decode.is_stop(tok_B, stop_ids_S)
    state = decode.LoopState(
        step=jnp.array(1, jnp.int32),
        cache=cache,
        last_S=tok_B,
        position_S=jnp.sum(prompt_mask_BP, axis=1, dtype=jnp.int32),
        done_S=done_B,
        row_S=jnp.arange(B, dtype=jnp.int32),
        keys_S=row_keys_B,
        length_R=active_B.astype(jnp.int32),
        done_R=done_B,
        tokens_RT=jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(tok_B),
        logprobs_RT=jnp.zeros((B, N), jnp.float32).at[:, 0].set(jnp.where(active_B, lp_B, 0.0)),
        slot_steps=jnp.array(0, jnp.int32),
        greedy_S=greedy_B,
        cap_S=row_caps_B,
    )
    state = decode.decode(
        params,
        state,
        model_config=model_config,
        sampling=sampling,
        stop_ids_S=stop_ids_S,
        pad_id=pad_id,
        prompt_len=P,
        max_new_tokens=N,
        sharding=sharding,
        compact=compact,
    )
    mask_BT = jnp.arange(N)[None, :] < state.length_R[:, None]
    return SampleOutput(
        tokens_BT=state.tokens_RT,
        logprobs_BT=state.logprobs_RT,
        mask_BT=mask_BT,
        lengths_B=state.length_R,
        truncated_B=active_B & ~state.done_R,
        prompt_tokens_BP=prompt_BP,
        prompt_mask_BP=prompt_mask_BP.astype(bool),
        dropped_B=jnp.zeros((B,), bool),
        num_steps=state.step,
        slot_steps=state.slot_steps,
    )


def generate(
    params: Any,
    model_config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    key: jax.Array,
    *,
    stop_ids: Sequence[int] | None = None,
    n: int = 1,
    pad_id: int | None = None,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    max_prompt_len: int | None = None,
    long_prompts: str = "error",
    row_keys: jax.Array | None = None,
    min_prompt_bucket: int = buckets.MIN_PROMPT_BUCKET,
    share_prompts: bool = True,
    max_rows: int | None = None,
    greedy_last: int = 0,
    compact: bool = True,
    decode_slots: int = 0,
    row_caps: Sequence[int] | None = None,
) -> SampleOutput:
    """Samples `n` completions of each prompt (lists of token ids, unpadded).

    stop_ids defaults to model_config.eos_token_ids; max_prompt_len defaults to
    max_position_embeddings - max_new_tokens. Longer prompts raise (long_prompts="error") or
    are skipped and flagged in `dropped_B` (long_prompts="drop"). `row_keys` ([len(prompts) *
    n] keys) overrides the per-row keys derived from `key`. With a mesh, params must already
    be placed on it (e.g. parallel.shard_pytree with transformer.param_logical_axes).
    Rows follow sampling.layout.RowLayout(n, share_prompts): a prompt's n samples are
    consecutive rows, and with share_prompts its prefill runs once for them.
    `max_rows` (global rows, all hosts) caps the rows decoded at once: more rows run as
    strided chunks of whole prompts, one after another, in the same program (same samples).
    `greedy_last` > 0: the last that many samples of each prompt decode greedily, in the same
    program (ReMax's baseline completion).
    `compact=False` keeps finished rows in the decode batch (the same samples; see decode.py).
    `decode_slots` > 0: continuous batching (continuous.py): that many rows decode at a time
    and a finished row's slot takes the next queued row (the same samples; `max_rows` does
    not apply: the slots bound the rows at once). With a mesh it must be a multiple of the
    data-parallel size.
    `row_caps` (len(prompts) * n ints in 1..max_new_tokens): each row's own token limit; a row
    stops there as at max_new_tokens (truncated_B unless that token is a stop token), e.g. to
    budget rows or to force a length mix (tools/bench_rollout.py --length_mix).
    """
    if decode_slots:
        continuous.check_slots(decode_slots, mesh, rules)
        max_rows = None
    _check_generate_args(len(prompts) * n, sampling, max_new_tokens, row_caps)
    stop_S = stop_id_array(model_config.eos_token_ids if stop_ids is None else stop_ids)
    pad = pad_id if pad_id is not None else (model_config.pad_token_id or 0)
    multihost = mesh is not None and jax.process_count() > 1
    multiple = _batch_multiple(mesh, rules, multihost)
    chunk = _rows_per_chunk(max_rows, len(prompts) * n, n, multiple)
    rows = prompt_rows(
        prompts,
        model_config,
        key,
        RowLayout(n, share_prompts),
        max_new_tokens=max_new_tokens,
        max_prompt_len=max_prompt_len,
        long_prompts=long_prompts,
        pad_id=pad,
        min_prompt_bucket=min_prompt_bucket,
        greedy_last=greedy_last,
        batch_multiple=chunk or multiple,  # a chunk is whole data-parallel shards
        multihost=multihost,
        row_keys=row_keys,
    )
    batch = rows.batch
    B = batch.prompt_BP.shape[0]
    num_chunks = B // chunk if chunk else 1

    place = functools.partial(place_rows, mesh=mesh, rules=rules, multihost=multihost)
    keys_B = _place_keys(rows.keys_B, place, multihost)
    inputs = (place(batch.prompt_BP), place(batch.mask_BP), place(batch.active_B), keys_B)
    greedy_B = None if rows.greedy_B is None else place(rows.greedy_B)
    caps_B = None
    if row_caps is not None:
        caps_B = place(_padded_row_caps(row_caps, batch.num_rows, B, max_new_tokens))
    decode_rows: Callable[..., Any] = (
        functools.partial(continuous.generate_slots, slots=decode_slots)
        if decode_slots
        else functools.partial(generate_tokens, num_chunks=num_chunks, compact=compact)
    )
    raw = decode_rows(
        params,
        *inputs,
        stop_S,
        np.int32(pad),
        model_config=model_config,
        sampling=sampling,
        max_new_tokens=int(max_new_tokens),
        mesh=mesh,
        rules=rules,
        greedy_B=greedy_B,
        row_caps_B=caps_B,
        prompt_group=rows.prompt_group,
    )
    out: SampleOutput = _slot_sample_output(raw, *inputs[:3]) if decode_slots else raw
    return _mark_dropped_rows(out, batch, place, multihost)


def _check_generate_args(
    num_rows: int, sampling: Any, max_new_tokens: Any, row_caps: Sequence[int] | None
) -> None:
    if row_caps is not None:
        caps = np.asarray(row_caps)
        if (
            caps.shape != (num_rows,)
            or not np.issubdtype(caps.dtype, np.integer)
            or caps.min(initial=1) < 1
            or caps.max(initial=1) > max_new_tokens
        ):
            raise ValueError(
                f"row_caps must hold len(prompts) * n = {num_rows} ints "
                f"in 1..max_new_tokens={max_new_tokens}; got shape {caps.shape}, "
                f"dtype {caps.dtype}."
            )
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int.")
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}.")


def _batch_multiple(mesh: Mesh | None, rules: parallel.LogicalRules, multihost: bool) -> int:
    """What this host's rows must pad to a multiple of: its share of the data-parallel size."""
    multiple = 1 if mesh is None else parallel.data_parallel_size(mesh, rules)
    if multihost:
        # Each host passes its own prompts; every host must build the same shapes.
        multiple = max(1, multiple // jax.process_count())
    return multiple


def _rows_per_chunk(max_rows: int | None, num_rows: int, n: int, multiple: int) -> int | None:
    """Rows per chunk on this host (None: all rows at once, max_rows unset or not reached):
    whole prompts (n rows) on whole data-parallel shards."""
    if not max_rows or max_rows >= num_rows * jax.process_count():
        return None
    unit = math.lcm(n, multiple)
    return unit * max(1, max_rows // jax.process_count() // unit)


def _place_keys(keys_B: jax.Array, place: Callable[..., Any], multihost: bool) -> jax.Array:
    # Across hosts the keys travel as their raw data (host-local rows -> one global batch,
    # hosts' blocks in process order).
    if multihost:
        return _wrap_keys(place(np.asarray(jax.random.key_data(keys_B))))
    return place(keys_B)


def _padded_row_caps(
    row_caps: Sequence[int], num_rows: int, batch_size: int, max_new_tokens: int
) -> np.ndarray:
    """row_caps over the whole batch: batch padding rows (inactive) take the full limit."""
    caps_B = np.full(batch_size, max_new_tokens, np.int32)
    caps_B[:num_rows] = row_caps
    return caps_B


def _mark_dropped_rows(
    out: SampleOutput, batch: buckets.PromptBatch, place: Callable[..., Any], multihost: bool
) -> SampleOutput:
    """`out` with the dropped prompts flagged (and their prompt masks cleared); on one host
    without the batch-bucket padding rows."""
    if multihost:
        # Rows stay global (each host's block keeps its padding rows: see host_rows).
        dropped_B = place(batch.dropped_B)
        return out.replace(
            dropped_B=dropped_B, prompt_mask_BP=_and_not(out.prompt_mask_BP, dropped_B)
        )
    dropped_B = jnp.asarray(batch.dropped_B)
    out = out.replace(dropped_B=dropped_B, prompt_mask_BP=out.prompt_mask_BP & ~dropped_B[:, None])
    if batch.prompt_BP.shape[0] > batch.num_rows:  # drop the batch-bucket padding rows
        out = jax.tree.map(lambda x: x if x.ndim == 0 else x[: batch.num_rows], out)
    return out


_wrap_keys = jax.jit(jax.random.wrap_key_data)


@jax.jit
def _slot_sample_output(
    out: continuous.SlotOutput, prompt_BP: jax.Array, prompt_mask_BP: jax.Array, active_B: jax.Array
) -> SampleOutput:
    """The continuous sampler's rows as a SampleOutput (num_steps: the longest row)."""
    N = out.tokens_RT.shape[1]
    return SampleOutput(
        tokens_BT=out.tokens_RT,
        logprobs_BT=out.logprobs_RT,
        mask_BT=jnp.arange(N)[None, :] < out.length_R[:, None],
        lengths_B=out.length_R,
        truncated_B=active_B & ~out.done_R,
        prompt_tokens_BP=prompt_BP,
        prompt_mask_BP=prompt_mask_BP.astype(bool),
        dropped_B=jnp.zeros(active_B.shape, bool),
        num_steps=jnp.maximum(jnp.max(out.length_R), 1),
        slot_steps=out.slot_steps,
    )


@jax.jit
def _and_not(mask_BP: jax.Array, dropped_B: jax.Array) -> jax.Array:
    return mask_BP & ~dropped_B[:, None]
