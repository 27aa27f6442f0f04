"""What the policy's optimizer trains: the whole params, or LoRA adapters on frozen base params.

With --lora_rank > 0 the TrainState's params are the adapters (models/lora.py): the optimizer
state and the checkpoints hold only them, the base params stay outside the state (never
donated, never updated) and serve as the reference model too (the adapters off).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import transformer
from jaxrl4llm.models.lora import LoraConfig


def trainable(lora: LoraConfig, model_config: Any, base: Any, seed: int) -> Any:
    """The params the optimizer trains: `base` itself, or fresh adapters in the base's dtype
    (replicated over the base's mesh, if it has one)."""
    if not lora.enabled:
        return base
    dtype = jax.tree.leaves(base)[0].dtype
    sharding = getattr(jax.tree.leaves(base)[0], "sharding", None)
    out = (
        NamedSharding(sharding.mesh, PartitionSpec())
        if isinstance(sharding, NamedSharding)
        else None
    )
    init = jax.jit(lora_lib.init_adapters, static_argnums=(0, 1, 3), out_shardings=out)
    # A key apart from the run's own (TrainState.rng): the adapters' A at the same seed.
    return init(model_config, lora, jax.random.fold_in(jax.random.key(seed), 0x10AA), dtype)


def param_axes(lora: LoraConfig | None, model_config: Any) -> Any:
    """Logical axes of the trained params (their gradients and optimizer moments)."""
    if lora is None or not lora.enabled:
        return transformer.param_logical_axes(model_config)
    return lora_lib.adapter_logical_axes(model_config, lora)


def policy(
    lora: LoraConfig | None, base: Any, trained: Any, dropout_key: jax.Array | None = None
) -> Any:
    """The params the policy's forward reads: `trained` (full fine-tuning) or the base with
    the adapters (the unmerged path: see docs/performance.md, "LoRA")."""
    if lora is None or not lora.enabled:
        return trained
    return lora_lib.combine(base, trained, lora, dropout_key)
