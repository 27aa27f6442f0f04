"""A partial-rollout step's rounds (train/rollout/partial.py) on one pool of KV pages: rows keep
their pages from one round of a step to the next, so a row that goes on in a later round of
the same step (the same weights) prefills nothing; only a group's prompt (once, when it
starts) and a row begun in an earlier step (its KV is the old policy's) are prefilled.

`StepPool` holds `slots` groups of G rows (TurnState row slot * G + g) in a pool of pages
(paged_turn_programs.PagedKV; paged_turns.pool_pages: the sampler's --kv_cache_tokens, or
the rows decoding at once at full length) and runs the multi-turn engine's paged programs and
memory policy on them (paged_turns.PagedPrograms), a round being a turn without an
observation; at most the sampler's max_rows (--rollout_micro_batch) rows decode at once:

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

On a mesh (one host), a pool per batch shard, as paged_turns_mesh.py lays out multi-turn
rollouts: shard d holds slots [d * S, (d + 1) * S) (S = slots / D) and their rows, a new
group goes to the shard with the most free slots, each program runs on every shard at once
(paged_round_programs.run_on_shards; a shard's heads and pool split over its devices where
the mesh has tensor) and the memory policy runs per shard on the host. The device programs:
paged_round_programs.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.sampling import buckets, decode, paged, paged_mesh, paged_turns, turn_programs
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling import paged_turn_programs as programs_lib
from jaxrl4llm.sampling import paged_turns_mesh as mesh_lib
from jaxrl4llm.sampling.paged_round_programs import empty_state, run_on_shards, run_program
from jaxrl4llm.sampling.row_io import stop_id_array
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turn_programs import TurnState

EOS = 2  # turn_programs._emit's code of a turn ended by a stop token


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


@functools.partial(jax.jit, static_argnums=3)
def _window(s: TurnState, rows_R: jax.Array, starts_R: jax.Array, width: int) -> dict:
    """Rows rows_R's completion columns [starts_R, starts_R + width) (clipped), their steps and
    how their last turn ended."""
    cols_RN = starts_R[:, None] + jnp.arange(width)[None, :]
    take = lambda x: x.at[rows_R[:, None], cols_RN].get(mode="clip")  # noqa: E731
    return {
        "tokens": take(s.tokens_BT),
        "logprobs": take(s.logprobs_BT),
        "step": s.step_B[rows_R],
        "ended": s.ended_B[rows_R],
    }


class StepPool:
    """One step's rounds on a pool of pages (module docstring); rows are slot * G + g. On a mesh
    splitting the batch, a pool per batch shard: shard d holds slots [d * S, (d + 1) * S) and
    their rows (paged_turns_mesh's layout, its memory policy per shard)."""

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
        mesh = sampler.mesh if sampler.mesh is not None and sampler.mesh.size > 1 else None
        self.mesh, self.rules = mesh, sampler.rules
        D = self.D = paged_mesh.shards(mesh, sampler.rules)
        slots = -(-slots // D) * D  # as many in each shard; the spare ones stay free
        config, B, W = sampler.model_config, slots * group, max_prompt_tokens
        self.sampler, self.G, self.T, self.width, self.n = sampler, group, max_new_tokens, W, B // D
        # At most the sampler's max_rows decode at once (its shard's part; the default pool
        # holds them at full length), as the single-turn engine's.
        self.max_rows = paged.shard_decode_rows(sampler.max_rows, D, group)
        rows = paged_turns.decoding_rows(self.n, self.max_rows)
        self.num_pages = paged_turns.pool_pages(
            sampler.kv_cache_tokens or 0, rows, W, max_new_tokens
        )
        self.M = pages_lib.pages_for(W + max_new_tokens, paged.PAGE_SIZE)
        weights = turn_programs.decode_weights(params, config, None)
        if mesh is not None:
            weights = mesh_lib.placed_weights(weights, config, mesh, sampler.rules)
        self.shards = [self._programs(weights, sampling, d) for d in range(D)]
        # The segments' stop ids and every row's stop sequences (none), the shards' end to end.
        p = self.shards[0]
        self._stops = (p.stop_ids_S, jnp.concatenate([p.stop_BQL] * D))
        self.state = self._empty(weights)
        self.free = [list(range(d * slots // D, (d + 1) * slots // D)) for d in range(D)]
        self.prompt_prefilled = 0

    def _programs(self, weights: Any, sampling: SamplingConfig, d: int) -> _Counted:
        """Shard d's memory policy over its n rows (paged_turns.PagedPrograms)."""
        n, W, pad = self.n, self.width, self.sampler.pad_id
        batch = buckets.PromptBatch(
            np.full((n, W), pad, np.int32), np.zeros((n, W), bool), np.zeros(n, bool),
            np.zeros(n, bool), np.arange(n), np.zeros(n, np.int32), n,
        )  # fmt: skip
        lib: Any = programs_lib
        if self.mesh is not None:
            lib = mesh_lib.ShardPrograms(d, self.D, n, self.mesh, self.rules)
        stop_ids = jnp.asarray(stop_id_array(self.sampler.stop_ids))
        stop_BQL = jnp.full((n, 1, 1), -1, jnp.int32)
        config = self.sampler.model_config
        return _Counted(weights, stop_ids, stop_BQL, config, sampling, batch, np.zeros(n, np.int32),
                        int(pad), lib=lib, max_rows=self.max_rows)  # fmt: skip

    def _empty(self, weights: Any) -> TurnState:
        """Every shard's rows holding no page, its pool free (laid end to end on a mesh)."""
        one = empty_state(
            jnp.int32(self.sampler.pad_id), model_config=self.sampler.model_config,
            rows=self.n, budget=self.T, num_pages=self.num_pages, M=self.M,
            dtype=decode.cache_dtype_for(weights),
        )  # fmt: skip
        if self.mesh is None:
            return one
        tiled = jax.tree.map(lambda x: jnp.concatenate([x.reshape(-1, *x.shape[1:])] * self.D), one)
        return jax.device_put(tiled, mesh_lib.layout(tiled, self.mesh, self.rules))

    def _run(self, program: str, whole: tuple, split: tuple, **static: Any) -> None:
        settings = tuple(sorted(static.items()))
        if self.mesh is None:
            self.state = run_program(self.state, whole, split, program=program, static=settings)
        else:
            self.state = run_on_shards(
                self.state, whole, split, program=program, static=settings, mesh=self.mesh,
                rules=self.rules,
            )  # fmt: skip

    def _view(self, d: int) -> Any:
        return self.state if self.mesh is None else mesh_lib.ShardView(self.state, d, self.D)

    @property
    def prefilled(self) -> int:
        """Prompt and history tokens prefilled so far (a group's prompt once, restores)."""
        return self.prompt_prefilled + sum(p.prefilled for p in self.shards)

    @property
    def slot_steps(self) -> int:
        """Rows computed by the decode steps so far."""
        return int(np.sum(jax.device_get(self.state.slot_steps)))

    def _place_prompt(self, row: int, prompt: Sequence[int]) -> None:
        """The host's copy of row `row`'s prompt (restores prefill it again)."""
        d, r = divmod(row, self.n)
        batch, W = self.shards[d].batch, self.width
        batch.prompt_BP[r] = self.sampler.pad_id
        batch.mask_BP[r] = False
        batch.prompt_BP[r, W - len(prompt) :] = prompt
        batch.mask_BP[r, W - len(prompt) :] = True
        batch.active_B[r] = True
        self.shards[d].plen_B[r] = len(prompt)

    def take_slot(self) -> int:
        """A free slot, in the shard with the most free slots."""
        return max(self.free, key=len).pop(0)

    def start(self, prompts: Sequence[Sequence[int]], keys_R: jax.Array, caps: int) -> list[int]:
        """New groups of `prompts` in free slots (returned), row g of group j keyed keys_R[j *
        G + g], capped at `caps` tokens."""
        G, S = self.G, self.n // self.G
        slots = [self.take_slot() for _ in prompts]
        for j, slot in enumerate(slots):
            for g in range(G):
                self._place_prompt(slot * G + g, prompts[j])
        by_shard = [[j for j, slot in enumerate(slots) if slot // S == d] for d in range(self.D)]
        Jp = buckets.two_per_octave(max(map(len, by_shard)))
        P = max(buckets.bucket_prompt_length(max(len(p), 1)) for p in prompts)
        refs = np.asarray(jax.device_get(self.state.cache.pool.refs_N)).reshape(self.D, -1)
        parts = [
            self._shard_start(prompts, slots, js, (Jp, P), np.flatnonzero(refs[d] == 0))
            for d, js in enumerate(by_shard)
        ]
        inputs = tuple(np.concatenate(x) for x in zip(*(part[0] for part in parts)))
        pages = jax.tree.map(lambda *x: jnp.concatenate(x), *(part[1] for part in parts))
        split = ((*inputs[:3], keys_R[inputs[3]], np.full(len(inputs[3]), caps, np.int32)), pages)
        p = self.shards[0]  # a shard's programs read its own rows' stop sequences
        whole = (p.weights, (p.stop_ids_S, p.stop_BQL), jnp.int32(self.sampler.pad_id))
        config, sampling = self.sampler.model_config, self.shards[0].sampling
        self._run("start", whole, split, model_config=config, sampling=sampling, group=G)
        self.prompt_prefilled += sum(len(p) for p in prompts)
        for d, (_, _, waiting) in enumerate(parts):
            self._wait(d, waiting)
        return slots

    def _shard_start(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        js: Sequence[int],
        shape: tuple[int, int],
        free_F: np.ndarray,
    ) -> tuple[tuple[np.ndarray, ...], programs_lib.PromptPages, np.ndarray]:
        """One shard's part of `start`, Jp groups of P-token prompts (groups js, then padding
        groups that write nowhere): (prompts, masks, its rows (n: none), each row's index
        in keys_R), the pages of the groups that fit, its rows that wait for pages."""
        (Jp, P), G, pad = shape, self.G, self.sampler.pad_id
        prompt_JP, mask_JP = np.full((Jp, P), pad, np.int32), np.zeros((Jp, P), bool)
        rows_R, key_R = np.full(Jp * G, self.n, np.int32), np.zeros(Jp * G, np.int32)
        for i in range(Jp):
            p = prompts[js[min(i, len(js) - 1)] if js else 0]
            prompt_JP[i, P - len(p) :], mask_JP[i, P - len(p) :] = p, True
        for i, j in enumerate(js):
            rows_R[i * G : (i + 1) * G] = slots[j] * G % self.n + np.arange(G)
            key_R[i * G : (i + 1) * G] = j * G + np.arange(G)
        active_R = rows_R < self.n
        plen_R = np.repeat(mask_JP.sum(axis=1), G)
        ps = paged.PAGE_SIZE
        pages = programs_lib.initial_pages(
            plen_R, active_R, G, self.num_pages, self.M, P, ps, free_F
        )
        waiting = rows_R[active_R & ~np.asarray(pages.admitted_B)]
        return (prompt_JP, mask_JP, rows_R, key_R), pages, waiting

    def _wait(self, d: int, rows: np.ndarray) -> None:
        """Shard d's rows `rows` (its own indices) hold no page; they go on once restored
        (unless their turn ended)."""
        ended = np.asarray(jax.device_get(self.state.ended_B)).reshape(self.D, -1)[d]
        for r in rows.tolist():
            self.shards[d].evicted.add(r)
            if not ended[r]:
                self.shards[d].ready.add(r)

    def _by_shard(self, rows: Sequence[int], width: int) -> tuple[np.ndarray, list[list[int]]]:
        """Where each shard's part of rows `rows` goes in [D * width] arrays (the shards'
        parts padded to `width` with row n, which names none), and each shard's rows' indices."""
        at, picks = np.full(self.D * width, -1), []
        for d in range(self.D):
            mine = [i for i, r in enumerate(rows) if r // self.n == d]
            at[d * width : d * width + len(mine)] = mine
            picks.append(mine)
        return at, picks

    def carry(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], done: Any) -> None:
        """Rows begun in an earlier step: `done` = (tokens so far per row, keys_R, caps_R (the
        most tokens each may have at the end of the round))."""
        completions, keys_R, caps = done
        for row, prompt in zip(rows, prompts):
            self._place_prompt(row, prompt)
        counts = np.bincount(np.asarray(rows) // self.n, minlength=self.D)
        width = buckets.two_per_octave(int(counts.max()))
        at, picks = self._by_shard(rows, width)
        real = at >= 0
        take = np.where(real, at, 0)
        tokens_RT = np.full((len(at), self.T), self.sampler.pad_id, np.int32)
        for k in np.flatnonzero(real):
            tokens_RT[k, : len(completions[at[k]])] = completions[at[k]]
        local = np.where(real, np.asarray(rows)[take] % self.n, self.n).astype(np.int32)
        plen = np.array([len(prompts[i]) for i in take], np.int32)
        steps = np.array([len(completions[i]) for i in take], np.int32)
        split = (local, plen, tokens_RT, steps, keys_R[take], np.asarray(caps, np.int32)[take])
        self._run("place", (), split)
        for d, mine in enumerate(picks):
            self._wait(d, np.array([rows[i] % self.n for i in mine], np.int64))

    def go_on(self, rows: Sequence[int], keys_R: jax.Array, caps: Sequence[int]) -> None:
        """Rows of this step go on, keyed keys_R, up to caps[i] tokens in all."""
        B = self.D * self.n
        rows_B, caps_B = np.zeros(B, bool), np.zeros(B, np.int32)
        rows_B[list(rows)] = True
        caps_B[list(rows)] = caps
        keys_B = self.state.keys_B.at[np.asarray(rows, np.int32)].set(keys_R)
        evicted_B = np.zeros(B, bool)
        for d, p in enumerate(self.shards):
            evicted_B[[d * self.n + r for r in p.evicted]] = True
        self._run("go_on", (), (rows_B, ~evicted_B, keys_B, caps_B))
        for r in rows:
            if evicted_B[r]:
                self.shards[r // self.n].ready.add(r % self.n)

    def _unblock(self) -> None:
        for d, p in enumerate(self.shards):
            out: Any = p.unblock(self._view(d))
            self.state = out if self.mesh is None else out.state

    def run(self) -> None:
        """Decodes until no row decodes or waits for pages."""
        self._unblock()
        static = dict(model_config=self.sampler.model_config, sampling=self.shards[0].sampling)
        static.update(max_steps=self.T, until_turn_end=False, max_rows=self.max_rows)
        while bool(jax.device_get(jnp.any(self.state.live_B))):
            if self.mesh is None:
                self.state = programs_lib.segment(
                    self.shards[0].weights, self.state, self._stops, **static
                )
            else:
                self.state = mesh_lib.segment_shards(
                    self.shards[0].weights, self.state, self._stops, mesh=self.mesh,
                    rules=self.rules, **static,
                )  # fmt: skip
            self._unblock()

    def read(self, rows: Sequence[int], starts: Sequence[int], width: int) -> Part:
        """What rows `rows` decoded since completion index starts[i], `width` columns (only
        those columns of those rows leave the devices)."""
        R = len(rows)
        Rp = buckets.two_per_octave(max(R, 1))  # a few shapes of the read
        rows_R, starts_R = np.zeros(Rp, np.int32), np.zeros(Rp, np.int32)
        rows_R[:R], starts_R[:R] = rows, starts
        got = jax.device_get(_window(self.state, rows_R, starts_R, width))
        n_R = got["step"][:R] - np.asarray(starts, np.int32)
        keep = np.arange(width)[None, :] < n_R[:, None]
        return Part(
            np.where(keep, got["tokens"][:R], self.sampler.pad_id).astype(np.int32),
            np.where(keep, got["logprobs"][:R], 0.0).astype(np.float32),
            n_R.astype(np.int32),
            got["ended"][:R] == EOS,
        )

    def finish(self, rows: Sequence[int]) -> None:
        """Rows that will not run again return their pages."""
        if not rows:
            return
        rows_B = np.zeros(self.D * self.n, bool)
        rows_B[list(rows)] = True
        for r in rows:
            self.shards[r // self.n].evicted.discard(r % self.n)
            self.shards[r // self.n].ready.discard(r % self.n)
        self._run("release", (), (rows_B,))

    def close_slot(self, slot: int) -> None:
        """A slot whose group is done takes another."""
        shard = self.free[slot * self.G // self.n]
        shard.append(slot)
        shard.sort()
