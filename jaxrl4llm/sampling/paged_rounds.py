"""A partial-rollout step's rounds (train/rollout/partial.py) on one pool of KV pages: rows keep
their pages from one round of a step to the next, so a row that goes on in a later round of
the same step (the same weights) prefills nothing; only a group's prompt (once, when it
starts) and a row begun in an earlier step (its KV is the old policy's) are prefilled.

`StepPool` holds `slots` groups of G rows (TurnState row slot * G + g) in a pool of pages
(paged_turn_programs.PagedKV; paged_turns.pool_pages: the sampler's --kv_cache_tokens, or
every row at full length) and runs the multi-turn engine's paged programs and memory policy
on them (paged_turns.PagedPrograms), a round being a turn without an observation:

  start    new groups in free slots: each prompt prefilled once (dense, at its bucket),
           written into free pages (full pages shared by the group's rows, the last partial
           page copied per row) for the groups that fit, every row's first token drawn; rows
           of groups that do not fit start evicted, restored as pages free;
  carry    rows begun in an earlier step: their tokens placed, the rows evicted, restored
           (prompt + completion so far prefilled into fresh pages) as pages free;
  go_on    rows of this step go on where the last round stopped them, with their pages;
  run      decode segments until no row decodes or waits for pages (PagedPrograms.unblock:
           waiting rows served lowest first; when none can go on and none decodes, the
           highest row holding pages is evicted and restored later by prefill);
  finish   a row that will not run again (stopped, or at max_new_tokens) returns its pages.

Keys, as a resumed sampler call's: a row given key k in a round draws the round's i-th token
with fold_in(k, i) (TurnState.key_base_B), so the pool's rows are the rounds' rows of
Sampler.generate(prefixes=...), up to float rounding (a row's KV decoded, not prefilled).

One device only (the trainer uses it without a mesh splitting the batch or heads, on one
host; otherwise each round's sampler calls prefill resumed rows, partial.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.models import kv_cache
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import buckets, decode, paged, paged_state, paged_turns, turn_programs
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling import paged_turn_programs as programs_lib
from jaxrl4llm.sampling.row_io import stop_id_array
from jaxrl4llm.sampling.strategies import SamplingConfig, sample
from jaxrl4llm.sampling.turn_programs import TurnState

EOS = 2  # turn_programs._emit's code of a turn ended by a stop token


@functools.partial(
    jax.jit, static_argnames=("model_config", "rows", "budget", "num_pages", "M", "dtype")
)
def empty_state(
    pad_id: jax.Array,
    *,
    model_config: ModelConfig,
    rows: int,
    budget: int,
    num_pages: int,
    M: int,
    dtype: Any,
) -> TurnState:
    """`rows` rows holding no page and not decoding, a pool of `num_pages` free pages."""
    pool = pages_lib.init_pool(model_config, num_pages, paged.PAGE_SIZE, dtype)
    kv = programs_lib.PagedKV(
        pool, jnp.full((rows, M), num_pages, jnp.int32), jnp.zeros(rows, bool)
    )
    off = jnp.zeros((rows,), bool)
    keys = jax.random.split(jax.random.key(0), rows)
    state = turn_programs.initial_state(
        kv, jnp.zeros((rows, 1), bool), off, keys, None, pad_id, budget
    )
    return state.replace(key_base_B=jnp.zeros((rows,), jnp.int32))


def _put(x: jax.Array, rows_R: jax.Array, v: Any) -> jax.Array:
    return x.at[rows_R].set(v, mode="drop")


@functools.partial(
    jax.jit, static_argnames=("model_config", "sampling", "group"), donate_argnames=("s",)
)
def start_groups(
    weights: Any,
    s: TurnState,
    inputs: tuple[jax.Array, ...],
    pages: programs_lib.PromptPages,
    stops: tuple[jax.Array, jax.Array],
    pad_id: jax.Array,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    group: int,
) -> TurnState:
    """J groups' prompts (prompt_JP, mask_JP) prefilled once and written into `pages` for the
    groups that fit (pages.admitted_B), their R = J * G rows (rows_R; B for none) started:
    key keys_R, cap caps_R, first token drawn (fold_in(key, 0)); rows not admitted wait."""
    prompt_JP, mask_JP, rows_R, keys_R, caps_R = inputs
    J, P = prompt_JP.shape
    kv = s.cache
    cache = kv_cache.init_kv_cache(model_config, J, P, kv.pool.k_pages[0].dtype)
    logits_JV, cache, _ = decode.prefill(weights, model_config, prompt_JP, mask_JP, cache, None)
    first_R = jax.vmap(jax.random.fold_in)(keys_R, jnp.zeros(rows_R.shape, jnp.uint32))
    tok_R, lp_R = sample(jnp.repeat(logits_JV, group, axis=0), first_R, sampling, None)
    plen_J = jnp.sum(mask_JP, axis=1, dtype=jnp.int32)

    def write_group(j: jax.Array, pool: pages_lib.PagePool) -> pages_lib.PagePool:
        full = plen_J[j] // pool.page_size
        shared_M, private_G = pages.shared_JM[j], pages.private_JG[j]
        return paged_state.write_prompt(pool, cache, j, P - plen_J[j], shared_M, private_G, full)

    pool = jax.lax.fori_loop(0, J, write_group, kv.pool)
    kv = kv.replace(
        pool=pool.replace(refs_N=pages_lib.hold(pool.refs_N, pages.table_BM)),
        table_BM=_put(kv.table_BM, rows_R, pages.table_BM),
        stalled_B=_put(kv.stalled_B, rows_R, False),
    )
    B, zero = s.step_B.shape[0], jnp.zeros((), jnp.int32)
    plen_R = jnp.repeat(plen_J, group)
    s = _place(s.replace(cache=kv), rows_R, plen_R, zero, pad_id, keys_R, caps_R, pad_id)
    s = _set_rows(s, rows_R, logprobs_BT=0.0, model_BT=False, live_B=pages.admitted_B)
    emit_B = _put(jnp.zeros((B,), bool), rows_R, True)
    tok_B = _put(jnp.zeros((B,), jnp.int32), rows_R, tok_R)
    lp_B = _put(jnp.zeros((B,), jnp.float32), rows_R, lp_R)
    return turn_programs._emit(s, emit_B, tok_B, lp_B, *stops)


def _set_rows(s: TurnState, rows_R: jax.Array, **values: Any) -> TurnState:
    """`s` with rows rows_R (B: none) of each named field set to its value."""
    return s.replace(**{k: _put(getattr(s, k), rows_R, v) for k, v in values.items()})


def _place(
    s: TurnState,
    rows_R: jax.Array,
    plen_R: Any,
    step_R: Any,
    last_R: Any,
    keys_R: jax.Array,
    caps_R: Any,
    tokens_RT: Any,
) -> TurnState:
    """Rows rows_R at completion index step_R, their draws counting from it, not decoding:
    prompt lengths, last tokens (not in the KV), keys, caps and completion tokens."""
    assert s.key_base_B is not None  # empty_state's
    return _set_rows(
        s, rows_R, plen_B=plen_R, step_B=step_R, last_B=last_R, live_B=False, keys_B=keys_R,
        key_base_B=step_R, cap_B=caps_R, turn_start_B=step_R, ended_B=0, tokens_BT=tokens_RT,
    )  # fmt: skip


@functools.partial(jax.jit, donate_argnames=("s",))
def place_rows(s: TurnState, inputs: tuple[jax.Array, ...]) -> TurnState:
    """Rows rows_R (B: none) begun in an earlier step, not decoding and holding no page: their
    prompt lengths plen_R, completions so far tokens_RT[:, :step_R], keys keys_R (drawing from
    0 again) and caps caps_R."""
    rows_R, plen_R, tokens_RT, step_R, keys_R, caps_R = inputs
    last_R = jnp.take_along_axis(tokens_RT, jnp.maximum(step_R - 1, 0)[:, None], axis=1)[:, 0]
    return _place(s, rows_R, plen_R, step_R, last_R, keys_R, caps_R, tokens_RT)


@functools.partial(jax.jit, donate_argnames=("s",))
def go_on(
    s: TurnState, rows_B: jax.Array, live_B: jax.Array, keys_B: jax.Array, caps_B: jax.Array
) -> TurnState:
    """Rows `rows_B` (bool) go on: key keys_B (drawing from 0 again), cap caps_B; those of them
    holding their pages (`live_B`) decode at the next segment, the others wait for a restore."""
    assert s.key_base_B is not None  # empty_state's
    return s.replace(
        keys_B=jnp.where(rows_B, keys_B, s.keys_B),
        key_base_B=jnp.where(rows_B, s.step_B, s.key_base_B),
        cap_B=jnp.where(rows_B, caps_B, s.cap_B),
        turn_start_B=jnp.where(rows_B, s.step_B, s.turn_start_B),
        ended_B=jnp.where(rows_B, 0, s.ended_B),
        live_B=s.live_B | (rows_B & live_B),
    )


@functools.partial(jax.jit, donate_argnames=("s",))
def release_rows(s: TurnState, rows_B: jax.Array) -> TurnState:
    """Rows `rows_B` (bool) not decoding, their pages returned."""
    kv = s.cache
    kv = kv.replace(
        pool=kv.pool.replace(refs_N=pages_lib.release(kv.pool.refs_N, kv.table_BM, rows_B)),
        table_BM=jnp.where(rows_B[:, None], kv.pool.num_pages, kv.table_BM),
        stalled_B=kv.stalled_B & ~rows_B,
    )
    return s.replace(cache=kv, live_B=s.live_B & ~rows_B)


@dataclasses.dataclass(eq=False)
class _Counted(paged_turns.PagedPrograms):
    """PagedPrograms counting the tokens its restores prefill."""

    prefilled: int = 0

    def _restore(self, state: TurnState, row: int, step: int, resume: bool) -> TurnState:
        self.prefilled += int(self.plen_B[row]) + step - 1
        return super()._restore(state, row, step, resume)


@dataclasses.dataclass(frozen=True)
class Part:
    """What rows did in a round (host numpy, R rows): the tokens since the round began (pad
    after them), their logprobs, how many and whether a stop token ended the row."""

    tokens_RN: np.ndarray
    logprobs_RN: np.ndarray
    lengths_R: np.ndarray
    stopped_R: np.ndarray


class StepPool:
    """One step's rounds on a pool of pages (module docstring); rows are slot * G + g."""

    def __init__(
        self,
        sampler: Any,
        params: Any,
        sampling: SamplingConfig,
        *,
        slots: int,
        group: int,
        max_new_tokens: int,
        max_prompt_tokens: int,
    ):
        config, B = sampler.model_config, slots * group
        self.sampler, self.G, self.T, self.width = sampler, group, max_new_tokens, max_prompt_tokens
        self.num_pages = paged_turns.pool_pages(
            sampler.kv_cache_tokens or 0, B, max_prompt_tokens, max_new_tokens
        )
        self.M = pages_lib.pages_for(max_prompt_tokens + max_new_tokens, paged.PAGE_SIZE)
        weights = turn_programs.decode_weights(params, config, None)
        pad = np.int32(sampler.pad_id)
        batch = buckets.PromptBatch(
            np.full((B, max_prompt_tokens), pad, np.int32), np.zeros((B, max_prompt_tokens), bool),
            np.zeros(B, bool), np.zeros(B, bool), np.arange(B), np.zeros(B, np.int32), B,
        )  # fmt: skip
        self.programs = _Counted(
            weights, jnp.asarray(stop_id_array(sampler.stop_ids)),
            jnp.full((B, 1, 1), -1, jnp.int32), config, sampling, batch, np.zeros(B, np.int32),
            int(pad),
        )  # fmt: skip
        self.state = empty_state(
            jnp.int32(pad), model_config=config, rows=B, budget=max_new_tokens,
            num_pages=self.num_pages, M=self.M, dtype=decode.cache_dtype_for(weights),
        )  # fmt: skip
        self.free = list(range(slots))
        self.prompt_prefilled = 0

    @property
    def _stops(self) -> tuple[jax.Array, jax.Array]:
        return self.programs.stop_ids_S, self.programs.stop_BQL

    @property
    def prefilled(self) -> int:
        """Prompt and history tokens prefilled so far (a group's prompt once, restores)."""
        return self.prompt_prefilled + self.programs.prefilled

    @property
    def slot_steps(self) -> int:
        """Rows computed by the decode steps so far."""
        return int(jax.device_get(self.state.slot_steps))

    def _place_prompt(self, row: int, prompt: Sequence[int]) -> None:
        """The host's copy of row `row`'s prompt (restores prefill it again)."""
        batch, W = self.programs.batch, self.width
        batch.prompt_BP[row] = self.programs.pad_id
        batch.mask_BP[row] = False
        batch.prompt_BP[row, W - len(prompt) :] = prompt
        batch.mask_BP[row, W - len(prompt) :] = True
        batch.active_B[row] = True
        self.programs.plen_B[row] = len(prompt)

    def _free_pages(self) -> np.ndarray:
        refs = np.asarray(jax.device_get(self.state.cache.pool.refs_N))
        return np.flatnonzero(refs == 0).astype(np.int32)

    def start(self, prompts: Sequence[Sequence[int]], keys_R: jax.Array, caps: int) -> list[int]:
        """New groups of `prompts` in free slots (returned), row g of group j keyed keys_R[j *
        G + g], capped at `caps` tokens."""
        G, J = self.G, len(prompts)
        slots = [self.free.pop(0) for _ in range(J)]
        Jp = buckets.two_per_octave(J)
        P = max(buckets.bucket_prompt_length(max(len(p), 1)) for p in prompts)
        prompt_JP = np.full((Jp, P), self.programs.pad_id, np.int32)
        mask_JP = np.zeros((Jp, P), bool)
        for j in range(Jp):
            p = prompts[min(j, J - 1)]  # padding groups repeat a prompt, write nowhere
            prompt_JP[j, P - len(p) :], mask_JP[j, P - len(p) :] = p, True
        rows_R = np.full(Jp * G, self.state.step_B.shape[0], np.int32)
        for j, slot in enumerate(slots):
            rows_R[j * G : (j + 1) * G] = slot * G + np.arange(G)
            for g in range(G):
                self._place_prompt(slot * G + g, prompts[j])
        plen_R = np.repeat(mask_JP.sum(axis=1), G)
        active_R = np.arange(Jp * G) < J * G
        pages = programs_lib.initial_pages(
            plen_R, active_R, G, self.num_pages, self.M, P, paged.PAGE_SIZE, self._free_pages()
        )
        keys = jnp.concatenate([keys_R, jnp.repeat(keys_R[:1], (Jp - J) * G)]) if Jp > J else keys_R
        caps_R = np.full(Jp * G, caps, np.int32)
        self.state = start_groups(
            self.programs.weights, self.state, (prompt_JP, mask_JP, rows_R, keys, caps_R), pages,
            self._stops, jnp.int32(self.programs.pad_id), model_config=self.sampler.model_config,
            sampling=self.programs.sampling, group=G,
        )  # fmt: skip
        self.prompt_prefilled += sum(len(p) for p in prompts)
        self._wait(rows_R[~np.asarray(pages.admitted_B) & active_R])
        return slots

    def _wait(self, rows: np.ndarray) -> None:
        """Rows holding no pages that go on once restored (unless their turn ended)."""
        ended = np.asarray(jax.device_get(self.state.ended_B))
        for r in rows.tolist():
            self.programs.evicted.add(r)
            if not ended[r]:
                self.programs.ready.add(r)

    def take_slot(self) -> int:
        return self.free.pop(0)

    def carry(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], done: Any) -> None:
        """Rows begun in an earlier step: `done` = (tokens so far per row, keys_R, caps_R (the
        most tokens each may have at the end of the round))."""
        completions, keys_R, caps = done
        R, T = len(rows), self.T
        tokens_RT = np.full((R, T), self.programs.pad_id, np.int32)
        for i, (row, prompt, c) in enumerate(zip(rows, prompts, completions)):
            tokens_RT[i, : len(c)] = c
            self._place_prompt(row, prompt)
        plen = [len(p) for p in prompts]
        steps = [len(c) for c in completions]
        inputs = (np.asarray(rows, np.int32), np.asarray(plen, np.int32), tokens_RT,
                  np.asarray(steps, np.int32), keys_R, np.asarray(caps, np.int32))  # fmt: skip
        self.state = place_rows(self.state, inputs)
        self._wait(np.asarray(rows))

    def go_on(self, rows: Sequence[int], keys_R: jax.Array, caps: Sequence[int]) -> None:
        """Rows of this step go on, keyed keys_R, up to caps[i] tokens in all."""
        B = self.state.step_B.shape[0]
        rows_B, caps_B = np.zeros(B, bool), np.zeros(B, np.int32)
        rows_B[list(rows)] = True
        caps_B[list(rows)] = caps
        keys = self.state.keys_B.at[np.asarray(rows, np.int32)].set(keys_R)
        evicted = np.zeros(B, bool)
        evicted[list(self.programs.evicted)] = True
        self.state = go_on(self.state, rows_B, ~evicted, keys, caps_B)
        self.programs.ready.update(r for r in rows if evicted[r])

    def run(self) -> None:
        """Decodes until no row decodes or waits for pages."""
        self.state = self.programs.unblock(self.state)
        while bool(jax.device_get(jnp.any(self.state.live_B))):
            self.state = self.programs.lib.segment(
                self.programs.weights, self.state, self._stops,
                model_config=self.sampler.model_config, sampling=self.programs.sampling,
                max_steps=self.T, until_turn_end=False,
            )  # fmt: skip
            self.state = self.programs.unblock(self.state)

    def read(self, rows: Sequence[int], starts: Sequence[int], width: int) -> Part:
        """What rows `rows` decoded since completion index starts[i], `width` columns."""
        step, ended, tokens, logprobs = jax.device_get(
            (self.state.step_B, self.state.ended_B, self.state.tokens_BT, self.state.logprobs_BT)
        )
        R = len(rows)
        out = Part(
            np.full((R, width), self.programs.pad_id, np.int32), np.zeros((R, width), np.float32),
            np.zeros(R, np.int32), np.zeros(R, bool),
        )  # fmt: skip
        for i, (r, a) in enumerate(zip(rows, starts)):
            n = int(step[r]) - a
            out.tokens_RN[i, :n] = tokens[r, a : a + n]
            out.logprobs_RN[i, :n] = logprobs[r, a : a + n]
            out.lengths_R[i], out.stopped_R[i] = n, ended[r] == EOS
        return out

    def finish(self, rows: Sequence[int]) -> None:
        """Rows that will not run again return their pages."""
        if not rows:
            return
        rows_B = np.zeros(self.state.step_B.shape[0], bool)
        rows_B[list(rows)] = True
        for r in rows:
            self.programs.evicted.discard(r)
            self.programs.ready.discard(r)
        self.state = release_rows(self.state, rows_B)

    def close_slot(self, slot: int) -> None:
        """A slot whose group is done takes another."""
        self.free.append(slot)
        self.free.sort()
