"""Multi-turn rollouts on the paged KV cache on a mesh that splits the batch: one page pool
and one set of paged_turns.py programs per batch shard, each on one device.

The rows are split into D shards of whole groups (D: the mesh's batch shards, the data,
fsdp and expert axes; paged_mesh.shards). Shard d's rows run in their own pool of
--kv_cache_tokens on the mesh's d-th device, under paged_turns.py's policy inside that pool
(stall, serve the lowest waiting row first, evict the highest), with the weights copied to
each device once. multiturn.py's host loop sees one state over every row (ShardedState: the
shards' per-row arrays, concatenated in row order) and one set of programs
(ShardedPrograms): a segment is started on every shard before the loop waits for any, so the
shards decode at the same time; a reply goes to its row's shard. A row draws its tokens with
its own key (fold_in(row_key, t)), so the samples are the ones one device draws.

Refused (check_mesh): a mesh with another axis of size > 1 (tensor), since a shard's programs
run on one device, and a batch whose shards would split a group (paged_mesh.check_rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.sampling import buckets, paged_mesh, paged_turns
from jaxrl4llm.sampling.row_io import PromptRows
from jaxrl4llm.sampling.turn_programs import RolloutSettings, TurnState


def check_mesh(
    mesh: Mesh | AbstractMesh | None, rules: parallel.LogicalRules = parallel.DEFAULT_RULES
) -> int:
    """The batch shards (pools) of `mesh` (1 without one); refuses a mesh with an axis of
    size > 1 that does not split the batch."""
    if mesh is None:
        return 1
    axes = paged_mesh.batch_axes(mesh, rules)
    other = {a: n for a, n in mesh.shape.items() if n > 1 and a not in axes}
    if other:
        split = ",".join(f"{a}:{n}" for a, n in other.items())
        raise FlagError(
            "Multi-turn rollouts (--env, --max_turns > 1) on the paged engine "
            "(--rollout_engine=paged) run one page pool per batch shard, each on one device: "
            f"--mesh splits {split}; use a mesh whose only axes of size > 1 are data, fsdp "
            "and expert, or --rollout_engine=compacted."
        )
    return paged_mesh.shards(mesh, rules)


@dataclasses.dataclass(frozen=True)
class ShardedState:
    """The shards' TurnStates, read by the host loop as one state over every row."""

    shards: tuple[TurnState, ...]

    def _rows(self, name: str) -> np.ndarray:
        return np.concatenate(jax.device_get([getattr(s, name) for s in self.shards]))

    tokens_BT = property(lambda self: self._rows("tokens_BT"))
    logprobs_BT = property(lambda self: self._rows("logprobs_BT"))
    model_BT = property(lambda self: self._rows("model_BT"))
    step_B = property(lambda self: self._rows("step_B"))
    live_B = property(lambda self: self._rows("live_B"))
    ended_B = property(lambda self: self._rows("ended_B"))
    turn_start_B = property(lambda self: self._rows("turn_start_B"))

    @property
    def slot_steps(self) -> int:
        return sum(int(s) for s in jax.device_get([s.slot_steps for s in self.shards]))

    def clear_ended(self) -> ShardedState:
        return ShardedState(tuple(s.clear_ended() for s in self.shards))


@dataclasses.dataclass(eq=False)
class ShardedPrograms:
    """paged_turns.PagedPrograms per shard, run as multiturn.py's host loop runs one set:
    a call for a row goes to its shard (rows `rows` per shard, in order), a call for every
    row to every shard, each on its device."""

    shards: tuple[paged_turns.PagedPrograms, ...]
    devices: tuple[jax.Device, ...]
    rows: int

    def _on(self, d: int, call: Callable[..., TurnState], *args: Any) -> TurnState:
        with jax.default_device(self.devices[d]):  # the call's new arrays start there
            return call(*args)

    def _each(self, state: ShardedState, method: str, *args: Any) -> ShardedState:
        return ShardedState(
            tuple(
                self._on(d, getattr(p, method), s, *args)
                for d, (p, s) in enumerate(zip(self.shards, state.shards))
            )
        )

    def _row(self, state: ShardedState, row: int, method: str, *args: Any) -> ShardedState:
        d, local = divmod(row, self.rows)
        shards = list(state.shards)
        shards[d] = self._on(d, getattr(self.shards[d], method), shards[d], local, *args)
        return ShardedState(tuple(shards))

    def segment(self, state: ShardedState) -> ShardedState:
        """Every shard's segment started, then waited for: the shards decode together."""
        state = self._each(state, "segment", False)
        jax.block_until_ready([s.ended_B for s in state.shards])
        return state

    def observe(self, state: ShardedState, row: int, obs: list[int], pad_id: int) -> ShardedState:
        return self._row(state, row, "observe", obs, pad_id)

    def finish(self, state: ShardedState, row: int) -> ShardedState:
        return self._row(state, row, "finish")

    def unblock(self, state: ShardedState) -> ShardedState:
        return self._each(state, "unblock")

    def pages_left(self, state: ShardedState) -> int:
        return sum(p.pages_left(s) for p, s in zip(self.shards, state.shards))

    @property
    def evictions(self) -> int:
        return sum(p.evictions for p in self.shards)


def start(
    weights: Any,
    rows: PromptRows,
    settings: RolloutSettings,
    kv_cache_tokens: int,
    mesh: Mesh,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
) -> tuple[ShardedState, ShardedPrograms]:
    """paged_turns.start on each batch shard of `mesh`, on its device, with a pool of
    `kv_cache_tokens` each (0: every row of the shard at full length)."""
    D = check_mesh(mesh, rules)
    B = rows.batch.prompt_BP.shape[0]
    paged_mesh.check_rows(B, D, rows.prompt_group)
    n = B // D
    devices = tuple(mesh.devices.flat)
    states, programs = [], []
    for d, device in enumerate(devices):
        part = slice(d * n, (d + 1) * n)
        local = jax.device_put(
            (weights, rows.keys_B[part], settings.stop_ids_S, settings.stop_BQL[part]), device
        )
        shard_rows = PromptRows(
            _batch_rows(rows.batch, part, d * n),
            local[1],
            None if rows.greedy_B is None else rows.greedy_B[part],
            rows.prompt_group,
        )
        shard_settings = settings._replace(stop_ids_S=local[2], stop_BQL=local[3])
        with jax.default_device(device):
            state, shard = paged_turns.start(local[0], shard_rows, shard_settings, kv_cache_tokens)
        states.append(state)
        programs.append(shard)
    return ShardedState(tuple(states)), ShardedPrograms(tuple(programs), devices, n)


def _batch_rows(batch: buckets.PromptBatch, part: slice, first: int) -> buckets.PromptBatch:
    """Rows `part` (from row `first`) of `batch`, its padding rows past num_rows kept so."""
    arrays = {
        f.name: getattr(batch, f.name)[part]
        for f in dataclasses.fields(batch)
        if f.name != "num_rows"
    }
    num_rows = min(max(batch.num_rows - first, 0), part.stop - part.start)
    return buckets.PromptBatch(**arrays, num_rows=num_rows)
