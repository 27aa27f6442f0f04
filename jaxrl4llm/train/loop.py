"""The thin outer loop: rollout, update(s), eval, checkpoint, log. It only sequences pure pieces."""
from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from jaxrl4llm import evaluation, parallel
from jaxrl4llm.data import make_iterator, make_source
from jaxrl4llm.models import registry
from jaxrl4llm.rewards import make_reward_fn
from jaxrl4llm.sampling import buckets
from jaxrl4llm.train import host_memory
from jaxrl4llm.train import metrics as metrics_lib
from jaxrl4llm.train import plots
from jaxrl4llm.train.checkpoint import Checkpointer, PreemptionFlag, abstract_like
from jaxrl4llm.train.config import TrainConfig, param_dtype
from jaxrl4llm.train.rollout import RolloutContext, rollout, shared_prompt_group
from jaxrl4llm.train.state import create_state, learning_rate_schedule
from jaxrl4llm.train.step import UpdateBatch, compile_train_step, train_step



_increment = jax.jit(lambda step: step + 1)  # keeps the step a global (replicated) array


def _minibatches(batch: UpdateBatch, config: TrainConfig, key: jax.Array, mesh: Any):
    """Yields the mini-batches of every PPO epoch (rows reshuffled per epoch when split)."""
    B, M = config.batch_size, config.mini_batch
    if not config.reshuffles_rows:
        yield batch
        return
    for epoch in range(config.ppo_epochs):
        order = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), B))
        for start in range(0, B, M):
            rows = order[start:start + M]
            mb = jax.tree.map(lambda x: x[rows], batch)
            if mesh is not None:
                mb = jax.tree.map(
                    lambda x: jax.device_put(x, parallel.batch_sharding(mesh, x.ndim)), mb)
            yield mb


def _prompts_per_host(config: TrainConfig, mesh: Any) -> int:
    """Each host feeds an equal share of the prompts, filling its data-parallel devices."""
    hosts = jax.process_count()
    if hosts == 1:
        return config.prompts_per_step
    rows = config.batch_size // hosts
    local_shards = max(1, parallel.data_parallel_size(mesh) // hosts)
    if config.prompts_per_step % hosts or buckets.bucket_batch_size(rows, local_shards) != rows:
        raise ValueError(
            f"--prompts_per_step={config.prompts_per_step} x --group_size={config.group_size} "
            f"over {hosts} hosts gives {rows} rows per host; it must split evenly over the hosts "
            f"and fill the {local_shards} local data-parallel devices of each (a multiple of "
            f"{max(local_shards, 8)} rows per host).")
    return config.prompts_per_step // hosts


def _mean_metrics(updates: list[dict]) -> dict[str, float]:
    host = [metrics_lib.to_host_scalars(m) for m in updates]
    return {k: float(np.mean([h[k] for h in host])) for k in host[0]}


def _update_metrics(m: dict[str, float], lr: float) -> dict[str, float]:
    renamed = {
        "policy/loss": m.get("loss"), "policy/entropy": m.get("entropy"),
        "policy/kl_ref": m.get("kl_ref"), "policy/approx_kl_old": m.get("approx_kl_old"),
        "policy/clip_frac": (m["clip_frac_low"] + m["clip_frac_high"]
                             if "clip_frac_low" in m else None),
        "policy/clip_frac_low": m.get("clip_frac_low"),
        "policy/clip_frac_high": m.get("clip_frac_high"), "policy/ratio_min": m.get("ratio_min"),
        "policy/ratio_max": m.get("ratio_max"), "policy/frac_rejected": m.get("frac_rejected"),
        "policy/pg_loss": m.get("pg_loss"), "policy/dual_clip_frac": m.get("dual_clip_frac"),
        "optim/grad_norm": m.get("grad_norm"), "optim/update_norm": m.get("update_norm"),
        "optim/learning_rate": lr,
    }
    return {k: v for k, v in renamed.items() if v is not None}


def run(config: TrainConfig, devices: list | None = None) -> dict[str, Any]:
    """Trains for config.num_steps steps (resuming from workdir's latest checkpoint).

    `devices` (default: all) is the device list the mesh spans. Returns a summary: final
    step, last metrics, eval results, the final state and the workdir.
    """
    devices = jax.devices() if devices is None else list(devices)
    config.validate(len(devices))
    mesh = parallel.make_mesh(config.mesh, devices)
    workdir = os.path.abspath(config.workdir)
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json())

    model_config, params, tokenizer = registry.load_model(
        config.model, mesh=mesh, dtype=param_dtype(config.param_dtype))
    # A separate copy: the policy's buffers are donated to each update.
    ref_params = jax.tree.map(jnp.copy, params) if config.needs_reference else None
    state = create_state(params, config.optimizer, config.seed)
    del params

    P_host = _prompts_per_host(config, mesh)
    source = make_source(config.data, split="train", **config.field_names)
    iterator = make_iterator(source, P_host, seed=config.seed, shard_index=jax.process_index(),
                             shard_count=jax.process_count())
    eval_records = []
    if config.eval_prompts > 0:
        eval_source = make_source(config.eval_data or config.data, split="test",
                                  **config.field_names)
        eval_records = [eval_source[i] for i in range(min(config.eval_prompts, len(eval_source)))]
    reward_fn = make_reward_fn("auto", scale=config.reward_scale,
                               format_penalty=config.format_penalty,
                               max_new_tokens=config.max_new_tokens,
                               overlong_buffer=config.overlong_buffer,
                               num_workers=config.reward_workers,
                               answer_mode=config.answer_mode)
    ctx = RolloutContext(config, model_config, tokenizer, reward_fn, mesh)
    lr_schedule = learning_rate_schedule(config.optimizer)

    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint_every,
                                config.keep_checkpoints)
    writer = metrics_lib.MetricsWriter(workdir, tensorboard=config.tensorboard)
    start = 0
    if checkpointer.latest_step() is not None:
        state, data_state = checkpointer.restore(abstract_like(state))
        # The saved iterator state is host 0's; hosts differ only in their shard index.
        iterator.set_state(dict(data_state["iterator"], shard_index=jax.process_index()))
        start = int(state.step)
        writer.truncate_after(start)
        logging.info("Resumed from step %d in %s", start, workdir)

    preempted = PreemptionFlag()
    last: dict[str, float] = {}
    eval_results: dict[str, float] = {}
    num_micro = config.mini_batch // config.micro_batch
    compiled: set = set()  # update shapes compiled so far
    bar = tqdm(total=config.num_steps, initial=start, desc="train", unit="step",
               disable=jax.process_index() != 0)
    try:
        if start == 0 and config.eval_every and eval_records:
            # The starting level, so curves show where training began.
            eval_results = evaluation.evaluate(ctx, state.params, eval_records,
                                               samples=config.eval_samples,
                                               key=jax.random.key(config.seed + 2))
            writer.write(0, eval_results)
            tqdm.write(metrics_lib.console_line(0, config.num_steps, eval_results))
        for step in range(start, config.num_steps):
            t_step = time.perf_counter()
            records = next(iterator)
            step_key = jax.random.fold_in(state.key(), step)
            batch, last = rollout(ctx, state.params, ref_params, records,
                                  jax.random.fold_in(step_key, 0))
            host_memory.release_free_memory()  # the sampler's freed buffers, before the update
            t0 = time.perf_counter()
            updates = []
            # Unshuffled rows keep each prompt's samples together: its prompt runs once.
            prompt_group = shared_prompt_group(
                config.group_size, batch.keep_B.shape[0], num_micro,
                share=config.share_prompts and not config.reshuffles_rows,
                data_parallel=parallel.data_parallel_size(mesh))
            static = dict(model_config=model_config, algorithm=config.algorithm,
                          optimizer=config.optimizer, num_micro=num_micro,
                          temperature=ctx.sampling.effective_temperature, remat=config.remat,
                          prompt_group=prompt_group, sharding=ctx.sharding)
            for mb in _minibatches(batch, config, jax.random.fold_in(step_key, 1), mesh):
                signature = (prompt_group, tuple(x.shape for x in jax.tree.leaves(mb)))
                if signature not in compiled:
                    compile_train_step(state, mb, **static)
                    compiled.add(signature)
                state, m = train_step(state, mb, **static)
                updates.append(m)
            update_metrics = _mean_metrics(updates)  # blocks until the updates finish
            last["time/update_s"] = time.perf_counter() - t0
            last.update(_update_metrics(update_metrics, float(lr_schedule(
                (step + 1) * config.updates_per_step - 1))))
            state = state.replace(step=_increment(state.step))
            done = step + 1
            if config.eval_every and done % config.eval_every == 0 and eval_records:
                eval_results = evaluation.evaluate(ctx, state.params, eval_records,
                                                   samples=config.eval_samples,
                                                   key=jax.random.fold_in(step_key, 2))
                last.update(eval_results)
            last["time/step_s"] = time.perf_counter() - t_step
            last["data/epoch"] = iterator.epoch
            last["memory/peak_rss_gib"] = host_memory.peak_rss_gib()
            writer.write(done, last)
            bar.update(1)
            tqdm.write(metrics_lib.console_line(done, config.num_steps, last))
            if checkpointer.should_save(done) or preempted.requested:
                checkpointer.save(done, state, {"iterator": iterator.get_state()})
            if preempted.requested:
                logging.warning("Preempted: checkpoint %d saved; exiting.", done)
                break
        else:
            final = int(state.step)
            checkpointer.save(final, state, {"iterator": iterator.get_state()})
            if eval_records and not (config.eval_every and final % config.eval_every == 0
                                     and eval_results):
                eval_results = evaluation.evaluate(ctx, state.params, eval_records,
                                                   samples=config.eval_samples,
                                                   key=jax.random.key(config.seed + 1))
    finally:
        # Whatever happened, what was computed is kept: metrics flushed, pool closed.
        bar.close()
        writer.close()
        checkpointer.close()
        reward_fn.close()
        preempted.restore_handler()
    outputs = _write_outputs(workdir, eval_results) if jax.process_index() == 0 else {}
    return {"step": int(state.step), "metrics": last, "eval": eval_results, "workdir": workdir,
            "outputs": outputs,
            "state": state, "ref_params": ref_params, "preempted": preempted.requested}


def _write_outputs(workdir: str, eval_results: dict[str, float]) -> dict[str, str]:
    """The end-of-run files a person looks at: eval.json and curves.png."""
    outputs = {}
    if eval_results:
        outputs["eval"] = os.path.join(workdir, "eval.json")
        with open(outputs["eval"], "w") as f:
            json.dump(eval_results, f, indent=2, sort_keys=True)
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        outputs["plot"] = plots.plot_runs([workdir], os.path.join(workdir, "curves.png"))
    return outputs

