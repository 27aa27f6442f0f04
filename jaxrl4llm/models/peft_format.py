"""LoRA adapters <-> a PEFT adapter folder (adapter_model.safetensors + adapter_config.json).

PEFT names a layer's adapter after its HF module, e.g.
base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight [r, in] and .lora_B.weight
[out, r] (torch Linear layouts: ours transposed, heads flattened the same way as the base
weights), and scales lora_B(lora_A(x)) by lora_alpha / r as we do.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import schema, weights
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.lora import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."


def _name(target: str, layer: int, matrix: str) -> str:
    module = lora_lib.HF_MODULES[target]
    return f"{_PREFIX}{schema.HF_LAYER.format(i=layer)}{module}.{matrix}.weight"


def export_peft(
    adapters: Any,
    config: ModelConfig,
    lora: LoraConfig,
    path: str | os.PathLike,
    base_model: str | None = None,
) -> None:
    """Writes `path`/adapter_model.safetensors (float32 tensors, as the adapters train) +
    adapter_config.json, which peft.PeftModel.from_pretrained loads onto the base model."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for t in lora.targets:
        a = np.asarray(adapters["layers"][f"{t}_lora_a"], np.float32)  # [L, in, r]
        b = np.asarray(adapters["layers"][f"{t}_lora_b"], np.float32)  # [L, r, out]
        for i in range(config.num_layers):
            tensors[_name(t, i, "lora_A")] = np.ascontiguousarray(a[i].T)
            tensors[_name(t, i, "lora_B")] = np.ascontiguousarray(b[i].T)
    weights._write_safetensors(os.path.join(path, ADAPTER_WEIGHTS), tensors)
    modules = [lora_lib.HF_MODULES[t].split(".")[-1] for t in lora.targets]
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    with open(os.path.join(path, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2)


def read_lora_config(path: str | os.PathLike) -> LoraConfig:
    """The LoraConfig of a PEFT LoRA folder's adapter_config.json; raises ValueError naming
    what this decoder cannot take (another PEFT type, rsLoRA / DoRA, biases, modules other
    than q,k,v,o,gate,up,down) and OSError when the file cannot be read."""
    with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as f:
        c = json.load(f)
    by_module = {m.split(".")[-1]: t for t, m in lora_lib.HF_MODULES.items()}
    modules = c.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else modules
    unsupported = [k for k in ("use_rslora", "use_dora", "fan_in_fan_out") if c.get(k)]
    if (
        c.get("peft_type") != "LORA"
        or unsupported
        or c.get("bias", "none") != "none"
        or any(m not in by_module for m in modules)
    ):
        raise ValueError(
            f"{path}: a PEFT LoRA adapter on {', '.join(by_module)} without "
            f"biases, rsLoRA or DoRA is needed; this one has peft_type="
            f"{c.get('peft_type')}, target_modules={modules}, bias="
            f"{c.get('bias')}{', ' + ', '.join(unsupported) if unsupported else ''}."
        )
    targets = tuple(t for t in lora_lib.TARGETS if lora_lib.HF_MODULES[t].split(".")[-1] in modules)
    return LoraConfig(
        rank=int(c["r"]),
        alpha=float(c["lora_alpha"]),
        dropout=float(c.get("lora_dropout", 0.0)),
        targets=targets,
    )


def load_peft(path: str | os.PathLike, config: ModelConfig) -> tuple[Any, LoraConfig]:
    """(adapters, their LoraConfig) of a PEFT LoRA folder, as numpy arrays shaped as
    lora_lib.adapter_shapes(config, ...); raises ValueError naming what this decoder cannot
    take (read_lora_config) or a tensor missing or shaped for another model."""
    lora = read_lora_config(path)
    source = weights.SafetensorsSource(str(path))
    expected, present = lora_lib.adapter_shapes(config, lora)["layers"], source.names()
    layers = {}
    for t in lora.targets:
        for matrix, ours in (("lora_A", f"{t}_lora_a"), ("lora_B", f"{t}_lora_b")):
            names = [_name(t, i, matrix) for i in range(config.num_layers)]
            missing = [n for n in names if n not in present]
            if missing:
                raise ValueError(
                    f"{path}: {ADAPTER_WEIGHTS} lacks {missing[0]} ({len(missing)} of the "
                    f"{len(names)} {matrix} tensors of {lora_lib.HF_MODULES[t]}): the "
                    f"adapter is for another model than this {config.num_layers}-layer one."
                )
            layers[ours] = np.stack([source.read(n).T for n in names])
            if layers[ours].shape != expected[ours]:
                raise ValueError(
                    f"{path}: {lora_lib.HF_MODULES[t]}.{matrix} is "
                    f"{list(layers[ours].shape[1:])} per layer (transposed: ours), this "
                    f"model's rank-{lora.rank} adapter needs {list(expected[ours][1:])}: "
                    "the adapter is for another model."
                )
    return {"layers": layers}, lora
