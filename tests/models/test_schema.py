"""The parameter schema: every table derived from it matches the layouts written out by hand."""

import numpy as np
import pytest

from jaxrl4llm.models import gguf_file, schema, transformer
from jaxrl4llm.models.config import FAMILIES, ModelConfig

# Every optional leaf on: q/k/v biases, q/k norms, an untied unembedding.
CFG = ModelConfig(
    vocab_size=50,
    hidden_size=12,
    intermediate_size=20,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=6,
    attention_bias=True,
    qk_norm=True,
    tie_word_embeddings=False,
    model_type="qwen2",
)


def test_shapes_and_axes_of_every_leaf():
    L, D, F, N, K, H, V = 3, 12, 20, 4, 2, 6, 50
    assert transformer.param_shapes(CFG) == {
        "embed": (V, D),
        "final_norm": (D,),
        "unembed": (D, V),
        "layers": {
            "attn_norm": (L, D),
            "q": (L, D, N, H),
            "k": (L, D, K, H),
            "v": (L, D, K, H),
            "o": (L, N, H, D),
            "mlp_norm": (L, D),
            "gate": (L, D, F),
            "up": (L, D, F),
            "down": (L, F, D),
            "q_bias": (L, N, H),
            "k_bias": (L, K, H),
            "v_bias": (L, K, H),
            "q_norm": (L, H),
            "k_norm": (L, H),
        },
    }
    axes = transformer.param_logical_axes(CFG)
    assert axes["embed"] == ("vocab", "embed") and axes["unembed"] == ("embed", "vocab")
    assert axes["layers"]["q"] == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["o"] == ("layers", "heads", "head_dim", "embed")
    assert axes["layers"]["down"] == ("layers", "mlp", "embed")
    assert axes["layers"]["k_bias"] == ("layers", "kv_heads", "head_dim")
    # A plain tied Llama has none of the optional leaves.
    tied = ModelConfig(
        vocab_size=50,
        hidden_size=12,
        intermediate_size=20,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=6,
        tie_word_embeddings=True,
    )
    shapes = transformer.param_shapes(tied)
    assert "unembed" not in shapes
    assert sorted(shapes["layers"]) == sorted(
        ["attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down"]
    )


def test_hf_layouts_follow_torch_linear_and_invert():
    """HF stores a Linear weight as [out, in]: q_proj is [N*H, D], o_proj [D, N*H]."""
    rng = np.random.default_rng(0)
    hf_shapes = {
        "q": (24, 12),
        "k": (12, 12),
        "o": (12, 24),
        "gate": (20, 12),
        "down": (12, 20),
        "q_bias": (24,),
        "embed": (50, 12),
        "unembed": (50, 12),
        "q_norm": (6,),
    }
    by_name = {leaf.name: leaf for leaf in schema.leaves(CFG)}
    for name, hf_shape in hf_shapes.items():
        leaf = by_name[name]
        w = rng.normal(size=hf_shape)
        ours = leaf.to_ours(CFG, w)
        assert ours.shape == leaf.our_shape(CFG), name
        np.testing.assert_array_equal(leaf.to_hf(CFG, ours), w)
    # q: our [D, N, H][d, n, h] is HF [N*H, D][n*H + h, d].
    w = rng.normal(size=(24, 12))
    np.testing.assert_array_equal(by_name["q"].to_ours(CFG, w)[5, 2, 3], w[2 * 6 + 3, 5])
    # o: our [N, H, D][n, h, d] is HF [D, N*H][d, n*H + h].
    w = rng.normal(size=(12, 24))
    np.testing.assert_array_equal(by_name["o"].to_ours(CFG, w)[1, 4, 7], w[7, 1 * 6 + 4])
    assert by_name["gate"].hf_name(2) == "model.layers.2.mlp.gate_proj.weight"


def test_gguf_names_map_to_hf_names():
    """llama.cpp's tensor names (convert_hf_to_gguf / gguf-py TENSOR_NAMES)."""
    want = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "blk.7.attn_q.weight": "model.layers.7.self_attn.q_proj.weight",
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
        "blk.12.ffn_up.weight": "model.layers.12.mlp.up_proj.weight",
        "blk.1.attn_k.bias": "model.layers.1.self_attn.k_proj.bias",
        "blk.2.attn_q_norm.weight": "model.layers.2.self_attn.q_norm.weight",
        "blk.3.ffn_norm.weight": "model.layers.3.post_attention_layernorm.weight",
        "rope_freqs.weight": "rope_freqs.weight",
    }  # unknown: passed through
    for gguf_name, hf_name in want.items():
        assert gguf_file._hf_name(gguf_name) == hf_name


def test_every_family_exports_its_architecture():
    for model_type, family in FAMILIES.items():
        cfg = ModelConfig(
            vocab_size=8,
            hidden_size=4,
            intermediate_size=8,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=2,
            model_type=model_type,
            attention_bias=family.attention_bias,
            qk_norm=family.qk_norm,
        )
        hf = cfg.to_hf_config()
        assert hf["architectures"] == [family.architecture]
        assert ModelConfig.from_hf_config(hf) == cfg
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig(
            vocab_size=8,
            hidden_size=4,
            intermediate_size=8,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=2,
            model_type="gemma2",
        )
