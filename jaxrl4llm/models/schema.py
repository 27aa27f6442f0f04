"""The parameter schema: one row per leaf of the params tree, and everything derived from it.

A row says what a leaf is (per layer or global), its shape and logical axes in symbolic
dimensions, its Hugging Face tensor name and layout, its GGUF tensor name, and which configs
have it. From PARAMS come transformer.param_shapes / param_logical_axes, the HF <-> params
mapping of weights.py (load and export) and the GGUF -> HF names of gguf_file.py. A model
family is a row of config.FAMILIES; docs/architecture.md says how to add one.

Dimensions: L layers, D hidden, F MLP, N query heads, K kv heads, H head dim, V vocabulary,
E experts, M an expert's MLP, S the shared expert's MLP; "N*H" is a product. HF stores a
torch Linear weight as [out, in]: a `transposed` leaf is ours = hf.T reshaped, hf = ours
reshaped to the transposed HF shape, then .T.

A per-layer leaf is stacked over the layers that have it (`Leaf.layers`): every layer's
attention, the dense layers' MLP, the MoE layers' router and experts. A `per_expert` leaf
is one HF tensor per expert ("{e}" in its name), stacked along our leading E axis.
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
    """name: key in params (per-layer leaves sit in params["layers"], stacked [L, ...] over
    the layers config.layers_of(layers)); shape / axes: our dims and logical axes without the
    layer axis; hf / hf_shape: the HF tensor name ("{i}": the layer, "{e}": the expert) and
    dims (of one expert's tensor when per_expert); gguf: the GGUF tensor name ("": none);
    present: which configs have the leaf."""

    name: str
    per_layer: bool
    shape: tuple[str, ...]
    axes: tuple[str | None, ...]
    hf: str
    hf_shape: tuple[str, ...]
    gguf: str
    transposed: bool = False
    present: Callable[[ModelConfig], bool] = _always
    layers: str = "all"
    per_expert: bool = False

    def dims(self, config: ModelConfig, which: tuple[str, ...]) -> tuple[int, ...]:
        sizes = _sizes(config)
        return tuple(math.prod(sizes[d] for d in dim.split("*")) for dim in which)

    def our_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """Without the layer axis."""
        return self.dims(config, self.shape)

    def unit_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """Our shape of one HF tensor: one expert's slice of a per_expert leaf."""
        return self.our_shape(config)[1:] if self.per_expert else self.our_shape(config)

    def to_ours(self, config: ModelConfig, w: np.ndarray) -> np.ndarray:
        return (w.T if self.transposed else w).reshape(self.unit_shape(config))

    def to_hf(self, config: ModelConfig, x: Any) -> Any:
        hf = self.dims(config, self.hf_shape)
        return x.reshape(hf[::-1]).T if self.transposed else x.reshape(hf)

    def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
        return self.hf.format(i=layer, e=expert)

    def stacked(self, config: ModelConfig) -> tuple[int, ...]:
        """The leading dims our leaf adds: the number of layers that have it, if per layer."""
        return (len(config.layers_of(self.layers)),) if self.per_layer else ()

    def tensors(self, config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(HF tensor name, the index of its slice in our leaf) for each HF tensor."""
        layers = enumerate(config.layers_of(self.layers)) if self.per_layer else [(None, None)]
        experts = range(config.moe.num_experts) if self.per_expert else (None,)
        for j, i in layers:
            for e in experts:
                index = tuple(x for x in (j, e) if x is not None)
                yield self.hf_name(i, e), index


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
        "E": c.moe.num_experts,
        "M": c.moe.moe_intermediate_size,
        "S": c.moe.shared_expert_intermediate_size,
        "1": 1,  # the shared expert's gate is a [1, D] Linear
    }


def _has_bias(config: ModelConfig) -> bool:
    return config.attention_bias


def _has_qk_norm(config: ModelConfig) -> bool:
    return config.qk_norm


def _untied(config: ModelConfig) -> bool:
    return not config.tie_word_embeddings


def _has_dense(config: ModelConfig) -> bool:
    return bool(config.dense_layers)


def _has_moe(config: ModelConfig) -> bool:
    return bool(config.moe_layers)


def _has_shared(config: ModelConfig) -> bool:
    return bool(config.moe_layers) and config.moe.shared_expert_intermediate_size > 0


# The name prefixes of per-layer tensors ({i}: the layer).
HF_LAYER = "model.layers.{i}."
GGUF_LAYER = "blk.{i}."
_L, _B = HF_LAYER, GGUF_LAYER


def _moe_leaf(
    name: str,
    shape: tuple[str, ...],
    axes: tuple[str | None, ...],
    hf: str,
    hf_shape: tuple[str, ...],
    present: Callable[[ModelConfig], bool],
    per_expert: bool = False,
) -> Leaf:
    """A per-layer Linear weight of the MoE layers (none in GGUF)."""
    return Leaf(
        name,
        True,
        shape,
        axes,
        HF_LAYER + hf,
        hf_shape,
        "",
        transposed=True,
        present=present,
        layers="moe",
        per_expert=per_expert,
    )


def _expert_mlp_leaves(
    name: str, hf: str, width: str, present: Callable[[ModelConfig], bool], per_expert: bool
) -> tuple[Leaf, ...]:
    """The gate / up / down projections ("{name}_gate", ...) of a MoE layer's experts
    (per_expert: [E, ...]) or its shared expert, of MLP width `width`."""
    lead: tuple[str, ...] = ("E",) if per_expert else ()
    lead_axes: tuple[str, ...] = ("experts",) if per_expert else ()
    return tuple(
        _moe_leaf(
            f"{name}_{proj}",
            lead + ((width, "D") if proj == "down" else ("D", width)),
            lead_axes + (("mlp", "embed") if proj == "down" else ("embed", "mlp")),
            hf + proj + "_proj.weight",
            ("D", width) if proj == "down" else (width, "D"),
            present,
            per_expert,
        )
        for proj in ("gate", "up", "down")
    )


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
        present=_has_dense,
        layers="dense",
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
        present=_has_dense,
        layers="dense",
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
        present=_has_dense,
        layers="dense",
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
    # Mixtures of experts: the router, the experts (stacked [E, ...]), and a shared expert
    # with its sigmoid gate (Qwen2-MoE), in the MoE layers only.
    _moe_leaf("router", ("D", "E"), ("embed", None), "mlp.gate.weight", ("E", "D"), _has_moe),
    *_expert_mlp_leaves("expert", "mlp.experts.{e}.", "M", _has_moe, per_expert=True),
    *_expert_mlp_leaves("shared", "mlp.shared_expert.", "S", _has_shared, per_expert=False),
    # Qwen2-MoE's shared expert's gate: a [1, D] Linear.
    _moe_leaf(
        "shared_expert_gate",
        ("D",),
        ("embed",),
        "mlp.shared_expert_gate.weight",
        ("1", "D"),
        _has_shared,
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


# Which layers hold each per-layer leaf (Leaf.layers); other per-layer keys (LoRA adapters,
# dropout keys) are in every layer.
LAYER_KIND: dict[str, str] = {leaf.name: leaf.layers for leaf in PARAMS if leaf.per_layer}


def _tree(config: ModelConfig, value: Callable[[Leaf], Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for leaf in leaves(config):
        (tree.setdefault("layers", {}) if leaf.per_layer else tree)[leaf.name] = value(leaf)
    return tree


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The params tree with each leaf replaced by its shape tuple ([L, ...] per layer, L the
    layers that have the leaf)."""
    return _tree(config, lambda leaf: leaf.stacked(config) + leaf.our_shape(config))


def param_logical_axes(config: ModelConfig) -> dict[str, Any]:
    """The params tree with each leaf replaced by its logical axis names (see parallel.py)."""
    return _tree(config, lambda leaf: (("layers",) if leaf.per_layer else ()) + leaf.axes)
