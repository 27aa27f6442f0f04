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
continuous.py's, as `decode_program` builds it (the Program the ahead-of-time planner lowers
too); both return a `SampleOutput` (sample_output.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models import kv_cache
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.program import Program
from jaxrl4llm.sampling import buckets, continuous, decode, paged, paged_mesh, sample_output
from jaxrl4llm.sampling.decode import decode_step, prefill  # noqa: F401  (re-exported)
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.row_io import (
    RowRequest,
    batch_multiple,
    check_generate_args,
    mark_dropped_rows,
    place_inputs,
    prompt_rows,
    rows_per_chunk,
    stop_id_array,
)
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


class _Rows(flax.struct.PyTreeNode):
    """One block of rows of generate_tokens (the optional per-row inputs None when absent)."""

    prompt_BP: jax.Array
    prompt_mask_BP: jax.Array
    active_B: jax.Array
    row_keys_B: jax.Array
    greedy_B: jax.Array | None = None
    row_caps_B: jax.Array | None = None


@functools.partial(
    jax.jit,
    static_argnames=(
        *decode.STATIC_SETTINGS,
        "num_chunks",
        "cache_dtype",
        "compact",
        "record_routing",
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
    record_routing: bool = False,
) -> SampleOutput:
    """The compiled sampler over one bucket. Rows must hold at least one prompt token
    (left-padded); inactive rows (batch padding, dropped prompts) produce nothing.
    stop_ids_S (int32, -1 = unused slot) and pad_id are traced, so they cost no recompiles.
    `prompt_group` > 1: rows [i*g, (i+1)*g) hold the same prompt (n samples of it), so the
    prompt is prefilled once and its cache rows copied to the group. `num_chunks` > 1: the
    rows run as that many strided chunks of whole groups, one after another (a row's
    samples do not depend on the other rows, so the output is the same). `cache_dtype`
    (default: decode.cache_dtype_for) is the KV cache's dtype. `greedy_B` (bool, optional): rows
    that decode greedily (see strategies.sample). `compact`: decode finished rows away in
    levels of halving batches (decode.py; not on a mesh). `row_caps_B` (int32, optional,
    1..max_new_tokens): each row's own token limit; a row stopped by it is truncated.
    `record_routing` (a mixture of experts): the output also holds the experts each prompt
    and completion token ran (SampleOutput.prompt_experts_BPLK, experts_BTLK)."""
    _check_chunks(prompt_BP.shape[0], num_chunks, prompt_group)
    # Per-layer buffers in the decode matmuls' layout, made once here, not in every step.
    params, sharding, cache_dtype = decode.loop_setup(
        params, model_config, mesh, rules, cache_dtype
    )
    run = _Block(
        params,
        stop_ids_S,
        pad_id,
        model_config,
        sampling,
        max_new_tokens,
        sharding,
        prompt_group,
        cache_dtype,
        compact,
        record_routing and bool(model_config.moe_layers),
    )
    rows = _Rows(prompt_BP, prompt_mask_BP, active_B, row_keys_B, greedy_B, row_caps_B)
    if num_chunks == 1:
        return run(rows)
    return _run_chunks(run, rows, num_chunks, prompt_group, sharding)


def _check_chunks(rows: int, num_chunks: int, prompt_group: int) -> None:
    if rows % (num_chunks * prompt_group):
        raise ValueError(
            f"generate_tokens: {rows} rows do not split into {num_chunks} chunks of "
            f"whole groups of {prompt_group}."
        )


def _run_chunks(
    run: Callable[[_Rows], SampleOutput],
    rows: _Rows,
    num_chunks: int,
    prompt_group: int,
    sharding: parallel.ActivationSharding | None,
) -> SampleOutput:
    """`run` over `num_chunks` strided chunks of whole groups of the rows, one after another
    (lax.map), merged back into the rows' order."""
    chunks = jax.tree.map(
        lambda x: parallel.constrain(
            parallel.split_strided(x, num_chunks, prompt_group), (None, "batch"), sharding
        ),
        rows,
    )
    out = jax.lax.map(run, chunks)
    merged = jax.tree.map(
        lambda x: parallel.merge_strided(x, prompt_group),
        out.replace(num_steps=None, slot_steps=None),
    )
    return merged.replace(num_steps=jnp.max(out.num_steps), slot_steps=jnp.sum(out.slot_steps))


@dataclasses.dataclass(frozen=True, eq=False)
class _Block:
    """Prefill + decode loop over one block of rows (see generate_tokens), with what it
    reads besides the rows: the weights, the traced stop ids and pad id, the settings."""

    params: Any
    stop_ids_S: jax.Array
    pad_id: jax.Array
    model_config: ModelConfig
    sampling: SamplingConfig
    max_new_tokens: int
    sharding: parallel.ActivationSharding | None
    prompt_group: int
    cache_dtype: Any
    compact: bool
    record_routing: bool = False

    def __call__(self, rows: _Rows) -> SampleOutput:
        state = decode.decode(
            self.params,
            self._prefilled(rows),
            model_config=self.model_config,
            sampling=self.sampling,
            stop_ids_S=self.stop_ids_S,
            pad_id=self.pad_id,
            prompt_len=rows.prompt_BP.shape[1],
            max_new_tokens=self.max_new_tokens,
            sharding=self.sharding,
            compact=self.compact,
        )
        return _rows_output(state, rows)

    def _prefilled(self, rows: _Rows) -> decode.LoopState:
        """The decode loop's state after prefill: every row's first token sampled (pad in
        inactive rows, which start done)."""
        B, P = rows.prompt_BP.shape
        N = self.max_new_tokens
        g = self.prompt_group
        cache = kv_cache.init_kv_cache(self.model_config, B // g, P + N - 1, self.cache_dtype)
        tok_B, lp_B, cache, prompt_experts = decode.prefill_first_tokens(
            self.params,
            self.model_config,
            rows.prompt_BP[::g],
            rows.prompt_mask_BP[::g],
            cache,
            rows.row_keys_B,
            self.sampling,
            rows.greedy_B,
            self.sharding,
        )
        if self.sharding is not None:
            cache = jax.lax.with_sharding_constraint(cache, cache_sharding(self.sharding, cache))
        active_B = rows.active_B
        tok_B = jnp.where(active_B, tok_B, self.pad_id)
        done_B = ~active_B | decode.is_stop(tok_B, self.stop_ids_S)
        return decode.LoopState(
            step=jnp.array(1, jnp.int32),
            cache=cache,
            last_S=tok_B,
            position_S=jnp.sum(rows.prompt_mask_BP, axis=1, dtype=jnp.int32),
            done_S=done_B,
            row_S=jnp.arange(B, dtype=jnp.int32),
            keys_S=rows.row_keys_B,
            length_R=active_B.astype(jnp.int32),
            done_R=done_B,
            tokens_RT=jnp.full((B, N), self.pad_id, jnp.int32).at[:, 0].set(tok_B),
            logprobs_RT=(
                jnp.zeros((B, N), jnp.float32).at[:, 0].set(jnp.where(active_B, lp_B, 0.0))
            ),
            slot_steps=jnp.array(0, jnp.int32),
            greedy_S=rows.greedy_B,
            cap_S=rows.row_caps_B,
            **(self._routing_record(prompt_experts, N) if self.record_routing else {}),
        )

    def _routing_record(self, prompt_experts_BPLK: Any, N: int) -> dict[str, jax.Array]:
        """The loop state's routing record: the prompt's experts and an empty completion
        record, laid out over the batch axes as the tokens are."""
        B, _, L, K = prompt_experts_BPLK.shape
        experts_BNLK = jnp.zeros((B, N, L, K), prompt_experts_BPLK.dtype)
        rows = ("batch", None, None, None)
        return dict(
            prompt_experts_RPLK=parallel.constrain(prompt_experts_BPLK, rows, self.sharding),
            experts_RTLK=parallel.constrain(experts_BNLK, rows, self.sharding),
        )


def _rows_output(state: decode.LoopState, rows: _Rows) -> SampleOutput:
    """The finished decode loop's rows as a SampleOutput."""
    B, N = state.tokens_RT.shape
    mask_BT = jnp.arange(N)[None, :] < state.length_R[:, None]
    return SampleOutput(
        tokens_BT=state.tokens_RT,
        logprobs_BT=state.logprobs_RT,
        mask_BT=mask_BT,
        lengths_B=state.length_R,
        truncated_B=rows.active_B & ~state.done_R,
        prompt_tokens_BP=rows.prompt_BP,
        prompt_mask_BP=rows.prompt_mask_BP.astype(bool),
        dropped_B=jnp.zeros((B,), bool),
        num_steps=state.step,
        slot_steps=state.slot_steps,
        prompt_experts_BPLK=state.prompt_experts_RPLK,
        experts_BTLK=state.experts_RTLK,
    )


def decode_program(
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    prompt_group: int = 1,
    num_chunks: int = 1,
    compact: bool = True,
    decode_slots: int = 0,
    greedy: bool = False,
    row_caps: bool = False,
    cache_dtype: Any = None,
    kv_pages: int = 0,
    max_rows: int = 0,
    paged_attention: str = "auto",
    record_routing: bool = False,
) -> Program:
    """The compiled decode of one bucket of rows as `generate` runs it (Program "sample"):
    generate_tokens (rows in `num_chunks` strided chunks of whole groups of `prompt_group`,
    finished rows compacted away with `compact`), or with `decode_slots` > 0 the
    continuous-batching continuous.generate_slots (`num_chunks` and `compact` unused), or
    with `kv_pages` > 0 the paged engine paged.generate_paged (a pool of that many pages of
    paged.PAGE_SIZE tokens; at most `max_rows` rows decoding at once, 0: every row; decode
    attention by `paged_attention`: paged_step.uses_kernel).
    `greedy` / `row_caps`: the calls pass greedy_B / row_caps_B (else they are bound to
    None). `cache_dtype`: the KV cache's (default: the weights' compute dtype, float32 on
    CPU; see decode.cache_dtype_for). `record_routing`: generate_tokens and the paged engine
    record each token's experts (a mixture of experts; continuous.py's slots do not). Called,
    or lowered on abstract inputs, as

        program(params, prompt_BP, prompt_mask_BP, active_B, row_keys_B, stop_ids_S, pad_id,
                [greedy_B=...], [row_caps_B=...])
    """
    static: dict[str, Any] = dict(
        model_config=model_config,
        sampling=sampling,
        max_new_tokens=int(max_new_tokens),
        mesh=mesh,
        rules=rules,
        prompt_group=prompt_group,
        cache_dtype=cache_dtype,
    )
    if not greedy:
        static["greedy_B"] = None
    if not row_caps:
        static["row_caps_B"] = None
    if kv_pages:
        rows = {"max_rows": max_rows or 1 << 30, "num_pages": kv_pages}
        static.update(attention=paged_attention, record_routing=record_routing)
        return Program("sample", paged_mesh.engine(mesh, rules), {**static, **rows})
    if decode_slots:
        return Program("sample", continuous.generate_slots, {**static, "slots": decode_slots})
    loop = {"num_chunks": num_chunks, "compact": compact, "record_routing": record_routing}
    return Program("sample", generate_tokens, {**static, **loop})


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
    kv_cache_tokens: int | None = None,
    record_routing: bool = False,
    paged_attention: str = "auto",
) -> SampleOutput:
    """Samples `n` completions of each prompt (lists of token ids, unpadded), rows laid out
    as RowLayout(n, share_prompts) and the prompt options as row_io.RowRequest says
    (max_prompt_len, long_prompts, min_prompt_bucket, greedy_last, row_keys, row_caps).
    stop_ids defaults to model_config.eos_token_ids. With a mesh, params must already be
    placed on it (e.g. parallel.shard_pytree with transformer.param_logical_axes).
    `max_rows` (global rows, all hosts) caps the rows decoded at once: more rows run as strided
    chunks of whole prompts, one after another, in the same program (same samples). `compact=False`
    keeps finished rows in the decode batch (the same samples; decode.py). `decode_slots` > 0:
    continuous batching (continuous.py): that many rows decode at a time and a finished row's slot
    takes the next queued row (the same samples; `max_rows` does not apply: the slots bound the rows
    at once); with a mesh, a multiple of the data-parallel size. A row stopped by its row_caps token
    limit reads as truncated_B unless that token is a stop token (e.g. tools/bench_rollout.py
    --length_mix). `kv_cache_tokens` (not None): the paged engine (paged.py), a pool of that many
    tokens (0: the rows decoding at once at full length); `max_rows` caps those rows,
    `paged_attention` its attention (paged_step.uses_kernel). `record_routing`: a mixture of
    experts' output holds each token's experts (routing replay; the compacted sampler and the
    paged engine: decode_slots refuses it)."""
    max_rows = None if decode_slots and kv_cache_tokens is None else max_rows
    engine = (decode_slots, kv_cache_tokens, record_routing, paged_attention)
    decoding = _Decoding(mesh, rules, max_rows, compact, *engine)
    check_generate_args(len(prompts) * n, sampling, max_new_tokens, row_caps, n)
    request = RowRequest(
        RowLayout(n, share_prompts),
        max_new_tokens=max_new_tokens,
        max_prompt_len=max_prompt_len,
        long_prompts=long_prompts,
        pad_id=pad_id if pad_id is not None else (model_config.pad_token_id or 0),
        min_prompt_bucket=min_prompt_bucket,
        greedy_last=greedy_last,
        row_keys=row_keys,
        row_caps=row_caps,
    )
    return _generate(params, model_config, prompts, sampling, key, request, stop_ids, decoding)


@dataclasses.dataclass(frozen=True)
class _Decoding:
    """How `generate` decodes its rows (its arguments of the same names)."""

    mesh: Mesh | None
    rules: parallel.LogicalRules
    max_rows: int | None
    compact: bool
    decode_slots: int
    kv_cache_tokens: int | None = None
    record_routing: bool = False
    paged_attention: str = "auto"

    def __post_init__(self):
        """The engine's refusals (ValueError): its mesh, its slots, a routing record."""
        if self.kv_cache_tokens is None and self.decode_slots:
            continuous.check_slots(self.decode_slots, self.mesh, self.rules)
        if self.record_routing and self.decode_slots and self.kv_cache_tokens is None:
            raise ValueError(
                "record_routing: the compacted sampler and the paged engine (kv_cache_tokens) "
                "record routing, decode_slots does not."
            )

    def paged_settings(
        self, rows: int, prompt_len: int, max_new_tokens: int, group: int
    ) -> dict[str, Any]:
        """decode_program's paged engine settings for a bucket (none: not paged)."""
        D = paged_mesh.shards(self.mesh, self.rules)
        t, a, R = self.kv_cache_tokens, self.paged_attention, self.max_rows
        return paged.program_settings(t, R, rows, prompt_len, max_new_tokens, group, a, D)


def _generate(
    params: Any,
    model_config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    key: jax.Array,
    request: RowRequest,
    stop_ids: Sequence[int] | None,
    decoding: _Decoding,
) -> SampleOutput:
    """generate's rows laid out on this host and placed on the mesh, decoded by
    decode_program's program, with the dropped prompts flagged."""
    stop_S = stop_id_array(model_config.eos_token_ids if stop_ids is None else stop_ids)
    mesh, rules = decoding.mesh, decoding.rules
    multihost = mesh is not None and jax.process_count() > 1
    n = request.layout.group_size
    # The paged engine gives each batch shard whole groups (paged_mesh.py).
    paged_rows = decoding.kv_cache_tokens is not None and paged_mesh.shards(mesh, rules) > 1
    multiple = batch_multiple(mesh, rules, multihost) * (n if paged_rows else 1)
    # The paged engine takes max_rows as its rows decoding at once, not as chunks.
    max_rows = None if decoding.kv_cache_tokens is not None else decoding.max_rows
    chunk = rows_per_chunk(max_rows, len(prompts) * n, n, multiple)
    # A chunk is whole data-parallel shards.
    rows = prompt_rows(
        prompts, model_config, key, request, batch_multiple=chunk or multiple, multihost=multihost
    )
    inputs, optional = place_inputs(rows, mesh=mesh, rules=rules, multihost=multihost)
    B, P = rows.batch.prompt_BP.shape
    program = decode_program(
        model_config=model_config,
        sampling=sampling,
        max_new_tokens=request.max_new_tokens,
        mesh=mesh,
        rules=rules,
        prompt_group=rows.prompt_group,
        num_chunks=rows.batch.prompt_BP.shape[0] // chunk if chunk else 1,
        compact=decoding.compact,
        decode_slots=decoding.decode_slots,
        greedy=rows.greedy_B is not None,
        row_caps=rows.caps_B is not None,
        record_routing=decoding.record_routing,
        **decoding.paged_settings(B, P, request.max_new_tokens, rows.prompt_group),
    )
    raw = program(params, *inputs, stop_S, np.int32(request.pad_id), **optional)
    out: SampleOutput = (
        sample_output.from_engine(raw, *inputs[:3])
        if decoding.decode_slots or decoding.kv_cache_tokens is not None
        else raw
    )
    return mark_dropped_rows(out, rows.batch, mesh=mesh, rules=rules, multihost=multihost)
