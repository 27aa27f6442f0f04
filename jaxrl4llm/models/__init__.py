"""Decoder models: config, pure-functional transformer, checkpoints, tokenizer, registry."""

from __future__ import annotations

from jaxrl4llm.models.config import PRESETS, ModelConfig, RopeScaling
from jaxrl4llm.models.kv_cache import KVCache, init_kv_cache
from jaxrl4llm.models.moe import Routing
from jaxrl4llm.models.moe_config import MoeConfig
from jaxrl4llm.models.transformer import (
    Params,
    forward,
    hidden_states,
    init_params,
    param_logical_axes,
    positions_from_mask,
    routed_hidden_states,
)
from jaxrl4llm.models.unembedding import unembed

__all__ = [
    "PRESETS",
    "ModelConfig",
    "RopeScaling",
    "KVCache",
    "MoeConfig",
    "Params",
    "forward",
    "hidden_states",
    "init_kv_cache",
    "init_params",
    "param_logical_axes",
    "positions_from_mask",
    "routed_hidden_states",
    "Routing",
    "unembed",
    "load_model",
]


def load_model(*args, **kwargs):
    """See registry.load_model (imported lazily: it pulls in transformers)."""
    from jaxrl4llm.models.registry import load_model as _load_model

    return _load_model(*args, **kwargs)
