"""Time of the packed update's forward and backward passes with the chunked kernel's block
skipping against full attention over every packed row, on one length mix, in one run.

    python tools/bench_packed_update.py --length_mix=tail10 --layers=4

Builds a mini-batch of --prompts groups of --group sequences (a --prompt_tokens-token prompt
per group, random tokens; completion lengths forced from bench_rollout's --length_mix) and
packs it with --micro_batch_tokens twice, each plan chosen by packing.SlotFlops for the
attention that then runs it:
  full     attention.AttentionConfig(impl="reference"): every [L, L] score of a packed row
           computed and masked, so the planner's attention term is rows x L^2
  skipping the default AttentionConfig: the chunked kernel on rows of two blocks or more,
           computing only the block pairs attention.block_visibility marks
Each variant times value_and_grad of the summed packed logprobs over every micro-batch that
holds rows (the update's passes, one micro-batch after another), after a compiling run, on
SmolLM2 cut to --layers layers (the FLOPs are modelled on the full model). Prints per variant
the plan (L x R, micro-batches), real share, modelled FLOPs and seconds, then the ratio
skipping / full of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.config import cli  # noqa: E402
from tools.bench_rollout import mix_caps  # noqa: E402

if TYPE_CHECKING:
    from jaxrl4llm.models.attention import AttentionConfig
    from jaxrl4llm.models.config import ModelConfig
    from jaxrl4llm.train.update.packing import PackedBatch

MODEL = "smollm2-135m-instruct"
_COUNTS = ("prompts", "group", "prompt_tokens", "micro_batch_tokens", "layers", "repeats")


def _parse(argv: Any) -> argparse.Namespace:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length_mix", choices=("step0", "tail10"), default="tail10")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt_tokens", type=int, default=58)
    parser.add_argument("--micro_batch_tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=MODEL)
    args = parser.parse_args(argv)
    for name in _COUNTS:
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be >= 1.")
    return args


def synthetic_sequences(args: argparse.Namespace, vocab: int) -> Any:
    """train.update.logprobs.Sequences: per group one random prompt (left-padded), per row a random
    completion of the mix's forced length."""
    from jaxrl4llm.sampling.buckets import bucket_completion_length, bucket_prompt_length
    from jaxrl4llm.train.update.logprobs import Sequences

    rng = np.random.default_rng(0)
    rows = args.prompts * args.group
    caps, max_new = mix_caps(args.length_mix, rows, 0)
    lengths = np.minimum(caps, max_new)
    P = bucket_prompt_length(args.prompt_tokens)
    T = bucket_completion_length(int(lengths.max()), max_new)
    prompts = rng.integers(2, vocab, (args.prompts, args.prompt_tokens))
    prompt_tokens = np.zeros((rows, P), np.int32)
    prompt_tokens[:, P - args.prompt_tokens :] = np.repeat(prompts, args.group, axis=0)
    prompt_mask = np.arange(P)[None] >= P - args.prompt_tokens
    completion_mask = np.arange(T)[None] < lengths[:, None]
    completions = np.where(completion_mask, rng.integers(2, vocab, (rows, T)), 0)
    return Sequences(
        jnp.asarray(prompt_tokens),
        jnp.asarray(np.broadcast_to(prompt_mask, (rows, P))),
        jnp.asarray(completions, jnp.int32),
        jnp.asarray(completion_mask),
    )


def time_variant(
    params: dict[str, Any],
    config: ModelConfig,
    packed: PackedBatch,
    attention: AttentionConfig,
    repeats: int,
) -> float:
    """Seconds (the fastest of `repeats`, after a compiling run) of value_and_grad of the
    summed logprobs over the micro-batches that hold rows."""
    from jaxrl4llm.train.update import packing

    def loss(params, k):
        logp_RL, _ = packing.packed_logprobs(params, config, packed, k, 1.0, attention=attention)
        return jnp.sum(logp_RL * (packed.segments_KRL[k] > 0))

    step = jax.jit(jax.value_and_grad(loss))
    used = int(packed.num_micro)

    def run():
        outs = [step(params, jnp.asarray(k)) for k in range(used)]
        jax.block_until_ready(outs)

    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: Any = None) -> int:
    args = _parse(argv)
    from jaxrl4llm.models import registry
    from jaxrl4llm.models.attention import AttentionConfig
    from jaxrl4llm.train.update import packing

    full_config, params, _ = registry.load_model(args.model, dtype=jnp.float32)
    args.layers = min(args.layers, full_config.num_layers)
    config = dataclasses.replace(full_config, num_layers=args.layers)
    params = {**params, "layers": jax.tree.map(lambda w: w[: args.layers], params["layers"])}
    seqs = synthetic_sequences(args, config.vocab_size)
    print(
        f"{args.model} ({args.layers} of {full_config.num_layers} layers) float32, "
        f"{args.prompts} groups x {args.group}, length mix {args.length_mix}, "
        f"--micro_batch_tokens={args.micro_batch_tokens}, {jax.devices()[0].device_kind}",
        flush=True,
    )
    results = {}
    for name, attention in (("full", AttentionConfig(impl="reference")), ("skipping", None)):
        attention = attention or AttentionConfig()
        flops = packing.SlotFlops.of(full_config, attention)
        packed = packing.pack(seqs, args.micro_batch_tokens, flops=flops)
        real, slots = packing.real_share(packed)
        seconds = time_variant(params, config, packed, attention, args.repeats)
        _, R, L = packed.segments_KRL.shape
        results[name] = (packing.packed_flops(packed, flops), seconds)
        print(
            f"{name}: rows {L} x {R}, {int(packed.num_micro)} micro-batches, real share "
            f"{real / slots:.3f}, modelled FLOPs {results[name][0]:.3e}, {seconds:.2f} s",
            flush=True,
        )
    (f_full, t_full), (f_skip, t_skip) = results["full"], results["skipping"]
    print(f"skipping / full: modelled FLOPs {f_skip / f_full:.3f}x, time {t_skip / t_full:.3f}x")
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
