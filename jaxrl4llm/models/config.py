"""ModelConfig: the static description of a decoder (Llama / Qwen2 / Qwen3 / Mistral families,
and the Qwen3-MoE / Qwen2-MoE mixtures of experts).

Built from a Hugging Face `config.json` (transformers 4 or 5 layout), written back for export,
and hashable so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from jaxrl4llm.models.moe_config import MoeConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """A decoder family: what its HF config.json says beyond the shared Llama layout.

    model_type: HF config.json `model_type`; architecture: the HF class (`architectures`).
    attention_bias: q/k/v projections carry biases (Qwen2: always).
    qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
    sliding_window: config.json's `sliding_window` limits attention (Mistral); see
        ModelConfig.sliding_window.
    gguf_permutes_qk: llama.cpp stores this family's q/k rows RoPE-interleaved.
    moe: the MLP of some layers is a mixture of experts (models/moe.py; ModelConfig.moe).
    shared_expert: each MoE layer also runs one dense expert on every token, scaled by
        sigmoid(x . shared_expert_gate) (Qwen2-MoE).
    hf_extra: fixed keys written into an exported config.json.
    """

    model_type: str
    architecture: str
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: bool = False
    gguf_permutes_qk: bool = False
    moe: bool = False
    shared_expert: bool = False
    hf_extra: tuple[tuple[str, Any], ...] = ()


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            gguf_permutes_qk=True,
            hf_extra=(("attention_bias", False), ("mlp_bias", False)),
        ),
        Family("qwen2", "Qwen2ForCausalLM", attention_bias=True),
        Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, hf_extra=(("attention_bias", False),)),
        Family("mistral", "MistralForCausalLM", sliding_window=True, gguf_permutes_qk=True),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            qk_norm=True,
            moe=True,
            hf_extra=(("attention_bias", False),),
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            attention_bias=True,
            moe=True,
            shared_expert=True,
            hf_extra=(("qkv_bias", True),),
        ),
    )
}
_ARCH_TO_TYPE = {f.architecture: f.model_type for f in FAMILIES.values()}
_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency-dependent RoPE scaling ("llama3" rope type)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer; every field is hashable."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    model_type: str = "llama"  # which HF family to export as
    # Mistral: a token attends to itself and the `sliding_window` - 1 tokens before it (None:
    # every earlier token), in every pass (see models/attention.py).
    sliding_window: int | None = None
    # Mixed precision: "bfloat16" runs every pass (sampler, teacher-forced, update) with its
    # weights cast to bfloat16 at the start, over float32 master params (None: the params'
    # dtype); see transformer.cast_for_compute. Not part of the HF config.
    compute_dtype: str | None = None
    # A `moe` family's mixture of experts (the default: none, every layer dense).
    moe: MoeConfig = MoeConfig()

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ValueError(
                f"ModelConfig.model_type={self.model_type!r} is not supported; "
                f"use one of {sorted(FAMILIES)}."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE.")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                f"ModelConfig.compute_dtype={self.compute_dtype!r}: use float32, "
                "bfloat16 or None (the params' dtype)."
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"ModelConfig.sliding_window={self.sliding_window} must be at "
                "least 1 (a token attends to itself), or None for no window."
            )
        if self.rope_scaling is not None and self.rope_scaling.rope_type != "llama3":
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_scaling.rope_type!r} is not "
                "supported; only 'llama3' (or no scaling) is."
            )
        _check_moe(self)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts."""
        return self.moe.sparse_layers(self.num_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the dense one (every layer of a dense model)."""
        sparse = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in sparse)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """The layers that hold a per-layer weight of `kind` (schema.Leaf.layers): "all",
        "dense" or "moe"."""
        if kind == "all":
            return tuple(range(self.num_layers))
        return self.dense_layers if kind == "dense" else self.moe_layers

    def mlp_params(self, active: bool = False) -> int:
        """The MLP weights of all layers; `active`: only those one token runs (its
        experts_per_token experts of each MoE layer)."""
        moe = self.moe.layer_params(self.hidden_size, active)
        dense = 3 * self.hidden_size * self.intermediate_size
        return len(self.dense_layers) * dense + len(self.moe_layers) * moe

    @property
    def num_params(self) -> int:
        d, h = self.hidden_size, self.head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 2 * d
        if self.attention_bias:
            per_layer += h * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            per_layer += 2 * h
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + self.mlp_params() + emb + d

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike) -> "ModelConfig":
        """Builds a config from a HF `config.json` dict, the file, or the folder holding it."""
        if isinstance(config, Mapping):
            return _from_hf_dict(dict(config))
        return _from_hf_dict(dict(_read_hf_config(config)))

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (transformers 5 layout) that `from_hf_config` reads back."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling is not None:
            rope = {**dataclasses.asdict(self.rope_scaling), "rope_theta": float(self.rope_theta)}
        eos: Any = list(self.eos_token_ids)
        eos = eos[0] if len(eos) == 1 else (eos or None)
        out: dict[str, Any] = {
            "architectures": [FAMILIES[self.model_type].architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            # Older transformers read these two keys instead of rope_parameters.
            "rope_theta": float(self.rope_theta),
            "rope_scaling": (
                None if self.rope_scaling is None else dataclasses.asdict(self.rope_scaling)
            ),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        family = FAMILIES[self.model_type]
        out.update(family.hf_extra)
        if family.sliding_window:
            out["sliding_window"] = self.sliding_window
        if family.moe:
            out.update(self.moe.to_hf(family.shared_expert))
        return out


def _read_hf_config(config: str | os.PathLike) -> Any:
    """The parsed `config.json` at `config`, a file or the folder holding it."""
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"No HF config at {path!r}: expected a config.json "
            "(or the model folder that holds one)."
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
    model_type, family = _family_from_hf(cfg)
    _check_hf_supported(cfg, model_type, family)
    sliding_window = cfg.get("sliding_window") if family.sliding_window else None
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope_from_hf(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = (
        () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    )
    pad = cfg.get("pad_token_id")
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family.attention_bias,
        qk_norm=family.qk_norm,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=None if pad is None else int(pad),
        model_type=model_type,
        sliding_window=None if sliding_window is None else int(sliding_window),
        moe=MoeConfig.from_hf(cfg, family.shared_expert) if family.moe else MoeConfig(),
    )


def _check_moe(config: ModelConfig) -> None:
    """Refuses a mixture of experts that this family does not have."""
    moe, family = config.moe, FAMILIES[config.model_type]
    moe.validate()
    if moe.num_experts and not family.moe:
        raise ValueError(
            f"ModelConfig.moe.num_experts={moe.num_experts}: {config.model_type} is a dense "
            f"family; experts need one of {sorted(m for m, f in FAMILIES.items() if f.moe)}."
        )
    if config.moe_layers and family.shared_expert != (moe.shared_expert_intermediate_size > 0):
        raise ValueError(
            f"ModelConfig.moe.shared_expert_intermediate_size="
            f"{moe.shared_expert_intermediate_size}: a {config.model_type} model "
            + ("has a shared expert; give its width." if family.shared_expert else "has none.")
        )


def _family_from_hf(cfg: Mapping[str, Any]) -> tuple[str, Family]:
    """(model_type, its Family) from `model_type` or else `architectures`, which must all
    name that family."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type is None and archs:
        model_type = _ARCH_TO_TYPE.get(archs[0])
    if model_type not in FAMILIES:
        raise ValueError(
            f"config.json field model_type={model_type!r} (architectures={archs}) is "
            f"not supported; supported model types: {sorted(FAMILIES)}."
        )
    family = FAMILIES[model_type]
    for arch in archs:
        if _ARCH_TO_TYPE.get(arch) != model_type:
            raise ValueError(
                f"config.json field architectures={archs} names {arch!r}, which "
                f"is not a {model_type} model; a {model_type} config.json names "
                f"{family.architecture!r}."
            )
    return model_type, family


def _check_hf_supported(cfg: Mapping[str, Any], model_type: str, family: Family) -> None:
    """Refuses the config.json fields this decoder does not implement."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json field hidden_act={act!r} is not supported; only 'silu' is.")
    if cfg.get("use_sliding_window"):
        raise ValueError(
            "config.json field use_sliding_window=true is not supported; "
            "set it to false (full attention)."
        )
    if cfg.get("mlp_bias"):
        raise ValueError("config.json field mlp_bias=true is not supported.")
    if cfg.get("attention_bias") and not family.attention_bias:
        raise ValueError(
            f"config.json field attention_bias=true is not supported for "
            f"{model_type} (it would add an o_proj bias)."
        )
    if cfg.get("qkv_bias") is False and family.attention_bias:
        raise ValueError(
            f"config.json field qkv_bias=false is not supported for {model_type} "
            "(its q/k/v projections carry biases)."
        )


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE theta + scaling from `rope_parameters` (transformers 5) or
    `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    field = "rope_parameters" if params else "rope_scaling"
    spec = dict(params or scaling)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"config.json field {field}.rope_type={rope_type!r} is not supported; "
            f"supported rope types: {list(_ROPE_TYPES)}."
        )
    if rope_type == "default":
        return theta, None
    try:
        return theta, RopeScaling(
            factor=float(spec["factor"]),
            low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(
            f"config.json field {field} of rope_type 'llama3' lacks {e.args[0]!r}."
        ) from None


# A tiny config for tests and smoke runs (2 layers, width 64, GQA 4:2).
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_ids=(2,),
    pad_token_id=2,
)

# SmolLM2-135M(-Instruct): Llama architecture, 30 layers, 9 heads / 3 KV heads, tied embeddings.
SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_ids=(2,),
    pad_token_id=2,
)

PRESETS: dict[str, ModelConfig] = {"tiny": TINY, "smollm2-135m": SMOLLM2_135M}
