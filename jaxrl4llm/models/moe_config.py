"""MoeConfig: a mixture of experts' settings (ModelConfig.moe), read from and written to a
Qwen-MoE config.json (transformers' Qwen3MoeConfig / Qwen2MoeConfig fields)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Layer i's MLP is `num_experts` experts of width `moe_intermediate_size`, each token
    running the `experts_per_token` its router ranks highest (models/moe.py), unless i is in
    `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0 (transformers' rule): then it is
    the dense MLP of the model's intermediate_size. 0 experts: every layer dense.

    norm_topk_prob: the chosen experts' router probabilities are renormalised to sum to 1.
    shared_expert_intermediate_size: the width of a dense expert every token also runs,
        scaled by sigmoid(x . shared_expert_gate) (Qwen2-MoE; 0: none).
    """

    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers (of `num_layers`) whose MLP is a mixture of experts."""
        if not self.num_experts:
            return ()
        return tuple(
            i
            for i in range(num_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    def validate(self) -> None:
        """Refuses settings that describe no mixture (ValueError naming the field)."""
        if self.decoder_sparse_step < 1 or self.num_experts < 0:
            raise ValueError(
                f"MoeConfig: decoder_sparse_step={self.decoder_sparse_step} must be at least "
                f"1 and num_experts={self.num_experts} at least 0."
            )
        if self.num_experts and not (
            1 <= self.experts_per_token <= self.num_experts and self.moe_intermediate_size >= 1
        ):
            raise ValueError(
                f"MoeConfig: experts_per_token={self.experts_per_token} must be in [1, "
                f"num_experts={self.num_experts}] and moe_intermediate_size="
                f"{self.moe_intermediate_size} at least 1."
            )

    def layer_params(self, hidden_size: int, active: bool = False) -> int:
        """The weights of one MoE layer's MLP (router, experts, shared expert); `active`:
        only those one token runs (its experts_per_token experts)."""
        d = hidden_size
        experts = self.experts_per_token if active else self.num_experts
        total = d * self.num_experts + 3 * d * self.moe_intermediate_size * experts
        if self.shared_expert_intermediate_size:
            total += 3 * d * self.shared_expert_intermediate_size + d
        return total

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], shared_expert: bool) -> "MoeConfig":
        """From a config.json (transformers 4 names num_experts, 5 writes num_local_experts),
        at transformers' defaults where a key is absent."""
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        shared = cfg.get("shared_expert_intermediate_size") if shared_expert else 0
        return cls(
            num_experts=int(experts or 0),
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(shared or 0),
        )

    def to_hf(self, shared_expert: bool) -> dict[str, Any]:
        """The config.json keys that from_hf reads back."""
        out: dict[str, Any] = {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
        }
        if shared_expert:
            out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return out
