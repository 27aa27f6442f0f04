"""ModelConfig from/to HF config.json: every family, both rope layouts, clear errors."""

from __future__ import annotations

import json

import pytest

from jaxrl4llm.models.config import PRESETS, ModelConfig, RopeScaling

_BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama_transformers5_rope_parameters():
    cfg = ModelConfig.from_hf_config(
        {
            **_BASE,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "rope_parameters": {**_LLAMA3, "rope_theta": 5e5},
        }
    )
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2
    assert cfg.eos_token_ids == (2, 3) and cfg.pad_token_id is None
    assert not cfg.attention_bias and not cfg.qk_norm and not cfg.tie_word_embeddings


def test_llama_legacy_rope_theta_and_scaling():
    legacy = {
        **_BASE,
        "model_type": "llama",
        "rope_theta": 5e5,
        "rope_scaling": {
            **{k: v for k, v in _LLAMA3.items() if k != "rope_type"},
            "type": "llama3",
        },
    }
    cfg = ModelConfig.from_hf_config(legacy)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.factor == 8.0


def test_qwen_families():
    qwen2 = ModelConfig.from_hf_config(
        {
            **_BASE,
            "model_type": "qwen2",
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        }
    )
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.tie_word_embeddings
    assert qwen2.rope_theta == 1e6 and qwen2.rope_scaling is None
    qwen3 = ModelConfig.from_hf_config({**_BASE, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_round_trip_through_hf_dict_and_file(tmp_path, model_type):
    rope = {**_LLAMA3, "rope_theta": 5e5} if model_type == "llama" else {"rope_theta": 1e6}
    cfg = ModelConfig.from_hf_config({**_BASE, "model_type": model_type, "rope_parameters": rope})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    assert ModelConfig.from_hf_config(tmp_path) == cfg
    assert ModelConfig.from_hf_config(tmp_path / "config.json") == cfg


def test_transformers_reads_exported_config():
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.from_hf_config(
        {**_BASE, "model_type": "llama", "rope_parameters": {**_LLAMA3, "rope_theta": 5e5}}
    )
    hf = transformers.LlamaConfig(**cfg.to_hf_config())
    assert hf.rope_parameters["rope_type"] == "llama3"
    assert hf.rope_parameters["rope_theta"] == 5e5
    assert hf.num_key_value_heads == 2 and hf.head_dim == 16


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"model_type": "gemma2"}, "model_type"),
        ({"model_type": "llama", "architectures": ["MistralForCausalLM"]}, "architectures"),
        (
            {"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            "rope_parameters.rope_type",
        ),
        (
            {"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type",
        ),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
        (
            {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "low_freq_factor",
        ),
    ],
)
def test_unsupported_fields_are_named(patch, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_hf_config({**_BASE, **patch})


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf_config(tmp_path)


def test_bad_direct_construction():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=3,
            num_kv_heads=2,
            head_dim=4,
        )


def test_presets_are_hashable_and_sized():
    assert len({hash(c) for c in PRESETS.values()}) == len(PRESETS)
    # SmolLM2-135M: 134.5M parameters with tied embeddings.
    assert 134e6 < PRESETS["smollm2-135m"].num_params < 135e6
