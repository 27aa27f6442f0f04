"""One rollout: prompts -> samples -> rewards -> reference / old logprobs -> advantages.

Host work (tokenizing prompts, decoding completions, verifying answers) happens here; every
device computation is a jitted function of the sampler, the logprob pass or rl. The batch
carries its row layout (sampling.layout.RowLayout) for every later consumer.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import parallel
from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.sampling import buckets, multiturn
from jaxrl4llm.sampling.context import RolloutContext
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.rounds import Rounds, sample_and_score
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra import metrics as metrics_lib
from jaxrl4llm.train.programs import StepPrograms
from jaxrl4llm.train.update import packing
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences


def _global_rows(ctx: RolloutContext, local: np.ndarray) -> jax.Array:
    """This host's rows (e.g. rewards) -> the global batch array, laid out like the samples."""
    if jax.process_count() == 1:
        return jnp.asarray(local)
    mesh = ctx.sampler.mesh
    assert mesh is not None  # several hosts always run on one mesh (train.services)
    return jax.make_array_from_process_local_data(parallel.batch_sharding(mesh, local.ndim), local)


def _group_metrics(correct_B: np.ndarray, group_size: int) -> dict[str, Metric]:
    correct_PG = correct_B.reshape(-1, group_size)
    return {
        "reward/pass_rate": Metric.mean(float(correct_PG.any(axis=1).mean())),
        "reward/frac_all_correct": Metric.mean(float(correct_PG.all(axis=1).mean())),
        "reward/frac_all_wrong": Metric.mean(float((~correct_PG).all(axis=1).mean())),
    }


def rollout(
    ctx: RolloutContext,
    config: TrainConfig,
    params: Any,
    ref_params: Any,
    records: Sequence[Any],
    key: jax.Array,
    next_records: Any = None,
    critic_params: Any = None,
    in_flight: Any = None,
    programs: StepPrograms | None = None,
) -> tuple[UpdateBatch, dict[str, float]]:
    """Builds the update batch of one training step (B = len(records) * group_size rows):
    sample -> score -> filter (`sample_and_score`, in rounds when dynamic sampling
    resamples), then the teacher-forced passes (reference / old logprobs, PPO's values) and
    the advantages. `next_records()` gives more prompts when dynamic sampling resamples
    (default: the same). `critic_params` (PPO): the critic's values of the batch give the
    advantages and returns. `in_flight` (partial rollouts: train.rollout.partial.InFlight) samples
    the step's groups instead, carrying unfinished rows to the next step. `programs`: the
    run's StepPrograms (default: built from `config` and the sampler's model and mesh)."""
    if programs is None:
        programs = StepPrograms(config, ctx.sampler.model_config, ctx.sampler.mesh)
    if in_flight is not None:
        rows, round_metrics = in_flight.sample_and_score(ctx, params, records, key, next_records)
    else:
        rows, round_metrics = sample_and_score(
            ctx,
            params,
            records,
            key,
            config.rollout.layout,
            Rounds.for_run(config.algorithm, config.rollout.dynamic),
            next_records,
        )
    t0 = time.perf_counter()
    # Teacher-forced passes and the update run on the batch's longest completion, bucketed.
    out = rows.samples.out.trimmed(
        buckets.bucket_completion_length(
            int(rows.samples.out.num_steps), config.rollout.max_new_tokens
        )
    )
    batch, adv_metrics, packed_tokens = _update_batch(
        ctx, programs, params, ref_params, critic_params, rows, out
    )
    jax.block_until_ready(batch)
    t_logprobs = time.perf_counter() - t0
    metrics = _rollout_metrics(rows, out, config.rollout.layout, round_metrics, t_logprobs)
    if packed_tokens is not None:  # the packed passes' share: prompt + completion tokens
        metrics["response/logprob_real_frac"] = packed_tokens[0] / max(packed_tokens[1], 1)
    # Computed on the global batch already (identical on every host).
    metrics.update(metrics_lib.to_host_scalars(adv_metrics))
    return batch, metrics


def _update_batch(
    ctx: RolloutContext,
    programs: StepPrograms,
    params: Any,
    ref_params: Any,
    critic_params: Any,
    rows: Any,
    out: Any,
) -> tuple[UpdateBatch, dict, tuple[int, int] | None]:
    """The reference / old-policy logprobs and PPO's values of the trimmed samples `out`,
    then the advantages: the update's batch, the advantage metrics and (packed passes) the
    real tokens and slots they computed."""
    seqs = Sequences(
        prompt_tokens_BP=out.prompt_tokens_BP,
        prompt_mask_BP=out.prompt_mask_BP,
        completion_tokens_BT=out.tokens_BT,
        completion_mask_BT=out.mask_BT,
        observation_mask_BT=out.observation_BT,
        # A mixture of experts' routing record (None when the sampler kept none).
        prompt_experts_BPLK=out.prompt_experts_BPLK,
        experts_BTLK=out.experts_BTLK,
        replay=programs.config.router.routing_replay,
    )
    if programs.mesh is not None:  # the layout the passes compile for (and the plan plans)
        seqs = parallel.on_batch_axes(seqs, programs.mesh)
    config = programs.config
    forced = _teacher_forced(ctx, programs, seqs, params, ref_params, critic_params, out)
    adv = _batch_advantages(ctx, programs, rows, out, forced)
    batch = UpdateBatch(
        seqs=seqs,
        advantages=adv.advantages_BT,
        keep_B=adv.keep_B,
        old_logp_BT=forced.old_logp_BT,
        ref_logp_BT=forced.ref_logp_BT,
        old_values_BT=forced.values_BT,
        returns_BT=adv.returns_BT,
        behaviour_logp_BT=(out.logprobs_BT if config.keeps_behaviour_logprobs else None),
        layout=config.rollout.layout,
    )
    return batch, adv.metrics, forced.packed_tokens


@dataclasses.dataclass(frozen=True)
class TeacherForced:
    """The teacher-forced passes over a trimmed batch of B rows and T completion columns:
    ref_logp_BT [B, T] (None when the algorithm has no reference), old_logp_BT [B, T] (None
    unless pi_old is needed; the sampler's own unless --recompute_old_logprobs),
    behaviour_logp_BT [B, T] (pi_old, else the sampler's: what the advantages' KL reads),
    values_BT [B, T] (PPO's critic; else None), packed_tokens (when the passes ran packed,
    --micro_batch_tokens: real prompt + completion tokens and the packed slots each pass
    computed; else None)."""

    ref_logp_BT: jax.Array | None
    old_logp_BT: jax.Array | None
    behaviour_logp_BT: jax.Array
    values_BT: jax.Array | None
    packed_tokens: tuple[int, int] | None = None


def _teacher_forced(
    ctx: RolloutContext,
    programs: StepPrograms,
    seqs: Sequences,
    params: Any,
    ref_params: Any,
    critic_params: Any,
    out: Any,
) -> TeacherForced:
    """Runs the passes the algorithm needs, in row chunks that hold whole groups (a group's
    prompt once when the layout shares it) or, with --micro_batch_tokens, on the batch's
    sequences packed (train/update/packing.py) where the packed plan's modelled FLOPs are below the
    padded passes' (packing.SlotFlops: matmuls per token and attention per row)."""
    config = programs.config
    recompute = config.needs_old_logprobs and config.update.recompute_old_logprobs
    budget = config.update.micro_batch_tokens
    logprobs, values, padded_flops = _padded_passes(programs, seqs)
    packed_tokens = None
    if budget and (config.needs_reference or recompute or critic_params is not None):
        flops = packing.SlotFlops.of(ctx.sampler.model_config)
        packed = packing.pack_on_mesh(
            seqs,
            budget,
            ctx.sampler.mesh,
            flops=flops,
            share_prompts=config.rollout.layout.share_prompts,
        )
        real, slots = packing.real_share(packed)
        if packing.packed_flops(packed, flops) < padded_flops(flops):
            logprobs, values = _packed_passes(programs, seqs, packed)
            packed_tokens = (real, slots)
    # The reference and the critic route themselves; the policy replays (--routing_replay).
    own = seqs.replace(prompt_experts_BPLK=None, experts_BTLK=None)
    ref_logp = logprobs(ref_params, seqs=own) if config.needs_reference else None
    old_logp = None
    if config.needs_old_logprobs:
        policy = seqs if seqs.replay else own
        old_logp = logprobs(params, seqs=policy) if recompute else out.logprobs_BT
    return TeacherForced(
        ref_logp_BT=ref_logp,
        old_logp_BT=old_logp,
        behaviour_logp_BT=old_logp if old_logp is not None else out.logprobs_BT,
        values_BT=None if critic_params is None else values(critic_params, seqs=own),
        packed_tokens=packed_tokens,
    )


def _padded_passes(
    programs: StepPrograms, seqs: Sequences
) -> tuple[Any, Any, Callable[[packing.SlotFlops], float]]:
    """(logprobs(params), values(critic_params)) -> [B, T], 0 off the completion mask: the
    padded passes over the [B, prompt + completion] rows, in row chunks of whole groups;
    and a function of packing.SlotFlops giving each pass's modelled FLOPs."""
    B = seqs.completion_tokens_BT.shape[0]
    group, _ = programs.teacher_forced_chunks(B)
    P, T = seqs.prompt_tokens_BP.shape[1], seqs.completion_tokens_BT.shape[1]
    return (
        functools.partial(programs.logprobs(B), seqs=seqs),
        functools.partial(programs.values(B), seqs=seqs),
        lambda flops: flops.padded(B, P, T, group),
    )


def _packed_passes(
    programs: StepPrograms, seqs: Sequences, packed: packing.PackedBatch
) -> tuple[Any, Any]:
    """`_padded_passes`' two functions, run on the batch's sequences `packed`: micro-batches
    of packed rows over the data-parallel devices, read back into the [B, T] layout. Packed
    rows carry no routing record (--routing_replay refuses packing): the `seqs` a caller
    passes to choose its record is not read."""
    passes = dict(packed=packed, mask_MT=seqs.completion_mask_BT)

    def on_packed(program: Any) -> Any:
        return lambda params, seqs=None: program(params, **passes)

    return on_packed(programs.packed_logprobs), on_packed(programs.packed_values)


@dataclasses.dataclass(frozen=True)
class BatchAdvantages:
    """`_advantages`' results on the global batch: advantages_BT [B, T], returns_BT [B, T]
    (PPO; else None), keep_B [B] (the rows the group filters keep), the advantage metrics."""

    advantages_BT: jax.Array
    returns_BT: jax.Array | None
    keep_B: jax.Array
    metrics: dict


def _batch_advantages(
    ctx: RolloutContext, programs: StepPrograms, rows: Any, out: Any, forced: TeacherForced
) -> BatchAdvantages:
    """The rewards, verdicts and ReMax's baseline of this host's rows laid out as the global
    batch, then the algorithm's advantages (and PPO's returns)."""
    verdicts = rows.verdicts
    valid = (
        ~verdicts.failed
        if rows.baseline_failed_B is None
        else ~(verdicts.failed | rows.baseline_failed_B)
    )  # ReMax: no baseline, no advantage
    baseline = [
        None if b is None else _global_rows(ctx, b)
        for b in (rows.baseline_B, rows.baseline_correct_B)
    ]
    advantages, returns, keep_B, adv_metrics = programs.advantages(
        _global_rows(ctx, verdicts.rewards),
        _global_rows(ctx, verdicts.correct),
        out.mask_BT,
        out.truncated_B,
        out.dropped_B,
        _global_rows(ctx, valid),
        forced.behaviour_logp_BT,
        forced.ref_logp_BT,
        *baseline,
        forced.values_BT,
    )
    return BatchAdvantages(
        advantages_BT=advantages, returns_BT=returns, keep_B=keep_B, metrics=adv_metrics
    )


def _rollout_metrics(
    rows: Any, out: Any, layout: RowLayout, round_metrics: dict, t_logprobs: float
) -> dict[str, float]:
    """reward/*, response/*, reward_reason/* and the rounds' metrics, combined over hosts,
    and the sampling / scoring / teacher-forced pass times. `out`: the samples trimmed for
    the passes."""
    samples, verdicts = rows.samples, rows.verdicts
    correct = np.asarray(verdicts.correct, bool)
    lengths = samples.host(samples.out.lengths_B).astype(np.float32)
    host = {
        "reward/mean": Metric.mean(float(np.mean(verdicts.rewards))),
        "reward/accuracy": Metric.mean(float(correct.mean())),
        # Unverified rows (timed out / crashed), masked out of the loss and the statistics.
        "reward/failed_frac": Metric.mean(float(verdicts.failed.mean())),
        **_group_metrics(correct, layout.group_size),
        "response/length_mean": Metric.mean(float(lengths.mean())),
        "response/length_max": Metric.max(float(lengths.max())),
        # Real completion tokens / positions the teacher-forced passes compute (after
        # trimming); the loop logs the update's own as response/update_real_frac.
        "response/logprob_real_frac": Metric.mean(
            float(lengths.sum() / max(lengths.size * out.mask_BT.shape[1], 1))
        ),
        "response/truncated_frac": Metric.mean(float(np.mean(samples.host(out.truncated_B)))),
        "response/dropped_prompts": Metric.sum(
            float(np.sum(samples.host(out.dropped_B)) / layout.group_size)
        ),
        **{f"reward_reason/{k}": Metric.sum(float(v)) for k, v in verdicts.metrics().items()},
        **{k: v for k, v in round_metrics.items() if isinstance(v, Metric)},
        **_engine_metrics(samples.out.engine_stats),
    }
    if isinstance(verdicts, multiturn.TurnVerdicts):
        host.update(_turn_metrics(verdicts.stats, lengths))
    metrics = metrics_lib.to_host_scalars(metrics_lib.combine_over_hosts(host))
    if isinstance(verdicts, multiturn.TurnVerdicts):
        stats = verdicts.stats
        metrics.update(
            {
                "time/decode_s": stats.decode_s,
                "time/tools_s": stats.tools_s,
                "time/tool_wait_s": stats.wait_s,
            }
        )
    t_sample = round_metrics["time/rollout_s"]
    metrics.update(
        {
            "time/rollout_s": t_sample,
            "time/reward_s": round_metrics["time/reward_s"],
            "time/logprobs_s": t_logprobs,
            "throughput/rollout_tokens_per_s": float(lengths.sum() / max(t_sample, 1e-9)),
        }
    )
    return metrics


def _engine_metrics(stats: Any) -> dict[str, Metric]:
    """The paged engine's (paged_state.PagedStats, summed over the step's calls; none for
    the compacted sampler): rows and pages per decode step, groups preempted."""
    if stats is None:
        return {}
    stats = jax.device_get(stats)  # one read of the counts
    steps, rows, pages, preempted = (
        float(x) for x in (stats.steps, stats.live_rows, stats.pages_in_use, stats.preemptions)
    )
    return {
        "rollout/rows_per_decode_step": Metric.mean(rows, steps),
        "rollout/pages_per_decode_step": Metric.mean(pages, steps),
        "rollout/preemptions": Metric.sum(preempted),
    }


def _turn_metrics(stats: multiturn.TurnStats, lengths: np.ndarray) -> dict[str, Metric]:
    """Multi-turn rollouts: turns and tool calls per trajectory, the tools' failures (sums over
    the batch), the share of completion tokens that are observations and the rows the paged
    engine evicted for memory (paged_turns.py; 0 with the dense one)."""
    return {
        "turns/mean": Metric.mean(float(stats.turns_B.mean())),
        "turns/max": Metric.max(float(stats.turns_B.max(initial=0))),
        "turns/evictions": Metric.sum(float(stats.evictions)),
        "tool/calls": Metric.mean(float(stats.tool_calls_B.mean())),
        "tool/errors": Metric.sum(float(stats.errors_B.sum())),
        "tool/timeouts": Metric.sum(float(stats.timeouts_B.sum())),
        "tool/crashes": Metric.sum(float(stats.crashes_B.sum())),
        "tool/observation_token_share": Metric.mean(
            float(stats.observation_tokens_B.sum()), float(max(lengths.sum(), 1.0))
        ),
    }
