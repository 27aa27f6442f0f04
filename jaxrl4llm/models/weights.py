"""Checkpoints <-> the params pytree: HF safetensors folders (in and out) and GGUF files (in).

Loading streams one tensor at a time: for each stacked leaf ([L, ...]) a host buffer in the
target dtype is filled layer by layer from memory-mapped files, then placed on the mesh with
`jax.make_array_from_callback`, which hands every device only its own shard. Peak host
memory is therefore one stacked leaf in the target dtype (the largest is the MLP gate/up:
L * hidden * intermediate elements, ~2.9 GB for a 7B model in bfloat16) plus one layer's
tensor as stored -- never a full model copy, let alone one per device.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxrl4llm import parallel
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig

# safetensors dtype codes <-> numpy dtypes (bfloat16 through ml_dtypes).
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32}
_ST_CODES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- name mapping

def _hf_layout(config: ModelConfig) -> dict[str, tuple[str, Callable, Callable]]:
    """Our leaf name -> (HF tensor name with {i} for the layer, HF->ours, ours->HF)."""
    D, N, K, H = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    pre = "model.layers.{i}."

    def proj_in(n):  # [n*H, D] torch Linear weight <-> our [D, n, H]
        return (lambda w: w.T.reshape(D, n, H), lambda x: x.reshape(D, n * H).T)

    def bias(n):
        return (lambda w: w.reshape(n, H), lambda x: x.reshape(n * H))

    ident = (lambda w: w, lambda x: x)
    transpose = (lambda w: w.T, lambda x: x.T)
    table = {
        "attn_norm": (pre + "input_layernorm.weight", *ident),
        "q": (pre + "self_attn.q_proj.weight", *proj_in(N)),
        "k": (pre + "self_attn.k_proj.weight", *proj_in(K)),
        "v": (pre + "self_attn.v_proj.weight", *proj_in(K)),
        "o": (pre + "self_attn.o_proj.weight",
              lambda w: w.T.reshape(N, H, D), lambda x: x.reshape(N * H, D).T),
        "q_bias": (pre + "self_attn.q_proj.bias", *bias(N)),
        "k_bias": (pre + "self_attn.k_proj.bias", *bias(K)),
        "v_bias": (pre + "self_attn.v_proj.bias", *bias(K)),
        "q_norm": (pre + "self_attn.q_norm.weight", *ident),
        "k_norm": (pre + "self_attn.k_norm.weight", *ident),
        "mlp_norm": (pre + "post_attention_layernorm.weight", *ident),
        "gate": (pre + "mlp.gate_proj.weight", *transpose),
        "up": (pre + "mlp.up_proj.weight", *transpose),
        "down": (pre + "mlp.down_proj.weight", *transpose),
        "embed": ("model.embed_tokens.weight", *ident),
        "final_norm": ("model.norm.weight", *ident),
        "unembed": ("lm_head.weight", *transpose),
    }
    return table


def _leaves(config: ModelConfig) -> Iterable[tuple[tuple[str, ...], tuple[int, ...]]]:
    shapes = transformer.param_shapes(config)
    for name, shape in shapes.items():
        if name == "layers":
            for lname, lshape in shape.items():
                yield ("layers", lname), lshape
        else:
            yield (name,), shape


# ----------------------------------------------------------------------------- tensor sources

class SafetensorsSource:
    """Memory-mapped tensors of one or many *.safetensors files (with or without an index)."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"No *.safetensors files in {folder!r}: expected a Hugging Face "
                                    "model folder (config.json + model*.safetensors).")
        self._entries: dict[str, tuple[str, dict[str, Any], int]] = {}
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for tname, info in header.items():
                self._entries[tname] = (path, info, 8 + n)

    def names(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][1]["shape"])

    def read(self, name: str) -> np.ndarray:
        path, info, base = self._entries[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"Tensor {name!r} in {path!r} has unsupported dtype {info['dtype']}.")
        begin, end = info["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        if end == begin:
            return np.zeros(info["shape"], dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=base + begin,
                         shape=tuple(info["shape"]))


def _place(buffer: np.ndarray, sharding: Any) -> jax.Array:
    if sharding is None:
        return jnp.asarray(buffer)
    # Each device (and each host) reads only its shard out of the host buffer.
    return jax.make_array_from_callback(buffer.shape, sharding, lambda idx: buffer[idx])


def load_params(source: Any, config: ModelConfig, mesh: Any = None,
                rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
                dtype: Any = jnp.float32) -> transformer.Params:
    """Reads every leaf from `source` (HF names and layouts) onto `mesh` (or the default device).

    Missing tensors, shape mismatches and tensors the model does not use are errors naming them.
    """
    table = _hf_layout(config)
    available = source.names()
    used: set[str] = set()
    shardings = None
    if mesh is not None:
        shardings = parallel.logical_to_sharding(
            transformer.param_logical_axes(config), mesh, rules,
            shapes=jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype),
                                transformer.param_shapes(config),
                                is_leaf=transformer._is_shape))
    params: dict[str, Any] = {"layers": {}}
    np_dtype = np.dtype(dtype)
    for path, shape in _leaves(config):
        hf_name, to_ours, to_hf = table[path[-1]]
        stacked = path[0] == "layers"
        names = [hf_name.format(i=i) for i in range(config.num_layers)] if stacked else [hf_name]
        want = shape[1:] if stacked else shape
        hf_shape = tuple(jax.eval_shape(to_hf, jax.ShapeDtypeStruct(want, jnp.float32)).shape)
        buffer = np.empty(shape, np_dtype)
        for i, name in enumerate(names):
            if name not in available:
                raise KeyError(f"Checkpoint is missing tensor {name!r} (needed for params "
                               f"{'/'.join(path)} of a {config.model_type} model).")
            if source.shape(name) != hf_shape:
                raise ValueError(f"Tensor {name!r} has shape {source.shape(name)} but the config "
                                 f"needs {hf_shape} (params {'/'.join(path)}); check that "
                                 "config.json matches the weights.")
            value = to_ours(source.read(name))
            if stacked:
                buffer[i] = value
            else:
                buffer[...] = value
            used.add(name)
        sharding = None
        if shardings is not None:
            sharding = shardings["layers"][path[1]] if stacked else shardings[path[0]]
        target = params["layers"] if stacked else params
        target[path[-1]] = _place(buffer, sharding)
        del buffer
    leftover = {n for n in available - used if not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        leftover.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
    if leftover:
        raise ValueError(f"Checkpoint has tensors the {config.model_type} model does not use: "
                         f"{sorted(leftover)[:8]}{' ...' if len(leftover) > 8 else ''}; check "
                         "that config.json matches the weights (e.g. attention_bias, "
                         "tie_word_embeddings, num_hidden_layers).")
    return params


def load_hf(path: str | os.PathLike, config: ModelConfig | None = None, mesh: Any = None,
            rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
            dtype: Any = jnp.float32) -> tuple[ModelConfig, transformer.Params]:
    """A Hugging Face folder (config.json + *.safetensors) -> (config, params on `mesh`)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Model folder {path!r} does not exist; pass a Hugging Face model "
                                "folder holding config.json and *.safetensors.")
    config = config or ModelConfig.from_hf_config(path)
    return config, load_params(SafetensorsSource(path), config, mesh, rules, dtype)


# ----------------------------------------------------------------------------- export

def _write_safetensors(path: str, tensors: dict[str, np.ndarray],
                       metadata: dict[str, str] | None = None) -> None:
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        code = _ST_CODES.get(arr.dtype)
        if code is None:
            raise ValueError(f"Cannot export tensor {name!r} of dtype {arr.dtype}.")
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def export_hf(params: transformer.Params, config: ModelConfig, path: str | os.PathLike,
              tokenizer: Any = None) -> None:
    """Writes `path`/config.json + model.safetensors that `transformers` loads.

    Tensors keep the params' dtype (float32 or bfloat16). Gathers one leaf at a time to host.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    table = _hf_layout(config)
    tensors: dict[str, np.ndarray] = {}
    dtype = None
    for leaf_path, _ in _leaves(config):
        node = params
        for key in leaf_path:
            node = node[key]
        value = np.asarray(jax.device_get(node))
        dtype = dtype or value.dtype
        hf_name, _, to_hf = table[leaf_path[-1]]
        if leaf_path[0] == "layers":
            for i in range(config.num_layers):
                tensors[hf_name.format(i=i)] = np.ascontiguousarray(to_hf(value[i]))
        else:
            tensors[hf_name] = np.ascontiguousarray(to_hf(value))
    _write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    hf_config = config.to_hf_config()
    hf_config["dtype"] = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                          np.dtype(np.float16): "float16"}.get(np.dtype(dtype), "float32")
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    if tokenizer is not None:
        getattr(tokenizer, "hf_tokenizer", tokenizer).save_pretrained(path)


def load_gguf(path: str | os.PathLike, config: ModelConfig | None = None, mesh: Any = None,
              rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
              dtype: Any = jnp.float32) -> tuple[ModelConfig, transformer.Params]:
    """A GGUF file -> (config from its metadata, dequantized params on `mesh`)."""
    from jaxrl4llm.models import gguf_file  # the gguf package is only needed here
    source = gguf_file.GGUFSource(os.fspath(path))
    config = config or source.config()
    return config, load_params(source, config, mesh, rules, dtype)
