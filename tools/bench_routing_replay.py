"""Rollout routing replay's effect on the sampler-trainer gap of a mixture of experts.

    python tools/bench_routing_replay.py                 # 16 prompts x 4 samples x 48 tokens
    python tools/bench_routing_replay.py --experts=64 --top_k=8 --layers=6

A tiny random Qwen3-MoE (float32 weights) samples random prompts at temperature 1 with
bfloat16 compute, recording each token's experts (the sampler's logprobs: "behaviour"); the
trainer's teacher-forced pass (train/update/logprobs.py, the update's own function) then
recomputes the logprobs of the same tokens in float32, once routing itself and once
replaying the sampler's experts (--routing_replay). Per pass it prints, over every sampled
token, the gap the trainer logs (rl.mismatch_metrics: mean and max |d| = |trainer logp -
sampler logp|, the share of ratios exp(d) outside [0.5, 2]), its 99th percentile and the
routing flips: the share of (MoE layer, token) pairs whose float32 router's own top-k set
differs from the experts the bfloat16 sampler ran (router/flip_frac), and of those whose
experts the pass ran differ (0 under replay).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl4llm.config import cli  # noqa: E402
from jaxrl4llm.models import transformer  # noqa: E402
from jaxrl4llm.models.config import ModelConfig  # noqa: E402
from jaxrl4llm.models.moe_config import MoeConfig  # noqa: E402
from jaxrl4llm.sampling import sampler  # noqa: E402
from jaxrl4llm.sampling.strategies import SamplingConfig  # noqa: E402
from jaxrl4llm.train.update.logprobs import (  # noqa: E402
    Sequences,
    TokenRouting,
    routed_completion_logprobs,
)
from tools.bench_mismatch import gap_cells, gap_stats  # noqa: E402


def tiny_moe(layers: int, experts: int, top_k: int) -> ModelConfig:
    """A Qwen3-MoE of width 128 with `experts` experts of width 64 per layer, top-`top_k`
    renormalised (Qwen3-MoE's rule), a 512-token vocabulary."""
    return ModelConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qk_norm=True,
        model_type="qwen3_moe",
        max_position_embeddings=256,
        moe=MoeConfig(experts, top_k, 64, norm_topk_prob=True),
    )


def differs(experts_LNK: jax.Array, routing: TokenRouting) -> float:
    """Share of (layer, real token) pairs whose expert set differs from the sampler's."""
    assert routing.recorded_LNK is not None  # the sampler recorded its routing
    a, b = jnp.sort(experts_LNK, axis=-1), jnp.sort(routing.recorded_LNK, axis=-1)
    flipped = jnp.any(a != b, axis=-1)
    w = routing.weight_N[None]
    return float(jnp.sum(flipped * w) / (flipped.shape[0] * jnp.sum(w)))


def own_top_k(routing: TokenRouting) -> jax.Array:
    k = routing.experts_LNK.shape[-1]
    return jax.lax.top_k(routing.logits_LNE.astype(jnp.float32), k)[1]


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = tiny_moe(args.layers, args.experts, args.top_k)
    params = transformer.init_params(config, jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    prompts = [list(rng.integers(1, 512, size=rng.integers(8, 24))) for _ in range(args.prompts)]
    out = sampler.generate(
        params,
        dataclasses.replace(config, compute_dtype="bfloat16"),
        prompts,
        SamplingConfig(temperature=1.0),
        args.new_tokens,
        jax.random.key(args.seed),
        n=args.group,
        stop_ids=(),
        record_routing=True,
    )
    print(
        f"devices: {jax.devices()}  tiny Qwen3-MoE: {args.layers} layers, {args.experts} "
        f"experts, top-{args.top_k}; {args.prompts} prompts x {args.group} samples x "
        f"{args.new_tokens} tokens, T = 1; sampler bfloat16, trainer float32"
    )
    print(
        "| trainer pass | tokens | mean abs diff | max abs diff | p99 abs diff | "
        "ratio outside [0.5, 2] | router's top-k differs | experts run differ |"
    )
    print("|---|---|---|---|---|---|---|---|")
    passes = jax.jit(routed_completion_logprobs, static_argnames=("config", "prompt_group"))
    for replay in (False, True):
        seqs = Sequences(
            out.prompt_tokens_BP,
            out.prompt_mask_BP,
            out.tokens_BT,
            out.mask_BT,
            prompt_experts_BPLK=out.prompt_experts_BPLK,
            experts_BTLK=out.experts_BTLK,
            replay=replay,
        )
        logp, _, routing = passes(params, config=config, seqs=seqs, prompt_group=args.group)
        s = gap_stats(np.asarray(logp), np.asarray(out.logprobs_BT), np.asarray(out.mask_BT))
        print(
            f"| {'replaying the sampler' if replay else 'routing itself'} | {gap_cells(s)} | "
            f"{s['mismatch/ratio_outside_frac']:.4f} | "
            f"{differs(own_top_k(routing), routing):.4f} | "
            f"{differs(routing.experts_LNK, routing):.4f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
