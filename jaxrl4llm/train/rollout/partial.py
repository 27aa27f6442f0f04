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

What a round runs (`sample_round`, at most two sampler calls). Groups no row of which has
started run as groups: their prompt is prefilled once (--share_prompts) and their G rows
decode. An unfinished row of a started group resumes: its prompt followed by its completion
so far is prefilled as one prompt (`Sampler.generate(prefixes=...)`, which rebuilds the KV
cache) and decoding continues. Each row stops at its own cap, the smaller of N and what
--max_new_tokens leaves it (the sampler's row_caps), so no token is decoded past the limit.
A finished row does not run again, also when its group is still generating: nothing is
decoded twice. Each call's rows are padded (with rows that do not run, cap 0) to
buckets.two_per_octave rows, so a run compiles a few call shapes. The history of a resumed
row is prefilled again each round it runs in, except with the paged engine on one host:
there the step's rounds run on one pool of KV pages (partial_pool.py, the same rows), and a
row keeps its pages from round to round, so only new prompts and rows carried into the step
are prefilled. `partial/decoded_tokens` and `partial/prefilled_tokens` count what the step's
rounds decoded and prefilled (tools/bench_partial.py compares them with a normal step).

Keys. Round i of a step samples with fold_in(step's rollout key, i), and its row r (slots in
buffer order, G rows per group) with fold_in(fold_in(round key, r), 0), whichever call runs
it. The
buffer (groups with their tokens, logprobs, ages; prompts drawn but not started) is saved
with each checkpoint (`InFlight.get_state`, in the data state beside the iterator's), so a
resumed run is bit-identical to one that never stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.data.records import Record
from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.sampling import buckets, row_io
from jaxrl4llm.sampling.context import RolloutContext
from jaxrl4llm.sampling.frontend import Samples
from jaxrl4llm.sampling.rounds import ScoredRows, on_device
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.train.rollout import partial_pool


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


@dataclasses.dataclass(frozen=True)
class RoundWork:
    """What a round asked of the sampler: decode loop work (slot steps), tokens decoded, and
    prompt tokens prefilled (a shared prompt once per group; a resumed row's prompt + its
    completion so far)."""

    slot_steps: int = 0
    decoded: int = 0
    prefilled: int = 0

    def __add__(self, other: "RoundWork") -> "RoundWork":
        return RoundWork(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
        )


def sample_round(
    sampler: Any, params: Any, groups: Sequence[Group], rollout: Any, key: jax.Array
) -> tuple[list[Group], RoundWork]:
    """One round: every unfinished row of `groups` continues by up to
    --partial_rollout_tokens tokens, cut at --max_new_tokens (its row cap). Groups no row of
    which has started run as groups (their prompt prefilled once with --share_prompts);
    unfinished rows of started groups resume from prompt + completion so far; finished rows
    do not run. Row r of the round (buffer order, G rows per group) draws with
    fold_in(fold_in(key, r), 0) whichever call runs it."""
    G, T = rollout.group_size, rollout.max_new_tokens
    budget = min(rollout.partial_rollout_tokens, T)
    multihost = sampler.mesh is not None and jax.process_count() > 1
    offset = jax.process_index() * len(groups) * G if multihost else 0
    keys_R = row_io.sample_keys(
        key, jnp.arange(len(groups) * G) + offset, jnp.zeros(len(groups) * G, jnp.int32)
    )
    fresh = [i for i, g in enumerate(groups) if not g.lengths_G.any()]
    resumed = [
        (i, int(j))
        for i, g in enumerate(groups)
        if g.lengths_G.any()
        for j in np.flatnonzero(~g.done_G)
    ]
    parts = {i: partial_pool.no_part(G, budget) for i in range(len(groups))}
    work = RoundWork()
    if fresh:
        out, w = _run_fresh(sampler, params, groups, fresh, rollout, (budget, key, keys_R))
        for n, i in enumerate(fresh):
            parts[i] = tuple(x[n * G : (n + 1) * G] for x in out)
        work += w
    if resumed:
        out, w = _run_resumed(sampler, params, groups, resumed, rollout, (budget, key, keys_R))
        for n, (i, j) in enumerate(resumed):
            for x, part in zip(out, parts[i]):
                part[j] = x[n]
        work += w
    return [extend(g, *parts[i]) for i, g in enumerate(groups)], work


def _padded(n: int) -> int:
    """Rows (or groups) a call runs: n rounded up to buckets.two_per_octave, the rest not run
    (cap 0), so a run compiles a few call shapes, not one per row count."""
    return buckets.two_per_octave(n)


def _run_fresh(
    sampler: Any,
    params: Any,
    groups: Sequence[Group],
    fresh: Sequence[int],
    rollout: Any,
    call: tuple[int, jax.Array, jax.Array],
) -> tuple[tuple[np.ndarray, ...], RoundWork]:
    """Groups `fresh` (no row started) as groups of G rows. `call`: (the round's budget, its
    key, its rows' keys)."""
    G, F = rollout.group_size, len(fresh)
    pad = _padded(F) - F
    prompts = [groups[i].prompt for i in fresh]
    rows = [i * G + j for i in fresh for j in range(G)]
    layout = dict(group_size=G, share_prompts=rollout.share_prompts)
    out = _generate(sampler, params, rollout, call, prompts, rows, [call[0]] * (F * G), pad, layout)
    per_prompt = 1 if rollout.share_prompts else G
    return _read(out, F * G, per_prompt * sum(len(p) for p in prompts))


def _run_resumed(
    sampler: Any,
    params: Any,
    groups: Sequence[Group],
    rows: Sequence[tuple[int, int]],
    rollout: Any,
    call: tuple[int, jax.Array, jax.Array],
) -> tuple[tuple[np.ndarray, ...], RoundWork]:
    """The unfinished rows (group i, row j) of started groups, each from prompt + its
    completion so far, capped at what --max_new_tokens leaves. `call` as _run_fresh's."""
    G, R = rollout.group_size, len(rows)
    pad = _padded(R) - R
    lengths = [int(groups[i].lengths_G[j]) for i, j in rows]
    prompts = [groups[i].prompt for i, _ in rows]
    prefixes = [groups[i].tokens_GT[j, :n].tolist() for (i, j), n in zip(rows, lengths)]
    caps = [min(call[0], rollout.max_new_tokens - n) for n in lengths]
    places = [i * G + j for i, j in rows]
    layout = dict(prefixes=prefixes + [[]] * pad)
    out = _generate(sampler, params, rollout, call, prompts, places, caps, pad, layout)
    return _read(out, R, sum(len(p) for p in prompts) + sum(lengths))


def _generate(
    sampler: Any,
    params: Any,
    rollout: Any,
    call: tuple[int, jax.Array, jax.Array],
    prompts: list[tuple[int, ...]],
    places: list[int],
    caps: list[int],
    pad: int,
    layout: dict[str, Any],
) -> SampleOutput:
    """One sampler call: `prompts` (laid out by `layout`) and `pad` more that do not run (cap
    0), their rows keyed as the round's buffer places `places`, capped at `caps`."""
    budget, key, keys_R = call
    filler = len(places) // len(prompts) * pad  # rows per prompt x prompts added
    return sampler.generate(
        params,
        prompts + prompts[:1] * pad,
        rollout.sampling,
        budget,
        key,
        row_keys=_padded_keys(keys_R, np.array(places), filler),
        row_caps=caps + [0] * filler,
        **layout,
    )


def _padded_keys(keys_R: jax.Array, rows: np.ndarray, pad: int) -> jax.Array:
    """The keys of buffer rows `rows`, then `pad` keys for rows that do not run."""
    picked = keys_R[jnp.asarray(rows)]
    return jnp.concatenate([picked, jnp.repeat(picked[:1], pad)]) if pad else picked


def _read(out: SampleOutput, rows: int, prefilled: int) -> tuple[tuple[np.ndarray, ...], RoundWork]:
    """The first `rows` rows of a call's output on the host (tokens, logprobs, lengths,
    stopped) and the call's work."""
    out = jax.device_get(out)
    fields = (out.tokens_BT, out.logprobs_BT, out.lengths_B, ~np.asarray(out.truncated_B))
    part = tuple(np.asarray(x)[:rows] for x in fields)
    steps = int(out.slot_steps) if out.slot_steps is not None else 0
    return part, RoundWork(steps, int(np.sum(part[2])), prefilled)


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
    t0, rounds, work, started = time.perf_counter(), 0, RoundWork(), 0
    pool = partial_pool.PoolRounds.of(ctx.sampler, params, r, extend, RoundWork)
    run_round = pool.sample_round if pool else functools.partial(sample_round, ctx.sampler, params)
    while len(ready) < P:
        while len(flight) < P:  # the free slots take new prompts
            need = P - len(flight)
            for g in _start_groups(ctx, [_next_record(pending, more) for _ in range(need)]):
                (ready if g.done else flight).append(g)
            started += need
        flight, done = run_round(flight, r, jax.random.fold_in(key, rounds))
        rounds, work = rounds + 1, work + done
        ready += [g for g in flight if g.done]
        flight = [g for g in flight if not g.done]
    trained, waiting = ready[:P], ready[P:] + flight
    out = batch_output(ctx, trained, work.slot_steps)
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
        "partial/decoded_tokens": Metric.sum(float(work.decoded)),
        "partial/prefilled_tokens": Metric.sum(float(work.prefilled)),
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
