"""Continuous batching: a fixed number of decode slots, each handed the next queued row as
soon as its own row ends.

The compacted sampler (decode.py) starts every row at once and halves its batch as rows
finish, so a long-tailed length mix still runs at half-empty levels. Here the B rows of a
bucket (prompt, sample index) wait in a queue and only `slots` rows decode at a time: when a
row emits a stop token or reaches max_new_tokens, its slot prefills the next queued row into
its own cache row and decodes it from the next step on. Decode steps then compute about one
useful token per slot until the queue is empty; the last rows drain in halving levels like
decode.py's, down to drain_floor() slots (not on a mesh, where compaction would move cache rows
between devices).

The whole rollout is one compiled program, one lax.while_loop whose body decodes one token
for every slot and then refills the free slots (an inner while loop). A refill prefills the
next R = refill_rows(slots) queued rows at once into a pending block and samples their first
tokens; free slots then take pending rows, the block being prefilled again once it is used
up. A freed slot is refilled before the next decode step, so no slot waits for others to free
before a prefill, and prefills still run R rows at a time. The alternative, decoding K steps
per host round trip and refilling from the host, pays a dispatch and a device-to-host sync
every K steps and leaves freed slots idle for up to K - 1 steps; refilling inside the loop
costs neither.

Each slot keeps its own completion step: its row writes cache slot P + step - 1 of its own
cache row (P prompt slots, then the completion), so a decode step scatters one key and value
per slot and masks attention per slot (slot_decode_step). A row draws its tokens with
fold_in(row_key, step), step counting its own completion tokens, so its samples do not depend
on its slot, on when it ran or on the other rows: the output equals the compacted sampler's.
With `prompt_group` G > 1 (a prompt's G samples are consecutive rows) a pending block holds
whole groups (R a multiple of G): each group's prompt is prefilled once and its cache rows and
first logits copied to its G rows, as the compacted sampler does. Rows that hold no prompt
(dropped prompts, batch padding) are never queued; a dropped prompt drops its whole group, so
queued groups stay whole. Per-row caps (`row_caps_B`) end a row at its own token limit as
max_new_tokens would.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import decoder_layer, kv_cache, transformer, unembedding
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import decode, strategies
from jaxrl4llm.sampling.strategies import SamplingConfig

# Rows per prefill: 1/REFILL_FRACTION of the slots (a prefill per that many finished rows;
# the pending block holds as many cache rows).
REFILL_FRACTION = 16


def check_slots(
    slots: int, mesh: Mesh | None, rules: parallel.LogicalRules = parallel.DEFAULT_RULES
) -> None:
    """Refuses a slot count that is negative or does not split over the mesh's data shards."""
    if not isinstance(slots, int) or slots < 0:
        raise FlagError(
            f"--decode_slots={slots!r} must be an int >= 0 (0: decode every row "
            "at once, compacting finished rows away)."
        )
    dp = 1 if mesh is None else parallel.data_parallel_size(mesh, rules)
    if slots % dp:
        raise FlagError(
            f"--decode_slots={slots} must be a multiple of the data-parallel size "
            f"{dp} (each device decodes the same number of slots); use "
            f"--decode_slots={dp * max(1, round(slots / dp))}."
        )


def drain_floor() -> int:
    """The smallest level the drain compacts to. The drain is where continuous batching still
    computes free slots: the last long rows run alone. On CPU a decode step costs about its
    rows' compute down to one row, so it halves down to one slot there; on accelerators a
    step below decode.MIN_COMPACT_ROWS rows costs about the weights' read whatever the rows."""
    return 1 if jax.default_backend() == "cpu" else decode.MIN_COMPACT_ROWS


def refill_rows(slots: int, multiple: int = 1) -> int:
    """Rows per refill prefill: about slots / REFILL_FRACTION, a multiple of `multiple`."""
    return multiple * max(1, slots // (multiple * REFILL_FRACTION))


class Slots(flax.struct.PyTreeNode):
    """Rows in decode slots (_S), or prefilled rows waiting for a slot (the pending block)."""

    cache: kv_cache.KVCache  # [S, ...]: a slot's prompt at [0, P), its completion from P
    row_S: jax.Array  # the row a slot decodes (stale once the slot is free)
    step_S: jax.Array  # that row's index of the completion token produced next
    last_S: jax.Array  # the token produced at step - 1 (fed in this step)
    position_S: jax.Array  # its RoPE position
    live_S: jax.Array  # the slot's row still decodes (else the slot is free)
    keys_S: jax.Array  # the row's key
    cap_S: jax.Array  # the row's token limit
    greedy_S: jax.Array | None = None

    def take(self, index: jax.Array) -> "Slots":
        return jax.tree.map(lambda x: jnp.take(x, index, axis=0), self)

    def put(self, index: jax.Array, values: "Slots") -> "Slots":
        """These slots with `values` (one entry per index) written at `index` (indices past
        the last slot are dropped)."""
        return jax.tree.map(lambda x, v: x.at[index].set(v, mode="drop"), self, values)


class SlotState(flax.struct.PyTreeNode):
    """The slots, the pending block and the outputs per row of the bucket (_R, caller's
    order)."""

    slots: Slots  # [S]
    pending: Slots  # [R]: the last prefill's rows; [pend_next, pend_end) still wait
    pend_next: jax.Array  # int32
    pend_end: jax.Array  # int32
    next_row: jax.Array  # int32: queue index of the next row to prefill
    length_R: jax.Array
    done_R: jax.Array  # emitted a stop token
    tokens_RT: jax.Array
    logprobs_RT: jax.Array
    slot_steps: jax.Array  # int32: sum over decode steps of the slots computed


class SlotOutput(flax.struct.PyTreeNode):
    """The rows' completions (caller's order) and the decode work."""

    tokens_RT: jax.Array
    logprobs_RT: jax.Array
    length_R: jax.Array
    done_R: jax.Array
    slot_steps: jax.Array


class Queue(flax.struct.PyTreeNode):
    """The rows waiting for a slot: order_Q[i] is the i-th row to start (num_queued of them)."""

    order_Q: jax.Array
    num_queued: jax.Array
    prompt_BP: jax.Array
    prompt_mask_BP: jax.Array
    row_keys_B: jax.Array
    caps_B: jax.Array
    greedy_B: jax.Array | None = None


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
    # The per-row causal and window rules are in valid_SL: the query sits past every slot.
    layer_config = dataclasses.replace(model_config, sliding_window=None)
    cos, sin = decoder_layer.rope_tables(model_config, position_S[:, None])
    h = transformer.embed_tokens(params, token_S[:, None], sharding)
    ks, vs = [], []
    for lp, k_cache, v_cache in zip(params["layers"], cache.k_BKHS, cache.v_BKSH):

        def kv_fn(k_SKH1, v_SK1H, k_cache=k_cache, v_cache=v_cache):
            k_new = k_cache.at[slot_n, :, :, write_S].set(k_SKH1[..., 0].astype(k_cache.dtype))
            v_new = v_cache.at[slot_n, :, write_S, :].set(v_SK1H[:, :, 0].astype(v_cache.dtype))
            return k_new, v_new, valid_SL, L - 1, (k_new, v_new)

        h, (k_new, v_new) = decoder_layer.apply_layer(
            layer_config, h, lp, cos, sin, kv_fn, sharding
        )
        ks.append(k_new)
        vs.append(v_new)
    h = decoder_layer.rms_norm(h, params["final_norm"], model_config.rms_norm_eps)
    logits_SV = unembedding.unembed(
        params, model_config, h.astype(params["embed"].dtype), sharding
    )[:, 0]
    return logits_SV, kv_cache.KVCache(k_BKHS=tuple(ks), v_BKSH=tuple(vs), mask_BS=mask_SL)


@functools.partial(
    jax.jit,
    static_argnames=(
        "model_config",
        "sampling",
        "max_new_tokens",
        "slots",
        "mesh",
        "rules",
        "prompt_group",
    ),
)
def generate_slots(
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
    slots: int,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    greedy_B: jax.Array | None = None,
    row_caps_B: jax.Array | None = None,
    prompt_group: int = 1,
) -> SlotOutput:
    """The compiled continuous-batching sampler over one bucket (arguments as
    sampler.generate_tokens): the active rows run through `slots` decode slots (at most B)."""
    B, P = prompt_BP.shape
    N = max_new_tokens
    S = min(slots, B)
    sharding = None if mesh is None else parallel.ActivationSharding(mesh, rules)
    # Gathered once here, or the partitioner gathers every weight in every decode step.
    params = decode.loop_params(params, model_config, sharding)
    cache_dtype = decode.cache_dtype_for(params)
    dp = 1 if mesh is None else parallel.data_parallel_size(mesh, rules)
    # Rows per prefill: whole groups, each device prefilling whole prompts.
    G = prompt_group
    R = refill_rows(S, G * dp)
    # The queue: active rows in the caller's order (rows without a prompt never start).
    order_Q = jnp.argsort(~active_B, stable=True).astype(jnp.int32)
    num_queued = jnp.sum(active_B, dtype=jnp.int32)
    queue = Queue(
        order_Q=order_Q,
        num_queued=num_queued,
        prompt_BP=prompt_BP,
        prompt_mask_BP=prompt_mask_BP,
        row_keys_B=row_keys_B,
        caps_B=jnp.full((B,), N, jnp.int32) if row_caps_B is None else row_caps_B,
        greedy_B=greedy_B,
    )
    step = functools.partial(
        _decode_slots,
        params,
        model_config=model_config,
        sampling=sampling,
        stop_ids_S=stop_ids_S,
        prompt_len=P,
        sharding=sharding,
    )
    prefill = functools.partial(
        _prefill_pending,
        params,
        queue,
        group=G,
        model_config=model_config,
        sampling=sampling,
        stop_ids_S=stop_ids_S,
        cache_dtype=cache_dtype,
        sharding=sharding,
    )

    def waiting(s: SlotState) -> jax.Array:
        return (s.next_row < num_queued) | (s.pend_next < s.pend_end)

    def refill_due(s: SlotState) -> jax.Array:
        return jnp.any(~s.slots.live_S) & waiting(s)

    def refill(s: SlotState) -> SlotState:
        return jax.lax.cond(s.pend_next < s.pend_end, _start_pending, prefill, s)

    def fill(s: SlotState) -> SlotState:
        return jax.lax.while_loop(refill_due, refill, s)

    def free_slots(n: int) -> Slots:
        return Slots(
            cache=kv_cache.init_kv_cache(model_config, n, P + N - 1, cache_dtype),
            row_S=jnp.zeros((n,), jnp.int32),
            step_S=jnp.ones((n,), jnp.int32),
            last_S=jnp.full((n,), pad_id, jnp.int32),
            position_S=jnp.zeros((n,), jnp.int32),
            live_S=jnp.zeros((n,), bool),
            keys_S=jax.random.split(jax.random.key(0), n),
            cap_S=jnp.full((n,), N, jnp.int32),
            greedy_S=None if greedy_B is None else jnp.zeros((n,), bool),
        )

    zero = jnp.array(0, jnp.int32)
    state = SlotState(
        slots=free_slots(S),
        pending=free_slots(R),
        pend_next=zero,
        pend_end=zero,
        next_row=zero,
        length_R=jnp.zeros((B,), jnp.int32),
        done_R=jnp.zeros((B,), bool),
        tokens_RT=jnp.full((B, N), pad_id, jnp.int32),
        logprobs_RT=jnp.zeros((B, N), jnp.float32),
        slot_steps=zero,
    )

    def more_live_than(floor: int, s: SlotState) -> jax.Array:
        return jnp.sum(s.slots.live_S) > floor

    state = jax.lax.while_loop(waiting, lambda s: fill(step(s)), fill(state))
    # The queue is empty: the last rows drain, compacted into halving levels.
    sizes = decode.levels(S, sharding is None and N > decode.MIN_COMPACT_ROWS, drain_floor())
    for level, size in enumerate(sizes):
        if level:
            order = jnp.argsort(~state.slots.live_S, stable=True)[:size]  # live ones first
            state = state.replace(slots=state.slots.take(order))
        floor = sizes[level + 1] if level + 1 < len(sizes) else 0
        state = jax.lax.while_loop(functools.partial(more_live_than, floor), step, state)
    return SlotOutput(
        tokens_RT=state.tokens_RT,
        logprobs_RT=state.logprobs_RT,
        length_R=state.length_R,
        done_R=state.done_R,
        slot_steps=state.slot_steps,
    )


def _prefill_pending(
    params: Any,
    queue: Queue,
    s: SlotState,
    *,
    group: int,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    stop_ids_S: jax.Array,
    cache_dtype: Any,
    sharding: parallel.ActivationSharding | None,
) -> SlotState:
    """Prefills the next R queued rows (R: the pending block's size; fewer if fewer are left)
    into the pending block and samples their first tokens. The queue advances by whole
    blocks of whole groups, so each group's prompt is prefilled once for its `group` rows."""
    prompt_BP, prompt_mask_BP = queue.prompt_BP, queue.prompt_mask_BP
    B = prompt_BP.shape[0]
    R = s.pending.row_S.shape[0]
    q_J = s.next_row + jnp.arange(R, dtype=jnp.int32)
    valid_J = q_J < queue.num_queued
    row_J = queue.order_Q[jnp.minimum(q_J, B - 1)]
    cache = kv_cache.init_kv_cache(model_config, R // group, s.slots.cache.max_len, cache_dtype)
    keys_J = queue.row_keys_B[row_J]
    greedy_J = None if queue.greedy_B is None else queue.greedy_B[row_J]
    tok_J, lp_J, cache = decode.prefill_first_tokens(
        params,
        model_config,
        prompt_BP[row_J[::group]],
        prompt_mask_BP[row_J[::group]],
        cache,
        keys_J,
        sampling,
        greedy_J,
        sharding,
    )
    stop_J = decode.is_stop(tok_J, stop_ids_S)
    cap_J = queue.caps_B[row_J]
    out_J = jnp.where(valid_J, row_J, B)  # B: past the queue, dropped
    pending = Slots(
        cache=cache,
        row_S=row_J,
        step_S=jnp.ones((R,), jnp.int32),
        last_S=tok_J,
        position_S=jnp.sum(prompt_mask_BP[row_J], axis=1, dtype=jnp.int32),
        live_S=~stop_J & (cap_J > 1),
        keys_S=keys_J,
        cap_S=cap_J,
        greedy_S=greedy_J,
    )
    num = jnp.sum(valid_J, dtype=jnp.int32)
    return s.replace(
        pending=pending,
        pend_next=jnp.array(0, jnp.int32),
        pend_end=num,
        next_row=s.next_row + num,
        length_R=s.length_R.at[out_J].set(1, mode="drop"),
        done_R=s.done_R.at[out_J].set(stop_J, mode="drop"),
        tokens_RT=s.tokens_RT.at[out_J, 0].set(tok_J, mode="drop"),
        logprobs_RT=s.logprobs_RT.at[out_J, 0].set(lp_J, mode="drop"),
    )


def _start_pending(s: SlotState) -> SlotState:
    """Moves waiting pending rows into the free slots (as many as both allow). A row that
    ended with its first token leaves its slot free for the next one."""
    S, R = s.slots.live_S.shape[0], s.pending.row_S.shape[0]
    n = min(S, R)
    free = S - jnp.sum(s.slots.live_S, dtype=jnp.int32)
    k = jnp.minimum(free, s.pend_end - s.pend_next)
    j = jnp.arange(n, dtype=jnp.int32)
    slot_J = jnp.argsort(s.slots.live_S, stable=True)[:n]  # free slots first
    rows = s.pending.take(jnp.minimum(s.pend_next + j, R - 1))
    return s.replace(
        slots=s.slots.put(jnp.where(j < k, slot_J, S), rows), pend_next=s.pend_next + k
    )


def _decode_slots(
    params: Any,
    s: SlotState,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    stop_ids_S: jax.Array,
    prompt_len: int,
    sharding: parallel.ActivationSharding | None,
) -> SlotState:
    """One token for every slot; free slots compute too (their results are dropped)."""
    B = s.length_R.shape[0]
    x = s.slots
    live_S = x.live_S
    write_S = jnp.minimum(prompt_len + x.step_S - 1, x.cache.max_len - 1)
    logits_SV, cache = slot_decode_step(
        params, model_config, x.last_S, x.position_S, write_S, x.cache, sharding
    )
    keys_S = jax.vmap(jax.random.fold_in)(x.keys_S, x.step_S.astype(jnp.uint32))
    tok_S, lp_S = strategies.sample(logits_SV, keys_S, sampling, x.greedy_S)
    out_S = jnp.where(live_S, x.row_S, B)  # B: a free slot, dropped
    stop_S = decode.is_stop(tok_S, stop_ids_S)
    step_S = x.step_S + live_S.astype(jnp.int32)
    return s.replace(
        slots=x.replace(
            cache=cache,
            step_S=step_S,
            last_S=tok_S,
            position_S=x.position_S + 1,
            live_S=live_S & ~stop_S & (step_S < x.cap_S),
        ),
        length_R=s.length_R.at[out_S].add(1, mode="drop"),
        done_R=s.done_R.at[out_S].set(stop_S, mode="drop"),
        tokens_RT=s.tokens_RT.at[out_S, x.step_S].set(tok_S, mode="drop"),
        logprobs_RT=s.logprobs_RT.at[out_S, x.step_S].set(lp_S, mode="drop"),
        slot_steps=s.slot_steps + live_S.shape[0],
    )
