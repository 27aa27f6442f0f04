"""A trained run's models read back from its workdir: the base model its config.json names,
with the latest (or a given) checkpoint's parameters (the evaluator, tools/export_hf.py)."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jaxrl4llm.config import paths
from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import registry
from jaxrl4llm.train.config import param_dtype
from jaxrl4llm.train.infra.checkpoint import Checkpointer, checkpoint_step, read_run_config
from jaxrl4llm.train.update import adapters, critic
from jaxrl4llm.train.update.state import abstract_state


def load_trained_policy(
    workdir: str, step: int | None = None, mesh: Mesh | None = None
) -> tuple[Any, Any, Any, Any]:
    """(train config, model config, trained params, tokenizer) of a training workdir.

    The base model named in WORKDIR/config.json gives the architecture and tokenizer; the
    latest (or `step`) checkpoint gives the parameters (a LoRA run's adapters come back merged
    into the base: plain params).
    """
    config, model_config, params, _, tokenizer = load_trained_models(workdir, step, mesh)
    return config, model_config, params, tokenizer


def load_trained_models(
    workdir: str, step: int | None = None, mesh: Mesh | None = None, *, merge_lora: bool = True
) -> tuple[Any, Any, Any, Any, Any]:
    """(train config, model config, policy params, critic params or None, tokenizer): as
    `load_trained_policy`, with PPO's critic when the run trained one. `merge_lora=False`:
    a LoRA run's policy params are its adapters as trained (models/lora.py)."""
    # Checked before the model loads: a training workdir with that step (or any) saved. With
    # no step, restore still falls back from a damaged latest to the last usable one.
    config = read_run_config(workdir)
    checkpoint_step(workdir, step)
    model_config, params, tokenizer = registry.load_model(
        config.model.name, mesh=mesh, dtype=param_dtype(config.model.param_dtype)
    )
    # Restored onto the params' layout, optimizer moments included. A LoRA run saved its
    # adapters: restored beside the base, and merged into it.
    trained = adapters.trainable(config.lora, model_config, params, config.run.seed)
    abstract: Any = abstract_state(trained, config.optimizer, config.run.seed)
    if config.needs_critic:  # PPO: the critic's state sits beside the policy's
        abstract = {
            "policy": abstract,
            "critic": abstract_state(
                critic.from_policy(params),
                critic.optimizer_config(config.optimizer, config.critic.learning_rate),
                config.run.seed,
            ),
        }
    checkpointer = Checkpointer(paths.join(workdir, "checkpoints"), every=1)
    try:
        state, _ = checkpointer.restore(abstract, step, set_aside=False)  # read-only here
    finally:
        checkpointer.close()
    policy = state["policy"] if config.needs_critic else state
    policy_params = (
        lora_lib.merge(params, policy.params, config.lora)
        if config.lora.enabled and merge_lora
        else policy.params
    )
    critic_params = state["critic"].params if config.needs_critic else None
    return config, model_config, policy_params, critic_params, tokenizer
