"""The parameter schema: one row per leaf of the params tree, and everything derived from it.

A row says what a leaf is (per layer or global), its shape and logical axes in symbolic
dimensions, its Hugging Face tensor name and layout, its GGUF tensor name, and which configs
have it. From PARAMS come transformer.param_shapes / param_logical_axes, the HF <-> params
mapping of weights.py (load and export) and the GGUF -> HF names of gguf_file.py. A model
family is a row of config.FAMILIES; docs/architecture.md says how to add one.

Dimensions: L layers, D hidden, F MLP, N query heads, K kv heads, H head dim, V vocabulary;
"N*H" is a product. HF stores a torch Linear weight as [out, in]: a `transposed` leaf is
ours = hf.T reshaped, hf = ours reshaped to the transposed HF shape, then .T.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator

import numpy as np

from jaxrl4llm.models.config import ModelConfig


def _always(config: ModelConfig) -> bool:
    del config
    return True


@dataclasses.dataclass(frozen=True)
class Leaf:
    """name: key in params (per-layer leaves sit in params["layers"], stacked [L, ...]);
    shape / axes: our dims and logical axes without the layer axis; hf / hf_shape: the HF
    tensor name ("{i}": the layer) and dims; gguf: the GGUF tensor name; present: which
    configs have the leaf."""

    name: str
    per_layer: bool
    shape: tuple[str, ...]
    axes: tuple[str | None, ...]
    hf: str
    hf_shape: tuple[str, ...]
    gguf: str
    transposed: bool = False
    present: Callable[[ModelConfig], bool] = _always

    def dims(self, config: ModelConfig, which: tuple[str, ...]) -> tuple[int, ...]:
        sizes = _sizes(config)
        return tuple(math.prod(sizes[d] for d in dim.split("*")) for dim in which)

    def our_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """Without the layer axis."""
        return self.dims(config, self.shape)

    def to_ours(self, config: ModelConfig, w: np.ndarray) -> np.ndarray:
        return (w.T if self.transposed else w).reshape(self.our_shape(config))

    def to_hf(self, config: ModelConfig, x: Any) -> Any:
        hf = self.dims(config, self.hf_shape)
        return x.reshape(hf[::-1]).T if self.transposed else x.reshape(hf)

    def hf_name(self, layer: int | None = None) -> str:
        return self.hf.format(i=layer)


def _sizes(config: ModelConfig) -> dict[str, int]:
    c = config
    return {
        "L": c.num_layers,
        "D": c.hidden_size,
        "F": c.intermediate_size,
        "N": c.num_heads,
        "K": c.num_kv_heads,
        "H": c.head_dim,
        "V": c.vocab_size,
    }


def _has_bias(config: ModelConfig) -> bool:
    return config.attention_bias


def _has_qk_norm(config: ModelConfig) -> bool:
    return config.qk_norm


def _untied(config: ModelConfig) -> bool:
    return not config.tie_word_embeddings


# The name prefixes of per-layer tensors ({i}: the layer).
HF_LAYER = "model.layers.{i}."
GGUF_LAYER = "blk.{i}."
_L, _B = HF_LAYER, GGUF_LAYER

PARAMS: tuple[Leaf, ...] = (
    Leaf(
        "embed",
        False,
        ("V", "D"),
        ("vocab", "embed"),
        "model.embed_tokens.weight",
        ("V", "D"),
        "token_embd.weight",
    ),
    Leaf(
        "attn_norm",
        True,
        ("D",),
        ("norm",),
        _L + "input_layernorm.weight",
        ("D",),
        _B + "attn_norm.weight",
    ),
    Leaf(
        "q",
        True,
        ("D", "N", "H"),
        ("embed", "heads", "head_dim"),
        _L + "self_attn.q_proj.weight",
        ("N*H", "D"),
        _B + "attn_q.weight",
        transposed=True,
    ),
    Leaf(
        "k",
        True,
        ("D", "K", "H"),
        ("embed", "kv_heads", "head_dim"),
        _L + "self_attn.k_proj.weight",
        ("K*H", "D"),
        _B + "attn_k.weight",
        transposed=True,
    ),
    Leaf(
        "v",
        True,
        ("D", "K", "H"),
        ("embed", "kv_heads", "head_dim"),
        _L + "self_attn.v_proj.weight",
        ("K*H", "D"),
        _B + "attn_v.weight",
        transposed=True,
    ),
    Leaf(
        "o",
        True,
        ("N", "H", "D"),
        ("heads", "head_dim", "embed"),
        _L + "self_attn.o_proj.weight",
        ("D", "N*H"),
        _B + "attn_output.weight",
        transposed=True,
    ),
    Leaf(
        "mlp_norm",
        True,
        ("D",),
        ("norm",),
        _L + "post_attention_layernorm.weight",
        ("D",),
        _B + "ffn_norm.weight",
    ),
    Leaf(
        "gate",
        True,
        ("D", "F"),
        ("embed", "mlp"),
        _L + "mlp.gate_proj.weight",
        ("F", "D"),
        _B + "ffn_gate.weight",
        transposed=True,
    ),
    Leaf(
        "up",
        True,
        ("D", "F"),
        ("embed", "mlp"),
        _L + "mlp.up_proj.weight",
        ("F", "D"),
        _B + "ffn_up.weight",
        transposed=True,
    ),
    Leaf(
        "down",
        True,
        ("F", "D"),
        ("mlp", "embed"),
        _L + "mlp.down_proj.weight",
        ("D", "F"),
        _B + "ffn_down.weight",
        transposed=True,
    ),
    # Qwen2: biases on the q/k/v projections.
    Leaf(
        "q_bias",
        True,
        ("N", "H"),
        ("heads", "head_dim"),
        _L + "self_attn.q_proj.bias",
        ("N*H",),
        _B + "attn_q.bias",
        present=_has_bias,
    ),
    Leaf(
        "k_bias",
        True,
        ("K", "H"),
        ("kv_heads", "head_dim"),
        _L + "self_attn.k_proj.bias",
        ("K*H",),
        _B + "attn_k.bias",
        present=_has_bias,
    ),
    Leaf(
        "v_bias",
        True,
        ("K", "H"),
        ("kv_heads", "head_dim"),
        _L + "self_attn.v_proj.bias",
        ("K*H",),
        _B + "attn_v.bias",
        present=_has_bias,
    ),
    # Qwen3: per-head RMSNorm of q and k.
    Leaf(
        "q_norm",
        True,
        ("H",),
        ("norm",),
        _L + "self_attn.q_norm.weight",
        ("H",),
        _B + "attn_q_norm.weight",
        present=_has_qk_norm,
    ),
    Leaf(
        "k_norm",
        True,
        ("H",),
        ("norm",),
        _L + "self_attn.k_norm.weight",
        ("H",),
        _B + "attn_k_norm.weight",
        present=_has_qk_norm,
    ),
    Leaf("final_norm", False, ("D",), ("norm",), "model.norm.weight", ("D",), "output_norm.weight"),
    Leaf(
        "unembed",
        False,
        ("D", "V"),
        ("embed", "vocab"),
        "lm_head.weight",
        ("V", "D"),
        "output.weight",
        transposed=True,
        present=_untied,
    ),
)


def leaves(config: ModelConfig) -> Iterator[Leaf]:
    """The leaves a model of this config has."""
    return (leaf for leaf in PARAMS if leaf.present(config))


def _tree(config: ModelConfig, value: Callable[[Leaf], Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for leaf in leaves(config):
        (tree.setdefault("layers", {}) if leaf.per_layer else tree)[leaf.name] = value(leaf)
    return tree


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The params tree with each leaf replaced by its shape tuple ([L, ...] per layer)."""
    L = config.num_layers
    return _tree(config, lambda leaf: ((L,) if leaf.per_layer else ()) + leaf.our_shape(config))


def param_logical_axes(config: ModelConfig) -> dict[str, Any]:
    """The params tree with each leaf replaced by its logical axis names (see parallel.py)."""
    return _tree(config, lambda leaf: (("layers",) if leaf.per_layer else ()) + leaf.axes)
