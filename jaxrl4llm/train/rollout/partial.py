"""Partial rollouts (--partial_rollout_tokens=N, --max_staleness=K): a step no longer waits for
its longest completions; rows still generating when the batch is full carry over to the next
step, as in Kimi k1.5's partial rollouts and slime's over-sampling with carried aborts.

What a step trains. The batch keeps its fixed shape, P groups of G rows. The sampler runs in
rounds over P group slots: groups carried from earlier steps first, then new prompts. A round
gives every unfinished row at most N more tokens (cut at --max_new_tokens in total). A group is
finished when all its G rows are (stop token, or --max_new_tokens tokens); rounds go on until P
groups are finished (at most ceil(max_new_tokens / N) rounds: by then the first round's groups
are). The step trains the first P finished groups (carried ones first, then in the order they
finished); later finished groups and unfinished ones wait in the buffer (`Carried`). A group
in the buffer more than K steps (its first tokens came from a policy K + 1 updates old) is
dropped and counted; K = 0 drops every carried group.

Logprobs. A resumed row's behaviour logprobs (`SampleOutput.logprobs_BT`) are the
concatenation of its parts' sampler logprobs, each part from the policy of its own step; they
are kept, and stand wherever a run uses the sampler's logprobs (e.g. a KL-in-reward estimate
when no old logprobs are recomputed). The importance ratio's pi_old is always the trainer's
recomputed logprobs of the full completion under the step's current policy (one proximal
policy, as AReaL's decoupled objective; --norecompute_old_logprobs is refused), so with one
update per step the ratio is 1 and the update is an ordinary policy-gradient step on
possibly stale samples.

Resuming a row: its prompt followed by its completion so far is prefilled as one prompt
(`Sampler.generate(prefixes=...)`, which rebuilds the KV cache) and decoding continues.

Keys. Round i of a step samples with fold_in(step's rollout key, i), and its row r (slots in
buffer order, G rows per group) with the sampler's fold_in(fold_in(round key, r), 0). The
buffer (groups with their tokens, logprobs, ages; prompts drawn but not started) is saved
with each checkpoint (`InFlight.get_state`, in the data state beside the iterator's), so a
resumed run is bit-identical to one that never stopped.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxrl4llm.data.records import Record
from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.sampling import buckets
from jaxrl4llm.sampling.context import RolloutContext
from jaxrl4llm.sampling.frontend import Samples
from jaxrl4llm.sampling.rounds import ScoredRows, on_device
from jaxrl4llm.sampling.sample_output import SampleOutput


@dataclasses.dataclass(frozen=True)
class Group:
    """One prompt's G rows while they are sampled (host numpy, T = --max_new_tokens)."""

    record: Any  # the data record, scored once every row is done
    prompt: tuple[int, ...]  # the prompt's token ids (chat template applied)
    tokens_GT: np.ndarray  # int32: the completion so far, pad after it
    logprobs_GT: np.ndarray  # float32: each token's behaviour logprob (0 after it)
    lengths_G: np.ndarray  # int32
    stopped_G: np.ndarray  # bool: emitted a stop token (the last token kept)
    dropped: bool = False  # prompt over --max_prompt_tokens (--long_prompts=drop): no rows
    age: int = 0  # steps since its first tokens: its staleness if trained now

    @property
    def done_G(self) -> np.ndarray:
        return self.stopped_G | (self.lengths_G >= self.tokens_GT.shape[1])

    @property
    def done(self) -> bool:
        return self.dropped or bool(self.done_G.all())


def new_group(
    record: Any,
    prompt: Sequence[int],
    group_size: int,
    max_new_tokens: int,
    pad_id: int,
    dropped: bool = False,
) -> Group:
    G, T = group_size, max_new_tokens
    return Group(
        record,
        tuple(int(t) for t in prompt),
        np.full((G, T), pad_id, np.int32),
        np.zeros((G, T), np.float32),
        np.zeros(G, np.int32),
        np.zeros(G, bool),
        dropped,
    )


def extend(
    group: Group,
    tokens_GN: np.ndarray,
    logprobs_GN: np.ndarray,
    lengths_G: np.ndarray,
    stopped_G: np.ndarray,
) -> Group:
    """`group` with one round's parts appended to its unfinished rows: part g is the first
    lengths_G[g] of tokens_GN[g] (ending with a stop token where stopped_G[g]), cut where the
    row reaches max_new_tokens (a stop token past the cut is not reached)."""
    T = group.tokens_GT.shape[1]
    tokens, logprobs = group.tokens_GT.copy(), group.logprobs_GT.copy()
    lengths, stopped = group.lengths_G.copy(), group.stopped_G.copy()
    for g in np.flatnonzero(~group.done_G):
        start = int(lengths[g])
        n = min(int(lengths_G[g]), T - start)
        tokens[g, start : start + n] = tokens_GN[g, :n]
        logprobs[g, start : start + n] = logprobs_GN[g, :n]
        lengths[g] = start + n
        stopped[g] = bool(stopped_G[g]) and n == int(lengths_G[g])
    return dataclasses.replace(
        group, tokens_GT=tokens, logprobs_GT=logprobs, lengths_G=lengths, stopped_G=stopped
    )


@dataclasses.dataclass(frozen=True)
class Carried:
    """What a step leaves to the next: its groups (finished ones waiting for a batch first,
    then those still generating) and the prompts drawn from the data iterator but not yet
    started."""

    groups: tuple[Group, ...] = ()
    pending: tuple[Any, ...] = ()

    def to_state(self) -> dict[str, Any]:
        """JSON (the checkpoint's data item): exact, float32 logprobs round-trip as floats."""

        def group(g: Group) -> dict[str, Any]:
            rows = [
                (g.tokens_GT[i, :n].tolist(), g.logprobs_GT[i, :n].tolist())
                for i, n in enumerate(g.lengths_G)
            ]
            return {
                "record": _record_state(g.record),
                "prompt": list(g.prompt),
                "tokens": [t for t, _ in rows],
                "logprobs": [lp for _, lp in rows],
                "stopped": g.stopped_G.tolist(),
                "dropped": g.dropped,
                "age": g.age,
            }

        return {
            "groups": [group(g) for g in self.groups],
            "pending": [_record_state(r) for r in self.pending],
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any] | None, group_size: int, max_new_tokens: int, pad_id: int
    ) -> "Carried":
        if not state:
            return cls()
        groups = []
        for s in state["groups"]:
            g = new_group(
                _record(s["record"]),
                s["prompt"],
                group_size,
                max_new_tokens,
                pad_id,
                bool(s["dropped"]),
            )
            for i, (tokens, logprobs) in enumerate(zip(s["tokens"], s["logprobs"])):
                g.tokens_GT[i, : len(tokens)] = tokens
                g.logprobs_GT[i, : len(tokens)] = logprobs
                g.lengths_G[i] = len(tokens)
            g.stopped_G[:] = s["stopped"]
            groups.append(dataclasses.replace(g, age=int(s["age"])))
        return cls(tuple(groups), tuple(_record(r) for r in state["pending"]))


def _record_state(record: Any) -> Any:
    return {"record": record.to_dict()} if isinstance(record, Record) else {"value": record}


def _record(state: dict[str, Any]) -> Any:
    return Record.from_dict(state["record"]) if "record" in state else state["value"]


def _start_groups(ctx: RolloutContext, records: Sequence[Any]) -> list[Group]:
    """New groups of `records`: prompts encoded and checked against --max_prompt_tokens
    (PromptTooLongError, or dropped groups with --long_prompts=drop)."""
    r, sampler = ctx.rollout, ctx.sampler
    prompts = sampler.encode([ctx.data.messages(x) for x in records])
    checked = buckets.prepare_batch(
        prompts,
        n=1,
        max_prompt_len=r.max_prompt_tokens,
        long_prompts=r.long_prompts,
        pad_id=sampler.pad_id,
        vocab_size=sampler.model_config.vocab_size,
    )
    return [
        new_group(x, p, r.group_size, r.max_new_tokens, sampler.pad_id, bool(drop))
        for x, p, drop in zip(records, prompts, checked.dropped_B)
    ]


def sample_round(
    sampler: Any, params: Any, groups: Sequence[Group], sampling: Any, budget: int, key: jax.Array
) -> tuple[list[Group], int]:
    """One round: every unfinished row of `groups` continues by up to `budget` tokens (one
    sampler call over all their rows; finished rows run from their bare prompt and their
    tokens are discarded, so the call's shape stays fixed). Returns the groups and the
    decode loop's work (slot steps)."""
    prompts, prefixes = [], []
    for g in groups:
        for i, done in enumerate(g.done_G):
            prompts.append(g.prompt)
            prefixes.append(() if done else g.tokens_GT[i, : g.lengths_G[i]].tolist())
    out = jax.device_get(
        sampler.generate(params, prompts, sampling, budget, key, prefixes=prefixes)
    )
    G = groups[0].tokens_GT.shape[0]
    split = [
        np.asarray(x).reshape(len(groups), G, *np.shape(x)[1:])
        for x in (out.tokens_BT, out.logprobs_BT, out.lengths_B, out.truncated_B)
    ]
    extended = [extend(g, tok, lp, n, ~trunc) for g, tok, lp, n, trunc in zip(groups, *split)]
    return extended, int(out.slot_steps) if out.slot_steps is not None else 0


def batch_output(ctx: RolloutContext, groups: Sequence[Group], slot_steps: int) -> SampleOutput:
    """The trained groups as the sampler's output would hold them (host numpy): left-padded
    prompt block, full completions and their behaviour logprobs."""
    r, sampler = ctx.rollout, ctx.sampler
    G = r.group_size
    block = buckets.prepare_batch(
        [g.prompt for g in groups],
        n=G,
        max_prompt_len=r.max_prompt_tokens,
        long_prompts="drop",
        pad_id=sampler.pad_id,
        vocab_size=sampler.model_config.vocab_size,
    )
    B = len(groups) * G
    dropped = np.repeat([g.dropped for g in groups], G)
    stack = lambda f: np.concatenate([getattr(g, f) for g in groups])  # noqa: E731
    lengths = np.where(dropped, 0, stack("lengths_G")).astype(np.int32)
    T = r.max_new_tokens
    fields: dict[str, Any] = dict(  # host arrays, put on the devices with the scores
        tokens_BT=stack("tokens_GT"),
        logprobs_BT=stack("logprobs_GT"),
        mask_BT=np.arange(T)[None, :] < lengths[:, None],
        lengths_B=lengths,
        truncated_B=~dropped & ~stack("stopped_G") & (lengths >= T),
        prompt_tokens_BP=block.prompt_BP[:B],
        prompt_mask_BP=block.mask_BP[:B] & ~dropped[:, None],
        dropped_B=dropped,
        num_steps=np.int32(lengths.max(initial=0)),
        slot_steps=np.int32(slot_steps),
    )
    return SampleOutput(**fields)


def _next_record(pending: list, next_records: Callable[[], Sequence[Any]]) -> Any:
    if not pending:
        pending.extend(next_records())
    return pending.pop(0)


def sample_and_score(
    ctx: RolloutContext,
    params: Any,
    carried: Carried,
    records: Sequence[Any],
    key: jax.Array,
    next_records: Callable[[], Sequence[Any]] | None = None,
) -> tuple[ScoredRows, Carried, dict[str, Any]]:
    """One step's P finished groups, scored; the buffer for the next step; the timings and the
    partial/* metrics. `records` (this step's prompts) join the pending ones; more come from
    `next_records()` when a round needs them (default: `records` again)."""
    r = ctx.rollout
    P, G, K = r.prompts_per_step, r.group_size, r.max_staleness
    more = next_records or (lambda: list(records))
    pending = list(carried.pending) + list(records)
    ready = [g for g in carried.groups if g.done]
    flight = [g for g in carried.groups if not g.done]
    t0, rounds, slot_steps, started = time.perf_counter(), 0, 0, 0
    while len(ready) < P:
        while len(flight) < P:  # the free slots take new prompts
            need = P - len(flight)
            for g in _start_groups(ctx, [_next_record(pending, more) for _ in range(need)]):
                (ready if g.done else flight).append(g)
            started += need
        flight, work = sample_round(
            ctx.sampler,
            params,
            flight,
            r.sampling,
            r.partial_rollout_tokens,
            jax.random.fold_in(key, rounds),
        )
        rounds, slot_steps = rounds + 1, slot_steps + work
        ready += [g for g in flight if g.done]
        flight = [g for g in flight if not g.done]
    trained, waiting = ready[:P], ready[P:] + flight
    out = batch_output(ctx, trained, slot_steps)
    t_sample = time.perf_counter() - t0
    t0 = time.perf_counter()
    texts = ctx.sampler.decode(out, P * G)
    scored = ctx.reward_fn.score(
        texts, [g.record for g in trained for _ in range(G)], lengths=np.asarray(out.lengths_B)
    )
    t_reward = time.perf_counter() - t0
    aged = [dataclasses.replace(g, age=g.age + 1) for g in waiting]
    kept = tuple(g for g in aged if g.age <= K)
    ages = np.array([g.age for g in trained])
    metrics: dict[str, Any] = {
        "time/rollout_s": t_sample,
        "time/reward_s": t_reward,
        "partial/rounds": Metric.mean(float(rounds)),
        "partial/new_groups": Metric.sum(float(started)),
        "partial/carried_rows": Metric.sum(float(G * len(kept))),
        "partial/dropped_rows": Metric.sum(float(G * (len(aged) - len(kept)))),
        **{
            f"partial/staleness_{k}": Metric.sum(float(G * np.sum(ages == k))) for k in range(K + 1)
        },
    }
    rows = ScoredRows(Samples(out, texts, r.layout), scored)
    return on_device(rows, ctx.sampler.mesh), Carried(kept, tuple(pending)), metrics


class InFlight:
    """The run's buffer between steps, held by the loop's services like the data iterator:
    `sample_and_score` runs a step on it; get_state / set_state go into each checkpoint."""

    def __init__(self, rollout: Any, pad_id: int):
        self._rollout, self._pad_id = rollout, pad_id
        self.carried = Carried()

    def sample_and_score(
        self,
        ctx: RolloutContext,
        params: Any,
        records: Sequence[Any],
        key: jax.Array,
        next_records: Callable[[], Sequence[Any]] | None = None,
    ) -> tuple[ScoredRows, dict[str, Any]]:
        rows, self.carried, metrics = sample_and_score(
            ctx, params, self.carried, records, key, next_records
        )
        return rows, metrics

    def get_state(self) -> dict[str, Any]:
        return self.carried.to_state()

    def set_state(self, state: dict[str, Any] | None) -> None:
        r = self._rollout
        self.carried = Carried.from_state(state, r.group_size, r.max_new_tokens, self._pad_id)
