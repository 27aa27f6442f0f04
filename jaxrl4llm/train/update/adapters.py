"""What the policy's optimizer trains: the whole params, or LoRA adapters on frozen base params.

With --lora_rank > 0 the TrainState's params are the adapters (models/lora.py): the optimizer
state and the checkpoints hold only them, the base params stay outside the state (never
donated, never updated) and serve as the reference model too (the adapters off). They start
fresh (B zero: the base model exactly) or from a PEFT adapter folder (--init_adapter), and are
float32 whatever the base's dtype (their gradients and Adam moments too): the passes compute
with them in the base's dtype (models/lora.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import peft_format, transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.lora import LoraConfig


def trainable(
    lora: LoraConfig, model_config: ModelConfig, base: Any, seed: int, init: str | None = None
) -> Any:
    """The params the optimizer trains: `base` itself, or float32 adapters (replicated over
    the base's mesh, if it has one): fresh, or read from the PEFT adapter folder `init`
    (--init_adapter), whose rank, alpha and targets must be `lora`'s."""
    if not lora.enabled:
        return base
    sharding = getattr(jax.tree.leaves(base)[0], "sharding", None)
    out = (
        NamedSharding(sharding.mesh, PartitionSpec())
        if isinstance(sharding, NamedSharding)
        else None
    )
    if init is not None:
        return from_peft(init, lora, model_config, out)
    make = jax.jit(lora_lib.init_adapters, static_argnums=(0, 1), out_shardings=out)
    # A key apart from the run's own (TrainState.rng): the adapters' A at the same seed.
    return make(model_config, lora, jax.random.fold_in(jax.random.key(seed), 0x10AA))


def param_axes(lora: LoraConfig | None, model_config: ModelConfig) -> Any:
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


def from_peft(path: str, lora: LoraConfig, model_config: ModelConfig, sharding: Any) -> Any:
    """The adapters of a PEFT folder in float32, placed on `sharding` (None: the default
    device); a FlagError naming --init_adapter when the folder's adapter is not `lora`'s or
    does not fit the model."""
    try:
        loaded, theirs = peft_format.load_peft(path, model_config)
    except (OSError, ValueError, KeyError) as exc:
        raise FlagError(f"--init_adapter: {exc}") from exc
    if (theirs.rank, theirs.alpha, theirs.targets) != (lora.rank, lora.alpha, lora.targets):
        raise FlagError(
            f"--init_adapter={path} holds a rank-{theirs.rank} adapter (alpha {theirs.alpha:g}) "
            f"on {','.join(theirs.targets)}, the run's is rank {lora.rank} (alpha "
            f"{lora.alpha:g}) on {','.join(lora.targets)}: leave --lora_rank, --lora_alpha "
            "and --lora_targets to the file (TrainConfig.with_init_adapter)."
        )

    def place(x: np.ndarray) -> jax.Array:
        x = np.asarray(x).astype(np.float32)  # every host holds the whole (small) file
        if sharding is None:
            return jnp.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, loaded)
