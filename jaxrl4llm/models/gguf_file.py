"""GGUF files as a tensor source with Hugging Face names and layouts (see weights.load_params).

Tensors are dequantized one at a time (Q4_0/Q4_1/Q8_0/... via `gguf.quants.dequantize`), and
llama.cpp's row permutation of the Llama q/k projections (it stores RoPE pairs interleaved)
is undone so the rotate-half RoPE of decoder_layer.py applies.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxrl4llm.models import schema
from jaxrl4llm.models.config import FAMILIES, ModelConfig

# GGUF tensor name -> HF name, from the parameter schema (the experts' leaves have none:
# llama.cpp stores them fused, and no MoE family loads from GGUF).
_GLOBAL_NAMES = {leaf.gguf: leaf.hf for leaf in schema.PARAMS if not leaf.per_layer}
_LAYER_NAMES = {
    leaf.gguf.removeprefix(schema.GGUF_LAYER): leaf.hf.removeprefix(schema.HF_LAYER)
    for leaf in schema.PARAMS
    if leaf.per_layer and leaf.gguf
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF name; unknown names pass through (and are reported unused)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return schema.HF_LAYER.format(i=m.group(1)) + _LAYER_NAMES[m.group(2)]
    return gguf_name


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """Dequantizing, HF-named view of the tensors of one GGUF file."""

    def __init__(self, path: str):
        import gguf  # optional at import time of the package

        self._gguf = gguf
        self.path = path
        try:
            self._reader = gguf.GGUFReader(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"GGUF file {path!r} does not exist.") from None
        self._tensors = {_hf_name(t.name): t for t in self._reader.tensors}
        self.arch = self._field("general.architecture")
        dense = sorted(m for m, f in FAMILIES.items() if not f.moe)
        if self.arch not in dense:
            raise ValueError(
                f"GGUF {path!r}: metadata field general.architecture={self.arch!r} is "
                f"not supported; supported: {dense} (mixtures of experts load from "
                "Hugging Face folders)."
            )
        if "rope_freqs.weight" in self._tensors:
            raise ValueError(
                f"GGUF {path!r} has a rope_freqs tensor (Llama 3.1-style rope "
                "scaling), which the GGUF loader does not support; load the "
                "Hugging Face folder of this model instead."
            )

    def _field(self, key: str, default: Any = KeyError) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise KeyError(f"GGUF {self.path!r} lacks metadata field {key!r}.")
            return default
        return field.contents()

    def config(self) -> ModelConfig:
        a = self.arch
        hidden = int(self._field(f"{a}.embedding_length"))
        heads = int(self._field(f"{a}.attention.head_count"))
        vocab = self._field(f"{a}.vocab_size", None)
        if vocab is None:
            vocab = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        scaling = self._field(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ValueError(
                f"GGUF {self.path!r}: metadata field {a}.rope.scaling.type="
                f"{scaling!r} is not supported."
            )
        eos = self._field("tokenizer.ggml.eos_token_id", None)
        pad = self._field("tokenizer.ggml.padding_token_id", None)
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._field(f"{a}.feed_forward_length")),
            num_layers=int(self._field(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self._field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self._field(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
            qk_norm=FAMILIES[a].qk_norm,
            max_position_embeddings=int(self._field(f"{a}.context_length", 2048)),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=() if eos is None else (int(eos),),
            pad_token_id=None if pad is None else int(pad),
            model_type=a,
        )

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGML lists dimensions fastest-first; HF/numpy order is the reverse.
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def read(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        w = self._gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, np.float32).reshape(self.shape(name))
        if FAMILIES[self.arch].gguf_permutes_qk and name.endswith(
            ("q_proj.weight", "k_proj.weight")
        ):
            a = self.arch
            heads = int(self._field(f"{a}.attention.head_count"))
            if name.endswith("k_proj.weight"):
                heads = int(self._field(f"{a}.attention.head_count_kv", heads))
            w = unpermute_qk(w, heads)
        return w
