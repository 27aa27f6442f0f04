"""The abstract inputs of the step's programs (jax.ShapeDtypeStruct leaves with the shardings
the trainer gives the real arrays): params, adapters, the critic's, the rollout's sequences,
a mini-batch and its packed rows. Nothing here allocates."""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl4llm import parallel
from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.lora import LoraConfig
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.update import critic, packing
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences


def abstract(shape: Any, dtype: Any, sharding: Any) -> jax.Array:
    """A ShapeDtypeStruct standing for the array the trainer would pass: lowering reads only
    its shape, dtype and sharding, so the pytrees typed with jax.Array fields hold it."""
    return cast(jax.Array, jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding))


def abstract_params(model_config: ModelConfig, mesh: Mesh, dtype: Any) -> Any:
    """The policy's params as the trainer lays them out: their logical axes on `mesh`."""
    shapes = transformer.param_shapes(model_config)
    shardings = parallel.logical_to_sharding(
        transformer.param_logical_axes(model_config),
        mesh,
        shapes=jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=lambda x: isinstance(x, tuple)
        ),
    )
    return jax.tree.map(
        lambda s, sh: abstract(s, dtype, sh),
        shapes,
        shardings,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def abstract_adapters(model_config: ModelConfig, lora: LoraConfig, mesh: Mesh) -> dict[str, Any]:
    """LoRA adapters as adapters.trainable lays them out: float32, replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(
        lambda s: abstract(s, jnp.float32, replicated),
        lora_lib.adapter_shapes(model_config, lora),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def abstract_policy(base: Any, trained: Any, lora: LoraConfig | None) -> Any:
    """The params the policy's passes read (adapters.policy): the trained params, or under
    LoRA the base with the adapter leaves in its layers (lora_lib.combine's tree)."""
    if lora is None:
        return trained
    return {**base, "layers": {**base["layers"], **trained["layers"]}}


def rows(mesh: Mesh, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Batch rows, split over the data-parallel devices as the trainer places them."""
    return abstract(shape, dtype, parallel.batch_sharding(mesh, len(shape)))


def per_device_bytes(tree: Any) -> float:
    """Per-device bytes of a tree of abstract arrays (shards, not whole arrays)."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def abstract_critic_params(params: Any) -> dict[str, Any]:
    """PPO's critic params as critic.from_policy lays them out: the policy's without the
    unembedding, and a head shaped, typed and placed like the final norm."""
    return {
        "backbone": {k: v for k, v in params.items() if k != "unembed"},
        critic.HEAD: params["final_norm"],
    }


def count(tree: Any) -> int:
    """Elements of a tree of (abstract) arrays."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def sequences(
    mesh: Mesh,
    B: int,
    P: int,
    T: int,
    record: tuple[int, int] | None = None,
    replay: bool = False,
) -> Sequences:
    """B rollout rows of P prompt and T completion columns; with `record` (MoE layers,
    experts per token: StepPrograms.routing_record) the sampler's routing record beside
    them, run by the passes with `replay`."""
    seqs = Sequences(
        prompt_tokens_BP=rows(mesh, (B, P), jnp.int32),
        prompt_mask_BP=rows(mesh, (B, P), bool),
        completion_tokens_BT=rows(mesh, (B, T), jnp.int32),
        completion_mask_BT=rows(mesh, (B, T), bool),
    )
    if record is None:
        return seqs
    L, K = record
    return seqs.replace(
        prompt_experts_BPLK=rows(mesh, (B, P, L, K), jnp.uint8),
        experts_BTLK=rows(mesh, (B, T, L, K), jnp.uint8),
        replay=replay,
    )


def update_batch(config: TrainConfig, mesh: Mesh, seqs: Sequences, advantages: Any) -> UpdateBatch:
    """A mini-batch of `seqs`' rows as the rollout hands it to the update: the logprobs,
    values and returns the algorithm needs (`advantages`: their abstract shape)."""
    M, T = seqs.completion_tokens_BT.shape
    logp = rows(mesh, (M, T), jnp.float32)
    c = config
    return UpdateBatch(
        seqs=seqs,
        advantages=rows(mesh, advantages.shape, jnp.float32),
        keep_B=rows(mesh, (M,), bool),
        old_logp_BT=logp if c.needs_old_logprobs else None,
        ref_logp_BT=logp if c.needs_reference else None,
        behaviour_logp_BT=logp if c.keeps_behaviour_logprobs else None,
        old_values_BT=logp if c.needs_critic else None,
        returns_BT=logp if c.needs_critic else None,
    )


def packed_rows(config: TrainConfig, mesh: Mesh) -> packing.PackedBatch:
    """A mini-batch's sequences packed (--micro_batch_tokens=N): ceil(M / dp) micro-batches
    of dp rows x N / dp slots, the longest row length."""
    N = config.update.micro_batch_tokens
    dp = parallel.data_parallel_size(mesh)
    K, M = -(-config.mini_batch // dp), config.mini_batch
    layout = parallel.ActivationSharding(mesh).named((None, "batch", None), (K, dp, N // dp))
    whole = NamedSharding(mesh, PartitionSpec())
    slots = abstract((K, dp, N // dp), jnp.int32, layout)
    return packing.PackedBatch(
        **dict.fromkeys(packing.SLOT_FIELDS, slots),
        micro_M=abstract((M,), jnp.int32, whole),
        start_M=abstract((M,), jnp.int32, whole),
        num_micro=abstract((), jnp.int32, whole),
    )


def expert_layout(params: Any, model_config: ModelConfig, mesh: Mesh) -> str:
    """How a mixture of experts' weights lie on `mesh`, read from the params' shardings: the
    experts' split, each expert's (its [D, M] projections), the dense weights' ("" for a
    model without experts)."""
    if not model_config.moe_layers:
        return ""

    def axes(spec: Any) -> str:
        names = [a for e in spec for a in parallel.mesh_axes(e) if mesh.shape[a] > 1]
        return " x ".join(f"{a}:{mesh.shape[a]}" for a in names) or "none (whole)"

    layers = params["layers"]  # per-layer leaves: [layer, ...], the layer axis whole
    split = layers["expert_gate"].sharding.spec[1:]
    per_device = model_config.moe.num_experts // math.prod(
        mesh.shape[a] for a in parallel.mesh_axes(split[0])
    )
    return (
        f"{model_config.moe.num_experts} experts per MoE layer over {axes(split[:1])} "
        f"({per_device} per device), each expert's weights over {axes(split[1:])}; "
        f"attention over {axes(layers['q'].sharding.spec[1:])}, router over "
        f"{axes(layers['router'].sharding.spec[1:])}, embeddings over "
        f"{axes(params['embed'].sharding.spec)}; each weight whole across the axes not named"
    )
