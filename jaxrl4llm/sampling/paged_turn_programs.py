"""The compiled programs of a multi-turn rollout on pages (paged_turns.py runs them): the
programs of turn_programs.py with the KV in a page pool (page_pool.py) instead of a dense
cache row per row. The state is a turn_programs.TurnState whose `cache` is a `PagedKV`: the
pool, each row's page table (logical slot = RoPE position, the prompt from slot 0 with no
padding) and the rows stalled for want of a page.

  prefill   each group's prompt prefilled once (decode.prefill_first_tokens), then written
            into the pool for the admitted groups: its full pages once, shared by its rows
            (reference count per row), its last partial page copied per row
            (paged_state.write_prompt); every active row's first token;
  segment   decode steps of the live rows reading their pages (paged_step.paged_decode_step);
            a row whose next token starts a page gets a free one, or stalls (stops decoding,
            keeps its pages) when none is free; a step computes the live rows only, at the
            smallest row level holding them (paged_step.row_levels): rows parked for a
            reply cost nothing, as their KV stays in its pages (the dense engine computes
            every row);
  observe   one row's chunk (its last model token and the observation tokens) prefilled at
            its position into its pages (`_prefill_chunk`: the row's pages gathered as a
            dense one-row cache, the chunk run through transformer.hidden_states as
            turn_programs.observe does, only the chunk's slots written back, into pages
            allocated for them), then its next token (turn_programs.resume_row);
  restore   an evicted row's prompt and completion so far prefilled from slot 0 into fresh
            pages (the same chunked prefill); `release` returns a row's pages.

Decode attention is page_pool's gather reference (paged_step.paged_decode_step) on every
backend, over whole tables: the single-turn engine's Pallas kernel and table widths
(paged.py) are not used here.

The programs run on one device, or (`sharding`: paged_mesh.inside_shard) as one batch
shard's under paged_turns_mesh.py's jax.shard_map, their heads, pool and vocabulary split
over the shard's devices; the logits are gathered whole before sampling (`paged_step.whole_logits`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import parallel
from jaxrl4llm.models import kv_cache, transformer, unembedding
from jaxrl4llm.models.attention import AttentionConfig
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import decode, paged, paged_state, paged_step, strategies, turn_programs
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling.page_pool import PagePool
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turn_programs import TurnState


class PagedKV(flax.struct.PyTreeNode):
    """The KV of a paged multi-turn rollout (TurnState.cache)."""

    pool: PagePool
    table_BM: jax.Array  # each row's pages in logical order, SCRATCH (num_pages) past them
    stalled_B: jax.Array  # rows stopped at a page boundary with no free page (keep their pages)


class PromptPages(flax.struct.PyTreeNode):
    """Where prefill writes the admitted groups' prompts (`initial_pages`; _J groups)."""

    admitted_B: jax.Array  # rows given pages (the others start evicted)
    table_BM: jax.Array
    shared_JM: jax.Array  # each group's full prompt pages, SCRATCH past them / if not admitted
    private_JG: jax.Array  # each row's copy of its prompt's last partial page


def initial_pages(
    plen_B: np.ndarray,
    active_B: np.ndarray,
    group: int,
    num_pages: int,
    M: int,
    P: int,
    ps: int,
    free_F: np.ndarray | None = None,
) -> PromptPages:
    """The pages of the groups admitted at the start, lowest first while their prompts (full
    pages once, a private page per active row) fit in the free pages `free_F` (default:
    the whole pool), in their order."""
    B, N, Mp = len(plen_B), num_pages, pages_lib.pages_for(P, ps)
    free_F = np.arange(N) if free_F is None else free_F
    table_BM = np.full((B, M), N, np.int32)
    shared_JM = np.full((B // group, Mp), N, np.int32)
    private_JG = np.full((B // group, group), N, np.int32)
    admitted_B = np.zeros(B, bool)
    used = 0
    for j in range(B // group):
        rows = slice(j * group, (j + 1) * group)
        live_G, full = active_B[rows], int(plen_B[j * group]) // ps
        n = int(live_G.sum())
        if n == 0:
            continue
        if used + full + n > len(free_F):
            break
        shared_JM[j, :full] = free_F[used : used + full]
        private_JG[j, live_G] = free_F[used + full : used + full + n]
        used += full + n
        table_BM[rows, :full] = np.where(live_G[:, None], shared_JM[j, :full], N)
        table_BM[rows, full] = private_JG[j]
        admitted_B[rows] = live_G
    return PromptPages(*map(jnp.asarray, (admitted_B, table_BM, shared_JM, private_JG)))


@functools.partial(
    jax.jit,
    static_argnames=(
        "model_config",
        "sampling",
        "max_new_tokens",
        "num_pages",
        "group",
        "sharding",
    ),
)
def prefill(
    weights: Any,
    inputs: tuple[jax.Array, ...],
    greedy_B: jax.Array | None,
    stops: tuple[jax.Array, jax.Array],
    pad_id: jax.Array,
    pages: PromptPages,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    num_pages: int,
    group: int,
    sharding: parallel.ActivationSharding | None = None,
) -> TurnState:
    """The admitted groups' prompts in the pool and every active row's first token; rows not
    admitted are not live (the host restores them when pages free). `inputs`: the prompt
    block, its mask, the active rows, the row keys; `stops`: the stop ids and sequences;
    `sharding`: a batch shard's heads split over its devices (paged_turns_mesh.py)."""
    prompt_BP, prompt_mask_BP, active_B, keys_B = inputs
    B = prompt_BP.shape[0]
    pool = pages_lib.init_pool(
        model_config, num_pages, paged.PAGE_SIZE, decode.cache_dtype_for(weights)
    )
    prompts = (prompt_BP[::group], prompt_mask_BP[::group], keys_B, greedy_B)
    pool, tok_B, lp_B, _ = prompts_into_pool(
        weights, prompts, pool, pages, model_config, sampling, group, sharding
    )
    kv = PagedKV(pool, pages.table_BM, jnp.zeros((B,), bool))
    state = turn_programs.initial_state(
        kv, prompt_mask_BP, active_B, keys_B, greedy_B, pad_id, max_new_tokens
    )
    state = turn_programs._emit(state, active_B, tok_B, lp_B, *stops)
    return state.replace(live_B=state.live_B & pages.admitted_B)


def prompts_into_pool(
    weights: Any,
    prompts: tuple[Any, ...],
    pool: PagePool,
    pages: PromptPages,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    group: int,
    sharding: parallel.ActivationSharding | None,
) -> tuple[PagePool, jax.Array, jax.Array, jax.Array]:
    """J groups' prompts (`prompts`: prompt_JP, mask_JP, then their R = J * G rows' keys and
    greedy rows or None) prefilled once in a dense block of one row per group (the pool is
    the memory bound), written into `pages` (full pages shared, the last partial page copied
    per row: paged_state.write_prompt) and held by their tables; every row's first token,
    drawn with fold_in(key, 0). (the pool, the tokens, their logprobs, each prompt's length)."""
    prompt_JP, mask_JP, keys_R, greedy_R = prompts
    J, P = prompt_JP.shape
    cache = kv_cache.init_kv_cache(model_config, J, P, pool.k_pages[0].dtype)
    logits_JV, cache, _ = decode.prefill(weights, model_config, prompt_JP, mask_JP, cache, sharding)
    first_R = jax.vmap(jax.random.fold_in)(keys_R, jnp.zeros(keys_R.shape, jnp.uint32))
    logits_RV = jnp.repeat(paged_step.whole_logits(logits_JV, sharding), group, axis=0)
    tok_R, lp_R = strategies.sample(logits_RV, first_R, sampling, greedy_R)
    plen_J = jnp.sum(mask_JP, axis=1, dtype=jnp.int32)

    def write_group(j: jax.Array, pool: PagePool) -> PagePool:
        full = plen_J[j] // pool.page_size
        shared_M, private_G = pages.shared_JM[j], pages.private_JG[j]
        return paged_state.write_prompt(pool, cache, j, P - plen_J[j], shared_M, private_G, full)

    pool = jax.lax.fori_loop(0, J, write_group, pool)
    return pool.replace(refs_N=pages_lib.hold(pool.refs_N, pages.table_BM)), tok_R, lp_R, plen_J


def _allocate(kv: PagedKV, live_B: jax.Array, position_B: jax.Array) -> tuple[PagedKV, jax.Array]:
    """A free page for each live row whose token at position_B starts a page it does not
    hold (lowest rows first); rows left without one stall. (the KV, the rows still live)."""
    N, ps, B = kv.pool.num_pages, kv.pool.page_size, live_B.shape[0]
    rows, slot_B = jnp.arange(B), position_B // ps
    held_B = kv.table_BM[rows, slot_B]
    need_B = live_B & (held_B == N)
    page_B, refs_N = pages_lib.take_free(kv.pool.refs_N, need_B)
    stall_B = need_B & (page_B == N)
    kv = kv.replace(
        pool=kv.pool.replace(refs_N=refs_N),
        table_BM=kv.table_BM.at[rows, slot_B].set(jnp.where(need_B, page_B, held_B)),
        stalled_B=kv.stalled_B | stall_B,
    )
    return kv, live_B & ~stall_B


@functools.partial(
    jax.jit,
    static_argnames=(
        *("model_config", "sampling", "max_steps", "sharding", "until_turn_end", "max_rows"),
    ),
    donate_argnames=("s",),
)
def segment(
    weights: Any,
    s: TurnState,
    stops: tuple[jax.Array, jax.Array],
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    max_steps: int,
    sharding: parallel.ActivationSharding | None = None,
    until_turn_end: bool = True,
    max_rows: int = 0,
) -> TurnState:
    """Decodes the live rows (turn_programs.segment on pages) until one ends its turn (with
    `until_turn_end`), none is live (ended, parked or stalled) or `max_steps` steps ran;
    `stops`: the stop ids and each row's stop sequences; `sharding`: as prefill's. At most
    `max_rows` rows (0: every row) decode at a step, the lowest live ones: the others wait,
    keeping their pages, and the step's buffers are those of max_rows rows."""
    B = s.step_B.shape[0]
    most = min(B, max_rows or B)
    sizes = paged_step.row_levels(most, paged_step.fewest_rows(most))

    def body(carry: tuple[TurnState, jax.Array]) -> tuple[TurnState, jax.Array]:
        x, k = carry
        position_B = jnp.maximum(x.plen_B + x.step_B - 1, 0)  # of the token fed (last_B)
        run_B = x.live_B & (jnp.cumsum(x.live_B) <= most)
        kv, runs_B = _allocate(x.cache, run_B, position_B)
        # The running rows first, in row order: a step computes the smallest row level
        # holding them (parked rows, waiting for a reply, cost nothing; their KV stays in
        # its pages).
        order_J = jnp.argsort(~runs_B, stable=True)[:most]
        level = jnp.sum(jnp.sum(runs_B) <= jnp.array(sizes), dtype=jnp.int32) - 1
        branches = [
            functools.partial(_decode_first, weights, model_config, sampling, sharding, size)
            for size in sizes
        ]
        x = x.replace(cache=kv, live_B=x.live_B & (runs_B | ~run_B))  # less the stalled
        tok_J, lp_J, k_LJKH, v_LJKH = jax.lax.switch(level, branches, x, position_B, order_J)
        # The pool is written after the switch (a write inside a branch copies it); slots
        # past the live rows write to SCRATCH.
        position_J, live_J = position_B[order_J], runs_B[order_J]
        page_J = jnp.where(
            live_J, kv.table_BM[order_J, position_J // kv.pool.page_size], kv.pool.num_pages
        )
        pool = paged_step.write_new_tokens(kv.pool, page_J, position_J, k_LJKH, v_LJKH)
        x = x.replace(
            cache=kv.replace(pool=pool), slot_steps=x.slot_steps + jnp.array(sizes)[level]
        )
        tok_B, lp_B = (
            jnp.zeros((B,), tok_J.dtype).at[order_J].set(tok_J),
            jnp.zeros((B,), lp_J.dtype).at[order_J].set(lp_J),
        )
        return turn_programs._emit(x, runs_B, tok_B, lp_B, *stops), k + 1

    def cond(carry: tuple[TurnState, jax.Array]) -> jax.Array:
        if until_turn_end:
            return turn_programs.segment_continues(max_steps, carry)
        return jnp.any(carry[0].live_B) & (carry[1] < max_steps)

    s, _ = jax.lax.while_loop(cond, body, (s, jnp.array(0, jnp.int32)))
    return s


def _decode_first(
    weights: Any,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    sharding: parallel.ActivationSharding | None,
    size: int,
    x: TurnState,
    position_B: jax.Array,
    order_J: jax.Array,
) -> tuple[jax.Array, ...]:
    """One decode step of rows order_J[:size] (every live row among them): their tokens,
    logprobs and each layer's new keys and values, in slot order, zero past `size` (J: the
    segment's max_rows slots). Row r's token is drawn with fold_in(row_key[r], its step), as
    every row's."""
    B, idx_S = order_J.shape[0], order_J[:size]
    logits_SV, k_LSKH, v_LSKH, _ = paged_step.paged_decode_step(
        weights, model_config, x.last_B[idx_S], position_B[idx_S], x.cache.table_BM[idx_S],
        x.cache.pool, sharding,
    )  # fmt: skip
    keys_S = x.draw_keys(idx_S)
    greedy_S = None if x.greedy_B is None else x.greedy_B[idx_S]
    tok_S, lp_S = strategies.sample(
        paged_step.whole_logits(logits_SV, sharding), keys_S, sampling, greedy_S
    )
    pad = lambda a: jnp.pad(a, [(0, B - size)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    dtype = x.cache.pool.k_pages[0].dtype
    new_kv = jax.tree.map(lambda a: pad(a.astype(dtype)), (k_LSKH, v_LSKH))
    return pad(tok_S), pad(lp_S), *new_kv


def _grow(kv: PagedKV, row: jax.Array, slots: jax.Array) -> PagedKV:
    """Row `row` with free pages for its first `slots` logical slots where it holds none
    (the host checked that they are free)."""
    N, M = kv.pool.num_pages, kv.table_BM.shape[1]
    table_M = kv.table_BM[row]
    need_M = (jnp.arange(M) < pages_lib.pages_for(slots, kv.pool.page_size)) & (table_M == N)
    new_M, refs_N = pages_lib.take_free(kv.pool.refs_N, need_M)
    return kv.replace(
        pool=kv.pool.replace(refs_N=refs_N),
        table_BM=kv.table_BM.at[row].set(jnp.where(need_M, new_M, table_M)),
    )


def _prefill_chunk(
    weights: Any,
    kv: PagedKV,
    row: jax.Array,
    chunk_C: jax.Array,
    start: jax.Array,
    num: jax.Array,
    model_config: ModelConfig,
    sharding: parallel.ActivationSharding | None,
) -> tuple[PagedKV, jax.Array]:
    """chunk_C[:num] prefilled at logical slots [start, start + num) of row `row`, which gets
    pages for them: its pages gathered as a dense one-row cache (slots before `start`
    visible), the chunk run through hidden_states, only the chunk's slots written back.
    (the KV, the chunk's hidden states [1, C, D])."""
    kv = _grow(kv, row, start + num)
    pool, table_1M = kv.pool, kv.table_BM[row][None]
    W = table_1M.shape[1] * pool.page_size
    index_C = jnp.arange(chunk_C.shape[0], dtype=jnp.int32)
    cache_1 = kv_cache.KVCache(
        k_BKHS=tuple(pages_lib.gather_keys(k, table_1M) for k in pool.k_pages),
        v_BKSH=tuple(pages_lib.gather_values(v, table_1M) for v in pool.v_pages),
        mask_BS=(jnp.arange(W) < start)[None],
    )
    h_1CD, cache_1 = transformer.hidden_states(
        weights,
        model_config,
        chunk_C[None],
        (start + index_C)[None],
        (index_C < num)[None],
        cache_1,
        start,
        sharding=sharding,
        # The chunk's offset is traced: the kernels that need a static one do not apply.
        attention=AttentionConfig(impl="reference"),
    )
    assert cache_1 is not None  # hidden_states returns the cache it is given, updated
    slot_C = jnp.minimum(start + index_C, W - 1)
    page_C = jnp.where(index_C < num, table_1M[0, slot_C // pool.page_size], pool.num_pages)
    ks = [k[0][:, :, slot_C].transpose(2, 0, 1) for k in cache_1.k_BKHS]
    vs = [v[0][:, slot_C].transpose(1, 0, 2) for v in cache_1.v_BKSH]
    pool = paged_step.write_new_tokens(pool, page_C, slot_C, tuple(ks), tuple(vs))
    return kv.replace(pool=pool), h_1CD


@functools.partial(
    jax.jit, static_argnames=("model_config", "sampling", "sharding"), donate_argnames=("s",)
)
def observe(
    weights: Any,
    s: TurnState,
    observation: tuple[jax.Array, jax.Array, jax.Array],
    stops: tuple[jax.Array, jax.Array],
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    sharding: parallel.ActivationSharding | None = None,
) -> TurnState:
    """turn_programs.observe on pages: `observation` = (row, chunk_C, num_obs)
    (turn_programs.observe_inputs): the row's chunk (its last model token, then `num_obs`
    observation tokens) prefilled at its position into its pages, its next model token
    sampled; `stops`: the stop ids and each row's stop sequences; `sharding`: as prefill's."""
    row, chunk_C, num_obs = observation
    start = s.plen_B[row] + s.step_B[row] - 1
    kv, h_1CD = _prefill_chunk(
        weights, s.cache, row, chunk_C, start, num_obs + 1, model_config, sharding
    )
    h_11D = jax.lax.dynamic_slice_in_dim(h_1CD, num_obs, 1, axis=1)
    logits_1V = paged_step.whole_logits(
        unembedding.unembed(weights, model_config, h_11D, sharding)[:, 0], sharding
    )
    s = s.replace(cache=kv)
    return turn_programs.resume_row(s, row, chunk_C, num_obs, logits_1V, *stops, sampling)


@functools.partial(jax.jit, static_argnames=("model_config", "sharding"), donate_argnames=("s",))
def restore(
    weights: Any,
    s: TurnState,
    row: jax.Array,
    tokens_C: jax.Array,
    resume: jax.Array,
    *,
    model_config: ModelConfig,
    sharding: parallel.ActivationSharding | None = None,
) -> TurnState:
    """Evicted row `row`'s prompt and completion tokens but its last (tokens_C[: plen +
    step - 1]; the last one is fed by its next decode step) prefilled from slot 0 into fresh
    pages, with a page for its last token's slot; it decodes again if `resume`. `sharding`:
    as prefill's."""
    num = s.plen_B[row] + s.step_B[row] - 1
    kv, _ = _prefill_chunk(
        weights, s.cache, row, tokens_C, jnp.int32(0), num, model_config, sharding
    )
    return s.replace(cache=_grow(kv, row, num + 1), live_B=s.live_B.at[row].set(resume))


@functools.partial(jax.jit, donate_argnames=("s",))
def release(s: TurnState, row: jax.Array) -> TurnState:
    """Row `row` not decoding, its pages returned (an eviction, or its trajectory's end)."""
    kv = s.cache
    gone_B = jnp.arange(s.live_B.shape[0]) == row
    refs_N = pages_lib.release(kv.pool.refs_N, kv.table_BM, gone_B)
    kv = kv.replace(
        pool=kv.pool.replace(refs_N=refs_N),
        table_BM=jnp.where(gone_B[:, None], kv.pool.num_pages, kv.table_BM),
        stalled_B=kv.stalled_B & ~gone_B,
    )
    return s.replace(cache=kv, live_B=s.live_B & ~gone_B)


@functools.partial(jax.jit, donate_argnames=("s",))
def unstall(s: TurnState, rows_B: jax.Array) -> TurnState:
    """Stalled rows `rows_B` (bool) decode again (their next segment step takes the page)."""
    kv = s.cache
    return s.replace(cache=kv.replace(stalled_B=kv.stalled_B & ~rows_B), live_B=s.live_B | rows_B)
