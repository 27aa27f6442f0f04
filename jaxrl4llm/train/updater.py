"""The update stage of a training step: every mini-batch of the rollout's batch through the
policy update program (and PPO's critic update), each compiled once per shape."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from jaxrl4llm import parallel
from jaxrl4llm.program import Program
from jaxrl4llm.rl.metrics import Metric, combine_metrics
from jaxrl4llm.train.infra import host_memory
from jaxrl4llm.train.infra import metrics as metrics_lib
from jaxrl4llm.train.services import Services
from jaxrl4llm.train.update import packing
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.minibatches import minibatches
from jaxrl4llm.train.update.models import Models
from jaxrl4llm.train.update.packing import PackedBatch


@dataclasses.dataclass
class Updater:
    """Runs the update stage with the run's programs (`services.programs`); remembers the
    update shapes compiled so far (each new shape is compiled ahead of its first call, see
    `compile_ahead`)."""

    services: Services
    compiled: set = dataclasses.field(default_factory=set)

    def __call__(
        self, models: Models, batch: UpdateBatch, step: int, key: jax.Array
    ) -> tuple[Models, dict[str, float]]:
        """All of a step's optimizer updates; returns the new models and the update's
        metrics (optim/*, policy/*, critic/*, response/update_real_frac, time/update_s; with
        --micro_batch_tokens response/update_packed, the share of mini-batches that ran
        packed, and response/update_flops_ratio, their modelled packed / padded FLOPs)."""
        config = self.services.config
        t0 = time.perf_counter()
        metrics: dict[str, Metric] = {}
        real_tokens, update_columns = 0, 0  # completion tokens / positions the update runs
        choices = []  # --micro_batch_tokens: each mini-batch's packing choice
        dropout_key = jax.random.fold_in(key, 1 << 20)  # apart from the shuffling's
        for index, (mini_batch, classes, tokens, choice) in enumerate(
            minibatches(batch, config, key, self.services.mesh, self.services.model_config)
        ):
            if tokens is not None:
                real_tokens += tokens[0]
                update_columns += tokens[1]
            packed = None if choice is None else choice.batch
            if choice is not None:
                choices.append(choice)
            # The layout the update compiles for (and tools/plan.py plans), whichever
            # program made each array.
            mini_batch = parallel.on_batch_axes(mini_batch, self.services.mesh)
            prompt_group = self.services.programs.update_group(mini_batch)
            # PPO: the first steps train the critic only.
            if step >= config.critic.warmup_steps:
                models, m = self._policy_update(
                    models,
                    mini_batch,
                    prompt_group,
                    classes,
                    jax.random.fold_in(dropout_key, index),
                    packed,
                )
                metrics = combine_metrics(metrics, m)
            if models.critic_state is not None:
                critic_update = self.services.programs.critic_update(prompt_group)
                critic_state, m = critic_update(models.critic_state, mini_batch)
                models = dataclasses.replace(models, critic_state=critic_state)
                metrics = combine_metrics(metrics, m)
        host = metrics_lib.to_host_scalars(metrics)  # waits for the updates
        if update_columns:
            host["response/update_real_frac"] = real_tokens / update_columns
        if choices:
            n = len(choices)
            host["response/update_packed"] = sum(c.batch is not None for c in choices) / n
            host["response/update_flops_ratio"] = sum(c.flops_ratio for c in choices) / n
        host["time/update_s"] = time.perf_counter() - t0
        host["optim/learning_rate"] = float(
            self.services.lr_schedule((step + 1) * config.updates_per_step - 1)
        )
        return models, host

    def _policy_update(
        self,
        models: Models,
        mini_batch: UpdateBatch,
        prompt_group: int,
        classes: tuple[int, ...],
        key: jax.Array,
        packed: PackedBatch | None = None,
    ) -> tuple[Models, dict[str, Metric]]:
        if packed is not None:  # the packed rows hold the prompts
            mini_batch = packing.for_update(mini_batch)
        shapes = tuple(x.shape for x in jax.tree.leaves((mini_batch, packed)))
        signature = (prompt_group, classes, shapes)
        lora = self.services.config.lora
        # LoRA: the frozen base beside the state; --lora_dropout's key (fresh each update).
        inputs = dict(
            frozen=models.base_params,
            dropout_key=key if lora.enabled and lora.dropout > 0 else None,
            packed=packed,
        )
        policy_update = self.services.programs.policy_update(prompt_group, classes)
        if signature not in self.compiled:
            compile_ahead(policy_update, models.state, mini_batch, **inputs)
            self.compiled.add(signature)
        state, metrics = policy_update(models.state, mini_batch, **inputs)
        return dataclasses.replace(models, state=state), metrics


def compile_ahead(program: Program, *args: Any, **kwargs: Any) -> None:
    """Compiles `program` for these arguments' shapes ahead of its first call (the jitted
    call reuses the executable), then hands the compiler's freed heap back to the OS: on
    CPU, the compiler's leftovers would otherwise sit under the update's own peak."""
    program.lower(*args, **kwargs).compile()
    host_memory.release_free_memory()
