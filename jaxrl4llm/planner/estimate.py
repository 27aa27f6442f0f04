"""Hand estimates of the per-device memory of one step's programs (tools/plan.py).

Symbols (per device; "rows" are those one device holds of the slice that runs at once):
  Np parameters, n layers, D width, F MLP width, V vocabulary, K kv heads, H head_dim
  s  bytes per parameter (2 for bfloat16); S = fsdp x tensor weight shards; T = tensor
  X  the expert axis; a mixture of experts' expert weights (Ne of the Np, 3 D M E per MoE
     layer: E experts of width M, k per token) are split over X x S, the rest over S
  Nb = Np - Ne + Ne / X               a device's share of the weights times S (Np when dense)
  Pb = Nb s / S                       the params' shard
  n Wl = the layers' weights a device gathers: every layer's (q, k, v, o, MLP or router,
     norms), an MoE layer's experts only the E / X it holds
  F  the dense MLP's width (0 when every layer is a mixture of experts)
  C  = X D in an MoE model (0 dense): the expert group's X rows of tokens an MoE layer
     gathers per token row (models/moe.py)
  Q  = Qc (D + 3 M) 4 in an MoE model (0 dense): one chunk of sorted token copies and their
     three projections, Qc = moe.EXPERT_CHUNK_COPIES copies whatever the rows
  c  bytes per element of a gathered weight. XLA's CPU compiler (the one plan.py runs)
     computes bfloat16 matmuls in float32, so it converts weights before gathering: c = 4.
     On TPU / GPU c = s, and the converted copies below are not there.
  b  rows per device (micro-batch or rollout chunk / (data x fsdp)); P the prompt bucket,
     N max_new_tokens. Teacher-forced passes whose g rows share a prompt run it once per
     group: a row costs L = N - 1 + P / g tokens, its largest block Lb = N - 1 tokens
     (g = 1: L = Lb = P + N - 1)
  R  resident: arrays that live beside the program (the optimizer state while sampling, the
     reference params, the rollout batch), counted exactly, not estimated

  create    Pb + 3 Pb (params and Adam moments out) + R
  update    3 Pb (params + moments, donated) + 2 (4 Nb / S) (float32 gradient accumulator,
            float32 weight shards) + n b L D 4 (remat checkpoints: one float32 residual per
            layer) + 6 b Lb F/T 4 (the recomputed MLP and its gradients) + 4 b Lb D 4
            + 2 b Lb C 4 + 2 Q (an MoE layer's gathered tokens in and out, a chunk of copies
            and its recomputation)
            + 4 D V/T 4 (unembedding gathered in float32, its gradient, the reduction buffer,
            a conversion) + R; with --micro_batch_tokens=Nt (packed micro-batches: one row
            of Nt / (data x fsdp) tokens per device) b L = b Lb = Nt / (data x fsdp), whatever
            the rows and lengths (PPO's critic still runs padded rows)
  rollout   Pb + n Wl s / T (every layer gathered once, before the decode loop, in the compute
            dtype: decode.loop_params gathers before any matmul converts)
            + 2 D V/T (c + s) (embedding and unembedding gathered, and converted)
            + 2 n b K H (P + N - 1) kv / T_kv (keys and values of one chunk, kv the cache
            dtype's bytes: the compute dtype's on an accelerator, 4 on CPU) + R
  logprobs  Pb + b Lb F/T (2 x 4 + s) (gate, up in float32, their product) + b Lb D 4
            + b Lb C (c + 4) + Q (an MoE layer's gathered tokens, a chunk of copies)
            + D V/T c (unembedding gathered) + R
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from jaxrl4llm import parallel
from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import moe as moe_lib
from jaxrl4llm.models import transformer
from jaxrl4llm.sampling import buckets
from jaxrl4llm.train.config import TrainConfig, param_dtype

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxrl4llm.models.config import ModelConfig
    from jaxrl4llm.models.lora import LoraConfig

_F32 = 4
CPU_GATHER_BYTES = 4  # c: see the module docstring


class Estimate:
    def __init__(
        self,
        config: TrainConfig,
        model_config: ModelConfig,
        mesh: Mesh,
        gather_bytes: int = CPU_GATHER_BYTES,
        cache_bytes: int | None = None,
    ) -> None:
        c, m = config, model_config
        self.c, self.m = c, m
        self.s = param_dtype(c.model.param_dtype)(0).dtype.itemsize
        self.kv = cache_bytes or self.s  # the KV cache's dtype (the run's, planner/programs.py)
        self.g = max(gather_bytes, self.s)
        shape = dict(zip(mesh.axis_names, mesh.devices.shape))
        self.T = shape["tensor"]
        self.dp = parallel.data_parallel_size(mesh)
        self.S = shape["fsdp"] * self.T
        layer = transformer.param_shapes(m)["layers"]
        X = shape.get("expert", 1)
        Ne = sum(math.prod(v) for k, v in layer.items() if k.startswith("expert_"))
        self.Nb = m.num_params - Ne + Ne / X
        self.Pb = self.Nb * self.s / self.S
        self.nWl = sum(math.prod(v) for v in layer.values()) - Ne + Ne / X
        self.P = buckets.bucket_prompt_length(c.rollout.max_prompt_tokens)
        self.N = c.rollout.max_new_tokens
        self.L = self.P + self.N - 1  # a row's tokens without prompt sharing
        self.DV = m.hidden_size * m.vocab_size / self.T
        moe_M = m.moe.moe_intermediate_size if m.moe_layers else 0
        self.F = (m.intermediate_size if m.dense_layers else 0) / self.T
        self.C = X * m.hidden_size if moe_M else 0
        self.Q = moe_lib.EXPERT_CHUNK_COPIES * (m.hidden_size + 3 * moe_M) * _F32 if moe_M else 0
        self.T_kv = self.T if m.num_kv_heads % self.T == 0 else 1

    def create(self, resident: float) -> float:
        return 4 * self.Pb + resident

    def _tokens(self, group: int) -> tuple[float, float]:
        """(L, Lb): a row's tokens and its largest block's, prompts shared by `group` rows."""
        if group == 1:
            return self.L, self.L
        return self.N - 1 + self.P / group, self.N - 1

    def update(
        self, group: int, resident: float, unembed: bool = True, packed: bool = True
    ) -> float:
        """unembed=False: PPO's critic, the same model without the unembedding (its scalar
        head reads the hidden states: no logits). packed=False: padded micro-batches even
        with --micro_batch_tokens (the critic's)."""
        m, D = self.m, self.m.hidden_size
        bL, bLb = self._update_tokens(group, packed)
        state = 3 * self.Pb + 2 * _F32 * self.Nb / self.S
        activations = (m.num_layers * bL * D + 6 * bLb * self.F + 4 * bLb * D) * _F32
        activations += 2 * bLb * self.C * _F32 + 2 * self.Q
        return state + activations + 4 * self.DV * _F32 * unembed + resident

    def _update_tokens(self, group: int, packed: bool) -> tuple[float, float]:
        """(b L, b Lb): a device's tokens in one update micro-batch and in its largest block.
        --micro_batch_tokens=Nt: one packed row of Nt / (data x fsdp) tokens per device (no
        prompt sharing, no padding), the token budget rather than rows x max length."""
        budget = self.c.update.micro_batch_tokens
        if packed and budget:
            return budget / self.dp, budget / self.dp
        b = self.c.micro_batch / self.dp
        L, Lb = self._tokens(group)
        return b * L, b * Lb

    def packed_micro_batches(self) -> int:
        """Micro-batches of a packed mini-batch at most (every sequence at --max_prompt_tokens
        + --max_new_tokens, rows filled), the trip count of the packed update's loop."""
        r = self.c.rollout
        tokens = self.c.mini_batch * (r.max_prompt_tokens + r.max_new_tokens)
        return math.ceil(tokens / self.c.update.micro_batch_tokens)

    def rollout(self, num_chunks: int, resident: float) -> float:
        m, s = self.m, self.s
        b = self.c.batch_size / num_chunks / self.dp
        weights = self.nWl * s / self.T + 2 * self.DV * (self.g + s)
        cache = 2 * m.num_layers * b * m.num_kv_heads * m.head_dim * self.L * self.kv / self.T_kv
        return self.Pb + weights + cache + resident

    def logprobs(self, num_chunks: int, group: int, resident: float, unembed: bool = True) -> float:
        """unembed=False: PPO's critic values pass (no unembedding gathered)."""
        b, D = self.c.batch_size / num_chunks / self.dp, self.m.hidden_size
        _, Lb = self._tokens(group)
        layer = b * Lb * self.F * (2 * _F32 + self.s) + b * Lb * D * _F32
        layer += b * Lb * self.C * (self.g + _F32) + self.Q
        return self.Pb + layer + self.DV * self.g * unembed + resident

    def rollout_hbm_bytes(self, num_chunks: int) -> float:
        """HBM reads of the decode loops: every gathered weight and the mean KV context per
        step, max_new_tokens steps per chunk (the roofline of a memory-bound decode)."""
        m, s = self.m, self.s
        b = self.c.batch_size / num_chunks / self.dp
        kv = 2 * m.num_layers * b * (self.P + self.N / 2) * m.num_kv_heads * m.head_dim * s
        return num_chunks * self.N * (self.Nb * s / self.T + kv / self.T_kv)

    def textbook_update_collectives(self, num_micro: int) -> float:
        """Payload bytes of textbook FSDP per update: per micro-batch every weight a device
        computes with (an MoE layer's held experts) gathered for the forward and again for
        the backward, and every gradient reduce-scattered."""
        return num_micro * 3 * self.Nb * self.s / self.T


class LoraEstimate(Estimate):
    """The estimate of a LoRA run (--lora_rank > 0): the optimizer trains the adapters only.

    Extra symbols: Na adapter parameters, rank x (in + out) per target projection per layer;
    A = 4 Na their bytes (float32 whatever the base's dtype; replicated: whole on every
    device). The base (Pb per device) is frozen: an argument of every program, with no
    gradient and no optimizer state; it is the reference too, so R holds no reference copy.

      create    A + 3 A (adapters and Adam moments out) + R (the base among it)
      update    3 A (adapters + moments, donated) + Pb (the base) + 4 Na (float32 gradient
                accumulator) + 4 Nb / S (float32 weight shards) + the full update's
                activations + 2 D V/T 4 (unembedding gathered in float32 and converted: no
                gradient of its own) + R
      rollout   the full rollout's + A (the adapters, folded into the gathered weights)
      logprobs  the full pass's + A
    """

    def __init__(
        self,
        config: TrainConfig,
        model_config: ModelConfig,
        mesh: Mesh,
        gather_bytes: int = CPU_GATHER_BYTES,
        cache_bytes: int | None = None,
    ) -> None:
        super().__init__(config, model_config, mesh, gather_bytes, cache_bytes)
        self.Na = adapter_params(model_config, config.lora)
        self.A = self.Na * _F32

    def create(self, resident: float) -> float:
        return 4 * self.A + resident

    def update(
        self, group: int, resident: float, unembed: bool = True, packed: bool = True
    ) -> float:
        full = super().update(group, 0.0, unembed, packed)
        full_state = 3 * self.Pb + 2 * _F32 * self.Nb / self.S
        state = 3 * self.A + self.Pb + _F32 * self.Na + _F32 * self.Nb / self.S
        return full - full_state - 2 * self.DV * _F32 * unembed + state + resident

    def rollout(self, num_chunks: int, resident: float) -> float:
        return super().rollout(num_chunks, resident) + self.A

    def logprobs(self, num_chunks: int, group: int, resident: float, unembed: bool = True) -> float:
        return super().logprobs(num_chunks, group, resident, unembed) + self.A

    def textbook_update_collectives(self, num_micro: int) -> float:
        """Per micro-batch every base weight gathered twice (forward and backward), no
        gradient of the base to reduce-scatter."""
        return num_micro * 2 * self.Nb * self.s / self.T


def adapter_params(model_config: ModelConfig, lora: LoraConfig) -> int:
    """Na: rank x (in + out) per target projection per layer (models/lora.py's shapes)."""
    widths = (lora_lib.in_out(model_config, t) for t in lora.targets)
    return model_config.num_layers * lora.rank * sum(i + o for i, o in widths)
