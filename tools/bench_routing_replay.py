"""Rollout routing replay's effect on the sampler-trainer gap of a mixture of experts.

    python tools/bench_routing_replay.py                 # 16 prompts x 4 samples x 48 tokens
    python tools/bench_routing_replay.py --experts=64 --top_k=8 --layers=6
    python tools/bench_routing_replay.py --train_steps=300   # trained first, ~10 min on CPU

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

With --train_steps the model is first trained on a Markov chain with peaked next-token
distributions (tools/markov_moe_training.py; it prints the held-out loss and accuracy) and the
prompts are walks of that chain.
"""

from __future__ import annotations

import argparse
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
from jaxrl4llm.models.transformer import Params  # noqa: E402
from jaxrl4llm.sampling import sampler  # noqa: E402
from jaxrl4llm.sampling.sample_output import SampleOutput  # noqa: E402
from jaxrl4llm.sampling.strategies import SamplingConfig  # noqa: E402
from jaxrl4llm.train.update.logprobs import (  # noqa: E402
    Sequences,
    TokenRouting,
    routed_completion_logprobs,
)
from tools import markov_moe_training  # noqa: E402
from tools.bench_mismatch import gap_cells, gap_stats  # noqa: E402


def tiny_moe(
    layers: int, experts: int, top_k: int, width: int = 128, vocab_size: int = 512
) -> ModelConfig:
    """A Qwen3-MoE of width `width` (4 heads) with `experts` experts of width `width` / 2 per
    layer, top-`top_k` renormalised (Qwen3-MoE's rule)."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=width // 4,
        qk_norm=True,
        model_type="qwen3_moe",
        max_position_embeddings=256,
        moe=MoeConfig(experts, top_k, width // 2, norm_topk_prob=True),
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train_steps",
        type=int,
        default=0,
        help="first train the model this many steps on a peaked Markov chain "
        "(tools/markov_moe_training.py) and draw the prompts from it; 0: random model",
    )
    parser.add_argument("--train_rows", type=int, default=32, help="walks of 64 tokens a step")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="Adam's, cosine-decayed")
    return parser.parse_args(argv)


def model_and_prompts(args: argparse.Namespace) -> tuple[ModelConfig, Params, list[list[int]], str]:
    """The model to measure, its prompts and a line describing both."""
    config = tiny_moe(args.layers, args.experts, args.top_k)
    params = transformer.init_params(config, jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    if args.train_steps == 0:
        prompts = [
            list(rng.integers(1, 512, size=rng.integers(8, 24))) for _ in range(args.prompts)
        ]
        return config, params, prompts, "random weights, random prompts"
    chain = markov_moe_training.MarkovChain.random(config.vocab_size, args.seed)
    params, report = markov_moe_training.train(
        params,
        config,
        chain,
        args.train_steps,
        rows=args.train_rows,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )
    trained = (
        f"trained {args.train_steps} steps x {args.train_rows} walks of 64 tokens (learning rate "
        f"{args.learning_rate:g}) on the Markov chain: held-out cross-entropy "
        f"{report.loss_before:.3f} -> {report.loss_after:.3f} nats/token (the chain's entropy "
        f"{markov_moe_training.ENTROPY_RATE:.3f}), top-1 accuracy "
        f"{report.accuracy_after:.3f} (best 0.9), load-balancing loss "
        f"{report.balance_loss_after:.3f} (balanced: {args.top_k}); prompts: walks of the chain"
    )
    return config, params, chain.prompts(args.prompts, rng), trained


def print_gap_rows(params: Params, config: ModelConfig, out: SampleOutput, group: int) -> None:
    """One table row per trainer pass: routing itself, then replaying the sampler."""
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
        logp, _, routing = passes(params, config=config, seqs=seqs, prompt_group=group)
        s = gap_stats(np.asarray(logp), np.asarray(out.logprobs_BT), np.asarray(out.mask_BT))
        print(
            f"| {'replaying the sampler' if replay else 'routing itself'} | {gap_cells(s)} | "
            f"{s['mismatch/ratio_outside_frac']:.4f} | "
            f"{differs(own_top_k(routing), routing):.4f} | "
            f"{differs(routing.experts_LNK, routing):.4f} |",
            flush=True,
        )


def main(argv=None):
    args = parse_args(argv)
    config, params, prompts, model_line = model_and_prompts(args)
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
        f"{args.new_tokens} tokens, T = 1; sampler bfloat16, trainer float32\n{model_line}"
    )
    print(
        "| trainer pass | tokens | mean abs diff | max abs diff | p99 abs diff | "
        "ratio outside [0.5, 2] | router's top-k differs | experts run differ |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print_gap_rows(params, config, out, args.group)
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
