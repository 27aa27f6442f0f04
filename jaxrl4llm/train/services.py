"""A training run's setup: the models it trains (`Models`, checkpointed) and the services a
step uses (`Services`: mesh, sampler context, reward pool, data iterator, evaluation,
checkpointer, metric writers), built once by `setup` and closed by `Services.close`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxrl4llm import parallel
from jaxrl4llm.config import options, paths
from jaxrl4llm.config.errors import flag_errors
from jaxrl4llm.data import make_iterator, make_source
from jaxrl4llm.envs import EnvService, open_env_service
from jaxrl4llm.eval import evaluator
from jaxrl4llm.eval.config import EvalConfig
from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import registry
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.rewards import RewardFn
from jaxrl4llm.sampling import buckets
from jaxrl4llm.sampling.context import RolloutContext
from jaxrl4llm.train.config import TrainConfig, checks, param_dtype
from jaxrl4llm.train.infra import metrics as metrics_lib
from jaxrl4llm.train.infra.checkpoint import Checkpointer, abstract_like
from jaxrl4llm.train.infra.resume import check_resume
from jaxrl4llm.train.programs import StepPrograms
from jaxrl4llm.train.rollout import partial
from jaxrl4llm.train.update import adapters, critic
from jaxrl4llm.train.update.models import Models
from jaxrl4llm.train.update.state import TrainState, create_state, learning_rate_schedule


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The held-out evaluation: the --eval_data prompts and the --eval_sets (each with its
    own protocol), scored with the trainer's own sampler."""

    config: EvalConfig
    records: list  # --eval_data / held-out split prompts (may be empty)
    set_records: Any  # --eval_sets' prompts by set

    @property
    def enabled(self) -> bool:
        return bool(self.records or self.config.sets)

    def due(self, done: int, num_steps: int) -> bool:
        """Every eval_every steps, and after the last step whatever eval_every is, so the
        final score is in metrics.jsonl (and its curve) like every other eval."""
        every = self.config.eval_every
        return self.enabled and (done == num_steps or bool(every and done % every == 0))

    def run(self, ctx: RolloutContext, params: Any, key: jax.Array) -> dict[str, float]:
        return evaluator.evaluate_run(
            ctx,
            params,
            self.records,
            self.config.sets,
            self.set_records,
            samples=self.config.eval_samples,
            key=key,
        )


@dataclasses.dataclass(frozen=True)
class Services:
    """What a training step uses besides the models; built by `setup`."""

    config: TrainConfig
    mesh: Mesh
    model_config: ModelConfig  # the policy's, with --compute_dtype
    programs: StepPrograms  # the step's compiled programs (train/programs.py)
    workdir: str
    iterator: Any  # the resumable prompt iterator (this host's shard)
    ctx: RolloutContext  # sampler, tokenizer, reward function, sharding
    reward_fn: RewardFn
    evaluation: Evaluation
    checkpointer: Checkpointer
    writer: metrics_lib.MetricsWriter
    lr_schedule: Callable[[int], Any]
    start: int  # the step this run starts at (after a resume)
    in_flight: partial.InFlight | None = None  # partial rollouts' carried buffer
    env_service: EnvService | None = None  # --env: the environment's workers

    def close(self) -> None:
        """Whatever happened, what was computed is kept: metrics flushed, pool closed."""
        self.writer.close()
        self.checkpointer.close()
        self.reward_fn.close()
        if self.env_service is not None:
            self.env_service.close()


def setup(config: TrainConfig, devices: list) -> tuple[Models, Services]:
    """Builds the run in the order that fails early: flags, resume compatibility and the
    data (before the model loads or the workdir is written), then the model, the states, the
    sampler and the writers, and restores the latest checkpoint if the workdir has one.
    `config` is validated already (train.loop.run runs train.config.checks.validate first)."""
    for warning in config.precision_warnings():
        logging.warning("%s", warning)
    run = config.run
    mesh = parallel.make_mesh(run.mesh, devices)
    workdir = paths.absolute(run.workdir)
    check_resume(workdir, config)  # a different model / algorithm: refused before any write
    # The data first: a bad source fails before the model loads or the workdir is written.
    iterator, evals = _open_data(config, mesh)
    _write_config(workdir, config)
    loaded = _load_models(config, mesh)
    reward_fn = RewardFn("auto", config.reward)
    env_service = open_env_service(config.rollout, loaded.tokenizer, config.reward)
    ctx = RolloutContext.create(
        loaded.model_config,
        loaded.tokenizer,
        reward_fn,
        mesh,
        config.data,
        config.rollout,
        turn_handlers=env_service,
        record_routing=StepPrograms(config, loaded.model_config, mesh).routing_record is not None,
    )
    checkpointer = Checkpointer(
        paths.join(workdir, "checkpoints"), run.checkpoint_every, run.keep_checkpoints
    )
    writer = metrics_lib.MetricsWriter(
        workdir, trackers=run.tracker_names, hparams=options.flatten(config)
    )
    in_flight = (
        partial.InFlight(config.rollout, ctx.sampler.pad_id)
        if config.rollout.partial_rollout_tokens
        else None
    )
    models, start = _restore_latest(loaded.models, checkpointer, iterator, in_flight, workdir)
    writer.truncate_after(start)  # also at 0: a run killed before its first checkpoint
    return models, Services(
        config=config,
        mesh=mesh,
        model_config=loaded.model_config,
        programs=loaded.programs,
        workdir=workdir,
        iterator=iterator,
        ctx=ctx,
        reward_fn=reward_fn,
        evaluation=evals,
        checkpointer=checkpointer,
        writer=writer,
        lr_schedule=learning_rate_schedule(config.optimizer),
        start=start,
        in_flight=in_flight,
        env_service=env_service,
    )


def _open_data(config: TrainConfig, mesh: Mesh) -> tuple[Any, Evaluation]:
    """The training prompts' resumable iterator (this host's shard) and the held-out
    evaluation's prompts; reading them is what fails on a bad source or split."""
    source = make_source(
        config.data.source, split="train", revision=config.data.revision, **config.data.field_names
    )
    iterator = make_iterator(
        source,
        _prompts_per_host(config, mesh),
        seed=config.run.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
    )
    evals = Evaluation(
        config.evaluation,
        evaluator.held_out_records(config.data, config.evaluation),
        evaluator.eval_set_records(config.evaluation.sets, config.data),
    )
    return iterator, evals


def _write_config(workdir: str, config: TrainConfig) -> None:
    """WORKDIR/config.json: the run's whole config tree (host 0 writes it)."""
    paths.makedirs(workdir)
    if jax.process_index() == 0:
        paths.write_text(paths.join(workdir, "config.json"), config.to_json())


@dataclasses.dataclass(frozen=True)
class LoadedModels:
    """`_load_models`' result: the run's fresh `Models`, the policy's ModelConfig (with
    --compute_dtype), the tokenizer and the step's programs built for them."""

    models: Models
    model_config: ModelConfig
    tokenizer: Any
    programs: StepPrograms


def _load_models(config: TrainConfig, mesh: Mesh) -> LoadedModels:
    """Loads the policy onto the mesh, checks the context length against it, and builds the
    states: the policy's (its params, or LoRA adapters on the frozen base), PPO's critic,
    and the reference."""
    model_config, params, tokenizer = registry.load_model(
        config.model.name, mesh=mesh, dtype=param_dtype(config.model.param_dtype)
    )
    # Before anything compiles: a prompt + completion longer than the model's context.
    config.validate_context(model_config.max_position_embeddings)
    model_config = config.model.compute_config(model_config)  # --compute_dtype
    with flag_errors():  # LoRA targets the model's layers lack (a MoE's dense MLP)
        lora_lib.check_model(model_config, config.lora)
        checks.check_router(config, model_config)  # router flags on a dense model
    lora = config.lora if config.lora.enabled else None
    if lora is not None:
        # The base is frozen outside the state (never donated): it is the reference too.
        ref_params = params if config.needs_reference else None
        trained = adapters.trainable(
            lora, model_config, params, config.run.seed, init=config.model.init_adapter
        )
    else:
        # A separate copy: the policy's buffers are donated to each update.
        ref_params = jax.tree.map(jnp.copy, params) if config.needs_reference else None
        trained = params
    programs = StepPrograms(config, model_config, mesh)
    models = Models(
        state=programs.create(trained)(trained),
        critic_state=_create_critic(config, params, model_config, mesh),
        ref_params=ref_params,
        base_params=params if lora else None,
        lora=lora,
    )
    return LoadedModels(
        models=models, model_config=model_config, tokenizer=tokenizer, programs=programs
    )


def _restore_latest(
    models: Models,
    checkpointer: Checkpointer,
    iterator: Any,
    in_flight: partial.InFlight | None,
    workdir: str,
) -> tuple[Models, int]:
    """The models, the iterator and partial rollouts' buffer as the latest checkpoint left
    them (unchanged when there is none), and the step the run starts at."""
    if checkpointer.latest_step() is None:
        return models, 0
    saved, data_state = checkpointer.restore(abstract_like(models.saved()))
    models = models.restored(saved)
    # The saved iterator state is host 0's; hosts differ only in their shard index.
    iterator.set_state(dict(data_state["iterator"], shard_index=jax.process_index()))
    if in_flight is not None:
        in_flight.set_state(data_state.get("in_flight"))
    start = int(models.state.step)
    tqdm.write(f"Resumed from step {start} in {workdir}")
    return models, start


def _prompts_per_host(config: TrainConfig, mesh: Mesh) -> int:
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
            f"{max(local_shards, 8)} rows per host)."
        )
    return P // hosts


def _create_critic(
    config: TrainConfig, params: Any, model_config: ModelConfig, mesh: Mesh
) -> TrainState | None:
    """PPO's critic state (None for every other algorithm): from --critic_model, else the
    policy's weights with a zero head, laid out like the policy."""
    if not config.needs_critic:
        return None
    if config.critic.model:
        critic_params = critic.load(
            config.critic.model, model_config, mesh, dtype=param_dtype(config.model.param_dtype)
        )
    else:
        critic_params = critic.from_policy(params)
    return create_state(
        critic_params,
        critic.optimizer_config(config.optimizer, config.critic.learning_rate),
        config.run.seed,
    )
