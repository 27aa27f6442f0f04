"""Partial rollouts' rounds (partial.py) on one pool of KV pages kept for the whole step
(sampling.paged_rounds.StepPool, one per batch shard on a mesh), where the paged engine runs
on one host: a row that goes on in a later round of the step keeps its pages and prefills
nothing. What a
round samples is partial.sample_round's, row for row (the same keys, caps and rows run):

  - a group no row of which has started: its prompt prefilled once into the pool, its G rows
    decoded, each up to --partial_rollout_tokens tokens;
  - an unfinished row of a group begun in an earlier step (its KV would be the old policy's):
    its prompt and completion so far prefilled into fresh pages, then decoded;
  - an unfinished row of a group begun earlier in this step: decoded on from its pages;
  - a row that finished (stop token, or --max_new_tokens tokens) returns its pages; a group
    whose rows all finished frees its slot for the next group.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.sampling import row_io
from jaxrl4llm.sampling.paged_rounds import StepPool


def applies(sampler: Any) -> bool:
    """The paged engine (--rollout_engine=paged) on one host (on a mesh, a pool per batch
    shard)."""
    return getattr(sampler, "kv_cache_tokens", None) is not None and jax.process_count() == 1


class PoolRounds:
    """A step's rounds on one pool (made at the first round); `sample_round` as
    partial.sample_round."""

    def __init__(
        self,
        sampler: Any,
        params: Any,
        rollout: Any,
        extend: Callable[..., Any],
        work: Callable[..., Any],
    ):
        self.sampler, self.params, self.rollout = sampler, params, rollout
        self.extend, self.work = extend, work  # partial.extend, partial.RoundWork
        self.G, self.T = rollout.group_size, rollout.max_new_tokens
        self._pool: StepPool | None = None
        self.slot: dict[int, int] = {}  # id(group) -> its slot, for groups in the pool

    @classmethod
    def of(cls, sampler: Any, *args: Any) -> PoolRounds | None:
        """The step's rounds on a pool where it `applies`, else None."""
        return cls(sampler, *args) if applies(sampler) else None

    @property
    def pool(self) -> StepPool:
        if self._pool is None:
            r = self.rollout
            self._pool = StepPool(
                self.sampler,
                self.params,
                r.sampling,
                slots=r.prompts_per_step,
                group=self.G,
                max_new_tokens=self.T,
                max_prompt_tokens=r.max_prompt_tokens,
            )
        return self._pool

    def _cap(self, length: int, budget: int) -> int:
        """The most tokens a row of `length` tokens may have at the end of a round."""
        return length + min(budget, self.T - length)

    def sample_round(
        self, groups: Sequence[Any], rollout: Any, key: jax.Array
    ) -> tuple[list[Any], Any]:
        """One round of `groups` (partial.Group): the groups extended and the round's work
        (partial.RoundWork: rows computed by decode steps, tokens decoded, tokens prefilled)."""
        G, pool = self.G, self.pool
        budget = min(rollout.partial_rollout_tokens, self.T)
        keys_R = row_io.sample_keys(
            key, jnp.arange(len(groups) * G), jnp.zeros(len(groups) * G, jnp.int32)
        )
        before = (pool.slot_steps, pool.prefilled)
        ran = self._resume(groups, keys_R, budget)  # first: it tells the fresh groups apart
        ran += self._start_fresh(groups, keys_R, budget)
        pool.run()
        part = pool.read([r for _, _, r, _ in ran], [a for *_, a in ran], budget)
        parts = {i: no_part(G, budget) for i in range(len(groups))}
        for n, (i, j, _, _) in enumerate(ran):
            for x, y in zip(parts[i], (part.tokens_RN, part.logprobs_RN, part.lengths_R)):
                x[j] = y[n]
            parts[i][3][j] = part.stopped_R[n]
        ends = part.stopped_R | (np.array([a for *_, a in ran]) + part.lengths_R >= self.T)
        pool.finish([r for (_, _, r, _), end in zip(ran, ends) if end])
        out = []
        for i, g in enumerate(groups):
            new, slot = self.extend(g, *parts[i]), self.slot.pop(id(g))
            if new.done:
                pool.close_slot(slot)
            else:
                self.slot[id(new)] = slot
            out.append(new)
        work = (pool.slot_steps - before[0], int(part.lengths_R.sum()), pool.prefilled - before[1])
        return out, self.work(*work)

    def _start_fresh(
        self, groups: Sequence[Any], keys_R: jax.Array, budget: int
    ) -> list[tuple[int, int, int, int]]:
        """Groups no row of which has started, into the pool; their rows (group i, row j,
        pool row, first index of the round's tokens)."""
        G = self.G
        fresh = [
            i for i, g in enumerate(groups) if id(g) not in self.slot and not g.lengths_G.any()
        ]
        if not fresh:
            return []
        rows = np.array([i * G + j for i in fresh for j in range(G)])
        slots = self.pool.start([groups[i].prompt for i in fresh], keys_R[rows], budget)
        self.slot.update((id(groups[i]), s) for i, s in zip(fresh, slots))
        return [(i, j, s * G + j, 0) for i, s in zip(fresh, slots) for j in range(G)]

    def _resume(
        self, groups: Sequence[Any], keys_R: jax.Array, budget: int
    ) -> list[tuple[int, int, int, int]]:
        """The unfinished rows of started groups: those begun in an earlier step placed (and
        prefilled as pages allow), those of this step's groups going on from their pages."""
        G = self.G
        carried: list[tuple[int, int, int, int]] = []
        going: list[tuple[int, int, int, int]] = []
        for i, g in enumerate(groups):
            if id(g) in self.slot:
                target = going
            elif g.lengths_G.any():
                target, self.slot[id(g)] = carried, self.pool.take_slot()
            else:
                continue  # no row started: _start_fresh
            s = self.slot[id(g)]
            target += [(i, j, s * G + j, int(g.lengths_G[j])) for j in _unfinished(g)]
        for rows, place in ((carried, True), (going, False)):
            if not rows:
                continue
            keys = keys_R[np.array([i * G + j for i, j, _, _ in rows])]
            caps = [self._cap(a, budget) for *_, a in rows]
            if place:
                tokens = [groups[i].tokens_GT[j, :a] for i, j, _, a in rows]
                prompts = [groups[i].prompt for i, *_ in rows]
                self.pool.carry([r for _, _, r, _ in rows], prompts, (tokens, keys, caps))
            else:
                self.pool.go_on([r for _, _, r, _ in rows], keys, caps)
        return carried + going


def _unfinished(group: Any) -> list[int]:
    return [int(j) for j in np.flatnonzero(~group.done_G)]


def no_part(G: int, budget: int) -> tuple[np.ndarray, ...]:
    """A group's part of a round before its rows run (rows that do not run keep it)."""
    return (
        np.zeros((G, budget), np.int32),
        np.zeros((G, budget), np.float32),
        np.zeros(G, np.int32),
        np.zeros(G, bool),
    )
