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
from jaxrl4llm.rewards import RewardFn
from jaxrl4llm.rl.metrics import combine_metrics
from jaxrl4llm.sampling import buckets
from jaxrl4llm.train import critic, host_memory
from jaxrl4llm.train import metrics as metrics_lib
from jaxrl4llm.train import plots
from jaxrl4llm.train.checkpoint import Checkpointer, PreemptionFlag, abstract_like
from jaxrl4llm.train.config import TrainConfig, param_dtype
from jaxrl4llm.train.errors import TrainingDivergedError
from jaxrl4llm.train.resume import check_resume
from jaxrl4llm.train.rollout import RolloutContext, rollout
from jaxrl4llm.train.state import create_state, learning_rate_schedule
from jaxrl4llm.train.step import (UpdateBatch, compile_train_step, length_classes,
                                  micro_batch_order, train_step)
from jaxrl4llm.train.workdir_lock import WorkdirLock

_increment = jax.jit(lambda step: step + 1)  # keeps the step a global (replicated) array


def _minibatches(batch: UpdateBatch, config: TrainConfig, key: jax.Array, mesh: Any):
    """Yields (mini-batch, its length_classes, (real completion tokens, completion positions
    the update computes) or None) for every PPO epoch (rows reshuffled per epoch when split).

    A mini-batch runs on its own longest completion, bucketed: the rollout's batch is already
    cut to the longest row of all, a mini-batch of fewer rows is often shorter still (the
    columns cut are padding, so the update is unchanged). With --micro_batch_length_classes
    > 1 its rows are also ordered so that each micro-batch holds rows of similar length
    (step.micro_batch_order; rows leave their prompt groups), and each micro-batch runs at
    the first of the length classes that holds it (the update's sum over micro-batches does
    not depend on the order)."""
    B, M = config.batch_size, config.mini_batch
    num_micro = M // config.micro_batch
    mask_BT = batch.seqs.completion_mask_BT
    # Multi-host: the rows are global and not all here; only the rollout's cut applies.
    lengths_B = (np.asarray(jax.device_get(mask_BT.sum(axis=1)))
                 if mask_BT.is_fully_addressable else None)
    num_classes = config.update.micro_batch_length_classes
    sort = lengths_B is not None and num_micro > 1 and num_classes > 1
    reshuffle = config.reshuffles_rows
    # Sorted rows leave their prompt groups: a group's rows differ in length (on SmolLM2 at
    # T = 1 nearly every group of 4 holds a row near the limit), and the columns saved by
    # sorting rows outweigh running each prompt once per group (bench_rollout.py).
    layout = batch.layout.shuffled() if reshuffle or sort else batch.layout
    epochs = config.update.ppo_epochs if reshuffle else 1
    for epoch in range(epochs):
        order = (np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), B))
                 if reshuffle else np.arange(B))
        for start in range(0, B, M):
            rows = order[start:start + M]
            if sort:
                rows = rows[micro_batch_order(lengths_B[rows], num_micro)]
            if not reshuffle and not sort:
                mb = batch
            else:
                mb = jax.tree.map(lambda x: x[rows], batch).replace(layout=layout)
                if mesh is not None:
                    mb = jax.tree.map(
                        lambda x: jax.device_put(x, parallel.batch_sharding(mesh, x.ndim)), mb)
            if lengths_B is None:
                yield mb, (), None
                continue
            lengths = lengths_B[rows]
            mb = mb.trimmed(buckets.bucket_completion_length(int(lengths.max()),
                                                             config.rollout.max_new_tokens))
            T = mb.seqs.completion_mask_BT.shape[1]
            classes = length_classes(T, num_classes) if sort else ()
            # Micro-batch k holds the rows k, k + num_micro, ... (step.accumulate).
            longest_k = lengths.reshape(-1, num_micro).max(axis=0)
            runs_at = (np.asarray(classes)[np.searchsorted(classes, longest_k)] if classes
                       else np.full(num_micro, T))
            yield mb, classes, (int(lengths.sum()), int(runs_at.sum()) * (M // num_micro))


def _prompts_per_host(config: TrainConfig, mesh: Any) -> int:
    """Each host feeds an equal share of the prompts, filling its data-parallel devices."""
    hosts = jax.process_count()
    P = config.rollout.prompts_per_step
    if hosts == 1:
        return P
    rows = config.batch_size // hosts
    local_shards = max(1, parallel.data_parallel_size(mesh) // hosts)
    if P % hosts or buckets.bucket_batch_size(rows, local_shards) != rows:
        raise ValueError(
            f"--prompts_per_step={P} x --group_size={config.rollout.group_size} "
            f"over {hosts} hosts gives {rows} rows per host; it must split evenly over the hosts "
            f"and fill the {local_shards} local data-parallel devices of each (a multiple of "
            f"{max(local_shards, 8)} rows per host).")
    return P // hosts


def run(config: TrainConfig, devices: list | None = None) -> dict[str, Any]:
    """Trains for config.run.num_steps steps (resuming from the workdir's latest checkpoint).

    `devices` (default: all) is the device list the mesh spans. Returns a summary: final
    step, last metrics, eval results, the final state and the workdir. The workdir is locked
    for the run: a second run on it fails, naming this one.
    """
    with WorkdirLock(config.run.workdir, enabled=jax.process_index() == 0):
        return _run(config, devices)


def _run(config: TrainConfig, devices: list | None) -> dict[str, Any]:
    devices = jax.devices() if devices is None else list(devices)
    config.validate(len(devices))
    run_config, e = config.run, config.evaluation
    mesh = parallel.make_mesh(run_config.mesh, devices)
    workdir = os.path.abspath(run_config.workdir)
    check_resume(workdir, config)  # a different model / algorithm: refused before any write

    # The data first: a bad source fails before the model loads or the workdir is written.
    P_host = _prompts_per_host(config, mesh)
    source = make_source(config.data.source, split="train", **config.data.field_names)
    iterator = make_iterator(source, P_host, seed=run_config.seed,
                             shard_index=jax.process_index(), shard_count=jax.process_count())
    eval_records = evaluation.held_out_records(config.data, e)
    eval_sets = e.sets  # --eval_sets: named sets, each with its own protocol
    set_records = evaluation.eval_set_records(eval_sets, config.data)
    has_eval = bool(eval_records or eval_sets)

    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json())

    model_config, params, tokenizer = registry.load_model(
        config.model.name, mesh=mesh, dtype=param_dtype(config.model.param_dtype))
    model_config = config.model.compute_config(model_config)   # --compute_dtype
    # A separate copy: the policy's buffers are donated to each update.
    ref_params = jax.tree.map(jnp.copy, params) if config.needs_reference else None
    state = create_state(params, config.optimizer, run_config.seed)
    critic_state = _create_critic(config, params, model_config, mesh)
    del params
    reward_fn = RewardFn("auto", config.reward)
    ctx = RolloutContext.create(model_config, tokenizer, reward_fn, mesh, config.data,
                                config.rollout)
    lr_schedule = learning_rate_schedule(config.optimizer)

    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                                run_config.checkpoint_every, run_config.keep_checkpoints)
    writer = metrics_lib.MetricsWriter(workdir, tensorboard=run_config.tensorboard)
    start = 0
    if checkpointer.latest_step() is not None:
        saved, data_state = checkpointer.restore(abstract_like(_saved(state, critic_state)))
        state, critic_state = (saved, None) if critic_state is None else (saved["policy"],
                                                                          saved["critic"])
        # The saved iterator state is host 0's; hosts differ only in their shard index.
        iterator.set_state(dict(data_state["iterator"], shard_index=jax.process_index()))
        start = int(state.step)
        tqdm.write(f"Resumed from step {start} in {workdir}")
    writer.truncate_after(start)  # also at 0: a run killed before its first checkpoint

    def evaluate(key: jax.Array) -> dict[str, float]:
        return evaluation.evaluate_run(ctx, state.params, eval_records, eval_sets, set_records,
                                       samples=e.eval_samples, key=key)

    preempted = PreemptionFlag()
    last: dict[str, float] = {}
    eval_results: dict[str, float] = {}
    num_micro = config.mini_batch // config.micro_batch
    num_steps = run_config.num_steps
    compiled: set = set()  # update shapes compiled so far
    static = dict(model_config=model_config, algorithm=config.update_algorithm,
                  optimizer=config.optimizer, num_micro=num_micro,
                  temperature=config.rollout.sampling.effective_temperature,
                  remat=config.model.remat, sharding=ctx.sharding)
    critic_static = dict(model_config=model_config, algorithm=config.update_algorithm,
                         optimizer=critic.optimizer_config(config.optimizer,
                                                           config.critic.learning_rate),
                         num_micro=num_micro, remat=config.model.remat, sharding=ctx.sharding)
    data_parallel = parallel.data_parallel_size(mesh)
    bar = tqdm(total=num_steps, initial=start, desc="train", unit="step",
               disable=jax.process_index() != 0)
    stalled = 0  # consecutive steps whose every update was skipped as non-finite
    try:
        if start == 0 and e.eval_every and has_eval:
            # The starting level, so curves show where training began.
            eval_results = evaluate(jax.random.key(run_config.seed + 2))
            writer.write(0, eval_results)
            tqdm.write(metrics_lib.console_line(0, num_steps, eval_results))
        for step in range(start, num_steps):
            t_step = time.perf_counter()
            records = next(iterator)
            step_key = jax.random.fold_in(state.key(), step)
            batch, last = rollout(ctx, config, state.params, ref_params, records,
                                  jax.random.fold_in(step_key, 0),
                                  next_records=lambda: next(iterator),  # dynamic sampling
                                  critic_params=None if critic_state is None
                                  else critic_state.params)
            host_memory.release_free_memory()  # the sampler's freed buffers, before the update
            t0 = time.perf_counter()
            update_metrics = {}
            real_tokens, update_columns = 0, 0  # completion tokens / positions the update runs
            for mb, classes, tokens in _minibatches(batch, config,
                                                    jax.random.fold_in(step_key, 1), mesh):
                if tokens is not None:
                    real_tokens += tokens[0]
                    update_columns += tokens[1]
                # Rows still in their groups run each group's prompt once.
                prompt_group = mb.layout.prompt_group(mb.keep_B.shape[0], num_micro,
                                                      data_parallel)
                signature = (prompt_group, classes, tuple(x.shape for x in jax.tree.leaves(mb)))
                if step >= config.critic.warmup_steps:  # PPO: the first steps train the critic only
                    if signature not in compiled:
                        compile_train_step(state, mb, prompt_group=prompt_group,
                                           length_classes=classes, **static)
                        compiled.add(signature)
                    state, m = train_step(state, mb, prompt_group=prompt_group,
                                          length_classes=classes, **static)
                    update_metrics = combine_metrics(update_metrics, m)
                if critic_state is not None:
                    critic_state, m = critic.critic_step(critic_state, mb, prompt_group=prompt_group,
                                                         **critic_static)
                    update_metrics = combine_metrics(update_metrics, m)
            last.update(metrics_lib.to_host_scalars(update_metrics))  # waits for the updates
            if update_columns:
                last["response/update_real_frac"] = real_tokens / update_columns
            last["time/update_s"] = time.perf_counter() - t0
            last["optim/learning_rate"] = float(lr_schedule(
                (step + 1) * config.updates_per_step - 1))
            state = state.replace(step=_increment(state.step))
            if critic_state is not None:
                critic_state = critic_state.replace(step=_increment(critic_state.step))
            done = step + 1
            # Every eval_every steps, and after the last step whatever eval_every is, so the
            # final score is in metrics.jsonl (and its curve) like every other eval.
            if has_eval and (done == num_steps or (e.eval_every and done % e.eval_every == 0)):
                eval_results = evaluate(jax.random.fold_in(step_key, 2))
                last.update(eval_results)
            last["time/step_s"] = time.perf_counter() - t_step
            last["data/epoch"] = iterator.epoch
            last["memory/peak_rss_gib"] = host_memory.peak_rss_gib()
            writer.write(done, last)
            bar.update(1)
            tqdm.write(metrics_lib.console_line(done, num_steps, last))
            # (During PPO's critic warm-up only the critic updates.)
            skipped = last.get("optim/skipped_updates", last.get("critic/skipped_updates", 0.0))
            skipped_all = skipped >= config.updates_per_step
            stalled = stalled + 1 if skipped_all else 0
            if stalled >= config.update.max_nonfinite_steps:
                raise TrainingDivergedError(_diverged_message(done, stalled, checkpointer))
            if checkpointer.should_save(done) or preempted.requested:
                checkpointer.save(done, _saved(state, critic_state),
                                  {"iterator": iterator.get_state()})
            if preempted.requested:
                logging.warning("Preempted: checkpoint %d saved; exiting.", done)
                break
        else:
            final = int(state.step)
            checkpointer.save(final, _saved(state, critic_state), {"iterator": iterator.get_state()})
            if has_eval and start >= num_steps:   # resumed after the last step: eval.json only
                eval_results = evaluate(jax.random.key(run_config.seed + 1))
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
            "state": state, "critic_state": critic_state, "ref_params": ref_params,
            "preempted": preempted.requested}


def _create_critic(config: TrainConfig, params: Any, model_config: Any, mesh: Any):
    """PPO's critic state (None for every other algorithm): from --critic_model, else the
    policy's weights with a zero head, laid out like the policy."""
    if not config.needs_critic:
        return None
    if config.critic.model:
        critic_params = critic.load(config.critic.model, model_config, mesh,
                                    dtype=param_dtype(config.model.param_dtype))
    else:
        critic_params = critic.from_policy(params)
    return create_state(critic_params, critic.optimizer_config(
        config.optimizer, config.critic.learning_rate), config.run.seed)


def _saved(state: Any, critic_state: Any) -> Any:
    """What a checkpoint holds: the policy's state, with PPO's critic beside it."""
    return state if critic_state is None else {"policy": state, "critic": critic_state}


def _diverged_message(step: int, stalled: int, checkpointer: Checkpointer) -> str:
    return (f"Stopped at step {step}: every update of the last {stalled} steps had a NaN / inf "
            f"loss or gradient and was skipped (--max_nonfinite_steps={stalled}), so the model "
            f"no longer trains. The last checkpoint is step {checkpointer.latest_step()} in "
            f"{checkpointer.directory}. Check the rewards and advantages for NaN / inf "
            "(metrics.jsonl: optim/skipped_updates, reward/*) or lower --learning_rate, then "
            "rerun to resume from that checkpoint.")


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

