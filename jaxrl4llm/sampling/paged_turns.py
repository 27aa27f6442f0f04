"""Multi-turn rollouts on the paged KV cache: multiturn.py's host loop over the compiled
programs of paged_turn_programs.py, whose rows keep their KV in a pool of pages
(page_pool.py) instead of a dense cache row of prompt + budget + chunk slots each.

A row holds the pages its tokens fill: a group's full prompt pages once (shared), a private
copy of the prompt's last partial page, then a page each time its tokens cross a page
boundary (a decode step, or an observation chunk prefilled straight into its pages). Its
pages return when its trajectory ends (the reply to its last turn).

Running out of pages (`PagedPrograms.unblock`, after each segment and its replies):
  - a row whose next token needs a page that is not free stalls: it stops decoding and
    keeps its pages; a reply whose observation needs pages that are not free waits;
  - the rows waiting for memory (stalled rows, waiting observations, evicted rows that are
    ready to go on) are served lowest index first, while the pages each needs are free,
    each with the pages for at least one new token; past the first that does not fit only
    rows that need no new page go on (a higher row does not take the pages a lower one
    waits for);
  - when no row decodes and none of them was served, the highest-index unfinished row holding
    pages is evicted: its pages return, its tokens stay; then the round runs again. An
    evicted row is restored when it is served: its prompt and completion so far (and the
    observation, when that reply is what it waited for) prefilled into fresh pages, then it
    goes on. An evicted row waiting for its reply holds nothing until the reply comes.
The pool must hold one row at full length (prompt + budget: `pool_pages` refuses less), so
the lowest row waiting fits once every row above it (and, if need be, itself and the parked
rows below it) is evicted: each round serves a row or evicts one, every served row makes a
token, tokens are never lost and evictions between two served rows are at most the rows, so
the rollout ends; no deadlock, no lost row, and the rows' KV never exceeds the pool (the
prompts are prefilled once per group into a dense block of one prompt per group, copied into
the pool and dropped, as the single-turn engine's pending block).

At most `max_rows` rows decode at a step (--rollout_micro_batch; paged_turn_programs.segment:
the lowest live rows, the step's buffers those of max_rows rows); the other live rows keep
their pages and wait, and a default pool (--kv_cache_tokens=0) holds max_rows rows at full
length. The lowest live rows always decode, so the argument above still holds.

Row r draws completion token t with fold_in(row_key[r], t), as the dense engine, so with a
pool that never evicts it samples the dense engine's tokens (up to float rounding: a restored
row's KV is prefilled, not decoded). Groups that do not fit at the start begin evicted (their
first tokens are drawn from the prompt prefill).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import buckets, paged
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling import paged_turn_programs as programs_lib
from jaxrl4llm.sampling.row_io import PromptRows
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turn_programs import (
    SEGMENT_STEPS,
    RolloutSettings,
    TurnState,
    chunk_length,
    observe_inputs,
)


def pool_pages(tokens: int, rows: int, prompt_len: int, budget: int) -> int:
    """The pool's pages: `tokens` in pages of paged.PAGE_SIZE, or with 0 every row at full
    length; refused (FlagError) below one row at full length (the longest prompt,
    `prompt_len`, and the budget: the module docstring)."""
    ps = paged.PAGE_SIZE
    row = pages_lib.pages_for(prompt_len + budget, ps)
    pages = tokens // ps or rows * row
    if pages < row:
        raise FlagError(
            f"--kv_cache_tokens={tokens} holds {pages} pages of {ps} tokens, fewer than one "
            f"multi-turn row at full length needs ({row}: a {prompt_len}-token prompt and a "
            f"{budget}-token budget); use --kv_cache_tokens={row * ps} or more, or 0."
        )
    return pages


def start(
    weights: Any,
    rows: PromptRows,
    settings: RolloutSettings,
    kv_cache_tokens: int,
    max_rows: int = 0,
) -> tuple[TurnState, PagedPrograms]:
    """The prompts of the groups that fit written into a pool of `kv_cache_tokens` tokens,
    every row's first token, the rest evicted; the programs (multiturn.run's start), at most
    `max_rows` rows decoding at once (0: every row)."""
    batch, plen_B = rows.batch, prompt_lengths(rows.batch)
    rows_at_once = decoding_rows(int(batch.active_B.sum()), max_rows)
    num_pages = pool_pages(kv_cache_tokens, rows_at_once, longest(plen_B, batch), settings.budget)
    pages = first_pages(batch, rows.prompt_group, settings, num_pages)
    args, static = prefill_args(rows, settings, num_pages)
    state = programs_lib.prefill(weights, *args, pages, **static)
    programs = PagedPrograms.of(weights, settings, batch, max_rows=max_rows)
    return admit(programs, state, pages.admitted_B), programs


def decoding_rows(rows: int, max_rows: int) -> int:
    """Of `rows` rows, those decoding at once, which a default pool holds at full length: at
    most `max_rows` (0: no cap); one with no row (every prompt dropped: still a pool)."""
    rows = max(rows, 1)
    return min(rows, max_rows or rows)


def prompt_lengths(batch: buckets.PromptBatch) -> np.ndarray:
    return batch.mask_BP.sum(axis=1).astype(np.int32)


def longest(plen_B: np.ndarray, batch: buckets.PromptBatch) -> int:
    """The longest active prompt (1 with none)."""
    return int(plen_B[batch.active_B].max(initial=1))


def first_pages(
    batch: buckets.PromptBatch, group: int, settings: RolloutSettings, num_pages: int
) -> programs_lib.PromptPages:
    """The pages of the groups admitted at the start (paged_turn_programs.initial_pages),
    tables wide enough for a prompt, the budget and an observation chunk."""
    P = batch.prompt_BP.shape[1]
    M = pages_lib.pages_for(P + settings.budget + settings.chunk, paged.PAGE_SIZE)
    plen_B = prompt_lengths(batch)
    return programs_lib.initial_pages(
        plen_B, batch.active_B, group, num_pages, M, P, paged.PAGE_SIZE
    )


def prefill_args(
    rows: PromptRows, settings: RolloutSettings, num_pages: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """paged_turn_programs.prefill's arguments before the pages, and its static ones."""
    batch = rows.batch
    inputs = tuple(map(jnp.asarray, (batch.prompt_BP, batch.mask_BP, batch.active_B)))
    greedy_B = None if rows.greedy_B is None else jnp.asarray(rows.greedy_B)
    stops = (settings.stop_ids_S, settings.stop_BQL)
    args = ((*inputs, rows.keys_B), greedy_B, stops, jnp.int32(settings.pad_id))
    static = dict(
        model_config=settings.static["model_config"],
        sampling=settings.static["sampling"],
        max_new_tokens=settings.budget,
        num_pages=num_pages,
        group=rows.prompt_group,
    )
    return args, static


def admit(programs: PagedPrograms, state: Any, admitted_B: jax.Array) -> Any:
    """After prefill: the active rows not admitted start evicted, ready to go on unless their
    first token ended their turn; the rows that fit are served."""
    ended_B = np.asarray(jax.device_get(state.ended_B))
    for r in np.flatnonzero(programs.batch.active_B & ~np.asarray(admitted_B)):
        programs.evicted.add(int(r))
        if not ended_B[r]:
            programs.ready.add(int(r))
    return programs.unblock(state)


@dataclasses.dataclass(eq=False)
class PagedPrograms:
    """The paged programs as multiturn.py's host loop runs them, with the host's record of
    the rows waiting for memory (module docstring): evicted rows, the evicted rows ready to
    go on, the observations waiting for pages."""

    weights: Any
    stop_ids_S: jax.Array
    stop_BQL: jax.Array
    model_config: ModelConfig
    sampling: SamplingConfig
    batch: buckets.PromptBatch  # the prompts a restore prefills again
    plen_B: np.ndarray
    pad_id: int
    # The programs' module; a batch shard's runs them on its part of a mesh's state
    # (paged_turns_mesh.ShardPrograms, the same functions).
    lib: Any = programs_lib
    evicted: set[int] = dataclasses.field(default_factory=set)
    ready: set[int] = dataclasses.field(default_factory=set)
    observations: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    evictions: int = 0
    max_rows: int = 0  # rows decoding at once (0: every live row)

    @classmethod
    def of(
        cls,
        weights: Any,
        settings: RolloutSettings,
        batch: buckets.PromptBatch,
        lib: Any = None,
        max_rows: int = 0,
    ) -> PagedPrograms:
        """The programs of the rows of `batch` (a rollout's, or a batch shard's)."""
        return cls(
            weights, settings.stop_ids_S, settings.stop_BQL, settings.static["model_config"],
            settings.static["sampling"], batch, prompt_lengths(batch), settings.pad_id,
            lib=lib or programs_lib, max_rows=max_rows,
        )  # fmt: skip

    def segment(self, state: TurnState) -> TurnState:
        """Up to SEGMENT_STEPS decode steps of the live rows (until some row ends its turn)."""
        state = self.lib.segment(
            self.weights,
            state,
            (self.stop_ids_S, self.stop_BQL),
            model_config=self.model_config,
            sampling=self.sampling,
            max_steps=SEGMENT_STEPS,
            max_rows=self.max_rows,
        )
        jax.block_until_ready(state.ended_B)
        return state

    def observe(self, state: TurnState, row: int, obs: list[int], pad_id: int) -> TurnState:
        """Row `row`'s observation waits for `unblock` (served in row order as pages fit)."""
        self.observations[row] = obs
        return state

    def finish(self, state: TurnState, row: int) -> TurnState:
        """Row `row`'s trajectory ended: its pages go back."""
        self.evicted.discard(row)
        self.ready.discard(row)
        return self.lib.release(state, jnp.int32(row))

    def pages_left(self, state: TurnState) -> int:
        """Pages still held (0 once every trajectory ended and returned its pages)."""
        pool = state.cache.pool
        return pool.num_pages - int(jax.device_get(pool.num_free()))

    def unblock(self, state: TurnState) -> TurnState:
        """Serves the rows waiting for memory lowest first while their pages are free; while
        none is served and no row decodes, evicts the highest-index row holding pages."""
        N = state.cache.pool.num_pages
        while True:
            # Each row's page count, not its table: the host needs no more after each segment.
            stalled_B, step_B, held_B, live_B, free = jax.device_get(
                (
                    state.cache.stalled_B,
                    state.step_B,
                    jnp.sum(state.cache.table_BM != N, axis=1),
                    state.live_B,
                    state.cache.pool.num_free(),
                )
            )
            waiting = set(np.flatnonzero(stalled_B).tolist()) | self.ready | set(self.observations)
            if not waiting:
                return state
            state, served = self._serve(state, sorted(waiting), step_B, held_B, int(free))
            if served or live_B.any():
                return state
            state = self._evict(state, held_B, stalled_B)

    def _serve(
        self, state: TurnState, rows: list[int], step_B: np.ndarray, held_B: np.ndarray, free: int
    ) -> tuple[TurnState, bool]:
        """Serves `rows` in order while the pages each needs (for its tokens so far, its
        observation and its next token) are free; past the first that does not fit, only
        rows that need no new page (they take none from it). (the state, whether one was)."""
        served = False
        for r in rows:
            extra = len(self.observations.get(r, ()))
            slots = int(self.plen_B[r] + step_B[r]) + extra
            need = max(0, pages_lib.pages_for(slots, paged.PAGE_SIZE) - int(held_B[r]))
            if need > free:
                free = 0  # what frees next goes to this row first
                continue
            free -= need
            state, served = self._resume(state, r, int(step_B[r])), True
        return state, served

    def _resume(self, state: TurnState, row: int, step: int) -> TurnState:
        """Row `row` goes on: restored if evicted, its waiting observation prefilled, else
        (stalled) decoding again."""
        obs = self.observations.pop(row, None)
        if row in self.evicted:
            state = self._restore(state, row, step, resume=obs is None)
        elif obs is None:
            state = self.lib.unstall(state, jnp.arange(len(self.plen_B)) == row)
        if obs is None:
            return state
        return self.lib.observe(
            self.weights,
            state,
            observe_inputs(state, row, obs, self.pad_id),
            (self.stop_ids_S, self.stop_BQL),
            model_config=self.model_config,
            sampling=self.sampling,
        )

    def _restore(self, state: TurnState, row: int, step: int, resume: bool) -> TurnState:
        """Evicted row `row`'s prompt and completion so far back in fresh pages."""
        P, plen = self.batch.prompt_BP.shape[1], int(self.plen_B[row])
        completion = np.asarray(jax.device_get(state.tokens_BT[row, : step - 1]))
        tokens = np.concatenate([self.batch.prompt_BP[row, P - plen :], completion])
        width = state.cache.table_BM.shape[1] * state.cache.pool.page_size
        chunk_C = np.zeros(min(chunk_length(len(tokens)), width), np.int32)
        chunk_C[: len(tokens)] = tokens
        self.evicted.discard(row)
        self.ready.discard(row)
        return self.lib.restore(
            self.weights,
            state,
            jnp.int32(row),
            jnp.asarray(chunk_C),
            jnp.asarray(resume),
            model_config=self.model_config,
        )

    def _evict(self, state: TurnState, held_B: np.ndarray, stalled_B: np.ndarray) -> TurnState:
        """Evicts the highest-index row holding pages (none decodes)."""
        holding = np.flatnonzero(held_B > 0)
        if not len(holding):
            raise RuntimeError("Rows wait for pages, but no row holds any (pool_pages).")
        row = int(holding[-1])
        self.evicted.add(row)
        if stalled_B[row]:
            self.ready.add(row)
        self.evictions += 1
        return self.lib.release(state, jnp.int32(row))
