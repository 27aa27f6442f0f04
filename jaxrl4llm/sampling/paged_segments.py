"""The paged engine (paged.py) driven from the host in segments: the same loop body (admit
the queued groups that fit, decode one step), stopped every `max_steps` decode steps so the
host can read which groups finished and queue more; the queue is an argument the host
rewrites between segments. sampling/admission.py runs DAPO's dynamic sampling on it.

The queue holds `slots` groups of G consecutive rows ([slots * G] rows: prompts, keys, outputs);
a slot whose group finished and was read back takes another group (`enqueue` writes its
prompt and key rows and clears its output rows). The admission order is order_Q, which the
host extends (order_Q[j * G] is the first row of the j-th group queued; num_queued / G groups
so far), so a run admits groups in the order they were queued, over any number of segments.

A row draws token t with fold_in(row_key, t), as in the one-program engine, so a group's rows
are the ones paged.generate_paged draws for the same prompt and keys, whatever the segment
boundaries, the slot it sits in or the groups around it.

`widen` pads a run's prompt width (a later group's prompt longer than every earlier one):
the prompt block, the pending prefilled groups and a routing record's prompt columns on the
left, the page tables on the right; pages already in the pool do not depend on the width,
and the pool grows where the wider prompt needs more pages (paged.pool_pages, as a call of
the one-program engine with prompts that wide would have).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.models import kv_cache
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import continuous, decode, paged, paged_state
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling.paged_state import PagedState
from jaxrl4llm.sampling.strategies import SamplingConfig

# Decode steps per segment: how late the host may learn that a group finished (one small
# device-to-host read per segment).
SEGMENT_STEPS = 32


@functools.partial(jax.jit, static_argnames=("model_config",))
def decode_weights(params: Any, model_config: ModelConfig) -> Any:
    """The weights laid out once for every segment's decode loop (decode.loop_params)."""
    return decode.loop_setup(params, model_config, None, parallel.DEFAULT_RULES)[0]


def empty_queue(
    slots: int, group: int, width: int, max_groups: int, max_new_tokens: int, key: jax.Array
) -> continuous.Queue:
    """A queue of `slots` empty groups of prompts `width` wide, room in its order for
    `max_groups` groups, nothing queued (order entries past the queued ones name row R, past
    the rows)."""
    R = slots * group
    return continuous.Queue(
        order_Q=jnp.full((max_groups * group,), R, jnp.int32),  # R: nothing queued there
        num_queued=jnp.int32(0),
        prompt_BP=jnp.zeros((R, width), jnp.int32),
        prompt_mask_BP=jnp.zeros((R, width), bool),
        row_keys_B=jax.random.split(key, R),
        caps_B=jnp.full((R,), max_new_tokens, jnp.int32),
    )


_RUN = ("model_config", "max_new_tokens", "decode_rows", "group", "record_routing")


@functools.partial(jax.jit, static_argnames=(*_RUN, "num_pages"))
def start(
    params: Any,
    queue: continuous.Queue,
    pad_id: jax.Array,
    *,
    num_pages: int,
    model_config: ModelConfig,
    max_new_tokens: int,
    decode_rows: int,
    group: int,
    record_routing: bool = False,
) -> PagedState:
    """An empty run over `queue`: a pool of `num_pages` free pages, `decode_rows` free decode
    rows, nothing admitted (`params`: decode_weights's); with `record_routing` (a mixture of
    experts) an empty routing record."""
    dtype = decode.cache_dtype_for(params)
    pool = pages_lib.init_pool(model_config, num_pages, paged.PAGE_SIZE, dtype)
    pending = kv_cache.init_kv_cache(
        model_config, paged.refill_groups(decode_rows, group), queue.prompt_BP.shape[1], dtype
    )
    record = paged.record_shape(model_config) if record_routing else None
    return paged_state.initial_state(
        queue, pool, pending, decode_rows, group, max_new_tokens, pad_id, record
    )


@functools.partial(
    jax.jit, static_argnames=(*_RUN, "sampling", "attention", "max_steps"), donate_argnums=2
)
def segment(
    params: Any,
    queue: continuous.Queue,
    state: PagedState,
    stop_ids_S: jax.Array,
    pad_id: jax.Array,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    decode_rows: int,
    group: int,
    record_routing: bool = False,
    attention: str = "auto",
    max_steps: int = SEGMENT_STEPS,
) -> PagedState:
    """Up to `max_steps` steps of the engine's loop (fewer when nothing is left to admit or
    decode): admit the queued groups that fit, decode one token per live row."""
    del max_new_tokens  # the run's: its outputs' width
    engine = paged.Engine.of(
        params, queue, model_config, sampling, stop_ids_S, pad_id, decode_rows, group, None,
        attention, record_routing,
    )  # fmt: skip

    def more(carry: tuple[jax.Array, PagedState]) -> jax.Array:
        steps, s = carry
        return (steps < max_steps) & paged.more_work(engine.num_groups, s)

    def body(carry: tuple[jax.Array, PagedState]) -> tuple[jax.Array, PagedState]:
        steps, s = carry
        return steps + 1, engine.admit(engine.step(s))

    return jax.lax.while_loop(more, body, (jnp.int32(0), engine.admit(state)))[1]


@functools.partial(jax.jit, donate_argnums=(0, 1))
def enqueue(
    queue: continuous.Queue,
    state: PagedState,
    rows_K: jax.Array,
    prompt_KP: jax.Array,
    mask_KP: jax.Array,
    keys_K: jax.Array,
    order_Q: jax.Array,
    pad_id: jax.Array,
) -> tuple[continuous.Queue, PagedState]:
    """Rows `rows_K` (whole slots; entries past the queue's rows are dropped) take new groups'
    prompts and keys, their outputs cleared; the queue's order becomes `order_Q` and its
    length the groups it names (num_queued rows: order_Q's entries below the rows)."""
    R = queue.prompt_BP.shape[0]
    put = lambda x, v: x.at[rows_K].set(v, mode="drop")  # noqa: E731
    queue = queue.replace(
        order_Q=order_Q,
        num_queued=jnp.sum(order_Q < R, dtype=jnp.int32),
        prompt_BP=put(queue.prompt_BP, prompt_KP),
        prompt_mask_BP=put(queue.prompt_mask_BP, mask_KP),
        row_keys_B=put(queue.row_keys_B, keys_K),
    )
    state = state.replace(
        length_R=put(state.length_R, 0),
        done_R=put(state.done_R, False),
        tokens_RT=put(state.tokens_RT, pad_id),
        logprobs_RT=put(state.logprobs_RT, 0.0),
    )
    if state.experts_RTLK is not None:  # a record of zeros, as the one-program engine's
        state = state.replace(
            prompt_experts_RPLK=put(state.prompt_experts_RPLK, 0),
            experts_RTLK=put(state.experts_RTLK, 0),
        )
    return queue, state


@functools.partial(jax.jit, static_argnames=("width", "max_new_tokens", "num_pages"))
def widen(
    queue: continuous.Queue,
    state: PagedState,
    pad_id: jax.Array,
    *,
    width: int,
    max_new_tokens: int,
    num_pages: int,
) -> tuple[continuous.Queue, PagedState]:
    """The run with prompts `width` wide and a pool of `num_pages` pages (at least its own):
    the prompt block and the pending groups' caches padded on the left, the page tables on
    the right, new free pages put before the scratch page (module docstring)."""
    extra = width - queue.prompt_BP.shape[1]
    left = lambda x, axis, value=0: jnp.pad(  # noqa: E731
        x, [(extra, 0) if a == axis else (0, 0) for a in range(x.ndim)], constant_values=value
    )
    cache = state.pending.cache
    cache = kv_cache.KVCache(
        k_BKHS=tuple(left(k, 3) for k in cache.k_BKHS),
        v_BKSH=tuple(left(v, 2) for v in cache.v_BKSH),
        mask_BS=left(cache.mask_BS, 1, False),
    )
    pool, old = state.pool, state.pool.num_pages

    def grow(pages: jax.Array) -> jax.Array:  # [K, old + 1, ...] -> [K, num_pages + 1, ...]
        new = jnp.zeros_like(pages[:, :1]).repeat(num_pages - old, 1)
        return jnp.concatenate([pages[:, :old], new, pages[:, old:]], axis=1)

    pool = pool.replace(
        k_pages=tuple(map(grow, pool.k_pages)),
        v_pages=tuple(map(grow, pool.v_pages)),
        refs_N=jnp.pad(pool.refs_N, (0, num_pages - old)),
    )
    M = pages_lib.pages_for(width + max_new_tokens, pool.page_size)
    table_SM = jnp.where(state.rows.table_SM == old, num_pages, state.rows.table_SM)
    table_SM = jnp.pad(table_SM, ((0, 0), (0, M - table_SM.shape[1])), constant_values=num_pages)
    queue = queue.replace(
        prompt_BP=left(queue.prompt_BP, 1, pad_id), prompt_mask_BP=left(queue.prompt_mask_BP, 1)
    )
    state = state.replace(
        pool=pool,
        pending=state.pending.replace(cache=cache),
        rows=state.rows.replace(table_SM=table_SM),
    )
    if state.prompt_experts_RPLK is not None:
        state = state.replace(prompt_experts_RPLK=left(state.prompt_experts_RPLK, 1))
    return queue, state


@jax.jit
def read_rows(state: PagedState, rows_K: jax.Array) -> dict[str, jax.Array]:
    """Rows `rows_K`' outputs (clipped to the queue's rows): tokens, logprobs and, with a
    routing record, their prompt's and completion's experts."""
    take = lambda x: jnp.take(x, rows_K, axis=0, mode="clip")  # noqa: E731
    out = {"tokens_GT": take(state.tokens_RT), "logprobs_GT": take(state.logprobs_RT)}
    if state.experts_RTLK is not None:
        out["prompt_experts_GPLK"] = take(state.prompt_experts_RPLK)
        out["experts_GTLK"] = take(state.experts_RTLK)
    return out
