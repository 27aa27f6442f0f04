"""Multi-turn rollouts: the host loop that stops a row at its turn end, hands the turn to a
`turns.TurnHandler` and resumes the row with the reply's observation tokens. The compiled
programs it runs (prefill, segment, observe) and their device state are turn_programs.py's
(a dense cache row per row) or, with `kv_cache_tokens`, paged_turns.py's (a pool of pages;
rows that wait for pages are served by its `unblock`, which the loop calls every round; on a
mesh a pool per batch shard, paged_turns_mesh.py).

The host loop runs a segment, submits the turns that ended in it (handler.submit never
blocks), takes the replies that are ready (handler.poll: without waiting while some row
decodes, else up to POLL_S seconds), prefills each reply's observation into its row and runs
the next segment (at most SEGMENT_STEPS decode steps). A row waiting for its reply is parked:
it emits nothing and its step, tokens and budget stay as they are while the other rows decode.
The loop ends when no row decodes and no reply is due.

A row draws completion token t with fold_in(row_key, t) (t over model and observation
tokens), so a row whose first turn is its only one samples what sampler.generate samples.
Observation tokens carry logprob 0 and are off `mask_BT` (the model-token mask).

On a mesh (one host) the rows are split over the data-parallel devices; the samples are the
one-device ones. Several hosts are refused (MULTIHOST).

Limits (turns.TurnLimits): a turn ended by EOS or the budget (max_total_tokens completion
tokens, model and observation) ends the trajectory; so do a reply with `done`, the
max_turns-th turn, and a turn whose observation (cut to max_observation_tokens; an
environment cuts inside its chat template, keeping the template whole) does not fit in the
budget with room for a model token after it: that trajectory ends at the turn, truncated,
and the observation is not appended, so no row trains on a cut template or on a model turn
squeezed into the budget's last token. Every turn end is
submitted, the last one included, and the row finishes when that turn's reply arrives (its
reward counts; its observation is not appended).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import buckets, paged_mesh, paged_turns, paged_turns_mesh, turn_programs
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.row_io import (
    PromptRows,
    RowRequest,
    place_inputs,
    prompt_rows,
    stop_id_array,
)
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turn_programs import (
    DensePrograms,
    Programs,
    TurnState,
    chunk_length,
    stop_sequence_array,
)
from jaxrl4llm.sampling.turns import TurnEnd, TurnHandler, TurnLimits, TurnReply

# How long the host waits for a reply when every row is parked, per poll.
POLL_S = 0.05
# ended_B codes (turn_programs._emit): how this segment's turn of a row ended (0: it did not).
_ENDS: dict[int, TurnEnd] = {1: "stop", 2: "eos", 3: "length"}
# Why several hosts are refused: each host's loop would issue its own observation programs.
MULTIHOST = (
    "Multi-turn rollouts run on one host: the host loop starts a compiled program for each "
    "reply when it arrives, and on several hosts every process must start the same programs "
    "in the same order, which replies arriving at different times on different hosts do "
    "not give. Run on one host (a mesh of its devices works) or with --max_turns=1."
)


@dataclasses.dataclass(frozen=True)
class TurnStats:
    """Per row (this host's rows, numpy) what the turns did, and the rollout's host times.

    reward_B: sum of the replies' rewards. turns_B: model turns. tool_calls_B: replies that
    called a tool. errors_B / timeouts_B / crashes_B: replies with that status.
    observation_tokens_B: observation tokens appended. final_status_B: the status of the
    reply to the row's last turn ("" for a row that never ran, e.g. a dropped prompt).
    decode_s: wall time in the compiled programs; tools_s: the replies' own seconds (host
    time of the steps, overlapping decode); wait_s: time the host waited for replies with
    no row decoding; evictions: rows whose KV was dropped for memory and recomputed later,
    pages_left: KV pages still held when the rollout ended (paged_turns.py; 0: all back)."""

    reward_B: np.ndarray
    turns_B: np.ndarray
    tool_calls_B: np.ndarray
    errors_B: np.ndarray
    timeouts_B: np.ndarray
    crashes_B: np.ndarray
    observation_tokens_B: np.ndarray
    final_status_B: np.ndarray
    decode_s: float = 0.0
    tools_s: float = 0.0
    wait_s: float = 0.0
    evictions: int = 0
    pages_left: int = 0

    @classmethod
    def empty(cls, rows: int) -> TurnStats:
        ints = lambda: np.zeros(rows, np.int32)  # noqa: E731
        return cls(
            np.zeros(rows, np.float32), ints(), ints(), ints(), ints(), ints(), ints(),
            np.full(rows, "", dtype=object),
        )  # fmt: skip

    _ROWS = (
        "reward_B",
        "turns_B",
        "tool_calls_B",
        "errors_B",
        "timeouts_B",
        "crashes_B",
        "observation_tokens_B",
        "final_status_B",
    )

    def take(self, rows: np.ndarray) -> TurnStats:
        return dataclasses.replace(self, **{f: getattr(self, f)[rows] for f in self._ROWS})

    def join(self, *others: TurnStats) -> TurnStats:
        """These rows followed by the others' (times added)."""
        parts = (self, *others)
        rows = {f: np.concatenate([getattr(p, f) for p in parts]) for f in self._ROWS}
        return dataclasses.replace(
            self,
            **rows,
            decode_s=sum(p.decode_s for p in parts),
            tools_s=sum(p.tools_s for p in parts),
            wait_s=sum(p.wait_s for p in parts),
            evictions=sum(p.evictions for p in parts),
            pages_left=sum(p.pages_left for p in parts),
        )


@dataclasses.dataclass(frozen=True)
class TurnVerdicts:
    """The verdicts of multi-turn trajectories (context.RowVerdicts), from their turns:
    reward = the sum of the replies' rewards, correct = a positive reward, failed = the
    reply to the last turn timed out or crashed (the trajectory has no verdict and, like an
    unverified single-turn row, leaves the loss). `stats` carries the turn metrics along
    when rows are taken or joined."""

    stats: TurnStats

    @property
    def rewards(self) -> np.ndarray:
        return self.stats.reward_B

    @property
    def correct(self) -> np.ndarray:
        return self.stats.reward_B > 0

    @property
    def failed(self) -> np.ndarray:
        return np.isin(self.stats.final_status_B, ("timeout", "crash"))

    def take(self, rows: np.ndarray) -> TurnVerdicts:
        return TurnVerdicts(self.stats.take(rows))

    def join(self, *others: TurnVerdicts) -> TurnVerdicts:
        return TurnVerdicts(self.stats.join(*(o.stats for o in others)))

    def metrics(self) -> dict[str, float]:
        """Counts by the last turn's status (as a reward function's reason counts)."""
        statuses, counts = np.unique(self.stats.final_status_B.astype(str), return_counts=True)
        return {f"turn_{s}": float(c) for s, c in zip(statuses, counts) if s}


@dataclasses.dataclass
class _Row:
    """The host's record of one row: its turns and the reply it waits for."""

    turns: int = 0
    waiting: bool = False  # submitted, no reply yet
    final: bool = False  # the submitted turn is the row's last whatever the reply says
    finished: bool = False
    truncated: bool = False


class _HostLoop:
    """The host side of one multi-turn rollout (see the module docstring)."""

    def __init__(self, handler: TurnHandler, limits: TurnLimits, budget: int, rows: int):
        self.handler, self.limits, self.budget = handler, limits, budget
        self.rows = [_Row() for _ in range(rows)]
        self.stats = TurnStats.empty(rows)
        self.tools_s = 0.0
        self.wait_s = 0.0

    def submit_ended(self, ended_B: np.ndarray, step_B: np.ndarray, state: TurnState) -> None:
        """Submits every turn that ended (ended_B > 0) since the last call."""
        ended = np.flatnonzero(ended_B[: len(self.rows)])
        tokens_BT, start_B = jax.device_get((state.tokens_BT, state.turn_start_B))
        for r in ended:
            how = _ENDS[int(ended_B[r])]
            row = self.rows[r]
            row.turns += 1
            self.stats.turns_B[r] = row.turns
            row.waiting = True
            room = self.budget - int(step_B[r]) - 1  # observation tokens that leave a model token
            row.final = how != "stop" or row.turns >= self.limits.max_turns or room < 0
            row.truncated = how == "length" or (how == "stop" and room < 0)
            self.handler.submit(int(r), tokens_BT[r, start_B[r] : step_B[r]].tolist(), how)

    def poll(self, decoding: bool) -> list[TurnReply]:
        t0 = time.perf_counter()
        replies = self.handler.poll(0.0 if decoding else POLL_S)
        if not decoding:
            self.wait_s += time.perf_counter() - t0
        return replies

    def take_reply(self, reply: TurnReply, step: int) -> list[int] | None:
        """Records a reply; the observation tokens to append, or None when the row ends."""
        r = reply.row
        if not 0 <= r < len(self.rows) or not self.rows[r].waiting:
            raise ValueError(
                f"The turn handler replied for row {r}, which has no turn waiting for a "
                f"reply (rows 0..{len(self.rows) - 1}); a reply must answer a submitted turn."
            )
        row, st = self.rows[r], self.stats
        row.waiting = False
        st.reward_B[r] += reply.reward
        st.tool_calls_B[r] += int(reply.tool_call)
        st.errors_B[r] += int(reply.status == "error")
        st.timeouts_B[r] += int(reply.status == "timeout")
        st.crashes_B[r] += int(reply.status == "crash")
        st.final_status_B[r] = reply.status
        self.tools_s += reply.seconds
        obs = [int(t) for t in reply.observation_ids[: self.limits.max_observation_tokens]]
        fits = len(obs) <= self.budget - step - 1  # the observation, then a model token
        if row.final or reply.done or not fits:
            row.finished = True
            row.truncated |= not (row.final or reply.done)  # the budget ended it
            return None
        st.observation_tokens_B[r] += len(obs)
        return obs

    @property
    def due(self) -> bool:
        return any(row.waiting for row in self.rows)


def run(
    params: Any,
    model_config: ModelConfig,
    batch: buckets.PromptBatch,
    keys_B: jax.Array,
    greedy_B: np.ndarray | None,
    handler: TurnHandler,
    limits: TurnLimits,
    sampling: SamplingConfig,
    budget: int,
    *,
    stop_ids_S: np.ndarray,
    pad_id: int,
    prompt_group: int,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    kv_cache_tokens: int | None = None,
    max_rows: int | None = None,
) -> tuple[dict[str, Any], TurnStats]:
    """Decodes every active row of `batch` over its turns; (per-row arrays: tokens_BT,
    logprobs_BT, model_BT, lengths_B, truncated_B, done_B, slot_steps; the turn stats).
    With a mesh (one host), params are placed on it and the rows (a multiple of the
    data-parallel size) are split over its data-parallel devices. `kv_cache_tokens` (not
    None): the KV in a page pool of that many tokens (paged_turns.py; on a mesh one per batch
    shard, paged_turns_mesh.py), at most `max_rows` rows decoding at once (0: all)."""
    _check_limits(limits)
    B = batch.prompt_BP.shape[0]
    stops = [handler.stop_sequences(r) if batch.active_B[r] else () for r in range(B)]
    stop_BQL = jnp.asarray(stop_sequence_array(stops))
    sharding = None if mesh is None else parallel.ActivationSharding(mesh, rules)
    static = dict(model_config=model_config, sampling=sampling, sharding=sharding)
    host = _HostLoop(handler, limits, budget, batch.num_rows)
    t0 = time.perf_counter()
    weights = turn_programs.decode_weights(params, model_config, sharding)
    rows = PromptRows(batch, keys_B, greedy_B, prompt_group)
    stop_ids = jnp.asarray(stop_ids_S)
    chunk = chunk_length(limits.max_observation_tokens + 1)
    settings = turn_programs.RolloutSettings(stop_ids, stop_BQL, pad_id, budget, chunk, static)
    state, programs = _start(weights, rows, settings, mesh, rules, kv_cache_tokens, max_rows)
    state, decode_s = _turn_loop(programs, host, state, t0, pad_id)
    stats = dataclasses.replace(
        host.stats, decode_s=decode_s, tools_s=host.tools_s, wait_s=host.wait_s,
        evictions=programs.evictions, pages_left=programs.pages_left(state),
    )  # fmt: skip
    return _rows_out(state, host, batch), stats


def _start(
    weights: Any,
    rows: PromptRows,
    settings: turn_programs.RolloutSettings,
    mesh: Mesh | None,
    rules: parallel.LogicalRules,
    kv_cache_tokens: int | None,
    max_rows: int | None,
) -> tuple[TurnState, Programs]:
    """The prefilled state and its programs: dense rows, a page pool, or one per shard."""
    if kv_cache_tokens is None:
        return _dense_start(weights, rows, settings, mesh, rules)
    cap = max_rows or 0
    if mesh is None or mesh.size == 1:
        return paged_turns.start(weights, rows, settings, kv_cache_tokens, cap)
    return paged_turns_mesh.start(weights, rows, settings, kv_cache_tokens, mesh, rules, cap)


def _dense_start(
    weights: Any,
    rows: PromptRows,
    settings: turn_programs.RolloutSettings,
    mesh: Mesh | None,
    rules: parallel.LogicalRules,
) -> tuple[TurnState, Programs]:
    """The prompts prefilled into dense cache rows, every row's first token; the programs."""
    stop_ids, stop_BQL, pad_id, budget, chunk, static = settings
    inputs, optional = place_inputs(rows, mesh=mesh, rules=rules)
    state = turn_programs.prefill(
        weights,
        *inputs,
        optional.get("greedy_B"),
        stop_ids,
        stop_BQL,
        jnp.int32(pad_id),
        max_new_tokens=budget,
        chunk=chunk,
        group=rows.prompt_group,
        **static,
    )
    P = rows.batch.prompt_BP.shape[1]
    return state, DensePrograms(weights, stop_ids, stop_BQL, P, static)


def _check_limits(limits: TurnLimits) -> None:
    if limits.max_turns < 1 or limits.max_observation_tokens < 0:
        raise ValueError(
            f"TurnLimits: max_turns={limits.max_turns} must be >= 1 and "
            f"max_observation_tokens={limits.max_observation_tokens} >= 0."
        )


def _turn_loop(
    programs: Programs, host: _HostLoop, state: TurnState, t0: float, pad_id: int
) -> tuple[TurnState, float]:
    """The host loop (module docstring) from the prefilled `state` (its programs started at
    t0) until no row decodes and no reply is due; (the final state, seconds in programs)."""
    decode_s = 0.0
    while True:
        ended_B, step_B, live_B = jax.device_get((state.ended_B, state.step_B, state.live_B))
        decode_s += time.perf_counter() - t0
        if ended_B.any():
            host.submit_ended(ended_B, step_B, state)
            state = state.clear_ended()
        decoding = bool(live_B.any())
        if not decoding and not host.due:
            return state, decode_s
        t0 = time.perf_counter()
        if decoding:
            state = programs.segment(state)
        decode_s += time.perf_counter() - t0
        replies = host.poll(decoding)
        t0 = time.perf_counter()
        if replies:
            state = _take_replies(programs, host, state, replies, pad_id)
        state = programs.unblock(state)  # rows waiting for KV memory (paged_turns.py)


def _take_replies(
    programs: Programs, host: _HostLoop, state: TurnState, replies: list[TurnReply], pad_id: int
) -> TurnState:
    """Records the replies and resumes each row that goes on after its observation."""
    step_B = np.asarray(jax.device_get(state.step_B))
    for reply in replies:
        obs = host.take_reply(reply, int(step_B[reply.row]))
        if obs is not None:
            state = programs.observe(state, reply.row, obs, pad_id)
        else:  # the trajectory ended: its KV memory goes back
            state = programs.finish(state, reply.row)
    return state


def _rows_out(state: TurnState, host: _HostLoop, batch: buckets.PromptBatch) -> dict[str, Any]:
    """The rollout's per-row arrays (numpy; see run)."""
    tokens_BT, logprobs_BT, model_BT, lengths_B, slot_steps = jax.device_get(
        (state.tokens_BT, state.logprobs_BT, state.model_BT, state.step_B, state.slot_steps)
    )
    truncated_B = np.zeros(batch.prompt_BP.shape[0], bool)
    truncated_B[: batch.num_rows] = [row.truncated for row in host.rows]
    return dict(
        tokens_BT=tokens_BT,
        logprobs_BT=np.where(model_BT, logprobs_BT, 0.0).astype(np.float32),
        model_BT=model_BT,
        lengths_B=lengths_B.astype(np.int32),
        truncated_B=truncated_B & batch.active_B,
        slot_steps=np.int32(np.sum(slot_steps)),  # one count per shard on a paged mesh
    )


def generate_turns(
    params: Any,
    model_config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    key: jax.Array,
    handler: TurnHandler,
    limits: TurnLimits,
    *,
    stop_ids: Sequence[int],
    n: int = 1,
    pad_id: int = 0,
    max_prompt_len: int | None = None,
    long_prompts: str = "error",
    min_prompt_bucket: int = buckets.MIN_PROMPT_BUCKET,
    share_prompts: bool = True,
    greedy_last: int = 0,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    kv_cache_tokens: int | None = None,
    max_rows: int | None = None,
) -> tuple[SampleOutput, TurnStats]:
    """`n` multi-turn trajectories of each prompt (token ids), rows laid out as
    sampler.generate's (row p * n + g: sample g of prompt p; the handler's row indices), with
    the same per-row keys. The completion budget is limits.max_total_tokens, or
    `max_new_tokens` when that is 0. With a mesh of one host's devices (params placed on
    it), the rows are split over its data-parallel devices and the cache as the single-turn
    sampler's; the samples are the same as on one device. One host only: see MULTIHOST.
    `kv_cache_tokens`, `max_rows`: as run's (the same samples)."""
    budget = _budget(limits, max_new_tokens)
    request = RowRequest(
        RowLayout(n, share_prompts),
        max_new_tokens=budget,
        max_prompt_len=max_prompt_len,
        long_prompts=long_prompts,
        pad_id=pad_id,
        min_prompt_bucket=min_prompt_bucket,
        greedy_last=greedy_last,
    )
    multiple = 1 if mesh is None else parallel.data_parallel_size(mesh, rules)
    if kv_cache_tokens is not None and paged_mesh.shards(mesh, rules) > 1:
        multiple *= n  # a pool per batch shard, each with whole groups (paged_turns_mesh.py)
    inputs = prompt_rows(prompts, model_config, key, request, batch_multiple=multiple)
    rows, stats = run(
        params, model_config, inputs.batch, inputs.keys_B, inputs.greedy_B, handler, limits,
        sampling, budget, stop_ids_S=stop_id_array(stop_ids), pad_id=pad_id,
        prompt_group=inputs.prompt_group, mesh=mesh, rules=rules,
        kv_cache_tokens=kv_cache_tokens, max_rows=max_rows,
    )  # fmt: skip
    return _turn_output(rows, inputs.batch, budget), stats


def _budget(limits: TurnLimits, max_new_tokens: int) -> int:
    """The completion budget, after refusing several hosts (MULTIHOST)."""
    if jax.process_count() > 1:
        raise ValueError(MULTIHOST)
    budget = limits.max_total_tokens or max_new_tokens
    if not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(f"The completion budget {budget!r} must be a positive int.")
    return int(budget)


def _turn_output(rows: dict[str, Any], batch: buckets.PromptBatch, budget: int) -> SampleOutput:
    """run's per-row arrays as a SampleOutput of the real rows (observation tokens flagged
    in observation_BT, off mask_BT)."""
    real_BT = np.arange(budget)[None, :] < rows["lengths_B"][:, None]
    keep = slice(0, batch.num_rows)
    return SampleOutput(
        tokens_BT=jnp.asarray(rows["tokens_BT"][keep]),
        logprobs_BT=jnp.asarray(rows["logprobs_BT"][keep]),
        mask_BT=jnp.asarray(rows["model_BT"][keep]),
        lengths_B=jnp.asarray(rows["lengths_B"][keep]),
        truncated_B=jnp.asarray(rows["truncated_B"][keep]),
        prompt_tokens_BP=jnp.asarray(batch.prompt_BP[keep]),
        prompt_mask_BP=jnp.asarray(batch.mask_BP[keep] & ~batch.dropped_B[keep, None]),
        dropped_B=jnp.asarray(batch.dropped_B[keep]),
        num_steps=jnp.int32(max(int(rows["lengths_B"].max(initial=0)), 1)),
        slot_steps=jnp.asarray(rows["slot_steps"]),
        observation_BT=jnp.asarray((real_BT & ~rows["model_BT"])[keep]),
    )
