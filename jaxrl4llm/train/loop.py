"""The training loop: `setup`, then per step a flat list of named stages.

    models, services = setup(config)          # services.py (with the step's programs)
    for step:
        batch, metrics = rollout(...)   # sample -> score -> filter -> ref / old logprobs
                                        # -> advantages (rollout/stage.py)
        models, m = update(...)         # every mini-batch's optimizer update (updater.py)
        models = models.next_step()
        maybe_evaluate, log, watch for divergence, maybe_checkpoint      (below)

Every stage is a function of its inputs; this module only sequences them and owns the
run's side effects (the console, metrics, checkpoints, SIGTERM).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
from absl import logging
from tqdm.auto import tqdm

from jaxrl4llm.config import paths
from jaxrl4llm.eval.evaluator import eval_key
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.infra import host_memory, plots
from jaxrl4llm.train.infra import metrics as metrics_lib
from jaxrl4llm.train.infra.checkpoint import Checkpointer, PreemptionFlag
from jaxrl4llm.train.infra.errors import TrainingDivergedError
from jaxrl4llm.train.infra.workdir_lock import WorkdirLock
from jaxrl4llm.train.rollout.stage import rollout
from jaxrl4llm.train.services import Services, setup
from jaxrl4llm.train.update.models import Models
from jaxrl4llm.train.updater import Updater


def run(config: TrainConfig, devices: list | None = None) -> dict[str, Any]:
    """Trains for config.run.num_steps steps (resuming from the workdir's latest checkpoint).

    `devices` (default: all) is the device list the mesh spans. Returns a summary: final
    step, last metrics, eval results, the final state and the workdir. The workdir is locked
    for the run: a second run on it fails, naming this one.
    """
    devices = jax.devices() if devices is None else list(devices)
    # --init_adapter's LoRA settings, then the run's one check, before the workdir is touched.
    config = validate(config.with_init_adapter(), len(devices))
    with WorkdirLock(config.run.workdir, enabled=jax.process_index() == 0):
        models, services = setup(config, devices)
        preempted = PreemptionFlag()
        try:
            models, progress = _train(models, services, preempted)
        finally:
            services.close()
            preempted.restore_handler()
    outputs = (
        _write_outputs(services.workdir, progress.eval_results) if jax.process_index() == 0 else {}
    )
    return {
        "step": int(models.state.step),
        "metrics": progress.last,
        "eval": progress.eval_results,
        "workdir": services.workdir,
        "outputs": outputs,
        "state": models.state,
        "critic_state": models.critic_state,
        "ref_params": models.ref_params,
        "preempted": preempted.requested,
    }


@dataclasses.dataclass
class Progress:
    """What the loop carries from step to step besides the models."""

    last: dict[str, float] = dataclasses.field(default_factory=dict)  # the last step's metrics
    eval_results: dict[str, float] = dataclasses.field(default_factory=dict)
    stalled: int = 0  # consecutive steps whose every update was skipped as non-finite
    save_s: float = 0.0  # the last checkpoint save's time (its blocking part)
    grace_warned: bool = False  # whether _warn_past_grace has warned


def _train(
    models: Models, services: Services, preempted: PreemptionFlag
) -> tuple[Models, Progress]:
    config, evals = services.config, services.evaluation
    seed, num_steps, start = config.run.seed, config.run.num_steps, services.start
    progress = Progress()
    updater = Updater(services)
    bar = tqdm(
        total=num_steps, initial=start, desc="train", unit="step", disable=jax.process_index() != 0
    )
    try:
        if start == 0 and config.evaluation.eval_every and evals.enabled:
            # The starting level, so curves show where training began.
            progress.eval_results = evals.run(
                services.ctx, models.policy_params(), eval_key(seed, 0)
            )
            services.writer.write(0, progress.eval_results)
            tqdm.write(metrics_lib.console_line(0, num_steps, progress.eval_results))
        for step in range(start, num_steps):
            models, progress.last, results = _step(models, services, updater, step)
            if results is not None:
                progress.eval_results = results
            done = step + 1
            services.writer.write(done, progress.last)
            bar.update(1)
            tqdm.write(metrics_lib.console_line(done, num_steps, progress.last))
            _watch_divergence(progress, config, done, services.checkpointer)
            stop = preempted.poll()  # the same answer on every host
            if services.checkpointer.should_save(done) or stop:
                t_save = time.perf_counter()
                _save(models, services, done)
                progress.save_s = time.perf_counter() - t_save
            _warn_past_grace(progress, compiled=step > start)
            if stop:
                logging.warning("Preempted: checkpoint %d saved; exiting.", done)
                break
        else:
            _save(models, services, int(models.state.step))
            if evals.enabled and start >= num_steps:  # resumed after the last step: eval.json only
                progress.eval_results = evals.run(
                    services.ctx, models.policy_params(), jax.random.key(seed + 1)
                )
    finally:
        bar.close()
    return models, progress


def _step(
    models: Models, services: Services, updater: Updater, step: int
) -> tuple[Models, dict[str, float], dict[str, float] | None]:
    """One training step: (new models, its metrics, the eval results if it evaluated)."""
    config = services.config
    t_step = time.perf_counter()
    records = next(services.iterator)
    step_key = jax.random.fold_in(models.state.key(), step)
    batch, metrics = rollout(
        services.ctx,
        config,
        models.policy_params(),
        models.ref_params,
        records,
        jax.random.fold_in(step_key, 0),
        next_records=_next_records(services.iterator),  # dynamic sampling
        critic_params=None if models.critic_state is None else models.critic_state.params,
        in_flight=services.in_flight,
        programs=services.programs,
    )
    host_memory.release_free_memory()  # the sampler's freed buffers, before the update
    models, update_metrics = updater(models, batch, step, jax.random.fold_in(step_key, 1))
    metrics.update(update_metrics)
    models = models.next_step()
    results = None
    if services.evaluation.due(step + 1, config.run.num_steps):
        # The key the evaluator also derives for this step's checkpoint.
        results = services.evaluation.run(
            services.ctx, models.policy_params(), eval_key(config.run.seed, step + 1)
        )
        metrics.update(results)
    metrics["time/step_s"] = time.perf_counter() - t_step
    metrics["data/epoch"] = services.iterator.epoch
    metrics["memory/peak_rss_gib"] = host_memory.peak_rss_gib()
    return models, metrics, results


def _watch_divergence(
    progress: Progress, config: TrainConfig, done: int, checkpointer: Checkpointer
) -> None:
    """Stops a run whose every update was skipped (non-finite) for --max_nonfinite_steps
    steps in a row. (During PPO's critic warm-up only the critic updates.)"""
    last = progress.last
    skipped = last.get("optim/skipped_updates", last.get("critic/skipped_updates", 0.0))
    progress.stalled = progress.stalled + 1 if skipped >= config.updates_per_step else 0
    if progress.stalled >= config.update.max_nonfinite_steps:
        raise TrainingDivergedError(_diverged_message(done, progress.stalled, checkpointer))


# The seconds between SIGTERM and SIGKILL (experiments.launch --grace_period_s sets it).
GRACE_ENV = "JAXRL4LLM_GRACE_PERIOD_S"


def _warn_past_grace(progress: Progress, compiled: bool) -> None:
    """Warns once when a step and a checkpoint save take longer than the preemption grace
    period (GRACE_ENV): a SIGTERM early in a step would then kill the run before its save
    ends. Not on the run's first step (`compiled` False), which compiles."""
    grace = float(os.environ.get(GRACE_ENV) or 0)
    need = progress.last.get("time/step_s", 0.0) + progress.save_s
    if not compiled or grace <= 0 or progress.grace_warned or need <= grace:
        return
    progress.grace_warned = True
    logging.warning(
        "A step and a checkpoint save take %.0f s, longer than the %.0f s a preempted run has "
        "between SIGTERM and SIGKILL (experiments.launch --grace_period_s): a preemption may "
        "kill the run before it saves. Raise --grace_period_s, or make the steps shorter.",
        need,
        grace,
    )


def _save(models: Models, services: Services, step: int) -> None:
    data_state = {"iterator": services.iterator.get_state()}
    if services.in_flight is not None:  # partial rollouts' carried rows
        data_state["in_flight"] = services.in_flight.get_state()
    services.checkpointer.save(step, models.saved(), data_state)


def _diverged_message(step: int, stalled: int, checkpointer: Checkpointer) -> str:
    return (
        f"Stopped at step {step}: every update of the last {stalled} steps had a NaN / inf "
        f"loss or gradient and was skipped (--max_nonfinite_steps={stalled}), so the model "
        f"no longer trains. The last checkpoint is step {checkpointer.latest_step()} in "
        f"{checkpointer.directory}. Check the rewards and advantages for NaN / inf "
        "(metrics.jsonl: optim/skipped_updates, reward/*) or lower --learning_rate, then "
        "rerun to resume from that checkpoint."
    )


def _write_outputs(workdir: str, eval_results: dict[str, float]) -> dict[str, str]:
    """The end-of-run files a person looks at: eval.json and curves.png."""
    outputs = {}
    if eval_results:
        outputs["eval"] = paths.join(workdir, "eval.json")
        paths.write_text(outputs["eval"], json.dumps(eval_results, indent=2, sort_keys=True))
    if paths.exists(paths.join(workdir, "metrics.jsonl")):
        outputs["plot"] = plots.plot_runs([workdir], paths.join(workdir, "curves.png"))
    return outputs


def _next_records(iterator: Any) -> Any:
    """Dynamic sampling's further prompts: the iterator's next batches, which admission may
    look at before it takes them (data.iterator.NextBatches), else plain next()."""
    if hasattr(iterator, "next_batches"):
        return iterator.next_batches()
    return lambda: next(iterator)
