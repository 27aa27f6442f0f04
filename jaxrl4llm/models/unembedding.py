"""The unembedding: final-normed hidden states -> float32 logits over the vocabulary (the
tied embedding or the untied `unembed` weight)."""

from __future__ import annotations

import jax

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.decoder_layer import Params, Sharding, dot

# Logits' logical axes: rows over the data-parallel axes, the vocabulary over tensor.
LOGITS_AXES = ("batch", "length", "vocab")


def unembedding_matrix(
    params: Params, config: ModelConfig, sharding: Sharding = None
) -> tuple[str, jax.Array]:
    """(einsum spec, the unembedding weight) laid out for the matmul: the model width whole,
    the vocabulary over tensor. Gathered once, it can serve many chunks of positions."""
    if config.tie_word_embeddings:
        return "btd,vd->btv", parallel.constrain(params["embed"], ("vocab", None), sharding)
    return "btd,dv->btv", parallel.constrain(params["unembed"], (None, "vocab"), sharding)


def unembed(
    params: Params, config: ModelConfig, h_BTD: jax.Array, sharding: Sharding = None
) -> jax.Array:
    """Final-normed hidden states -> float32 logits [B, T, V]."""
    spec, w = unembedding_matrix(params, config, sharding)
    return parallel.constrain(dot(spec, h_BTD, w), LOGITS_AXES, sharding)
