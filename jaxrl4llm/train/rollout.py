"""One rollout: prompts -> samples -> rewards -> reference / old logprobs -> advantages.

Host work (tokenizing prompts, decoding completions, verifying answers) happens here; every
device computation is a jitted function of the sampler, the logprob pass or rl.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import parallel, rl
from jaxrl4llm.data import record_messages
from jaxrl4llm.sampling import sampler as sampler_lib
from jaxrl4llm.sampling.sampler import host_rows
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.logprobs import Sequences, completion_logprobs_jit
from jaxrl4llm.train.step import UpdateBatch


@dataclasses.dataclass
class RolloutContext:
    """What stays fixed across rollouts."""

    config: TrainConfig
    model_config: Any
    tokenizer: Any
    reward_fn: Any
    mesh: Any = None
    force_length: bool = False  # ignore stop tokens: every completion is max_new_tokens long

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return () if self.force_length else tuple(self.tokenizer.stop_token_ids)

    @property
    def sharding(self) -> parallel.ActivationSharding | None:
        return None if self.mesh is None else parallel.ActivationSharding(self.mesh)

    @property
    def sampling(self) -> SamplingConfig:
        c = self.config
        return SamplingConfig(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)


def shared_prompt_group(group_size: int, rows: int, slices: int = 1, *,
                        share: bool = True, data_parallel: int = 1) -> int:
    """The `prompt_group` for teacher-forced passes over `rows` sampler rows split into
    `slices` slices: the group size when sharing is on and every slice holds whole groups on
    each of its `data_parallel` devices (the sampler lays a prompt's samples out as
    consecutive rows), else 1."""
    if not share or rows % slices or (rows // slices) % (group_size * data_parallel):
        return 1
    return group_size


def encode_prompts(ctx: RolloutContext, records: Sequence[Any]) -> list[list[int]]:
    c = ctx.config
    kwargs = {} if c.instruction is None else {"instruction": c.instruction}
    return [ctx.tokenizer.encode_chat(record_messages(r, system=c.system_prompt, **kwargs))
            for r in records]


def sample(ctx: RolloutContext, params: Any, records: Sequence[Any], key: jax.Array, *,
           n: int, sampling: SamplingConfig | None = None) -> tuple[Any, list[str]]:
    """Samples `n` completions per record; returns (SampleOutput, completion texts)."""
    c = ctx.config
    out = sampler_lib.generate(
        params, ctx.model_config, encode_prompts(ctx, records), sampling or ctx.sampling,
        c.max_new_tokens, key, stop_ids=ctx.stop_ids, n=n,
        pad_id=ctx.tokenizer.pad_token_id, mesh=ctx.mesh, max_prompt_len=c.max_prompt_tokens,
        long_prompts=c.long_prompts, max_rows=c.rollout_micro_batch or None)
    rows = len(records) * n
    tokens_BT, mask_BT = host_rows(out.tokens_BT, rows), host_rows(out.mask_BT, rows)
    texts = [ctx.tokenizer.decode(t[m]) for t, m in zip(tokens_BT, mask_BT)]
    return out, texts


def _global_rows(ctx: RolloutContext, local: np.ndarray) -> jax.Array:
    """This host's rows (e.g. rewards) -> the global batch array, laid out like the samples."""
    if jax.process_count() == 1:
        return jnp.asarray(local)
    return jax.make_array_from_process_local_data(
        parallel.batch_sharding(ctx.mesh, local.ndim), local)


def _mean_over_hosts(metrics: dict[str, float]) -> dict[str, float]:
    if jax.process_count() == 1:
        return metrics
    from jax.experimental import multihost_utils
    keys = sorted(metrics)
    values = multihost_utils.process_allgather(np.array([metrics[k] for k in keys], np.float64))
    return dict(zip(keys, np.asarray(values).mean(axis=0).tolist()))


@functools.partial(jax.jit, static_argnames=("config", "group_size"))
def _advantages(config, rewards_B, correct_B, mask_BT, truncated_B, dropped_B, logp_BT,
                ref_logp_BT, *, group_size):
    advantages, keep_B, metrics = rl.compute_advantages(
        config, rewards_B, correct_B, mask_BT, group_size, truncated_B=truncated_B,
        logp_BT=logp_BT, ref_logp_BT=ref_logp_BT)
    # Prompts skipped as too long never enter the loss.
    return advantages, keep_B & ~dropped_B, metrics


def _group_metrics(correct_B: np.ndarray, group_size: int) -> dict[str, float]:
    correct_PG = correct_B.reshape(-1, group_size)
    return {
        "reward/pass_rate": float(correct_PG.any(axis=1).mean()),
        "reward/frac_all_correct": float(correct_PG.all(axis=1).mean()),
        "reward/frac_all_wrong": float((~correct_PG).all(axis=1).mean()),
    }


def rollout(ctx: RolloutContext, params: Any, ref_params: Any, records: Sequence[Any],
            key: jax.Array) -> tuple[UpdateBatch, dict[str, float]]:
    """Builds the update batch of one training step (B = len(records) * group_size rows)."""
    c, G = ctx.config, ctx.config.group_size
    t0 = time.perf_counter()
    out, texts = sample(ctx, params, records, key, n=G)
    jax.block_until_ready(out.tokens_BT)
    t_sample = time.perf_counter() - t0

    t0 = time.perf_counter()
    repeated = [r for r in records for _ in range(G)]
    lengths_B = host_rows(out.lengths_B, len(repeated))
    scored = ctx.reward_fn.score(texts, repeated, lengths=lengths_B)
    t_reward = time.perf_counter() - t0

    t0 = time.perf_counter()
    seqs = Sequences(prompt_tokens_BP=out.prompt_tokens_BP, prompt_mask_BP=out.prompt_mask_BP,
                     completion_tokens_BT=out.tokens_BT, completion_mask_BT=out.mask_BT)
    temperature = ctx.sampling.effective_temperature
    rows = seqs.completion_tokens_BT.shape[0]
    chunks = parallel.num_row_chunks(rows, c.rollout_micro_batch, G if rows % G == 0 else 1)
    data_parallel = 1 if ctx.mesh is None else parallel.data_parallel_size(ctx.mesh)
    logprobs = functools.partial(
        completion_logprobs_jit, config=ctx.model_config, seqs=seqs, temperature=temperature,
        prompt_group=shared_prompt_group(G, rows, chunks, share=c.share_prompts,
                                         data_parallel=data_parallel),
        num_chunks=chunks, sharding=ctx.sharding)
    ref_logp = logprobs(ref_params) if c.needs_reference else None
    old_logp = None
    if c.needs_old_logprobs:
        old_logp = logprobs(params) if c.recompute_old_logprobs else out.logprobs_BT
    behaviour_logp = old_logp if old_logp is not None else out.logprobs_BT
    advantages, keep_B, adv_metrics = _advantages(
        c.algorithm, _global_rows(ctx, scored.rewards), _global_rows(ctx, scored.correct),
        out.mask_BT, out.truncated_B, out.dropped_B, behaviour_logp, ref_logp, group_size=G)
    batch = UpdateBatch(seqs=seqs, advantages=advantages, keep_B=keep_B, old_logp_BT=old_logp,
                        ref_logp_BT=ref_logp)
    jax.block_until_ready(batch)
    t_logprobs = time.perf_counter() - t0

    correct = np.asarray(scored.correct, bool)
    lengths = lengths_B.astype(np.float32)
    metrics = {
        "reward/mean": float(np.mean(scored.rewards)),
        "reward/accuracy": float(correct.mean()),
        **_group_metrics(correct, G),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(np.mean(host_rows(out.truncated_B, len(repeated)))),
        "response/dropped_prompts": float(np.sum(host_rows(out.dropped_B, len(repeated))) / G),
        "time/rollout_s": t_sample,
        "time/reward_s": t_reward,
        "time/logprobs_s": t_logprobs,
        "throughput/rollout_tokens_per_s": float(lengths.sum() / max(t_sample, 1e-9)),
    }
    metrics.update({f"reward_reason/{k}": float(v) for k, v in scored.metrics().items()})
    metrics = _mean_over_hosts(metrics)
    # Computed on the global batch already (identical on every host).
    metrics.update({f"adv/{k}": float(v) for k, v in jax.device_get(adv_metrics).items()})
    return batch, metrics
