"""LoRA adapters: a separate, small pytree trained beside frozen base params.

An adapter on projection W (x -> x W) adds (alpha / rank) * x A B, with A [in, r] and
B [r, out] (in / out: the projection's input and output widths, heads flattened as in the
HF tensors). Adapters are stacked per layer like the params they adapt:

    adapters = {"layers": {"q_lora_a": [L, D, r], "q_lora_b": [L, r, N*H], ...}}

A starts random (PEFT's default: uniform(+-1 / sqrt(in))) and B at zero, so a fresh adapter
leaves the model exactly as it was. `combine(base, adapters, config)` is the params tree the
forward reads (the base leaves plus the adapter leaves, B pre-scaled): the transformer adds
x A B wherever a layer has "NAME_lora_a"; gradients taken with respect to the adapters only
never compute one for the base. `fold` / `merge` fold the adapters into the weights
(W + scale * A B, summed in float32): the sampler does so inside its program
(decode.loop_params, which copies the weights anyway), and an export to a full HF folder does
too.

Adapters are float32 whatever the base's dtype (as PEFT keeps them over a bfloat16 base): in
bfloat16 an Adam step of ~lr rounds away unless it is ~1/256 of the entry. A pass computes
with them in the dtype their weight computes in (`in_weight_dtype`, which
transformer.cast_for_compute applies), so the adapter matmuls run at the base's precision and,
the cast being differentiated, their gradients come back float32.

With dropout (training only), `combine` is given a key and the adapters' input x is dropped
per element with probability `dropout` (as in PEFT: dropout(x) A B; the base path is not).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm.models import schema
from jaxrl4llm.models.config import ModelConfig

Params = dict[str, Any]

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# HF module names of the targets (PEFT's target_modules).
HF_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
# Per-layer leaves that carry dropout (present only while training with --lora_dropout > 0).
DROPOUT_KEY, DROPOUT_KEEP = "lora_dropout_key", "lora_dropout_keep"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA: train low-rank adapters on frozen base weights (the reference model is the base
    with the adapters off).

    rank: LoRA adapter rank (0 = full fine-tuning).
    alpha: LoRA scale numerator: the adapter's output is scaled by alpha / rank.
    dropout: Dropout on the adapters' input in the update (0 for RL: the default).
    targets: Projections that get adapters, from q,k,v,o,gate,up,down.
    """

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 0:
            raise ValueError(f"--lora_rank={self.rank} must be >= 0 (0 = full fine-tuning).")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"--lora_targets={','.join(self.targets)}: name each of "
                f"{','.join(TARGETS)} at most once (e.g. q,v)."
            )
        if self.alpha <= 0:
            raise ValueError(f"--lora_alpha={self.alpha} must be > 0 (the scale is alpha / rank).")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--lora_dropout={self.dropout} must be in [0, 1) (0: off).")


def check_model(config: ModelConfig, lora: LoraConfig) -> None:
    """Refuses adapters on projections the model's layers lack: the MoE layers of a mixture
    of experts have a router and experts, not the dense gate / up / down (its attention
    projections take adapters as any model's do)."""
    mlp = [t for t in lora.targets if t in ("gate", "up", "down")]
    if lora.enabled and mlp and config.moe_layers:
        raise ValueError(
            f"--lora_targets={','.join(lora.targets)}: {','.join(mlp)} are dense MLP "
            f"projections, which the mixture-of-experts layers of this {config.model_type} "
            "model do not have; adapt its attention projections (--lora_targets=q,k,v,o)."
        )


def _leaf(name: str) -> schema.Leaf:
    return next(leaf for leaf in schema.PARAMS if leaf.name == name)


def in_out(config: ModelConfig, target: str) -> tuple[int, int]:
    """(input width, output width) of a projection, heads flattened (the HF Linear's)."""
    out_features, in_features = _leaf(target).dims(config, _leaf(target).hf_shape)
    return in_features, out_features


def adapter_shapes(config: ModelConfig, lora: LoraConfig) -> Params:
    L, r = config.num_layers, lora.rank
    layers = {}
    for t in lora.targets:
        i, o = in_out(config, t)
        layers[f"{t}_lora_a"] = (L, i, r)
        layers[f"{t}_lora_b"] = (L, r, o)
    return {"layers": layers}


def adapter_logical_axes(config: ModelConfig, lora: LoraConfig) -> Params:
    """Adapters are replicated: rank x width is small next to the base weights, and a
    replicated adapter needs no collective of its own."""
    return jax.tree.map(
        lambda s: ("layers", None, None),
        adapter_shapes(config, lora),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def init_adapters(config: ModelConfig, lora: LoraConfig, key: jax.Array) -> Params:
    """Fresh float32 adapters: A uniform(+-1 / sqrt(in)) (PEFT's kaiming_uniform(a=sqrt(5))),
    B zero."""
    shapes = adapter_shapes(config, lora)["layers"]
    keys = jax.random.split(key, len(lora.targets))
    layers = {}
    for k, t in zip(keys, lora.targets):
        a_shape = shapes[f"{t}_lora_a"]
        bound = 1.0 / math.sqrt(a_shape[1])
        layers[f"{t}_lora_a"] = jax.random.uniform(k, a_shape, jnp.float32, -bound, bound)
        layers[f"{t}_lora_b"] = jnp.zeros(shapes[f"{t}_lora_b"], jnp.float32)
    return {"layers": layers}


def combine(
    base: Params, adapters: Params, lora: LoraConfig, dropout_key: jax.Array | None = None
) -> Params:
    """The params the forward reads: `base` with the adapter leaves added to its layers, each
    B scaled by alpha / rank. With `dropout_key` and lora.dropout > 0, each layer also gets
    its dropout key and keep probability."""
    layers = dict(base["layers"])
    for name, w in adapters["layers"].items():
        layers[name] = w * jnp.asarray(lora.scale, w.dtype) if name.endswith("_b") else w
    if dropout_key is not None and lora.dropout > 0:
        L = jax.tree.leaves(adapters)[0].shape[0]
        layers[DROPOUT_KEY] = jax.random.key_data(jax.random.split(dropout_key, L))
        layers[DROPOUT_KEEP] = jnp.full((L,), 1.0 - lora.dropout, jnp.float32)
    return {**base, "layers": layers}


def has_adapters(params: Params) -> bool:
    layers = params.get("layers", {})
    return isinstance(layers, dict) and any(name.endswith("_lora_a") for name in layers)


def in_weight_dtype(params: Params) -> Params:
    """Params read by the forward with every adapter leaf in the dtype of the weight it
    adapts (float32 adapters on a bfloat16 weight compute in bfloat16; under `grad` the cast
    is differentiated, so the adapters' gradients stay float32)."""
    if not has_adapters(params):
        return params
    layers = params["layers"]
    cast = {
        name: w.astype(layers[name.rsplit("_lora_", 1)[0]].dtype)
        for name, w in layers.items()
        if name.endswith(("_lora_a", "_lora_b"))
    }
    return {**params, "layers": {**layers, **cast}}


def fold(params: Params) -> Params:
    """Params read by the forward (`combine`'s output) with every adapter folded into its
    weight: W + A B (B carries the scale), in W's dtype; no adapter or dropout leaves left.
    Params without adapters come back as they are."""
    if not has_adapters(params):
        return params
    layers = {
        k: v
        for k, v in params["layers"].items()
        if "_lora_" not in k and k not in (DROPOUT_KEY, DROPOUT_KEEP)
    }
    for name, a in params["layers"].items():
        if not name.endswith("_lora_a"):
            continue
        target = name[: -len("_lora_a")]
        b = params["layers"][f"{target}_lora_b"]
        w = layers[target]
        ab = jnp.einsum("lir,lro->lio", a.astype(jnp.float32), b.astype(jnp.float32))
        layers[target] = (w.astype(jnp.float32) + ab.reshape(w.shape)).astype(w.dtype)
    return {**params, "layers": layers}


def merge(base: Params, adapters: Params, lora: LoraConfig) -> Params:
    """`base` with the adapters folded in (W + scale * A B, in W's dtype): plain params
    without adapter leaves, for an HF export or a forward without the adapter matmuls."""
    return fold(combine(base, adapters, lora))
