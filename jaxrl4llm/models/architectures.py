"""The architectures of the paper flagfiles' models, from each Hugging Face repo's config.json,
keyed by the repo / folder name in lower case: tools/plan.py plans them without weights
(planner/programs.py architecture())."""

from __future__ import annotations

import dataclasses

from jaxrl4llm.models.config import SMOLLM2_135M, ModelConfig, RopeScaling
from jaxrl4llm.models.moe_config import MoeConfig

# The fields each Qwen family's models share; each entry below sets the rest.
_QWEN25_7B = ModelConfig(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    attention_bias=True,
    model_type="qwen2",
)
_QWEN3_8B = ModelConfig(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1e6,
    qk_norm=True,
    max_position_embeddings=32768,
    eos_token_ids=(151643,),
    model_type="qwen3",
)
ARCHITECTURES: dict[str, ModelConfig] = {
    "qwen2.5-math-7b": dataclasses.replace(
        _QWEN25_7B, rope_theta=10000.0, max_position_embeddings=4096, eos_token_ids=(151643,)
    ),
    "qwen2.5-7b-instruct-1m": dataclasses.replace(
        _QWEN25_7B,
        rope_theta=1e7,
        rms_norm_eps=1e-5,
        max_position_embeddings=1010000,
        eos_token_ids=(151645,),
    ),
    "qwen3-8b-base": _QWEN3_8B,
    "qwen3-4b-base": dataclasses.replace(
        _QWEN3_8B, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True
    ),
    # Qwen/Qwen3-30B-A3B-Base's config.json: Qwen3's attention (32 heads / 4 KV heads of 128,
    # qk_norm, RoPE theta 1e6) over 48 layers of width 2048, every layer's MLP a mixture of
    # 128 experts of width 768, 8 per token, their weights renormalised (norm_topk_prob);
    # intermediate_size 6144 is unused (no dense layer); untied, eos 151643.
    "qwen3-30b-a3b-base": dataclasses.replace(
        _QWEN3_8B,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_kv_heads=4,
        rms_norm_eps=1e-6,
        model_type="qwen3_moe",
        moe=MoeConfig(
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
    ),
    "smollm2-135m-instruct": SMOLLM2_135M,
    # meta-llama/Llama-3.2-3B-Instruct's config.json: 28 layers of width 3072, MLP 8192, 24
    # heads / 8 KV heads of 128, vocabulary 128256 tied, RMSNorm eps 1e-5, RoPE theta 5e5 with
    # llama3 scaling (factor 32, low / high frequency factors 1 / 4, original 8192 positions),
    # 131072 positions, bos 128000, eos 128001 / 128008 / 128009.
    "llama-3.2-3b-instruct": ModelConfig(
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
}
