"""Checkpoints <-> the params pytree: HF safetensors folders (in and out) and GGUF files (in).

Loading streams one tensor at a time: for each stacked leaf ([L, ...]) a host buffer in the
target dtype is filled layer by layer from memory-mapped files, then placed on the mesh with
`jax.make_array_from_callback`, which hands every device only its own shard. Peak host
memory is therefore one stacked leaf in the target dtype (the largest is the MLP gate/up:
L * hidden * intermediate elements, ~2.9 GB for a 7B model in bfloat16; of a mixture of
experts, one expert matrix of every layer and expert, ~19 GB for Qwen3-30B-A3B) plus one
tensor as stored -- never a full model copy, let alone one per device. A mixture's experts
are one HF tensor each (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, as
transformers' save_pretrained writes them), stacked into our [L, E, ...] leaves.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, Sharding

from jaxrl4llm import parallel
from jaxrl4llm.models import schema, transformer
from jaxrl4llm.models.config import ModelConfig

# safetensors dtype codes <-> numpy dtypes (bfloat16 through ml_dtypes).
_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
}
_ST_CODES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
            raise FileNotFoundError(
                f"No *.safetensors files in {folder!r}: expected a Hugging "
                "Face model folder (config.json + model*.safetensors)."
            )
        self._entries: dict[str, tuple[str, dict[str, Any], int]] = {}
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
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
        return np.memmap(
            path, dtype=dtype, mode="r", offset=base + begin, shape=tuple(info["shape"])
        )


def _place(buffer: np.ndarray, sharding: Sharding | None) -> jax.Array:
    if sharding is None:
        return jnp.asarray(buffer)
    # Each device (and each host) reads only its shard out of the host buffer.
    return jax.make_array_from_callback(buffer.shape, sharding, lambda idx: buffer[idx])


def load_params(
    source: Any,
    config: ModelConfig,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    dtype: Any = jnp.float32,
    skip: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
) -> transformer.Params:
    """Reads every leaf from `source` (HF names and layouts) onto `mesh` (or the default device).

    Missing tensors, shape mismatches and tensors the model does not use are errors naming them.
    `skip`: leaves (params names, e.g. "unembed") neither read nor required, their tensors
    ignored if present; `ignore`: tensor names the caller reads itself (a critic's head).
    """
    available = source.names()
    used: set[str] = set(ignore) & available
    shardings = _param_shardings(config, mesh, rules, dtype)
    params: dict[str, Any] = {"layers": {}}
    np_dtype = np.dtype(dtype)
    for leaf in schema.leaves(config):
        if leaf.name in skip:
            used.update(name for name, _ in leaf.tensors(config))
            continue
        buffer, names = _read_leaf(source, available, leaf, config, np_dtype)
        used.update(names)
        target = params["layers"] if leaf.per_layer else params
        sharding = None
        if shardings is not None:
            sharding = (shardings["layers"] if leaf.per_layer else shardings)[leaf.name]
        target[leaf.name] = _place(buffer, sharding)
        del buffer
    _check_all_used(available - used, config)
    return params


def _param_shardings(
    config: ModelConfig, mesh: Mesh | None, rules: parallel.LogicalRules, dtype: Any
) -> Any:
    """The params tree of shardings on `mesh` (None without a mesh)."""
    if mesh is None:
        return None
    return parallel.logical_to_sharding(
        schema.param_logical_axes(config),
        mesh,
        rules,
        shapes=jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, dtype),
            schema.param_shapes(config),
            is_leaf=transformer.is_shape,
        ),
    )


def _read_leaf(
    source: Any, available: set[str], leaf: schema.Leaf, config: ModelConfig, np_dtype: Any
) -> tuple[np.ndarray, list[str]]:
    """One params leaf as a host buffer in our layout and `np_dtype` (per-layer tensors
    stacked [L, ...], per-expert ones [L, E, ...]), and the names of the tensors it was read
    from."""
    hf_shape = leaf.dims(config, leaf.hf_shape)
    buffer = np.empty(leaf.stacked(config) + leaf.our_shape(config), np_dtype)
    names: list[str] = []
    for name, index in leaf.tensors(config):
        if name not in available:
            raise KeyError(
                f"Checkpoint is missing tensor {name!r} (needed for params "
                f"{leaf.name} of a {config.model_type} model)."
            )
        if source.shape(name) != hf_shape:
            raise ValueError(
                f"Tensor {name!r} has shape {source.shape(name)} but the config "
                f"needs {hf_shape} (params {leaf.name}); check that "
                "config.json matches the weights."
            )
        buffer[index] = leaf.to_ours(config, source.read(name))
        names.append(name)
    return buffer, names


def _check_all_used(unread: set[str], config: ModelConfig) -> None:
    """Raises on checkpoint tensors that no params leaf read (a config / weights mismatch)."""
    leftover = {n for n in unread if not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        leftover.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
    if leftover:
        raise ValueError(
            f"Checkpoint has tensors the {config.model_type} model does not use: "
            f"{sorted(leftover)[:8]}{' ...' if len(leftover) > 8 else ''}; check "
            "that config.json matches the weights (e.g. attention_bias, "
            "tie_word_embeddings, num_hidden_layers)."
        )


def load_hf(
    path: str | os.PathLike,
    config: ModelConfig | None = None,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    dtype: Any = jnp.float32,
) -> tuple[ModelConfig, transformer.Params]:
    """A Hugging Face folder (config.json + *.safetensors) -> (config, params on `mesh`)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"Model folder {path!r} does not exist; pass a Hugging Face model "
            "folder holding config.json and *.safetensors."
        )
    config = config or ModelConfig.from_hf_config(path)
    return config, load_params(SafetensorsSource(path), config, mesh, rules, dtype)


# ----------------------------------------------------------------------------- export


def _write_safetensors(
    path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        code = _ST_CODES.get(arr.dtype)
        if code is None:
            raise ValueError(f"Cannot export tensor {name!r} of dtype {arr.dtype}.")
        header[name] = {
            "dtype": code,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def export_hf(
    params: transformer.Params,
    config: ModelConfig,
    path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    extra_tensors: dict[str, np.ndarray] | None = None,
    hf_config: dict[str, Any] | None = None,
) -> None:
    """Writes `path`/config.json + model.safetensors that `transformers` loads.

    Tensors keep the params' dtype (float32 or bfloat16). Gathers one leaf at a time to host.
    Leaves absent from `params` (a critic has no "unembed") are not written; `extra_tensors`
    are written as they are and `hf_config` keys override config.json's (a critic's head and
    its *ForTokenClassification architecture).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    dtype = None
    for leaf in schema.leaves(config):
        if not leaf.per_layer and leaf.name not in params:
            continue
        value = np.asarray(
            jax.device_get(params["layers"][leaf.name] if leaf.per_layer else params[leaf.name])
        )
        dtype = dtype or value.dtype
        for name, index in leaf.tensors(config):
            tensors[name] = np.ascontiguousarray(leaf.to_hf(config, value[index]))
    tensors.update(extra_tensors or {})
    _write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    written = config.to_hf_config()
    written["dtype"] = {
        np.dtype(np.float32): "float32",
        np.dtype(ml_dtypes.bfloat16): "bfloat16",
        np.dtype(np.float16): "float16",
    }.get(np.dtype(dtype), "float32")
    written.update(hf_config or {})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(written, f, indent=2)
    if tokenizer is not None:
        getattr(tokenizer, "hf_tokenizer", tokenizer).save_pretrained(path)


def load_gguf(
    path: str | os.PathLike,
    config: ModelConfig | None = None,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    dtype: Any = jnp.float32,
) -> tuple[ModelConfig, transformer.Params]:
    """A GGUF file -> (config from its metadata, dequantized params on `mesh`)."""
    from jaxrl4llm.models import gguf_file  # the gguf package is only needed here

    source = gguf_file.GGUFSource(os.fspath(path))
    config = config or source.config()
    return config, load_params(source, config, mesh, rules, dtype)
