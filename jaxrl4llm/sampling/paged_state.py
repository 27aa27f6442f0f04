"""The paged engine's state (sampling/paged.py): the decoding rows with their page tables, the
pending prefilled groups, the counts it reports, and its page bookkeeping: which rows need a
page, preemption of the latest group when they do not fit, allocation, and the admission
test, and admission's writes (a group's prompt into the pool, its rows into the decode
rows)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.models import kv_cache
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import continuous, decode
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling.page_pool import PagePool

# Admission reserves this share of the pages the live rows would fill up to their caps
# (SGLang's "new token ratio"): optimistic at first, since most RL completions stop well
# before the cap; each preemption raises it by GROWTH_STEP, up to 1 (every row's cap reserved,
# no preemption possible), so a length mix that runs to its caps stops thrashing.
GROWTH_START = 0.3
GROWTH_STEP = 0.2


class PagedStats(flax.struct.PyTreeNode):
    """What the engine did, summed over its decode steps (int32 scalars)."""

    steps: jax.Array  # decode steps
    live_rows: jax.Array  # rows that decoded a token, summed over steps
    pages_in_use: jax.Array  # pages held, summed over steps
    decoded: jax.Array  # tokens decoded, recomputed ones included
    preemptions: jax.Array  # groups preempted
    pages_left: jax.Array  # pages still held when the loop ended (0: every page came back)


class DecodeRows(flax.struct.PyTreeNode):
    """The rows decoding (_S: `max_rows` decode rows; a free one has live_S False)."""

    table_SM: jax.Array  # the row's pages in logical order, SCRATCH past them
    row_S: jax.Array  # the bucket row it decodes
    step_S: jax.Array  # the row's index of the completion token produced next
    last_S: jax.Array  # the token produced at step - 1 (fed in this step)
    position_S: jax.Array  # its position = its logical cache slot
    live_S: jax.Array
    keys_S: jax.Array
    cap_S: jax.Array
    admit_S: jax.Array  # admission number of the row's group (preemption takes the latest)
    greedy_S: jax.Array | None = None

    def take(self, index: jax.Array) -> "DecodeRows":
        return jax.tree.map(lambda x: jnp.take(x, index, axis=0), self)

    def current_page(self, page_size: int, scratch: int) -> tuple[jax.Array, jax.Array]:
        """(the table slot of each row's next token, the page there; `scratch` if none yet)."""
        slot_S = jnp.minimum(self.position_S // page_size, self.table_SM.shape[1] - 1)
        return slot_S, self.table_SM[jnp.arange(slot_S.shape[0]), slot_S]

    def put(self, index: jax.Array, values: "DecodeRows") -> "DecodeRows":
        return jax.tree.map(lambda x, v: x.at[index].set(v, mode="drop"), self, values)


class Pending(flax.struct.PyTreeNode):
    """Prefilled groups waiting for admission (_J: `refill_groups` of them, _JG their rows)."""

    cache: kv_cache.KVCache  # [J, ...]: each group's prompt, left-padded as prefilled
    group_J: jax.Array
    prompt_len_J: jax.Array
    first_JG: jax.Array  # each row's first completion token
    live_JG: jax.Array  # rows that go on decoding after it
    cap_JG: jax.Array  # each row's token limit


class PagedState(flax.struct.PyTreeNode):
    pool: PagePool
    rows: DecodeRows
    pending: Pending
    pend_next: jax.Array
    pend_end: jax.Array
    next_group: jax.Array  # queue index of the next group to prefill
    retry_Q: jax.Array  # preempted groups, a stack (the last pushed is readmitted first)
    retry_len: jax.Array
    admitted: jax.Array  # groups admitted so far (admission numbers)
    growth: jax.Array  # float32: the share of their remaining tokens admission reserves
    length_R: jax.Array
    done_R: jax.Array
    tokens_RT: jax.Array
    logprobs_RT: jax.Array
    slot_steps: jax.Array
    stats: PagedStats
    # Routing record (record_routing): as decode.LoopState's, the prompt's experts written
    # at prefill, completion column t when a live row feeds token t.
    prompt_experts_RPLK: jax.Array | None = None
    experts_RTLK: jax.Array | None = None


class PagedOutput(flax.struct.PyTreeNode):
    """The rows' completions (caller's order), the decode work, the engine's stats and the
    routing record (None unless recorded)."""

    tokens_RT: jax.Array
    logprobs_RT: jax.Array
    length_R: jax.Array
    done_R: jax.Array
    slot_steps: jax.Array
    stats: PagedStats
    prompt_experts_RPLK: jax.Array | None = None
    experts_RTLK: jax.Array | None = None


def output(s: PagedState) -> PagedOutput:
    """The finished loop's outputs (pages_left: the pages still held)."""
    return PagedOutput(
        tokens_RT=s.tokens_RT,
        logprobs_RT=s.logprobs_RT,
        length_R=s.length_R,
        done_R=s.done_R,
        slot_steps=s.slot_steps,
        stats=s.stats.replace(pages_left=s.pool.num_pages - s.pool.num_free()),
        prompt_experts_RPLK=s.prompt_experts_RPLK,
        experts_RTLK=s.experts_RTLK,
    )


def initial_state(
    queue: continuous.Queue,
    pool: PagePool,
    pending_cache: kv_cache.KVCache,
    S: int,
    G: int,
    max_new_tokens: int,
    pad_id: jax.Array,
    record: tuple[int, int, int] | None,
) -> PagedState:
    """`S` free decode rows, an empty pending block of `pending_cache`'s groups of G rows,
    every group queued, empty outputs; with `record` (MoE layers, experts per token,
    experts) an empty routing record."""
    B, P = queue.prompt_BP.shape
    N = max_new_tokens
    M = pages_lib.pages_for(P + N, pool.page_size)
    J = pending_cache.k_BKHS[0].shape[0]
    zero = jnp.array(0, jnp.int32)
    rows = DecodeRows(
        table_SM=jnp.full((S, M), pool.num_pages, jnp.int32),
        row_S=jnp.zeros((S,), jnp.int32),
        step_S=jnp.ones((S,), jnp.int32),
        last_S=jnp.full((S,), pad_id, jnp.int32),
        position_S=jnp.zeros((S,), jnp.int32),
        live_S=jnp.zeros((S,), bool),
        keys_S=jax.random.split(jax.random.key(0), S),
        cap_S=jnp.full((S,), N, jnp.int32),
        admit_S=jnp.zeros((S,), jnp.int32),
        greedy_S=None if queue.greedy_B is None else jnp.zeros((S,), bool),
    )
    pending = Pending(
        cache=pending_cache,
        group_J=jnp.zeros((J,), jnp.int32),
        prompt_len_J=jnp.zeros((J,), jnp.int32),
        first_JG=jnp.zeros((J, G), jnp.int32),
        live_JG=jnp.zeros((J, G), bool),
        cap_JG=jnp.zeros((J, G), jnp.int32),
    )
    return PagedState(
        pool=pool,
        rows=rows,
        pending=pending,
        pend_next=zero,
        pend_end=zero,
        next_group=zero,
        retry_Q=jnp.zeros((B // G,), jnp.int32),
        retry_len=zero,
        admitted=zero,
        growth=jnp.array(GROWTH_START, jnp.float32),
        length_R=jnp.zeros((B,), jnp.int32),
        done_R=jnp.zeros((B,), bool),
        tokens_RT=jnp.full((B, N), pad_id, jnp.int32),
        logprobs_RT=jnp.zeros((B, N), jnp.float32),
        slot_steps=zero,
        stats=PagedStats(zero, zero, zero, zero, zero, zero),
        **({} if record is None else empty_record(B, P, N, *record)),
    )


def empty_record(B: int, P: int, N: int, L: int, K: int, E: int) -> dict[str, jax.Array]:
    """A routing record of B rows, all zeros: P prompt and N completion columns of L MoE
    layers' K experts (ids of E experts, in decode.expert_id_dtype)."""
    dtype = decode.expert_id_dtype(E)
    return dict(
        prompt_experts_RPLK=jnp.zeros((B, P, L, K), dtype),
        experts_RTLK=jnp.zeros((B, N, L, K), dtype),
    )


def record_prompts(s: PagedState, experts_JPLK: jax.Array | None, row_JG: jax.Array) -> PagedState:
    """The record with each prefilled group's prompt experts at its G rows (row_JG; rows past
    the batch dropped). A readmitted group writes the same values again."""
    if s.prompt_experts_RPLK is None:
        return s
    assert experts_JPLK is not None  # recorded only for a mixture of experts
    G = row_JG.shape[1]
    experts_RPLK = s.prompt_experts_RPLK.at[row_JG.reshape(-1)].set(
        jnp.repeat(experts_JPLK, G, axis=0), mode="drop"
    )
    return s.replace(prompt_experts_RPLK=experts_RPLK)


def record_fed(
    s: PagedState, experts_SLK: jax.Array | None, out_S: jax.Array, step_S: jax.Array
) -> PagedState:
    """The record with each live row's fed token's experts at (its row out_S, column
    step_S - 1: the fed token is completion token step - 1, as in decode.py); rows out_S
    past the batch (not live) dropped. A recomputed row writes the same values again."""
    if s.experts_RTLK is None:
        return s
    assert experts_SLK is not None  # recorded only for a mixture of experts
    experts_RTLK = s.experts_RTLK.at[out_S, step_S - 1].set(experts_SLK, mode="drop")
    return s.replace(experts_RTLK=experts_RTLK)


def count(stats: PagedStats, live_S: jax.Array, pages_in_use: jax.Array) -> PagedStats:
    """`stats` with one more decode step (none when no row is live: nothing decoded)."""
    n = jnp.sum(live_S, dtype=jnp.int32)
    return stats.replace(
        steps=stats.steps + (n > 0),
        live_rows=stats.live_rows + n,
        pages_in_use=stats.pages_in_use + jnp.where(n > 0, pages_in_use, 0),
        decoded=stats.decoded + n,
    )


def finished(s: PagedState, caps_B: jax.Array, row: jax.Array) -> jax.Array:
    """Rows that already ended (a preempted group's finished rows)."""
    return s.done_R[row] | (s.length_R[row] >= caps_B[row])


def fits(s: PagedState, group: int) -> jax.Array:
    """The next pending group fits: free decode rows for its live rows, and free pages for
    its prompt, a page per live row, and `growth` times the pages every live row (its own
    included) would still fill up to its cap."""
    j, ps = s.pend_next, s.pool.page_size
    live_G = s.pending.live_JG[j]
    n = jnp.sum(live_G, dtype=jnp.int32)
    full = s.pending.prompt_len_J[j] // ps
    x = s.rows
    rest_S = jnp.where(x.live_S, pages_lib.pages_for(x.cap_S - x.step_S, ps) + 1, 0)
    rest_G = jnp.where(live_G, pages_lib.pages_for(s.pending.cap_JG[j] - 1, ps), 0)
    rest = jnp.sum(rest_S) + jnp.sum(rest_G)
    reserve = jnp.ceil(s.growth * rest.astype(jnp.float32)).astype(jnp.int32)
    rows_ok = x.live_S.shape[0] - jnp.sum(x.live_S, dtype=jnp.int32) >= n
    pages_ok = s.pool.num_free() >= jnp.where(n > 0, full + n + reserve, 0)
    # A group alone always fits (check_pool): with no live row it is admitted whatever the
    # reserve says, so the loop never stalls.
    return rows_ok & (pages_ok | ~jnp.any(x.live_S))


def needs_page(s: PagedState) -> jax.Array:
    """Live rows whose next token starts a page they do not hold yet."""
    _, page_S = s.rows.current_page(s.pool.page_size, s.pool.num_pages)
    return s.rows.live_S & (page_S == s.pool.num_pages)


def release_rows(pool: PagePool, rows: DecodeRows, gone_S: jax.Array) -> tuple:
    """(the pool without the references of rows gone_S, the rows with their tables emptied)."""
    return (
        pool.replace(refs_N=pages_lib.release(pool.refs_N, rows.table_SM, gone_S)),
        rows.replace(table_SM=jnp.where(gone_S[:, None], pool.num_pages, rows.table_SM)),
    )


def short_of_pages(s: PagedState) -> jax.Array:
    return jnp.sum(needs_page(s), dtype=jnp.int32) > s.pool.num_free()


def preempt_latest(s: PagedState) -> PagedState:
    """Stops the live rows of the most recently admitted group, returns their pages and
    pushes the group back at the head of the queue."""
    x = s.rows
    latest = jnp.max(jnp.where(x.live_S, x.admit_S, -1))
    victims_S = x.live_S & (x.admit_S == latest)
    group = jnp.max(jnp.where(victims_S, x.row_S, -1)) // _group_size(s)
    pool, x = release_rows(s.pool, x, victims_S)
    return s.replace(
        pool=pool,
        rows=x.replace(live_S=x.live_S & ~victims_S),
        retry_Q=s.retry_Q.at[s.retry_len].set(group),
        retry_len=s.retry_len + 1,
        growth=jnp.minimum(s.growth + GROWTH_STEP, 1.0),
        stats=s.stats.replace(preemptions=s.stats.preemptions + 1),
    )


def _group_size(s: PagedState) -> int:
    return s.pending.live_JG.shape[1]


def allocate(s: PagedState) -> PagedState:
    """A free page for every live row whose next token starts a new page (they fit)."""
    x = s.rows
    need_S = needs_page(s)
    new_S, refs_N = pages_lib.take_free(s.pool.refs_N, need_S)
    slot_S, current = x.current_page(s.pool.page_size, s.pool.num_pages)
    rows_S = jnp.arange(need_S.shape[0])
    table_SM = x.table_SM.at[rows_S, slot_S].set(jnp.where(need_S, new_S, current))
    return s.replace(pool=s.pool.replace(refs_N=refs_N), rows=x.replace(table_SM=table_SM))


def write_prompt(
    pool: PagePool,
    cache: kv_cache.KVCache,
    j: jax.Array,
    pad: jax.Array,
    shared_M: jax.Array,
    private_G: jax.Array,
    full: jax.Array,
) -> PagePool:
    """Pending group j's prompt (left-padded by `pad` in its dense cache) into the pool: its
    logical slots from 0, full pages at shared_M, the partial last page at each private_G."""
    ps = pool.page_size
    Mp = shared_M.shape[0]
    slot = jnp.minimum(pad + jnp.arange(Mp * ps), cache.max_len - 1)
    ks, vs = [], []
    for k_pages, v_pages, k_BKHS, v_BKSH in zip(
        pool.k_pages, pool.v_pages, cache.k_BKHS, cache.v_BKSH
    ):
        k_KMPH = k_BKHS[j][:, :, slot].transpose(0, 2, 1).reshape(-1, Mp, ps, k_BKHS.shape[2])
        v_KMPH = v_BKSH[j][:, slot].reshape(-1, Mp, ps, v_BKSH.shape[3])
        ks.append(_scatter_prompt(k_pages, k_KMPH, shared_M, private_G, full))
        vs.append(_scatter_prompt(v_pages, v_KMPH, shared_M, private_G, full))
    return pool.replace(k_pages=tuple(ks), v_pages=tuple(vs))


def _scatter_prompt(
    pages_KNPH: jax.Array,
    prompt_KMPH: jax.Array,
    shared_M: jax.Array,
    private_G: jax.Array,
    full: jax.Array,
) -> jax.Array:
    prompt_KMPH = prompt_KMPH.astype(pages_KNPH.dtype)
    pages_KNPH = pages_lib.write_pages(pages_KNPH, shared_M, prompt_KMPH)
    tail_KPH = jax.lax.dynamic_index_in_dim(
        prompt_KMPH, jnp.minimum(full, prompt_KMPH.shape[1] - 1), 1, False
    )
    tail_KGPH = jnp.broadcast_to(
        tail_KPH[:, None], (tail_KPH.shape[0], private_G.shape[0], *tail_KPH.shape[1:])
    )
    return pages_lib.write_pages(pages_KNPH, private_G, tail_KGPH)


def place_rows(
    s: PagedState,
    queue: continuous.Queue,
    pending: Pending,
    j: jax.Array,
    shared_M: jax.Array,
    private_G: jax.Array,
    full: jax.Array,
) -> DecodeRows:
    """The decode rows with pending group j's live rows in the first free ones."""
    G = private_G.shape[0]
    S, M = s.rows.table_SM.shape
    Np = s.pool.num_pages
    live_G = pending.live_JG[j]
    row_G = pending.group_J[j] * G + jnp.arange(G, dtype=jnp.int32)
    m = jnp.arange(M)
    shared = jnp.where(m < shared_M.shape[0], shared_M[jnp.minimum(m, shared_M.shape[0] - 1)], Np)
    table_GM = jnp.where(m[None, :] == full, private_G[:, None], shared[None, :])
    free_S = jnp.argsort(s.rows.live_S, stable=True)  # free decode rows first
    rank_G = jnp.cumsum(live_G) - 1
    dest_G = jnp.where(live_G, free_S[jnp.minimum(rank_G, S - 1)], S)
    new = DecodeRows(
        table_SM=table_GM,
        row_S=row_G,
        step_S=jnp.ones((G,), jnp.int32),
        last_S=pending.first_JG[j],
        position_S=jnp.broadcast_to(pending.prompt_len_J[j], (G,)),
        live_S=live_G,
        keys_S=queue.row_keys_B[row_G],
        cap_S=queue.caps_B[row_G],
        admit_S=jnp.broadcast_to(s.admitted, (G,)),
        greedy_S=None if queue.greedy_B is None else queue.greedy_B[row_G],
    )
    return s.rows.put(dest_G, new)


def split_heads(s: PagedState, sharding: parallel.ActivationSharding | None) -> PagedState:
    """`s` with its keys and values split over kv heads on a mesh, as the model's heads
    (left to the partitioner, a pool it did not split would sit whole on every device)."""
    if sharding is None:
        return s
    on = lambda x, axes: sharding.constrain(x, axes)  # noqa: E731
    pool_axes, cache = ("kv_heads", None, None, None), s.pending.cache
    pool = s.pool.replace(
        k_pages=tuple(on(x, pool_axes) for x in s.pool.k_pages),
        v_pages=tuple(on(x, pool_axes) for x in s.pool.v_pages),
    )
    cache = cache.replace(
        k_BKHS=tuple(on(x, kv_cache.K_CACHE_LOGICAL_AXES) for x in cache.k_BKHS),
        v_BKSH=tuple(on(x, kv_cache.V_CACHE_LOGICAL_AXES) for x in cache.v_BKSH),
    )
    return s.replace(pool=pool, pending=s.pending.replace(cache=cache))


def record_shape(model_config: ModelConfig) -> tuple[int, int, int] | None:
    """(MoE layers, experts per token, experts) of the routing record; None: dense."""
    if not model_config.moe_layers:
        return None
    moe = model_config.moe
    return len(model_config.moe_layers), moe.experts_per_token, moe.num_experts


def more_work(num_groups: jax.Array, s: PagedState) -> jax.Array:
    """The engine's loop goes on: a group waits (queued, preempted or pending) or a row is
    live."""
    waiting = (s.next_group < num_groups) | (s.retry_len > 0) | (s.pend_next < s.pend_end)
    return waiting | jnp.any(s.rows.live_S)
