"""The paged engine (paged.py) driven from the host in segments: the same loop body (admit
the queued groups that fit, decode one step), stopped every `max_steps` decode steps so the
host can read which groups finished and queue more; the queue is an argument the host
rewrites between segments. These are the run's compiled programs (`segment_program` is the
one the planner lowers); paged_driver.py is its host side (slots, segments, reading
finished groups back), on which sampling/admission.py runs DAPO's dynamic sampling.

The run is D batch shards' (1 without a mesh; on a mesh splitting the batch, one per batch
shard, as paged_mesh.py: its own queue, pool and decode rows, under jax.shard_map over the
batch axes with no collective between shards in its loop, its heads and pool split over
tensor where the mesh has it): every array of the queue and of the state has a first axis
of D, split over the batch axes (state_shardings); `enqueue` and `widen` act on each shard's
part (jax.vmap), `segment` runs each shard's loop on its own devices.

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
and the pool grows where the wider prompt needs more pages (page_pool.pool_pages, as a call of
the one-program engine with prompts that wide would have).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl4llm import parallel
from jaxrl4llm.models import kv_cache
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.program import Program
from jaxrl4llm.sampling import continuous, decode, paged, paged_mesh, paged_state
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling.paged_state import PagedState
from jaxrl4llm.sampling.strategies import SamplingConfig

# Decode steps per segment: how late the host may learn that a group finished (one small
# device-to-host read per segment).
SEGMENT_STEPS = 32


def shard_layout(groups: int, group: int, shards: int, own: int, max_rows: int) -> tuple[int, int]:
    """(slots, decode rows) of each batch shard of a run of `groups` groups of `group` rows
    over the `own` shards of the mesh's `shards` that this host fills (all on one host):
    whole groups, as many in each shard; at most `max_rows` of every host's rows decoding
    at once (0: all), whole groups, a group at least."""
    slots = -(-groups // own)
    local_max = paged.shard_decode_rows(max_rows, shards, group)
    return slots, paged.decode_rows(local_max, slots * group, group)


def run_shardings(tree: Any, mesh: Mesh, rules: parallel.LogicalRules) -> Any:
    """Where a run's queue and state live (`tree`: either, or a (queue, state) pair): every
    array's first axis (the shards) over the batch axes, a state's as state_shardings."""
    if isinstance(tree, tuple):
        return tuple(run_shardings(part, mesh, rules) for part in tree)
    if isinstance(tree, PagedState):
        return paged_mesh.state_shardings(tree, mesh, rules)
    batch = NamedSharding(mesh, P(paged_mesh.batch_axes(mesh, rules)))
    return jax.tree.map(lambda _: batch, tree)


@functools.partial(jax.jit, static_argnums=1, donate_argnums=0)
def lay_out(tree: Any, shardings: Any) -> Any:
    """`tree` laid out by `shardings` in a program, not by jax.device_put, which keeps an
    array whose sharding is equivalent but spelled otherwise (one the compiler chose for
    enqueue's outputs): a segment program called on each spelling would compile again. The
    program's output shardings are the one layout every segment takes; `tree` is donated
    (nothing copied)."""
    return jax.lax.with_sharding_constraint(tree, shardings)


def segment_program(
    sampling: SamplingConfig,
    mesh: Mesh | None,
    rules: parallel.LogicalRules,
    **run: Any,
) -> Program:
    """The run's `segment` (Program "segment") with its settings bound (`run`: RUN's, as
    paged_driver.Driver and the planner pass them); called as

        program(weights, queue, state, stop_ids_S, pad_id)"""
    static = dict(sampling=sampling, max_steps=SEGMENT_STEPS, mesh=mesh, rules=rules)
    return Program("segment", segment, {**static, **run})


def empty_queue(
    shards: int,
    slots: int,
    group: int,
    width: int,
    max_groups: int,
    max_new_tokens: int,
    key: jax.Array,
) -> continuous.Queue:
    """The queues of `shards` batch shards, stacked on a first axis: `slots` empty groups of
    prompts `width` wide each, room in each order for `max_groups` groups, nothing queued
    (order entries past the queued ones name row R, past a shard's rows)."""
    R, D = slots * group, shards
    return continuous.Queue(
        order_Q=jnp.full((D, max_groups * group), R, jnp.int32),  # R: nothing queued there
        num_queued=jnp.zeros((D,), jnp.int32),
        prompt_BP=jnp.zeros((D, R, width), jnp.int32),
        prompt_mask_BP=jnp.zeros((D, R, width), bool),
        row_keys_B=jax.random.split(key, (D, R)),
        caps_B=jnp.full((D, R), max_new_tokens, jnp.int32),
    )


RUN = ("model_config", "max_new_tokens", "decode_rows", "group", "record_routing")


@functools.partial(jax.jit, static_argnames=(*RUN, "num_pages", "cache_dtype"))
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
    cache_dtype: Any = None,
) -> PagedState:
    """Each shard's empty run over its queue (stacked as `queue`): a pool of `num_pages` free
    pages, `decode_rows` free decode rows, nothing admitted (`params`: decode_weights's);
    with `record_routing` (a mixture of experts) an empty routing record. `cache_dtype`: the
    pool's (default: decode.cache_dtype_for the weights; a planner on CPU passes the planned
    accelerator's)."""
    dtype = cache_dtype or decode.cache_dtype_for(params)
    record = paged_state.record_shape(model_config) if record_routing else None

    def one(queue: continuous.Queue) -> PagedState:
        pool = pages_lib.init_pool(model_config, num_pages, paged.PAGE_SIZE, dtype)
        pending = kv_cache.init_kv_cache(
            model_config, paged.refill_groups(decode_rows, group), queue.prompt_BP.shape[1], dtype
        )
        return paged_state.initial_state(
            queue, pool, pending, decode_rows, group, max_new_tokens, pad_id, record
        )

    return jax.vmap(one)(queue)


@functools.partial(
    jax.jit,
    static_argnames=(*RUN, "sampling", "attention", "max_steps", "mesh", "rules"),
    donate_argnums=2,
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
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
) -> PagedState:
    """Up to `max_steps` steps of each shard's engine loop (fewer when nothing is left to
    admit or decode): admit the queued groups that fit, decode one token per live row. On a
    mesh each batch shard runs its own, as paged_mesh.py (an expert group's in lockstep:
    paged_lockstep.py), its heads split over tensor where the mesh has it."""
    del max_new_tokens  # the run's: its outputs' width
    lockstep = () if mesh is None else paged_mesh.lockstep_axes(mesh, rules, model_config)
    inner = None if mesh is None else paged_mesh.inside_shard(mesh, rules, lockstep)

    def one(params: Any, queue: Any, state: Any, stop_ids_S: jax.Array, pad_id: jax.Array) -> Any:
        queue, state = jax.tree.map(lambda x: x[0], (queue, state))  # this shard's
        engine = paged.Engine.of(
            params, queue, model_config, sampling, stop_ids_S, pad_id, decode_rows, group,
            paged_mesh.in_body(inner), attention, record_routing, lockstep,
        )  # fmt: skip

        def more(carry: tuple[jax.Array, PagedState]) -> jax.Array:
            steps, s = carry
            return (steps < max_steps) & engine.more(s)

        def body(carry: tuple[jax.Array, PagedState]) -> tuple[jax.Array, PagedState]:
            steps, s = carry
            return steps + 1, engine.iterate(s)

        start = paged_state.split_heads(state, engine.sharding)
        state = jax.lax.while_loop(more, body, (jnp.int32(0), start))[1]
        return jax.tree.map(lambda x: x[None], state)

    if mesh is None:
        return one(params, queue, state, stop_ids_S, pad_id)
    axes = paged_mesh.batch_axes(mesh, rules)
    rows = P(axes)
    run = jax.shard_map(
        one,
        mesh=mesh,
        in_specs=(paged_mesh.weight_specs(params, model_config, mesh, rules), rows, rows, P(), P()),
        out_specs=rows,
        axis_names=paged_mesh.manual_axes(mesh, rules),
        check_vma=False,
    )
    out = run(params, queue, state, stop_ids_S, pad_id)
    return jax.lax.with_sharding_constraint(out, paged_mesh.state_shardings(out, mesh, rules))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def enqueue(
    queue: continuous.Queue,
    state: PagedState,
    rows_DK: jax.Array,
    prompt_DKP: jax.Array,
    mask_DKP: jax.Array,
    key_data_DK: jax.Array,
    order_DQ: jax.Array,
    pad_id: jax.Array,
) -> tuple[continuous.Queue, PagedState]:
    """Each shard's `_enqueue_one` (the arguments stacked over the shards, the keys as their
    data (jax.random.key_data), pad_id shared)."""
    one = functools.partial(_enqueue_one, pad_id=pad_id)
    keys_DK = jax.random.wrap_key_data(key_data_DK)
    return jax.vmap(one)(queue, state, rows_DK, prompt_DKP, mask_DKP, keys_DK, order_DQ)


def _enqueue_one(
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
    """Each shard's `_widen_one` (stacked over the shards)."""
    one = functools.partial(
        _widen_one, pad_id=pad_id, width=width, max_new_tokens=max_new_tokens, num_pages=num_pages
    )
    return jax.vmap(one)(queue, state)


def _widen_one(
    queue: continuous.Queue, state: PagedState, pad_id: jax.Array, width: int,
    max_new_tokens: int, num_pages: int,
) -> tuple[continuous.Queue, PagedState]:  # fmt: skip
    """One shard's run with prompts `width` wide and a pool of `num_pages` pages (at least
    its own): the prompt block and the pending groups' caches padded on the left, the page
    tables on the right, new free pages put before the scratch page (module docstring)."""
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
def read_rows(state: PagedState, shard_K: jax.Array, rows_K: jax.Array) -> dict[str, jax.Array]:
    """The outputs of rows `rows_K` of shards `shard_K` (clipped to the queues' rows):
    tokens, logprobs and, with a routing record, their prompt's and completion's experts."""
    take = lambda x: x.at[shard_K, rows_K].get(mode="clip")  # noqa: E731
    out = {"tokens_GT": take(state.tokens_RT), "logprobs_GT": take(state.logprobs_RT)}
    if state.experts_RTLK is not None:
        out["prompt_experts_GPLK"] = take(state.prompt_experts_RPLK)
        out["experts_GTLK"] = take(state.experts_RTLK)
    return out
