"""DAPO's dynamic sampling by admission (the paged engine): instead of sampling
whole batches of P groups in rounds until P groups hold both a correct and a wrong row
(rounds.py), groups are queued into one running paged engine (paged_driver.py) as its rows
free, each group is scored on the host once its G rows finish, and the rollout stops as soon
as the first P groups with spread, in the records' order, are done.

Which groups: the records come in chunks of P as rounds.py draws them (the step's records,
then one next_records() per chunk, at most 1 + max_resample_rounds chunks), and group p of
chunk k samples with the keys of rounds.py's round k (fold_in(key, k), then prompt p, sample
g). The batch is the first P groups with spread in that order, then, when every chunk ran and
fewer had spread, the groups without spread in that order: the groups, and rows, that
rounds.py selects from the same records. What differs is the work. Rounds wait for each
round's longest row before the next round starts, and the last round samples a whole batch
of P groups however few are missing. Here a finished group's slot takes the next record's
group at once, and the next chunk starts while the previous one's long rows still decode:
where next_records has a `peek` (the trainer's data iterator, data.iterator.NextBatches) the
next chunk is looked at ahead and sampled before it is taken, and it is taken (called) only
once the rounds would draw it, i.e. once the groups with spread in the chunks before it, with
every unscored one counted as having spread, are fewer than P. So a step takes exactly the
chunks the rounds take and the run reads the same data; a chunk looked at but not taken is
the next step's first (its groups sampled here are dropped). The host keeps MARGIN x need /
rate of the drawn groups queued or decoding (need: P minus the groups with spread so far;
rate: the share of this step's scored groups with spread; at most P, and P before any group
is scored), so the last groups are not sampled as a whole batch. The rollout ends when the
groups before the P-th with spread, in the records' order, have all finished: groups still
decoding then come after it and are dropped (`rollout/groups_dropped`).

On a mesh that splits the batch the engine runs one queue and pool per batch shard
(paged_driver.py), P / D slots each (on several hosts a host's P / hosts groups over its
own D / hosts shards); a group goes to the shard with the most free slots.
Its rows depend only on its prompt and keys, so the batch is the same. On several hosts each
host runs this for its own block of the records (keyed as the rounds key it) in its own
shards; every program runs on every host at once, so at each iteration the hosts exchange
what they need (the widest prompt and the most groups a shard takes, whether any group
decodes, which rows finished, whether each is done) and go on until every host's batch is
known; then each takes as many chunks of records as the host that took the most, as the
rounds would (a host's batch does not depend on chunks it did not need).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.sampling import buckets, decode, paged_driver, paged_mesh, paged_state, trim
from jaxrl4llm.sampling.context import has_spread
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.row_io import RowRequest, every_host, prompt_rows
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.sampling.strategies import SamplingConfig

# Groups kept queued or decoding per group still expected to be needed (need / rate). Above
# 1 the engine decodes more rows per step (fewer steps: what a step costs on an accelerator)
# and drops more groups at the end (more tokens: what a step costs on CPU). On SmolLM2
# (tools/bench_dynamic.py, docs/performance.md) 1.5 took as many steps as 1 and decoded 4-8%
# more tokens; on the toy model (6 seeds) 1 took 5% more steps than 1.5 and 9% fewer tokens.
MARGIN = 1.0


@dataclasses.dataclass
class _Group:
    """One record's G rows: its prompt, keys and, once finished, its rows read back."""

    index: int  # in the records' order
    record: Any
    prompt_P: np.ndarray  # the prompt's tokens, unpadded
    keys_G: jax.Array
    dropped: bool  # its prompt is over the limit (long_prompts="drop"): no row runs
    slot: int = -1
    rows: dict[str, np.ndarray] | None = None  # tokens_GT, logprobs_GT, lengths_G, done_G
    texts: list[str] | None = None
    verdicts: Any = None
    spread: bool = False


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The rollout's P * G rows (numpy), their texts and verdicts, and its counts."""

    out: SampleOutput
    texts: list[str]
    verdicts: Any
    metrics: dict[str, Any]


@dataclasses.dataclass(eq=False)
class _Run:
    """The host side of one rollout (module docstring)."""

    sampler: Any  # frontend.Sampler (the paged engine: kv_cache_tokens set)
    messages: Callable[[Any], Any]  # record -> chat messages
    score: Callable[[list[str], list[Any], np.ndarray], Any]  # -> RowVerdicts
    sampling: SamplingConfig
    max_new_tokens: int
    layout: RowLayout
    key: jax.Array
    records: Sequence[Any]  # the step's (the first chunk)
    next_records: Callable[[], Sequence[Any]] | None
    max_chunks: int
    groups: list[_Group] = dataclasses.field(default_factory=list)
    chunks: int = 0  # drawn
    taken: int = 1  # drawn and taken from next_records (the step's own records: chunk 0)
    next: int = 0  # the next group to queue (groups are queued, or dropped ones finished, in order)
    reward_s: float = 0.0

    @property
    def P(self) -> int:
        return len(self.records)

    @property
    def G(self) -> int:
        return self.layout.group_size

    def _draw(self) -> bool:
        """Draws the next chunk of P records, tokenized and keyed as rounds.py's round
        `chunks`: taken from next_records if the rounds would draw it (`needed`), else looked
        at ahead (its `peek`, one chunk at most), else not (False)."""
        k = self.chunks
        if k == self.max_chunks:
            return False
        if k == 0:
            records = self.records
        elif self.needed(k):
            records, self.taken = self._take(), self.taken + 1
        elif k == self.taken and (ahead := self._ahead()) is not None:
            records = ahead
        else:
            return False
        key = self.key if k == 0 else jax.random.fold_in(self.key, k)
        s = self.sampler
        request = RowRequest(
            RowLayout(self.G, self.layout.share_prompts),
            max_new_tokens=self.max_new_tokens,
            max_prompt_len=s.max_prompt_len,
            long_prompts=s.long_prompts,
            pad_id=s.pad_id,
            min_prompt_bucket=s.min_prompt_bucket,
        )
        ids = s.encode([self.messages(r) for r in records])
        multihost = s.mesh is not None and jax.process_count() > 1  # keys as the rounds'
        rows = prompt_rows(ids, s.model_config, key, request, multihost=multihost)
        batch, G = rows.batch, self.G
        for p, record in enumerate(records):
            r = p * G
            self.groups.append(
                _Group(
                    index=len(self.groups),
                    record=record,
                    prompt_P=batch.prompt_BP[r][batch.mask_BP[r].astype(bool)],
                    keys_G=rows.keys_B[r : r + G],
                    dropped=bool(batch.dropped_B[r]),
                )
            )
        self.chunks += 1
        return True

    def needed(self, k: int) -> bool:
        """Whether the rounds draw chunk k whatever the unscored groups give: the groups with
        spread in the chunks before it, with every unscored one counted as having spread,
        are fewer than P."""
        before = self.groups[: k * self.P]
        spread = sum(g.spread or g.verdicts is None for g in before)
        return k < self.max_chunks and spread < self.P

    def _take(self) -> Sequence[Any]:
        """The next chunk's records, taken (the step's own again without next_records)."""
        return self.records if self.next_records is None else self.next_records()

    def _ahead(self) -> Sequence[Any] | None:
        """The next chunk's records, not taken: next_records' `peek` (None where it has none
        or the data ends)."""
        if self.next_records is None:
            return self.records
        peek = getattr(self.next_records, "peek", None)
        return None if peek is None else peek(0)

    def take_needed(self) -> None:
        """Takes each chunk looked at ahead that the rounds now draw."""
        while self.taken < self.chunks and self.needed(self.taken):
            taken = list(self._take())
            ahead = [g.record for g in self.groups[self.taken * self.P : (self.taken + 1) * self.P]]
            assert taken == ahead, "next_records gave other records than its peek"
            self.taken += 1

    def take_as_every_host(self) -> None:
        """Takes the chunks any host took (several hosts draw their records together, as the
        rounds do: each host its own block of every chunk); those it did not look at are
        not sampled."""
        most = int(every_host([self.taken]).max())
        while self.taken < most:
            self._take()
            self.taken += 1

    def in_flight(self) -> list[_Group]:
        return [g for g in self.groups if g.slot >= 0 and g.rows is None]

    def wanted(self) -> int:
        """Groups to keep queued or decoding (module docstring): P until a group is scored,
        then MARGIN x need / rate, at most P; none once P groups with spread are done."""
        scored = [g for g in self.groups if g.verdicts is not None]
        spread = sum(g.spread for g in scored)
        if spread >= self.P:
            return 0
        if not scored:
            return self.P
        rate = max(spread / len(scored), 1.0 / self.P)
        return min(self.P, math.ceil(MARGIN * (self.P - spread) / rate))

    def next_groups(self, free_slots: int) -> list[_Group]:
        """The groups to queue now (drawing chunks as needed); dropped prompts on the way are
        finished at once (no row runs)."""
        take: list[_Group] = []
        room = min(free_slots, self.wanted() - len(self.in_flight()))
        while len(take) < room:
            if self.next == len(self.groups) and not self._draw():
                break
            g = self.groups[self.next]
            self.next += 1
            if g.dropped:
                g.rows = _empty_rows(self.G, self.max_new_tokens, self.sampler.pad_id)
            else:
                take.append(g)
                g.slot = -2  # being queued
        return take

    def to_score(self) -> list[_Group]:
        return [g for g in self.groups if g.rows is not None and g.verdicts is None]

    def score_finished(self) -> None:
        """Scores every finished group not scored yet (one reward call)."""
        groups = self.to_score()
        if not groups:
            return
        t0 = time.perf_counter()
        texts, records, lengths = [], [], []
        for g in groups:
            rows = g.rows
            assert rows is not None
            truncated = ~rows["done_G"] & (rows["lengths_G"] > 0)
            ids = trim.text_token_ids(rows["tokens_GT"], rows["lengths_G"], truncated)
            g.texts = ["" if x is None else self.sampler.tokenizer.decode(x) for x in ids]
            texts += g.texts
            records += [g.record] * self.G
            lengths.append(rows["lengths_G"])
        verdicts = self.score(texts, records, np.concatenate(lengths))
        for i, g in enumerate(groups):
            g.verdicts = verdicts.take(np.arange(i * self.G, (i + 1) * self.G))
            g.spread = bool(has_spread(g.verdicts, self.G)[0])
        self.reward_s += time.perf_counter() - t0

    def selected(self) -> list[_Group] | None:
        """The batch's groups once known (module docstring), else None."""
        spread = []
        for g in self.groups:
            if g.verdicts is None:
                break
            if g.spread:
                spread.append(g)
            if len(spread) == self.P:
                return spread
        else:
            drawn = self.chunks == self.max_chunks and self.next == len(self.groups)
            if drawn and not self.in_flight():
                flat = [g for g in self.groups if not g.spread]
                return (spread + flat)[: self.P]
        return None


def _empty_rows(G: int, N: int, pad_id: int) -> dict[str, np.ndarray]:
    return dict(
        tokens_GT=np.full((G, N), pad_id, np.int32),
        logprobs_GT=np.zeros((G, N), np.float32),
        lengths_G=np.zeros((G,), np.int32),
        done_G=np.zeros((G,), bool),
    )


def sample(
    sampler: Any,
    params: Any,
    records: Sequence[Any],
    next_records: Callable[[], Sequence[Any]] | None,
    messages: Callable[[Any], Any],
    score: Callable[[list[str], list[Any], np.ndarray], Any],
    sampling: SamplingConfig,
    max_new_tokens: int,
    layout: RowLayout,
    key: jax.Array,
    max_resample_rounds: int,
) -> Admitted:
    """P = len(records) groups of layout.group_size rows by admission (module docstring):
    `messages(record)` its prompt, `score(texts, records, lengths)` the rows' verdicts
    (context.RowVerdicts), `next_records()` each further chunk (default: the same records)."""
    t0 = time.perf_counter()
    run = _Run(
        sampler, messages, score, sampling, max_new_tokens, layout, key, records,
        next_records, 1 + max_resample_rounds,
    )  # fmt: skip
    run._draw()
    width = max(
        buckets.bucket_prompt_length(max(len(g.prompt_P), 1), sampler.min_prompt_bucket)
        for g in run.groups
    )
    engine = paged_driver.Driver(
        sampler, sampling, run.P, run.G, max_new_tokens, width, run.max_chunks * run.P
    )
    engine.begin(params)
    batch = None
    while True:  # on several hosts every host runs each iteration's programs together
        engine.push(run.next_groups(engine.free_slots))
        if every_host([bool(run.in_flight())]).max():
            engine.segment()
            engine.collect(run.in_flight())
        run.score_finished()
        run.take_needed()
        batch = run.selected()
        if batch is None and not run.in_flight() and not engine.free_slots:
            raise RuntimeError("admission: no group decodes and no slot is free")
        if not every_host([batch is None]).max():
            break
    run.take_as_every_host()
    assert batch is not None
    out = _assemble(batch, run, engine)
    texts = [t for g in batch for t in (g.texts or [])]
    verdicts = batch[0].verdicts.join(*(g.verdicts for g in batch[1:]))
    return Admitted(out, texts, verdicts, _metrics(run, engine, time.perf_counter() - t0))


def _assemble(batch: list[_Group], run: _Run, engine: paged_driver.Driver) -> SampleOutput:
    """The batch's rows as the samplers give them (rounds.on_device lays them out)."""
    G, N, s = run.G, run.max_new_tokens, run.sampler
    width = buckets.bucket_prompt_length(
        max(max(len(g.prompt_P), 1) for g in batch), s.min_prompt_bucket
    )
    prompt_BP = np.full((len(batch) * G, width), s.pad_id, np.int32)
    prompt_mask_BP = np.zeros(prompt_BP.shape, bool)
    for i, g in enumerate(batch):
        n = 0 if g.dropped else len(g.prompt_P)
        if n:
            prompt_BP[i * G : (i + 1) * G, width - n :] = g.prompt_P
            prompt_mask_BP[i * G : (i + 1) * G, width - n :] = True
    keys = ("tokens_GT", "logprobs_GT", "lengths_G", "done_G")
    rows = {k: np.concatenate([g.rows[k] for g in batch if g.rows]) for k in keys}
    lengths_B = rows["lengths_G"]
    dropped_B = np.repeat([g.dropped for g in batch], G)
    state = engine.state  # the counts summed over the shards; pages held when it stopped
    stats = jax.tree.map(lambda x: jnp.sum(x), state.stats)
    stats = paged_mesh.host_values(stats.replace(pages_left=jnp.sum(state.pool.refs_N > 0)))
    slot_steps = paged_mesh.host_values(jnp.sum(state.slot_steps))
    return SampleOutput(
        tokens_BT=jnp.asarray(rows["tokens_GT"]),
        logprobs_BT=jnp.asarray(rows["logprobs_GT"]),
        mask_BT=jnp.asarray(np.arange(N)[None, :] < lengths_B[:, None]),
        lengths_B=jnp.asarray(lengths_B),
        truncated_B=jnp.asarray(~rows["done_G"] & ~dropped_B),
        prompt_tokens_BP=jnp.asarray(prompt_BP),
        prompt_mask_BP=jnp.asarray(prompt_mask_BP),
        dropped_B=jnp.asarray(dropped_B),
        num_steps=jnp.int32(max(int(lengths_B.max(initial=0)), 1)),
        slot_steps=jnp.asarray(slot_steps),
        engine_stats=stats,
        **(_record(batch, run, width) if engine.record else {}),
    )


def _record(batch: list[_Group], run: _Run, width: int) -> dict[str, jax.Array]:
    """The batch's routing record: each prompt's experts at its real columns (zeros on the
    padding, as the samplers leave them) and each completion's; zeros for dropped prompts."""
    L, K, E = paged_state.record_shape(run.sampler.model_config) or (0, 0, 0)
    dtype = decode.expert_id_dtype(E)
    G, N = run.G, run.max_new_tokens
    prompt_BPLK = np.zeros((len(batch) * G, width, L, K), dtype)
    completion_BTLK = np.zeros((len(batch) * G, N, L, K), dtype)
    for i, g in enumerate(batch):
        if g.rows and "experts_GTLK" in g.rows:
            n = g.rows["prompt_experts_GPLK"].shape[1]
            prompt_BPLK[i * G : (i + 1) * G, width - n :] = g.rows["prompt_experts_GPLK"]
            completion_BTLK[i * G : (i + 1) * G] = g.rows["experts_GTLK"]
    return dict(
        prompt_experts_BPLK=jnp.asarray(prompt_BPLK), experts_BTLK=jnp.asarray(completion_BTLK)
    )


def _metrics(run: _Run, engine: paged_driver.Driver, seconds: float) -> dict[str, Any]:
    """rounds.py's dynamic-sampling metrics over the groups scored, and admission's counts."""
    scored = [g for g in run.groups if g.verdicts is not None]
    spread = sum(g.spread for g in scored)
    correct = sum(int(g.verdicts.correct.sum()) for g in scored)
    return {
        "time/rollout_s": seconds - run.reward_s,
        "time/reward_s": run.reward_s,
        "rollout/rounds": Metric.mean(float(run.taken)),
        "rollout/frac_groups_filtered": Metric.mean(1.0 - spread / len(scored)),
        "rollout/groups_short": Metric.mean(float(max(run.P - spread, 0))),
        "reward/accuracy_sampled": Metric.mean(correct / (len(scored) * run.G)),
        # Groups queued into the engine, and those dropped while decoding at the end.
        "rollout/groups_admitted": Metric.mean(float(engine.queued.sum())),
        "rollout/group_slots": Metric.mean(float(engine.slots * len(engine.local))),
        "rollout/groups_dropped": Metric.mean(float(len(run.in_flight()))),
    }
