"""The sampler-trainer gap of the quickstart model, per dtype combination.

    python tools/bench_mismatch.py                       # 8 prompts x 4 samples x 64 tokens
    python tools/bench_mismatch.py --prompts=4 --new_tokens=32

SmolLM2-135M-Instruct (float32 weights) samples chat prompts at temperature 1 with its
compute dtype (the sampler's logprobs: "behaviour"), then the trainer's teacher-forced pass
(train/logprobs.completion_logprobs, the update's own function) recomputes the logprobs of the
same tokens with its compute dtype. Per combination (sampler / trainer) it prints, over every
sampled token, the statistics the trainer logs (rl.mismatch_metrics: mean and max of
|d| = |trainer logp - sampler logp|, the fraction of ratios exp(d) outside [0.5, 2]), the 99th
percentile of |d|, and the fraction of tokens with |d| > 0.01 and of sequences whose
geometric-mean ratio leaves [0.99, 1.01].
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm import rl  # noqa: E402
from jaxrl4llm.config import cli
from jaxrl4llm.models import registry  # noqa: E402
from jaxrl4llm.sampling import Sampler  # noqa: E402
from jaxrl4llm.sampling.strategies import SamplingConfig  # noqa: E402
from jaxrl4llm.train.update.logprobs import Sequences, completion_logprobs  # noqa: E402

# (sampler compute dtype, trainer compute dtype); float32 weights throughout.
COMBINATIONS = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))
QUESTIONS = [
    "What is 17 plus 25?",
    "A train travels 60 km in 1.5 hours. What is its speed?",
    "What is 9 times 7?",
    "Solve for x: 3x + 5 = 20.",
    "What is 144 divided by 12?",
    "What is 15 percent of 200?",
    "How many minutes are in two and a half hours?",
    "What is 1000 minus 387?",
    "Is 91 a prime number? Explain.",
    "What is 2 to the power 10?",
    "A rectangle is 4 by 7. What is its area?",
    "What is the sum of the first 10 integers?",
]


def gap_stats(
    trainer_logp: np.ndarray, sampler_logp: np.ndarray, mask: np.ndarray
) -> dict[str, float]:
    """The logged mismatch metrics plus a few quantiles, over the tokens of `mask`."""
    logged = rl.finalize_metrics(
        rl.mismatch_metrics(jnp.asarray(trainer_logp), jnp.asarray(sampler_logp), jnp.asarray(mask))
    )
    d = np.where(mask, trainer_logp.astype(np.float64) - sampler_logp, 0.0)
    n = np.maximum(mask.sum(1), 1)
    geo = np.exp(d.sum(1) / n)[mask.any(1)]
    abs_d = np.abs(d[mask])
    return {
        **{k: float(v) for k, v in logged.items()},
        "abs_diff_p99": float(np.quantile(abs_d, 0.99)),
        "abs_diff_over_0.01_frac": float((abs_d > 0.01).mean()),
        "geo_ratio_outside_1pct_frac": float(((geo < 0.99) | (geo > 1.01)).mean()),
        "tokens": int(mask.sum()),
    }


def gap_cells(s: dict[str, float]) -> str:
    """The table cells tokens | mean | max | p99 |d| of `gap_stats`' result."""
    return (
        f"{s['tokens']} | {s['mismatch/logp_abs_diff_mean']:.2e} | "
        f"{s['mismatch/logp_abs_diff_max']:.2e} | {s['abs_diff_p99']:.2e}"
    )


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(QUESTIONS):
        parser.error(f"--prompts={args.prompts} must be in [1, {len(QUESTIONS)}].")

    config, params, tokenizer = registry.load_model(registry.resolve("smollm2-135m-instruct"))
    print(
        f"devices: {jax.devices()}  model: smollm2-135m-instruct, float32 weights; "
        f"{args.prompts} prompts x {args.group} samples x <= {args.new_tokens} tokens, T = 1"
    )
    outputs = {}
    for dtype in sorted({s for s, _ in COMBINATIONS}):
        smp = Sampler(dataclasses.replace(config, compute_dtype=dtype), tokenizer)
        t0 = time.perf_counter()
        outputs[dtype] = smp.generate(
            params,
            smp.encode(QUESTIONS[: args.prompts]),
            SamplingConfig(temperature=1.0),
            args.new_tokens,
            jax.random.key(args.seed),
            group_size=args.group,
        )
        print(f"sampled with {dtype} compute in {time.perf_counter() - t0:.1f} s")
    print(
        "| sampler / trainer | tokens | mean abs diff | max abs diff | p99 abs diff | "
        "tokens abs diff > 0.01 | ratio outside [0.5, 2] | seq geo-mean outside [0.99, 1.01] |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for sampler_dtype, trainer_dtype in COMBINATIONS:
        out = outputs[sampler_dtype]
        seqs = Sequences(out.prompt_tokens_BP, out.prompt_mask_BP, out.tokens_BT, out.mask_BT)
        trainer = dataclasses.replace(config, compute_dtype=trainer_dtype)
        logp, _ = jax.jit(completion_logprobs, static_argnums=(1, 3))(params, trainer, seqs, 1.0)
        s = gap_stats(np.asarray(logp), np.asarray(out.logprobs_BT), np.asarray(out.mask_BT))
        print(
            f"| {sampler_dtype} / {trainer_dtype} | {gap_cells(s)} | "
            f"{s['abs_diff_over_0.01_frac']:.4f} | "
            f"{s['mismatch/ratio_outside_frac']:.4f} | {s['geo_ratio_outside_1pct_frac']:.4f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
