"""Sampling and scoring records' groups, the one entry point (`sample_and_score`) of the
trainer's rollout and of the evaluator: one sampler call, or several (DAPO's dynamic
sampling), each with ReMax's greedy row per prompt when `Rounds` asks for it. Scoring is the
context's reward function (sampling.context.RewardFunction).

The result always has P groups of G rows (P = the records given), so every later shape (the
teacher-forced passes, the update) is the same whatever happened here:

* ReMax (Rounds.greedy_baseline): each prompt is sampled G + 1 times in the same sampler
  call, the last row greedily; that row is scored, its reward becomes the group's baseline,
  and it leaves the batch (it is not trained on).
* Dynamic sampling (DAPO, RolloutConfig.dynamic; on the paged engine by admission,
  admission.py: the same groups and rows, without waiting on whole rounds):
  groups whose valid rows are all correct or all wrong carry no signal; they are set aside
  and further rounds (the next prompts of the data iterator, or the same prompts again
  without one) are sampled until P groups with both verdicts are gathered or
  `max_resample_rounds` extra rounds have run. A batch still short is filled with set-aside
  groups, which the preset's group filters then keep out of the loss. On several hosts each
  host keeps and fills its own groups (its block of the global batch), and every round all
  hosts exchange their counts of kept groups, so they all stop after the same round: every
  sampler call is a program all hosts run together.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.rl.algorithm_config import AlgorithmConfig
from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.sampling import admission, multiturn
from jaxrl4llm.sampling.config import DynamicSampling
from jaxrl4llm.sampling.context import RolloutContext, RowVerdicts, has_spread
from jaxrl4llm.sampling.frontend import Samples
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.row_io import every_host
from jaxrl4llm.sampling.strategies import SamplingConfig

ONE_HOST_ONLY = (
    "--advantage=remax picks rows on the host and runs on one host only; use one host, "
    "or another advantage."
)


@dataclasses.dataclass(frozen=True)
class Rounds:
    """How records' groups are drawn. The default, one plain sampler call, is the evaluator's;
    the trainer's follows its algorithm and --dynamic_sampling (`for_run`).

    greedy_baseline: ReMax: one more greedy row per prompt, whose reward is the baseline.
    dynamic_sampling: DAPO: resample until every group holds a correct and a wrong row.
    max_resample_rounds: Cap on dynamic sampling's extra rounds.
    by_admission: dynamic sampling by admission (admission.py) where the sampler allows it
        (`admits`); False: in rounds always (tools/bench_dynamic.py compares the two).
    """

    greedy_baseline: bool = False
    dynamic_sampling: bool = False
    max_resample_rounds: int = 0
    by_admission: bool = True

    @classmethod
    def for_run(cls, algorithm: AlgorithmConfig, dynamic: DynamicSampling) -> Rounds:
        return cls(
            greedy_baseline=algorithm.advantage == "remax",
            dynamic_sampling=dynamic.dynamic_sampling,
            max_resample_rounds=dynamic.max_resample_rounds,
        )


@dataclasses.dataclass(frozen=True)
class ScoredRows:
    """P * G rows: the samples, the reward function's verdicts on them and, for ReMax, each
    row's baseline (the reward and verdict of its prompt's greedy completion; its failure
    masks the group)."""

    samples: Samples
    verdicts: RowVerdicts
    baseline_B: np.ndarray | None = None
    baseline_correct_B: np.ndarray | None = None
    baseline_failed_B: np.ndarray | None = None


_BASELINES = ("baseline_B", "baseline_correct_B", "baseline_failed_B")


def _take(part: ScoredRows, rows: np.ndarray) -> ScoredRows:
    """The rows `rows` of `part` (its output on the host: numpy indexing compiles nothing)."""
    s = part.samples
    out = jax.tree.map(lambda x: x if np.ndim(x) == 0 else x[rows], s.out)
    base = [None if getattr(part, f) is None else getattr(part, f)[rows] for f in _BASELINES]
    return ScoredRows(
        Samples(out, [s.texts[i] for i in rows], s.layout), part.verdicts.take(rows), *base
    )


def _left_pad(x: Any, width: int, value: Any) -> Any:
    """[B, P, ...] -> [B, width, ...], padded on the left (None stays None)."""
    if x is None:
        return None
    pad = ((0, 0), (width - x.shape[1], 0)) + ((0, 0),) * (np.ndim(x) - 2)
    return np.pad(x, pad, constant_values=value)


def _concat(parts: Sequence[ScoredRows], pad_id: int) -> ScoredRows:
    """Rows of several rounds in one batch; prompts left-padded to the widest round's."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.samples.out.prompt_tokens_BP.shape[1] for p in parts)
    outs = [
        p.samples.out.replace(
            prompt_tokens_BP=_left_pad(p.samples.out.prompt_tokens_BP, width, pad_id),
            prompt_mask_BP=_left_pad(p.samples.out.prompt_mask_BP, width, False),
            prompt_experts_BPLK=_left_pad(p.samples.out.prompt_experts_BPLK, width, 0),
        )
        for p in parts
    ]
    # The engine's counts are each round's (sample_and_score adds them up), not each part's.
    outs = [o.replace(engine_stats=None) for o in outs]
    out = jax.tree.map(lambda *xs: max(xs) if np.ndim(xs[0]) == 0 else np.concatenate(xs), *outs)
    verdicts = parts[0].verdicts.join(*(p.verdicts for p in parts[1:]))
    base = [
        None if getattr(parts[0], f) is None else np.concatenate([getattr(p, f) for p in parts])
        for f in _BASELINES
    ]
    texts = [t for p in parts for t in p.samples.texts]
    return ScoredRows(Samples(out, texts, parts[0].samples.layout), verdicts, *base)


def _counted(batch: ScoredRows, stats: list[Any]) -> ScoredRows:
    """The batch with the paged engine's counts of every round added up (each round's once;
    None from the other engines)."""
    if any(x is None for x in stats):
        return batch
    out = batch.samples.out.replace(engine_stats=jax.tree.map(lambda *xs: sum(xs), *stats))
    return dataclasses.replace(batch, samples=dataclasses.replace(batch.samples, out=out))


def _reset_messages(ctx: RolloutContext, handler: Any, messages: list, n: int) -> list:
    """The groups' prompts after the environments' `reset`s (the handler's optional
    `prompt_records`: a reset may write the first observation, which is then the prompt). The
    rows of a group share one prompt, so they must agree."""
    rewritten = getattr(handler, "prompt_records", None)
    if rewritten is None:
        return messages
    rows = [ctx.data.messages(r) for r in rewritten()]
    for g in range(len(messages)):
        group = rows[g * n : (g + 1) * n]
        if any(m != group[0] for m in group):
            raise ValueError(
                f"the environment's reset gave the {n} rows of prompt {g} different prompts; "
                "a group shares one prompt: make the prompt reset returns depend on the record "
                "alone"
            )
    return rows[::n]


def admits(ctx: RolloutContext, rounds: Rounds) -> bool:
    """Whether dynamic sampling runs by admission (admission.py): the paged engine (one
    device, or a mesh of one host or several: a pool per batch shard, its heads split over
    tensor), single-turn, without ReMax's greedy rows; elsewhere it runs in rounds."""
    return (
        rounds.dynamic_sampling
        and rounds.by_admission
        and not rounds.greedy_baseline
        and ctx.turn_handlers is None
        and getattr(ctx.sampler, "kv_cache_tokens", None) is not None
    )


def _by_admission(
    ctx: RolloutContext, params: Any, records: Sequence[Any], key: jax.Array, layout: RowLayout,
    rounds: Rounds, next_records: Callable[[], Sequence[Any]] | None, sampling: SamplingConfig,
) -> tuple[ScoredRows, dict[str, Any]]:  # fmt: skip
    """sample_and_score's groups by admission (`admits`), laid out as the rounds' batch."""
    got = admission.sample(
        ctx.sampler,
        params,
        records,
        next_records,
        ctx.data.messages,
        lambda texts, rows, lengths: ctx.reward_fn.score(texts, rows, lengths=lengths),
        sampling,
        ctx.rollout.max_new_tokens,
        layout,
        key,
        rounds.max_resample_rounds,
    )
    part = ScoredRows(Samples(got.out, got.texts, layout), got.verdicts)
    return on_device(part, ctx.sampler.mesh), got.metrics


def _one_round(
    ctx: RolloutContext,
    params: Any,
    records: Sequence[Any],
    key: jax.Array,
    layout: RowLayout,
    rounds: Rounds,
    sampling: SamplingConfig,
) -> tuple[ScoredRows, float, float]:
    """Samples and scores the records' groups; (result, sample seconds, reward seconds)."""
    t0 = time.perf_counter()
    greedy = rounds.greedy_baseline
    n = layout.group_size + int(greedy)
    # An environment answers the turns (and gives the rewards) of this round's rows.
    turns: dict[str, Any] = {}
    messages = [ctx.data.messages(r) for r in records]
    if ctx.turn_handlers is not None:
        handler = ctx.turn_handlers(RowLayout(n).repeat(records))
        messages = _reset_messages(ctx, handler, messages, n)
        turns = dict(handler=handler, limits=ctx.rollout.turns)
    samples = ctx.sampler.sample(
        params,
        messages,
        sampling,
        ctx.rollout.max_new_tokens,
        key,
        RowLayout(n, layout.share_prompts),
        greedy_last=int(greedy),
        **turns,
    )
    jax.block_until_ready(samples.out.tokens_BT)
    t_sample = time.perf_counter() - t0
    t0 = time.perf_counter()
    verdicts: RowVerdicts
    if samples.turns is not None:
        verdicts = multiturn.TurnVerdicts(samples.turns)
    else:
        lengths = samples.host(samples.out.lengths_B)
        verdicts = ctx.reward_fn.score(samples.texts, RowLayout(n).repeat(records), lengths=lengths)
    part = ScoredRows(dataclasses.replace(samples, layout=layout), verdicts)
    if greedy or rounds.dynamic_sampling:  # rows are selected on the host: this host's
        out = jax.tree.map(lambda x: x if np.ndim(x) == 0 else samples.host(x), samples.out)
        part = dataclasses.replace(
            part, samples=dataclasses.replace(samples, out=out, layout=layout)
        )
    if greedy:  # rows p * n + G are the greedy ones: baselines of the G rows before them
        index_PN = np.arange(len(records) * n).reshape(-1, n)
        base = index_PN[:, -1].repeat(layout.group_size)
        part = _take(part, index_PN[:, :-1].reshape(-1))
        part = dataclasses.replace(
            part,
            baseline_B=verdicts.rewards[base],
            baseline_correct_B=verdicts.correct[base],
            baseline_failed_B=verdicts.failed[base],
        )
    return part, t_sample, time.perf_counter() - t0


def on_device(part: ScoredRows, mesh: Mesh | None) -> ScoredRows:
    """The selected rows back on the devices, laid out like the sampler's (same shapes every
    step, so later passes do not recompile)."""

    def put(x):
        if np.ndim(x) == 0 or mesh is None:
            return jnp.asarray(x)
        sharding = parallel.batch_sharding(mesh, np.ndim(x))
        if jax.process_count() > 1:  # this host's rows: its block of the global batch
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        return jax.device_put(x, sharding)

    out = jax.tree.map(put, part.samples.out)
    return dataclasses.replace(part, samples=dataclasses.replace(part.samples, out=out))


def sample_and_score(
    ctx: RolloutContext,
    params: Any,
    records: Sequence[Any],
    key: jax.Array,
    layout: RowLayout,
    rounds: Rounds = Rounds(),
    next_records: Callable[[], Sequence[Any]] | None = None,
    *,
    sampling: SamplingConfig | None = None,
) -> tuple[ScoredRows, dict[str, Any]]:
    """P = len(records) groups of `layout.group_size` rows, sampled with `sampling` (default:
    the context's) and scored by the context's reward function; and the timings and metrics
    (time/rollout_s, time/reward_s; with dynamic sampling rollout/rounds, frac_groups_filtered,
    groups_short, reward/accuracy_sampled; by admission, admission.py's). `next_records()`
    gives more prompts when dynamic sampling resamples (default: the same)."""
    greedy, dynamic = rounds.greedy_baseline, rounds.dynamic_sampling
    if greedy and jax.process_count() > 1:  # train.config.checks.validate says so first
        raise ValueError(ONE_HOST_ONLY)
    sampling = sampling or ctx.rollout.sampling
    if admits(ctx, rounds):
        return _by_admission(ctx, params, records, key, layout, rounds, next_records, sampling)
    G, P = layout.group_size, len(records)
    part, t_sample, t_reward = _one_round(ctx, params, records, key, layout, rounds, sampling)
    if not dynamic:
        times = {"time/rollout_s": t_sample, "time/reward_s": t_reward}
        return on_device(part, ctx.sampler.mesh) if greedy else part, times
    # Per host: kept groups, rounds, correct rows, the paged engine's counts of each round;
    # `hosts` sums the first over the hosts, whose counts every host receives each round, so
    # all take the same decision to stop.
    kept, flat, n_kept, n_rounds, n_correct, stats = [], [], 0, 1, 0, []
    while True:
        stats.append(part.samples.out.engine_stats)
        n_correct += int(part.verdicts.correct.sum())
        spread_P = has_spread(part.verdicts, G)
        rows_PG = np.arange(P * G).reshape(P, G)
        kept.append(_take(part, rows_PG[spread_P].reshape(-1)))
        flat.append(_take(part, rows_PG[~spread_P].reshape(-1)))
        n_kept += int(spread_P.sum())
        hosts = every_host([n_kept, n_correct])  # [hosts, 2]
        if hosts[:, 0].min() >= P or n_rounds > rounds.max_resample_rounds:
            break
        records = next_records() if next_records is not None else records
        part, ts, tr = _one_round(
            ctx, params, records, jax.random.fold_in(key, n_rounds), layout, rounds, sampling
        )
        t_sample, t_reward, n_rounds = t_sample + ts, t_reward + tr, n_rounds + 1
    batch = _concat([p for p in kept + flat if p.verdicts.rewards.size], ctx.sampler.pad_id)
    batch = on_device(_counted(_take(batch, np.arange(P * G)), stats), ctx.sampler.mesh)
    n_groups = n_rounds * P * len(hosts)  # over every host
    return batch, {
        "time/rollout_s": t_sample,
        "time/reward_s": t_reward,
        "rollout/rounds": Metric.mean(float(n_rounds)),
        "rollout/frac_groups_filtered": Metric.mean(1.0 - hosts[:, 0].sum() / n_groups),
        "rollout/groups_short": Metric.mean(float(np.maximum(P - hosts[:, 0], 0).sum())),
        # Over every sample drawn this step: the policy's accuracy, unlike the
        # batch's, which the filter biases towards groups with a correct sample.
        "reward/accuracy_sampled": Metric.mean(hosts[:, 1].sum() / (n_groups * G)),
    }
