"""Sampling and scoring a step's groups: one sampler call, or several (DAPO's dynamic
sampling), each with ReMax's greedy row per prompt when the algorithm asks for it.

The batch always has P groups of G rows (P = the step's prompts), so every later shape (the
teacher-forced passes, the update) is the same whatever happened here:

* ReMax (advantage="remax"): each prompt is sampled G + 1 times in the same sampler call, the
  last row greedily; that row is scored, its reward becomes the group's baseline, and it
  leaves the batch (it is not trained on).
* Dynamic sampling (DAPO, algorithm.dynamic_sampling): groups whose valid rows are all
  correct or all wrong carry no signal; they are set aside and further rounds (the next
  prompts of the data iterator, or the same prompts again without one) are sampled until P
  groups with both verdicts are gathered or `max_resample_rounds` extra rounds have run.
  A batch still short is filled with set-aside groups, which the preset's group filters
  then keep out of the loss.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import parallel
from jaxrl4llm.rewards.base import RewardBatch
from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.sampling.frontend import Samples
from jaxrl4llm.sampling.layout import RowLayout

ONE_HOST_ONLY = ("--advantage=remax and --dynamic_sampling pick rows on the host and run on one "
                 "host only; use one host, or --nodynamic_sampling / another advantage.")


@dataclasses.dataclass(frozen=True)
class Scored:
    """A step's P * G rows: samples, their scores and, for ReMax, each row's baseline (the
    reward and verdict of its prompt's greedy completion; its failure masks the group)."""

    samples: Samples
    scored: RewardBatch
    baseline_B: np.ndarray | None = None
    baseline_correct_B: np.ndarray | None = None
    baseline_failed_B: np.ndarray | None = None


def _take(part: Scored, rows: np.ndarray) -> Scored:
    """The rows `rows` of `part` (its output on the host: numpy indexing compiles nothing)."""
    s = part.samples
    out = jax.tree.map(lambda x: x if np.ndim(x) == 0 else x[rows], s.out)
    scored = RewardBatch(rewards=part.scored.rewards[rows], correct=part.scored.correct[rows],
                         reasons=[part.scored.reasons[i] for i in rows])
    base = [None if b is None else b[rows] for b in
            (part.baseline_B, part.baseline_correct_B, part.baseline_failed_B)]
    return Scored(Samples(out, [s.texts[i] for i in rows], s.layout), scored, *base)


def _left_pad(x: jax.Array | np.ndarray, width: int, value: Any) -> np.ndarray:
    return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)


def _concat(parts: Sequence[Scored], pad_id: int) -> Scored:
    """Rows of several rounds in one batch; prompts left-padded to the widest round's."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.samples.out.prompt_tokens_BP.shape[1] for p in parts)
    outs = [p.samples.out.replace(
        prompt_tokens_BP=_left_pad(p.samples.out.prompt_tokens_BP, width, pad_id),
        prompt_mask_BP=_left_pad(p.samples.out.prompt_mask_BP, width, False)) for p in parts]
    out = jax.tree.map(lambda *xs: max(xs) if np.ndim(xs[0]) == 0 else np.concatenate(xs),
                       *outs)
    scored = RewardBatch(rewards=np.concatenate([p.scored.rewards for p in parts]),
                         correct=np.concatenate([p.scored.correct for p in parts]),
                         reasons=[r for p in parts for r in p.scored.reasons])
    base = [None if getattr(parts[0], f) is None else np.concatenate([getattr(p, f) for p in parts])
            for f in ("baseline_B", "baseline_correct_B", "baseline_failed_B")]
    texts = [t for p in parts for t in p.samples.texts]
    return Scored(Samples(out, texts, parts[0].samples.layout), scored, *base)


def _one_round(ctx: Any, params: Any, records: Sequence[Any], key: jax.Array, layout: RowLayout,
               greedy: bool, dynamic: bool) -> tuple[Scored, float, float]:
    """Samples and scores the records' groups; (result, sample seconds, reward seconds)."""
    t0 = time.perf_counter()
    n = layout.group_size + int(greedy)
    samples = ctx.sampler.sample(params, [ctx.data.messages(r) for r in records],
                                 ctx.rollout.sampling, ctx.rollout.max_new_tokens, key,
                                 RowLayout(n, layout.share_prompts), greedy_last=int(greedy))
    jax.block_until_ready(samples.out.tokens_BT)
    t_sample = time.perf_counter() - t0
    t0 = time.perf_counter()
    lengths = samples.host(samples.out.lengths_B)
    scored = ctx.reward_fn.score(samples.texts, [r for r in records for _ in range(n)],
                                 lengths=lengths)
    part = Scored(dataclasses.replace(samples, layout=layout), scored)
    if greedy or dynamic:   # rows are selected on the host
        part = dataclasses.replace(part, samples=dataclasses.replace(
            samples, out=jax.device_get(samples.out), layout=layout))
    if greedy:   # rows p * n + G are the greedy ones: baselines of the G rows before them
        index_PN = np.arange(len(records) * n).reshape(-1, n)
        base = index_PN[:, -1].repeat(layout.group_size)
        part = _take(part, index_PN[:, :-1].reshape(-1))
        part = dataclasses.replace(part, baseline_B=scored.rewards[base],
                                   baseline_correct_B=scored.correct[base],
                                   baseline_failed_B=scored.failed[base])
    return part, t_sample, time.perf_counter() - t0


def _on_device(part: Scored, mesh: Any) -> Scored:
    """The selected rows back on the devices, laid out like the sampler's (same shapes every
    step, so later passes do not recompile)."""
    def put(x):
        if np.ndim(x) == 0 or mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, parallel.batch_sharding(mesh, np.ndim(x)))
    out = jax.tree.map(put, part.samples.out)
    return dataclasses.replace(part, samples=dataclasses.replace(part.samples, out=out))


def _has_spread(part: Scored, group_size: int) -> np.ndarray:
    """bool [groups]: the group's valid rows hold both a correct and a wrong one (DAPO eq. 11)."""
    valid = ~part.scored.failed
    correct = (part.scored.correct & valid).reshape(-1, group_size)
    wrong = (~part.scored.correct & valid).reshape(-1, group_size)
    return correct.any(axis=1) & wrong.any(axis=1)


def sample_and_score(ctx: Any, algorithm: Any, params: Any, records: Sequence[Any],
                     key: jax.Array, layout: RowLayout,
                     next_records: Callable[[], Sequence[Any]] | None = None
                     ) -> tuple[Scored, dict[str, Any]]:
    """The step's P = len(records) groups of G rows, scored; and the timings and metrics
    (time/rollout_s, time/reward_s, and with dynamic sampling rollout/rounds,
    rollout/frac_groups_filtered, rollout/groups_short and reward/accuracy_sampled)."""
    greedy = algorithm.advantage == "remax"
    dynamic = algorithm.dynamic_sampling
    if (greedy or dynamic) and jax.process_count() > 1:   # TrainConfig.validate says so first
        raise ValueError(ONE_HOST_ONLY)
    G, P = layout.group_size, len(records)
    part, t_sample, t_reward = _one_round(ctx, params, records, key, layout, greedy, dynamic)
    if not dynamic:
        return _on_device(part, ctx.sampler.mesh) if greedy else part, {
            "time/rollout_s": t_sample, "time/reward_s": t_reward}
    kept, flat, n_kept, n_groups, rounds, n_correct = [], [], 0, 0, 1, 0
    while True:
        n_correct += int(part.scored.correct.sum())
        spread_P = _has_spread(part, G)
        rows_PG = np.arange(P * G).reshape(P, G)
        kept.append(_take(part, rows_PG[spread_P].reshape(-1)))
        flat.append(_take(part, rows_PG[~spread_P].reshape(-1)))
        n_kept, n_groups = n_kept + int(spread_P.sum()), n_groups + P
        if n_kept >= P or rounds > algorithm.max_resample_rounds:
            break
        records = next_records() if next_records is not None else records
        part, ts, tr = _one_round(ctx, params, records, jax.random.fold_in(key, rounds), layout,
                                  greedy, dynamic)
        t_sample, t_reward, rounds = t_sample + ts, t_reward + tr, rounds + 1
    batch = _concat([p for p in kept + flat if p.scored.rewards.size], ctx.sampler.pad_id)
    batch = _on_device(_take(batch, np.arange(P * G)), ctx.sampler.mesh)  # spread first
    metrics = {"time/rollout_s": t_sample, "time/reward_s": t_reward,
               "rollout/rounds": Metric.mean(float(rounds)),
               "rollout/frac_groups_filtered": Metric.mean(1.0 - n_kept / n_groups),
               "rollout/groups_short": Metric.mean(float(max(P - n_kept, 0))),
               # Over every sample drawn this step: the policy's accuracy, unlike the
               # batch's, which the filter biases towards groups with a correct sample.
               "reward/accuracy_sampled": Metric.mean(n_correct / (n_groups * G))}
    return batch, metrics
