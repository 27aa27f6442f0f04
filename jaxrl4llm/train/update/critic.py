"""PPO's critic: a value model of the policy's family, its values and its jitted update.

The critic is the policy's decoder (embeddings, layers, final norm; no unembedding) and a
scalar head w [D]: V(s_t) = h_t . w, with h_t the last layer's hidden state after the final
norm at the column of completion token t (the state before it; `completion_hidden_states`,
the same as the policy's logprob of token t reads), so no [B, T, V] logits are ever built.

Params: {"backbone": the policy's params without "unembed", "value_head": [D]}. The backbone
takes the policy's logical axes (so the policy's shardings on the same mesh), the head the
final norm's. It is initialised from the policy's weights with a zero head (V = 0 at step 0)
or read from `--critic_model`, an HF folder / GGUF of the same family; a folder
`export_critic` wrote holds the head as transformers' `score` ([1, D] weight, zero bias),
which `AutoModelForTokenClassification` loads.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel, rl
from jaxrl4llm.models import registry, transformer, weights
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.train.update import packing
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences, completion_hidden_states, over_row_chunks
from jaxrl4llm.train.update.state import OptimizerConfig, TrainState
from jaxrl4llm.train.update.step import (
    UPDATE_STATICS,
    accumulate,
    apply_update,
    mini_batch_denominator,
)

HEAD = "value_head"
SCORE_WEIGHT, SCORE_BIAS = "score.weight", "score.bias"  # transformers' *ForTokenClassification
# What makes two configs the same family, shape and computation (a critic must match its policy).
_SAME_MODEL = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "qk_norm",
    "sliding_window",
)


def logical_axes(model_config: ModelConfig) -> dict[str, Any]:
    """The critic params' logical axes: the policy's for the backbone, the final norm's for
    the head (a [D] vector)."""
    axes = dict(transformer.param_logical_axes(model_config))
    axes.pop("unembed", None)
    return {"backbone": axes, HEAD: axes["final_norm"]}


def _placed_like(x: jax.Array, value: Any) -> jax.Array:
    """`value` with x's shape, dtype and (when x has one) sharding."""
    value = jnp.broadcast_to(jnp.asarray(value, x.dtype), x.shape)
    sharding = getattr(x, "sharding", None)
    return value if sharding is None else jax.device_put(value, sharding)


def from_policy(params: Any) -> dict[str, Any]:
    """A critic initialised from the policy's params (copies, laid out like them), head 0."""
    backbone = {k: jax.tree.map(jnp.copy, v) for k, v in params.items() if k != "unembed"}
    return {"backbone": backbone, HEAD: _placed_like(params["final_norm"], 0.0)}


def load(
    name: str, model_config: ModelConfig, mesh: Mesh | None = None, dtype: Any = jnp.float32
) -> dict[str, Any]:
    """The critic read from `--critic_model`: an HF folder or GGUF of the policy's family (the
    backbone; a zero head unless the folder holds transformers' `score` head)."""
    path = registry.resolve(name)
    if path.endswith(".gguf"):
        from jaxrl4llm.models import gguf_file

        source: gguf_file.GGUFSource | weights.SafetensorsSource
        source = gguf_file.GGUFSource(path)
        config = source.config()
    else:
        source = weights.SafetensorsSource(path)
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        hf.pop("architectures", None)  # a *ForTokenClassification critic names its head class
        config = type(model_config).from_hf_config(hf)
    different = [f for f in _SAME_MODEL if getattr(config, f) != getattr(model_config, f)]
    if different:
        listed = ", ".join(
            f"{f}={getattr(config, f)!r} (policy: {getattr(model_config, f)!r})"
            for f in different[:4]
        )
        raise ValueError(
            f"--critic_model={name!r} is not a model of the policy's family and "
            f"shape: {listed}. Pass a checkpoint of the same architecture, or leave "
            "--critic_model unset to start the critic from the policy's weights."
        )
    backbone = weights.load_params(
        source,
        model_config,
        mesh,
        dtype=dtype,
        skip=("unembed",),
        ignore=(SCORE_WEIGHT, SCORE_BIAS),
    )
    head = np.zeros(model_config.hidden_size, np.dtype(dtype))
    if SCORE_WEIGHT in source.names():
        if source.shape(SCORE_WEIGHT) != (1, model_config.hidden_size):
            raise ValueError(
                f"--critic_model={name!r}: {SCORE_WEIGHT} has shape "
                f"{source.shape(SCORE_WEIGHT)}; a value head is [1, "
                f"{model_config.hidden_size}] (one label)."
            )
        if SCORE_BIAS in source.names() and np.any(np.asarray(source.read(SCORE_BIAS)) != 0):
            raise ValueError(
                f"--critic_model={name!r}: its head has a non-zero {SCORE_BIAS}; "
                "the critic's head has no bias (export it with a zero bias)."
            )
        head = np.asarray(source.read(SCORE_WEIGHT), head.dtype).reshape(-1)
    return {"backbone": backbone, HEAD: _placed_like(backbone["final_norm"], head)}


def export(
    critic_params: Any, model_config: ModelConfig, path: str | os.PathLike, tokenizer: Any = None
) -> None:
    """An HF folder `transformers.AutoModelForTokenClassification` loads (num_labels 1: its
    logits [B, L, 1] are the values) and `--critic_model` reads back."""
    head = np.asarray(jax.device_get(critic_params[HEAD]))
    arch = model_config.to_hf_config()["architectures"][0].replace(
        "ForCausalLM", "ForTokenClassification"
    )
    weights.export_hf(
        critic_params["backbone"],
        model_config,
        path,
        tokenizer,
        extra_tensors={SCORE_WEIGHT: head.reshape(1, -1), SCORE_BIAS: np.zeros(1, head.dtype)},
        hf_config={
            "architectures": [arch],
            "num_labels": 1,
            "id2label": {"0": "value"},
            "label2id": {"value": 0},
        },
    )


def optimizer_config(optimizer: OptimizerConfig, learning_rate: float | None) -> OptimizerConfig:
    """The critic's AdamW: the policy's, at `learning_rate` (None: 10 x the policy's, verl's
    1e-5 for a 1e-6 actor)."""
    lr = optimizer.learning_rate * 10 if learning_rate is None else learning_rate
    return dataclasses.replace(optimizer, learning_rate=lr)


def completion_values(
    critic_params: Any,
    model_config: ModelConfig,
    seqs: Sequences,
    *,
    remat: bool = False,
    prompt_group: int = 1,
    sharding: parallel.ActivationSharding | None = None,
) -> jax.Array:
    """values_BT float32: V(s_t) at every completion token t (0-masked by the caller)."""
    backbone = transformer.cast_for_compute(critic_params["backbone"], model_config)
    h_BTD = completion_hidden_states(
        backbone, model_config, seqs, remat=remat, prompt_group=prompt_group, sharding=sharding
    )
    return _head(critic_params, h_BTD)


def _head(critic_params: Any, h_BTD: jax.Array) -> jax.Array:
    """V = h . w, float32, at every position of the final hidden states h_BTD."""
    head = critic_params[HEAD].astype(h_BTD.dtype)
    return jnp.einsum("btd,d->bt", h_BTD, head, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("config", "prompt_group", "num_chunks", "sharding"))
def values_jit(
    critic_params: Any,
    config: ModelConfig,
    seqs: Sequences,
    prompt_group: int = 1,
    num_chunks: int = 1,
    sharding: parallel.ActivationSharding | None = None,
) -> jax.Array:
    """The rollout's values (V_old), 0 off the mask, in `num_chunks` strided row chunks."""

    def values(seqs: Sequences) -> jax.Array:
        v_BT = completion_values(
            critic_params, config, seqs, prompt_group=prompt_group, sharding=sharding
        )
        return jnp.where(seqs.completion_mask_BT, v_BT, 0.0)

    return over_row_chunks(values, seqs, num_chunks, prompt_group, sharding)


@functools.partial(jax.jit, static_argnames=("config", "sharding"))
def packed_values_jit(
    critic_params: Any,
    config: ModelConfig,
    packed: packing.PackedBatch,
    mask_MT: jax.Array,
    sharding: parallel.ActivationSharding | None = None,
) -> jax.Array:
    """`values_jit`'s values [M, T] (0 off `mask_MT`) of the sequences `packed` holds,
    computed on the packed rows (--micro_batch_tokens, train/update/packing.py)."""
    backbone = transformer.cast_for_compute(critic_params["backbone"], config)
    return packing.read_back(
        lambda k: _head(
            critic_params,
            packing.packed_hidden_states(backbone, config, packed, k, sharding=sharding),
        ),
        packed,
        mask_MT,
        sharding,
    )


def _micro_loss(
    critic_params: Any,
    micro_batch: UpdateBatch,
    denominator: jax.Array,
    *,
    model_config: ModelConfig,
    algorithm: rl.AlgorithmConfig,
    remat: bool,
    prompt_group: int,
    sharding: parallel.ActivationSharding | None,
) -> tuple[jax.Array, dict[str, Metric]]:
    # PPO's update batches carry the critic's old values and returns (train.rollout).
    assert micro_batch.old_values_BT is not None and micro_batch.returns_BT is not None
    values_BT = completion_values(
        critic_params,
        model_config,
        micro_batch.seqs,
        remat=remat,
        prompt_group=prompt_group,
        sharding=sharding,
    )
    loss_sum, _, metrics = rl.value_loss(
        values_BT,
        micro_batch.old_values_BT,
        micro_batch.returns_BT,
        micro_batch.seqs.completion_mask_BT,
        micro_batch.keep_B,
        value_clip=algorithm.value_clip,
        agg=algorithm.agg,
        max_tokens=algorithm.max_tokens,
    )
    return loss_sum / denominator, metrics


@functools.partial(jax.jit, donate_argnames=("state",), static_argnames=UPDATE_STATICS)
def critic_step(
    state: TrainState,
    batch: UpdateBatch,
    *,
    model_config: ModelConfig,
    algorithm: rl.AlgorithmConfig,
    optimizer: OptimizerConfig,
    num_micro: int,
    remat: bool = False,
    prompt_group: int = 1,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW update of the critic on a mini-batch's clipped value loss (rl.value_loss,
    aggregated like the policy's loss), accumulated over micro-batches like `train_step`
    and skipped likewise when not finite. Metrics: critic/loss, critic/grad_norm, ..."""
    denominator = mini_batch_denominator(algorithm, batch)
    grad_fn = jax.value_and_grad(
        functools.partial(
            _micro_loss,
            model_config=model_config,
            algorithm=algorithm,
            remat=remat,
            prompt_group=prompt_group,
            sharding=sharding,
        ),
        has_aux=True,
    )
    axes = logical_axes(model_config)
    loss, grads, metrics = accumulate(
        state.params,
        batch,
        grad_fn,
        denominator,
        num_micro=num_micro,
        prompt_group=prompt_group,
        param_axes=axes,
        sharding=sharding,
    )
    new_state, update_metrics = apply_update(
        state,
        loss,
        grads,
        optimizer=optimizer,
        param_axes=axes,
        sharding=sharding,
        loss_name="critic/loss",
        prefix="critic",
    )
    return new_state, dict(metrics, **update_metrics)
