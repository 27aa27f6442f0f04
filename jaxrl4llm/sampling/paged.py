"""The paged rollout engine: rows decode from a shared pool of KV pages (page_pool.py), and a
queued group starts as soon as its prompt's pages and a page per sample are free.

Why pages: a fixed batch (decode.py) or fixed slots (continuous.py) reserve a full-length
cache row per row, so at any memory budget they hold as many rows as full-length rows fit,
and every decode step reads the weights for that few rows. Here a row holds only the pages
its tokens fill, a group's G samples hold its prompt's full pages once, and pages come back
when a row ends: the same memory holds more rows at a time, which is what continuous batching
needs to pay for itself.

The whole rollout is one compiled program, like continuous.py's: one lax.while_loop whose
body admits waiting groups while they fit, then (1) gives every live row crossing a page
boundary a new page, (2) decodes one token for each of the `max_rows` decode rows, (3)
returns the pages of rows that ended (a step with no live row computes nothing). Groups are
prefilled `refill_groups` at a time into a dense
pending block (a prompt's KV written once, its G samples' first tokens drawn there); moving a
group into the pool writes its full prompt pages once, shared by its G rows (reference count
G), and copies the last partial prompt page into one private page per row (copy-on-write done
at admission).

Admission policy: a pending group is admitted when there are free decode rows for it and the
pool keeps, after its prompt pages and one page per sample, a reserve of `growth` times the
pages every live row (the group's included) would still fill up to its cap (SGLang's "new
token ratio"). `growth` starts optimistic (GROWTH_START: RL completions mostly stop well
before the cap) and each preemption raises it (GROWTH_STEP, up to 1: every cap reserved, no
preemption possible). Running out of pages is resolved as vLLM does, by preemption and
recompute: while the rows crossing a page boundary need more pages than are free, the most
recently admitted group is preempted (its live rows stop, their pages return) and put back at
the head of the queue; its finished rows are kept.
On readmission its prompt is prefilled again and its unfinished rows decode again from their
first token. Row r draws token t with fold_in(row_key[r], t), so the recomputed tokens are
the same: a row's samples do not depend on page layout, admission order, pool size or
preemption. A pool that holds one group at full length (check_pool) always progresses (the
oldest group is never preempted while another group runs), so the loop cannot deadlock.

The live rows are moved to the front of the decode rows (their small state only: the KV
stays in the pool, so moving a row is free, unlike compaction in decode.py and continuous.py,
which copies cache rows). Decode attention (`attention`, paged_step.uses_kernel) is, on TPU,
JAX's Pallas paged attention kernel (page_pool.pallas_attention), which reads only a row's
filled pages; elsewhere (CPU, GPU) and with a sliding window, page_pool's gather reference,
which copies each row's table prefix:

  kernel     one decode step over every decode row and whole tables (a free row reads one
             slot of SCRATCH): each layer writes the new keys and values into the pool, then
             attends, and with no switch around it the pool is written in place.
  reference  the step computes only the live rows: it runs at the smallest row level holding
             them (max_rows, then steps of about 3/4 in multiples of decode.MIN_COMPACT_ROWS:
             paged_step.row_levels), gathering the tables' first quarter when it holds their
             pages, else the whole tables (paged_step.widths): one compiled decode step per
             (rows, pages) pair, picked by lax.switch. The pool is only read inside the
             switch and the new keys and values written after it, so the switch does not
             copy the pool.

On a mesh, paged_mesh.py runs one engine per batch shard (the shards of an expert group in
lockstep: paged_lockstep.py); a mesh splitting heads splits an engine's heads, pool and
vocabulary, its logits gathered whole before sampling (`paged_step.whole_logits`).

With `record_routing` (a mixture of experts) the engine keeps the compacted sampler's routing
record: a group's prompt experts from its prefill, and each live row's fed token's experts
from the decode step, by either attention (paged_state.record_prompts, record_fed); a
preempted row's recomputation writes the same values again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import kv_cache
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import continuous, decode, paged_state, paged_step, strategies
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling import paged_lockstep as lockstep_lib
from jaxrl4llm.sampling.page_pool import PagePool
from jaxrl4llm.sampling.strategies import SamplingConfig

# Tokens per page (page_pool.PAGE_SIZE).
PAGE_SIZE = pages_lib.PAGE_SIZE


def check_pool(
    num_pages: int, prompt_len: int, max_new_tokens: int, group: int, page_size: int
) -> None:
    """Refuses a pool too small to finish a group on its own (the loop could not progress)."""
    need = pages_lib.min_pool_pages(prompt_len, max_new_tokens, group, page_size)
    if num_pages < need:
        raise FlagError(
            f"--kv_cache_tokens holds {num_pages} pages of {page_size} tokens, fewer than one "
            f"group at full length needs ({need}: a {prompt_len}-token prompt once and "
            f"{group} rows of {max_new_tokens} new tokens); use "
            f"--kv_cache_tokens={need * page_size} or more."
        )


def program_settings(
    tokens: int | None,
    max_rows: int | None,
    rows: int,
    prompt_len: int,
    N: int,
    group: int,
    attention: str = "auto",
    shards: int = 1,
) -> dict[str, Any]:
    """sampler.decode_program's settings of the paged engine for a bucket of `rows` rows of
    `prompt_len`-token prompts, `tokens` of KV (pool_pages) in each of `shards` batch shards'
    pools (paged_mesh.py), at most `max_rows` decoding at once (None / 0: every row) and
    decode attention by `attention`; {} where `tokens` is None (not paged)."""
    if tokens is None:
        return {}
    local, decode_rows = max(1, rows // shards), shard_decode_rows(max_rows, shards, group)
    pages = pages_lib.pool_pages(tokens, local, prompt_len, N, group, decode_rows)
    return {"kv_pages": pages, "max_rows": max_rows or 0, "paged_attention": attention}


def shard_decode_rows(max_rows: int | None, shards: int, group: int) -> int:
    """A batch shard's part of max_rows decoding at once (whole groups; 0: every row)."""
    return max(group, max_rows // shards) if max_rows else 0


def refill_groups(max_rows: int, group: int) -> int:
    """Groups per pending prefill: about max_rows / REFILL_FRACTION rows (continuous.py)."""
    return max(1, max_rows // (group * continuous.REFILL_FRACTION))


def decode_rows(max_rows: int, rows: int, group: int) -> int:
    """The rows of `rows` decoding at once: at most `max_rows` (0: all), whole groups of
    `group`, a group at least."""
    return max(group, min(max_rows or rows, rows) // group * group)


def loop_bounds(rows: int, max_rows: int, group: int, max_new_tokens: int) -> tuple[int, int]:
    """(decode steps, prefills) of a shard's run of `rows` rows, at most `max_rows` decoding
    at once (0: all), none preempted, at most: every row at full length, the rows in waves
    of the decode rows, the groups prefilled in blocks of refill_groups (the loop holds the
    prefill, decode.PREFILL_SCOPE, but runs it once per block: the planner counts it so)."""
    S = decode_rows(max_rows, rows, group)
    return -(-rows // S) * max_new_tokens, -(-(rows // group) // refill_groups(S, group))


STATIC = (
    *decode.STATIC_SETTINGS,
    *("max_rows", "num_pages", "page_size", "cache_dtype", "attention", "record_routing"),
    *("laid_out", "lockstep"),
)


@functools.partial(jax.jit, static_argnames=STATIC)
def generate_paged(
    params: Any,
    prompt_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    active_B: jax.Array,
    row_keys_B: jax.Array,
    stop_ids_S: jax.Array,
    pad_id: jax.Array,
    *,
    num_pages: int,
    max_rows: int,
    page_size: int = PAGE_SIZE,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    greedy_B: jax.Array | None = None,
    row_caps_B: jax.Array | None = None,
    prompt_group: int = 1,
    cache_dtype: Any = None,
    attention: str = "auto",
    record_routing: bool = False,
    laid_out: bool = False,
    lockstep: tuple[str, ...] = (),
) -> paged_state.PagedOutput:
    """The compiled paged sampler over one bucket (arguments as sampler.generate_tokens): the
    active rows decode `max_rows` at a time from a pool of `num_pages` pages of `page_size`
    tokens, groups of `prompt_group` rows admitted as pages free (module docstring); decode
    attention by `attention` (paged_step.uses_kernel). `record_routing` (a mixture of
    experts): the output holds each prompt and completion token's experts, as the compacted
    sampler records them. `laid_out`: the caller laid the weights out (decode.loop_setup);
    `lockstep`: the manual mesh axes whose devices step together (paged_lockstep.py)."""
    B, P = prompt_BP.shape
    N, G = max_new_tokens, prompt_group
    S = decode_rows(max_rows, B, G)
    check_pool(num_pages, P, N, G, page_size)
    params, sharding, cache_dtype = decode.loop_setup(
        params, model_config, mesh, rules, cache_dtype, laid_out
    )
    queue = continuous.row_queue(
        prompt_BP, prompt_mask_BP, active_B, row_keys_B, greedy_B, row_caps_B, N
    )
    record = paged_state.record_shape(model_config) if record_routing else None
    engine = Engine.of(
        params, queue, model_config, sampling, stop_ids_S, pad_id, S, G, sharding, attention,
        record is not None, lockstep,
    )  # fmt: skip
    pool = pages_lib.init_pool(model_config, num_pages, page_size, cache_dtype)
    pending = kv_cache.init_kv_cache(model_config, refill_groups(S, G), P, cache_dtype)
    start = paged_state.initial_state(queue, pool, pending, S, G, N, pad_id, record)
    state = jax.lax.while_loop(
        engine.more, engine.iterate, paged_state.split_heads(start, sharding)
    )
    return paged_state.output(state)


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
    """The loop's steps with what they read besides the state: the weights, the queue (of
    rows; groups are G consecutive rows, queued in order), the stop ids and the settings."""

    params: Any
    queue: continuous.Queue
    model_config: ModelConfig
    sampling: SamplingConfig
    stop_ids_S: jax.Array
    pad_id: jax.Array
    group: int
    sharding: parallel.ActivationSharding | None
    floor: int  # the smallest decode level (rows per decode step)
    kernel: bool  # attention by the Pallas kernel (paged_step.pallas_decode_step)
    record: bool  # keeps the routing record (a mixture of experts' record_routing)
    lockstep: tuple[str, ...]  # the mesh axes whose devices step together (paged_lockstep.py)

    @classmethod
    def of(
        cls,
        params: Any,
        queue: continuous.Queue,
        model_config: ModelConfig,
        sampling: SamplingConfig,
        stop_ids_S: jax.Array,
        pad_id: jax.Array,
        decode_rows: int,
        group: int,
        sharding: parallel.ActivationSharding | None,
        attention: str,
        record: bool = False,
        lockstep: tuple[str, ...] = (),
    ) -> Engine:
        """The engine of `decode_rows` rows decoding at once, attending by `attention`
        (paged_step.uses_kernel), keeping the routing record with `record`, stepping
        together with the devices of `lockstep`."""
        kernel = paged_step.uses_kernel(attention, model_config)
        floor = paged_step.fewest_rows(decode_rows)
        return cls(
            params, queue, model_config, sampling, stop_ids_S, pad_id, group, sharding, floor,
            kernel, record, lockstep,
        )  # fmt: skip

    @property
    def num_groups(self) -> jax.Array:
        return self.queue.num_queued // self.group

    def more(self, s: paged_state.PagedState) -> jax.Array:
        """The loop goes on (paged_state.more_work), on any device of the lockstep group."""
        return lockstep_lib.joint(paged_state.more_work(self.num_groups, s), self.lockstep)

    def admit(self, s: paged_state.PagedState) -> paged_state.PagedState:
        """Admits waiting groups while the next one fits, prefilling the pending block when
        it is used up."""

        def due(s: paged_state.PagedState) -> jax.Array:
            has_pending = s.pend_next < s.pend_end
            more_groups = (s.next_group < self.num_groups) | (s.retry_len > 0)
            free_rows = jnp.sum(~s.rows.live_S) >= self.group
            return jnp.where(has_pending, paged_state.fits(s, self.group), more_groups & free_rows)

        def one(s: paged_state.PagedState) -> paged_state.PagedState:
            with jax.named_scope(decode.PREFILL_SCOPE):
                return jax.lax.cond(s.pend_next < s.pend_end, self._admit_next, self._prefill, s)

        if self.lockstep:
            return lockstep_lib.admit(s, self.lockstep, due, self._admit_next, self._prefill)
        return jax.lax.while_loop(due, one, s)

    def _prefill(self, s: paged_state.PagedState) -> paged_state.PagedState:
        """Prefills the next J waiting groups (preempted ones first, then the queue's) into the
        pending block and draws each row's first token (fold_in(row_key, 0)); rows a
        preempted group already finished keep their output."""
        q, G = self.queue, self.group
        J = s.pending.group_J.shape[0]
        j = jnp.arange(J, dtype=jnp.int32)
        from_retry = j < s.retry_len
        queue_j = s.next_group + j - jnp.minimum(s.retry_len, J)
        valid_J = from_retry | (queue_j < self.num_groups)
        first_row = q.order_Q[jnp.clip(queue_j, 0, q.order_Q.shape[0] // G - 1) * G]
        retry_group = s.retry_Q[jnp.clip(s.retry_len - 1 - j, 0, s.retry_Q.shape[0] - 1)]
        group_J = jnp.where(from_retry, retry_group, first_row // G)
        row_JG = group_J[:, None] * G + jnp.arange(G)[None, :]
        cache = kv_cache.init_kv_cache(
            self.model_config, J, q.prompt_BP.shape[1], s.pending.cache.k_BKHS[0].dtype
        )
        logits_JV, cache, experts_JPLK = decode.prefill(
            self.params,
            self.model_config,
            q.prompt_BP[group_J * G],
            q.prompt_mask_BP[group_J * G],
            cache,
            self.sharding,
        )
        tok_JG, lp_JG = self._first_tokens(logits_JV, row_JG)
        start_JG = valid_J[:, None] & ~paged_state.finished(s, q.caps_B, row_JG)
        stop_JG = decode.is_stop(tok_JG.reshape(-1), self.stop_ids_S).reshape(J, G)
        out = jnp.where(start_JG, row_JG, q.prompt_BP.shape[0]).reshape(-1)
        n_retry = jnp.minimum(s.retry_len, J)
        B = q.prompt_BP.shape[0]
        s = paged_state.record_prompts(s, experts_JPLK, jnp.where(valid_J[:, None], row_JG, B))
        return s.replace(
            pending=paged_state.Pending(
                cache=cache,
                group_J=group_J,
                prompt_len_J=jnp.sum(q.prompt_mask_BP[group_J * G], axis=1, dtype=jnp.int32),
                first_JG=tok_JG,
                live_JG=start_JG & ~stop_JG & (q.caps_B[row_JG] > 1),
                cap_JG=q.caps_B[row_JG],
            ),
            pend_next=jnp.array(0, jnp.int32),
            pend_end=jnp.sum(valid_J, dtype=jnp.int32),
            retry_len=s.retry_len - n_retry,
            next_group=s.next_group + jnp.sum(valid_J & ~from_retry, dtype=jnp.int32),
            length_R=s.length_R.at[out].set(1, mode="drop"),
            done_R=s.done_R.at[out].set(stop_JG.reshape(-1), mode="drop"),
            tokens_RT=s.tokens_RT.at[out, 0].set(tok_JG.reshape(-1), mode="drop"),
            logprobs_RT=s.logprobs_RT.at[out, 0].set(lp_JG.reshape(-1), mode="drop"),
        )

    def iterate(self, s: paged_state.PagedState) -> paged_state.PagedState:
        """One iteration of the engine's loop: admission, then a decode step. (Admission comes
        first so that the loop holds the only copy of the prefill: one admitting before the
        loop too compiled the model's prefill twice, 2 of the quickstart's 9 s.)"""
        return paged_state.split_heads(self.step(self.admit(s)), self.sharding)

    def _first_tokens(self, logits_JV: jax.Array, row_JG: jax.Array) -> tuple[jax.Array, ...]:
        """Each row's first completion token from its group's prompt logits."""
        J, G = row_JG.shape
        rows = row_JG.reshape(-1)
        keys = jax.vmap(jax.random.fold_in)(
            self.queue.row_keys_B[rows], jnp.zeros((J * G,), jnp.uint32)
        )
        greedy = None if self.queue.greedy_B is None else self.queue.greedy_B[rows]
        logits_RV = jnp.repeat(paged_step.whole_logits(logits_JV, self.sharding), G, axis=0)
        tok, lp = strategies.sample(logits_RV, keys, self.sampling, greedy)
        return tok.reshape(J, G), lp.reshape(J, G)

    def _admit_next(self, s: paged_state.PagedState) -> paged_state.PagedState:
        """Moves the next pending group (it fits: paged_state.fits) into the pool and the
        free decode rows: its prompt's full pages once, a private page per live row holding
        the prompt's last partial page."""
        G, j = self.group, s.pend_next
        pool, pending = s.pool, s.pending
        ps, Np = pool.page_size, pool.num_pages
        P = pending.cache.max_len
        Mp = pages_lib.pages_for(P, ps)
        p = pending.prompt_len_J[j]
        live_G = pending.live_JG[j]
        n_live = jnp.sum(live_G, dtype=jnp.int32)
        full = p // ps
        free = pages_lib.first_free(pool.refs_N, Mp + G)
        m = jnp.arange(Mp)
        shared_M = jnp.where(m < full, free[jnp.minimum(m, Mp + G - 1)], Np)
        rank_G = jnp.cumsum(live_G) - 1
        private_G = jnp.where(live_G, free[jnp.minimum(full + rank_G, Mp + G - 1)], Np)
        pool = paged_state.write_prompt(pool, pending.cache, j, P - p, shared_M, private_G, full)
        refs = pages_lib.hold(pool.refs_N, shared_M, n_live)
        pool = pool.replace(refs_N=pages_lib.hold(refs, private_G))
        return s.replace(
            pool=pool,
            rows=paged_state.place_rows(s, self.queue, pending, j, shared_M, private_G, full),
            pend_next=j + 1,
            admitted=s.admitted + 1,
        )

    def step(self, s: paged_state.PagedState) -> paged_state.PagedState:
        """One token for every live row: pages for rows crossing a page boundary (after
        preempting the latest groups while they do not fit), the live rows moved first (only
        their small state moves; their KV stays in the pool) and decoded (_decode), the
        outputs, and the pages of rows that ended returned."""
        s = paged_state.allocate(
            jax.lax.while_loop(paged_state.short_of_pages, paged_state.preempt_latest, s)
        )
        x = s.rows.take(jnp.argsort(~s.rows.live_S, stable=True))
        B, live_S = s.length_R.shape[0], x.live_S
        tok_S, lp_S, pool, computed, experts_SLK = self._decode(x, s.pool)
        out_S = jnp.where(live_S, x.row_S, B)
        s = paged_state.record_fed(s, experts_SLK, out_S, x.step_S)
        stop_S = decode.is_stop(tok_S, self.stop_ids_S)
        step_S = x.step_S + live_S.astype(jnp.int32)
        still_S = live_S & ~stop_S & (step_S < x.cap_S)
        stats = paged_state.count(s.stats, live_S, pool.num_pages - pool.num_free())
        pool, x = paged_state.release_rows(pool, x, live_S & ~still_S)
        return s.replace(
            pool=pool,
            rows=x.replace(
                step_S=step_S,
                last_S=tok_S,
                position_S=x.position_S + 1,
                live_S=still_S,
            ),
            length_R=s.length_R.at[out_S].add(1, mode="drop"),
            done_R=s.done_R.at[out_S].set(stop_S, mode="drop"),
            tokens_RT=s.tokens_RT.at[out_S, x.step_S].set(tok_S, mode="drop"),
            logprobs_RT=s.logprobs_RT.at[out_S, x.step_S].set(lp_S, mode="drop"),
            slot_steps=s.slot_steps + computed,
            stats=stats,
        )

    def _decode(self, x: paged_state.DecodeRows, pool: PagePool) -> tuple[Any, ...]:
        """The rows' (live ones first) next tokens and logprobs, the pool with their new keys
        and values, the rows the step computed and (recording) the fed tokens' experts. The
        kernel: one step over every row and whole tables (it reads only a row's filled
        pages), which writes the pool in place.
        The reference: the smallest row level holding the live rows and the narrowest table
        prefix holding their pages (no more rows computed, no more pages gathered), picked by
        lax.switch; the pool is only read inside the switch and written after it."""
        Np, live_S = pool.num_pages, x.live_S
        page_S = jnp.where(live_S, x.current_page(pool.page_size, Np)[1], Np)
        if self.kernel:
            length_S = jnp.where(live_S, x.position_S + 1, 1)
            logits, pool, experts = paged_step.pallas_decode_step(
                *self._step_args(x), length_S, page_S, x.table_SM, pool, self.sharding
            )
            fed = self._fed(experts)
            computed = jnp.where(jnp.any(live_S), live_S.shape[0], 0)
            return *self._sample(logits, x), pool, computed, fed
        sizes = paged_step.row_levels(live_S.shape[0], self.floor)
        widths = paged_step.widths(x.table_SM.shape[1])
        row_level = jnp.sum(jnp.sum(live_S) <= jnp.array(sizes), dtype=jnp.int32) - 1
        pages = jnp.max(jnp.where(live_S, x.position_S // pool.page_size + 1, 1))
        width_level = jnp.sum(pages <= jnp.array(widths), dtype=jnp.int32) - 1
        # No live row (the last groups admitted all ended at their first token): no step.
        row_level, width_level, idle = lockstep_lib.decode_levels(
            row_level, width_level, jnp.logical_not(jnp.any(live_S)), self.lockstep
        )
        branches = [
            functools.partial(self._decode_first, size, width) for size in sizes for width in widths
        ]
        branches.append(functools.partial(self._idle, jax.eval_shape(branches[-1], x, pool)))
        index = jnp.where(idle, len(branches) - 1, row_level * len(widths) + width_level)
        tok_S, lp_S, k_LSKH, v_LSKH, fed = jax.lax.switch(index, branches, x, pool)
        pool = paged_step.write_new_tokens(pool, page_S, x.position_S, k_LSKH, v_LSKH)
        return tok_S, lp_S, pool, jnp.where(idle, 0, jnp.array(sizes, jnp.int32)[row_level]), fed

    def _step_args(
        self, x: paged_state.DecodeRows
    ) -> tuple[Any, ModelConfig, jax.Array, jax.Array]:
        return self.params, self.model_config, x.last_S, x.position_S

    def _sample(self, logits_SV: jax.Array, x: paged_state.DecodeRows) -> tuple[jax.Array, ...]:
        """Each row's token and logprob, row r's token t drawn with fold_in(row_key[r], t)."""
        keys = jax.vmap(jax.random.fold_in)(x.keys_S, x.step_S.astype(jnp.uint32))
        return strategies.sample(
            paged_step.whole_logits(logits_SV, self.sharding), keys, self.sampling, x.greedy_S
        )

    def _decode_first(
        self, size: int, width: int, x: paged_state.DecodeRows, pool: PagePool
    ) -> tuple[jax.Array, ...]:
        """The reference decode step of the first `size` rows (every live one among them),
        reading the first `width` pages of their tables (all they hold): their tokens,
        logprobs (pad / 0 past them), each layer's new keys and values (zeros past them) and
        (recording) the fed tokens' experts (zeros past them)."""
        S = x.live_S.shape[0]
        x = jax.tree.map(lambda a: a[:size], x)
        logits, ks, vs, experts = paged_step.paged_decode_step(
            *self._step_args(x), x.table_SM[:, :width], pool, self.sharding
        )
        tok, lp = self._sample(logits, x)
        pad = lambda a, value=0: jnp.pad(  # noqa: E731
            a, [(0, S - size)] + [(0, 0)] * (a.ndim - 1), constant_values=value
        )
        new_kv = jax.tree.map(lambda a: pad(a.astype(pool.k_pages[0].dtype)), (ks, vs))
        fed = self._fed(experts)
        return pad(tok, self.pad_id), pad(lp), *new_kv, None if fed is None else pad(fed)

    def _idle(self, shapes: Any, x: paged_state.DecodeRows, pool: PagePool) -> Any:
        """A decode branch's outputs (`shapes`) for no live row: pad tokens, zeros."""
        del x, pool
        tok, *rest = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return jnp.full_like(tok, self.pad_id), *rest

    def _fed(self, experts_S1LK: jax.Array | None) -> jax.Array | None:
        """The fed tokens' experts [S, L, K] when recording, else None."""
        if not self.record:
            return None
        assert experts_S1LK is not None  # recorded only for a mixture of experts
        return experts_S1LK[:, 0]
