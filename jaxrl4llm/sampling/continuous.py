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
per slot and masks attention per slot (decode.slot_decode_step). A row draws its tokens with
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
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import kv_cache
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
    return 1 if parallel.backend() == "cpu" else decode.MIN_COMPACT_ROWS


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

    def output(self) -> SlotOutput:
        return SlotOutput(
            tokens_RT=self.tokens_RT,
            logprobs_RT=self.logprobs_RT,
            length_R=self.length_R,
            done_R=self.done_R,
            slot_steps=self.slot_steps,
        )


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


@functools.partial(jax.jit, static_argnames=(*decode.STATIC_SETTINGS, "slots", "cache_dtype"))
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
    cache_dtype: Any = None,
) -> SlotOutput:
    """The compiled continuous-batching sampler over one bucket (arguments as
    sampler.generate_tokens): the active rows run through `slots` decode slots (at most B)."""
    B, P = prompt_BP.shape
    N = max_new_tokens
    S = min(slots, B)
    params, sharding, cache_dtype = decode.loop_setup(
        params, model_config, mesh, rules, cache_dtype
    )
    dp = 1 if mesh is None else parallel.data_parallel_size(mesh, rules)
    # Rows per prefill: whole groups, each device prefilling whole prompts.
    R = refill_rows(S, prompt_group * dp)
    queue = row_queue(prompt_BP, prompt_mask_BP, active_B, row_keys_B, greedy_B, row_caps_B, N)
    loop = _SlotLoop(
        params, queue, model_config, sampling, stop_ids_S, P, prompt_group, cache_dtype, sharding
    )
    free_slots = functools.partial(
        _free_slots,
        model_config=model_config,
        max_len=P + N - 1,
        cache_dtype=cache_dtype,
        pad_id=pad_id,
        cap=N,
        greedy=greedy_B is not None,
    )
    state = _start_state(free_slots(S), free_slots(R), B, N, pad_id)
    state = _run_queue(state, loop.step, loop.prefill, queue.num_queued)
    state = _drain(state, loop.step, sharding is None and N > decode.MIN_COMPACT_ROWS)
    return state.output()


def row_queue(
    prompt_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    active_B: jax.Array,
    row_keys_B: jax.Array,
    greedy_B: jax.Array | None,
    row_caps_B: jax.Array | None,
    max_new_tokens: int,
) -> Queue:
    """The queue: the active rows in the caller's order (rows without a prompt never start),
    each capped at max_new_tokens unless row_caps_B gives its own cap."""
    order_Q = jnp.argsort(~active_B, stable=True).astype(jnp.int32)
    num_queued = jnp.sum(active_B, dtype=jnp.int32)
    return Queue(
        order_Q=order_Q,
        num_queued=num_queued,
        prompt_BP=prompt_BP,
        prompt_mask_BP=prompt_mask_BP,
        row_keys_B=row_keys_B,
        caps_B=(
            jnp.full((prompt_BP.shape[0],), max_new_tokens, jnp.int32)
            if row_caps_B is None
            else row_caps_B
        ),
        greedy_B=greedy_B,
    )


def _free_slots(
    n: int,
    *,
    model_config: ModelConfig,
    max_len: int,
    cache_dtype: Any,
    pad_id: jax.Array,
    cap: int,
    greedy: bool,
) -> Slots:
    """`n` free slots, each with an empty cache row of `max_len` slots."""
    return Slots(
        cache=kv_cache.init_kv_cache(model_config, n, max_len, cache_dtype),
        row_S=jnp.zeros((n,), jnp.int32),
        step_S=jnp.ones((n,), jnp.int32),
        last_S=jnp.full((n,), pad_id, jnp.int32),
        position_S=jnp.zeros((n,), jnp.int32),
        live_S=jnp.zeros((n,), bool),
        keys_S=jax.random.split(jax.random.key(0), n),
        cap_S=jnp.full((n,), cap, jnp.int32),
        greedy_S=jnp.zeros((n,), bool) if greedy else None,
    )


def _start_state(
    slots: Slots, pending: Slots, rows: int, max_new_tokens: int, pad_id: jax.Array
) -> SlotState:
    """Free slots, an empty pending block, every row still queued and without output."""
    zero = jnp.array(0, jnp.int32)
    return SlotState(
        slots=slots,
        pending=pending,
        pend_next=zero,
        pend_end=zero,
        next_row=zero,
        length_R=jnp.zeros((rows,), jnp.int32),
        done_R=jnp.zeros((rows,), bool),
        tokens_RT=jnp.full((rows, max_new_tokens), pad_id, jnp.int32),
        logprobs_RT=jnp.zeros((rows, max_new_tokens), jnp.float32),
        slot_steps=zero,
    )


def _run_queue(
    state: SlotState,
    step: Callable[[SlotState], SlotState],
    prefill: Callable[[SlotState], SlotState],
    num_queued: jax.Array,
) -> SlotState:
    """Decodes while rows wait (in the queue or the pending block): before each decode step
    every free slot takes the next waiting row, a prefill refilling the pending block."""

    def waiting(s: SlotState) -> jax.Array:
        return (s.next_row < num_queued) | (s.pend_next < s.pend_end)

    def refill_due(s: SlotState) -> jax.Array:
        return jnp.any(~s.slots.live_S) & waiting(s)

    def refill(s: SlotState) -> SlotState:
        return jax.lax.cond(s.pend_next < s.pend_end, _start_pending, prefill, s)

    def fill(s: SlotState) -> SlotState:
        return jax.lax.while_loop(refill_due, refill, s)

    return jax.lax.while_loop(waiting, lambda s: fill(step(s)), fill(state))


def _drain(state: SlotState, step: Callable[[SlotState], SlotState], compact: bool) -> SlotState:
    """The queue is empty: the last rows drain, compacted into halving levels (`compact`)."""
    sizes = decode.levels(state.slots.live_S.shape[0], compact, drain_floor())
    for level, size in enumerate(sizes):
        if level:
            order = jnp.argsort(~state.slots.live_S, stable=True)[:size]  # live ones first
            state = state.replace(slots=state.slots.take(order))
        floor = sizes[level + 1] if level + 1 < len(sizes) else 0
        state = jax.lax.while_loop(functools.partial(_more_live_than, floor), step, state)
    return state


def _more_live_than(floor: int, s: SlotState) -> jax.Array:
    return jnp.sum(s.slots.live_S) > floor


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


@dataclasses.dataclass(frozen=True, eq=False)
class _SlotLoop:
    """The loop's two steps with what they read besides the state: the weights, the queue,
    the stop ids and the settings (`group`: rows per prompt prefill)."""

    params: Any
    queue: Queue
    model_config: ModelConfig
    sampling: SamplingConfig
    stop_ids_S: jax.Array
    prompt_len: int
    group: int
    cache_dtype: Any
    sharding: parallel.ActivationSharding | None

    def prefill(self, s: SlotState) -> SlotState:
        """Prefills the next R queued rows (R: the pending block's size; fewer if fewer are left)
        into the pending block and samples their first tokens. The queue advances by whole
        blocks of whole groups, so each group's prompt is prefilled once for its `group` rows."""
        queue, group = self.queue, self.group
        prompt_BP, prompt_mask_BP = queue.prompt_BP, queue.prompt_mask_BP
        B = prompt_BP.shape[0]
        R = s.pending.row_S.shape[0]
        q_J = s.next_row + jnp.arange(R, dtype=jnp.int32)
        valid_J = q_J < queue.num_queued
        row_J = queue.order_Q[jnp.minimum(q_J, B - 1)]
        cache = kv_cache.init_kv_cache(
            self.model_config, R // group, s.slots.cache.max_len, self.cache_dtype
        )
        keys_J = queue.row_keys_B[row_J]
        greedy_J = None if queue.greedy_B is None else queue.greedy_B[row_J]
        tok_J, lp_J, cache, _ = decode.prefill_first_tokens(
            self.params,
            self.model_config,
            prompt_BP[row_J[::group]],
            prompt_mask_BP[row_J[::group]],
            cache,
            keys_J,
            self.sampling,
            greedy_J,
            self.sharding,
        )
        stop_J = decode.is_stop(tok_J, self.stop_ids_S)
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

    def step(self, s: SlotState) -> SlotState:
        """One token for every slot; free slots compute too (their results are dropped)."""
        B = s.length_R.shape[0]
        x = s.slots
        live_S = x.live_S
        write_S = jnp.minimum(self.prompt_len + x.step_S - 1, x.cache.max_len - 1)
        logits_SV, cache = decode.slot_decode_step(
            self.params, self.model_config, x.last_S, x.position_S, write_S, x.cache, self.sharding
        )
        keys_S = jax.vmap(jax.random.fold_in)(x.keys_S, x.step_S.astype(jnp.uint32))
        tok_S, lp_S = strategies.sample(logits_SV, keys_S, self.sampling, x.greedy_S)
        out_S = jnp.where(live_S, x.row_S, B)  # B: a free slot, dropped
        stop_S = decode.is_stop(tok_S, self.stop_ids_S)
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
