"""Does keeping a row's KV pages over a step's rounds pay? Steps of partial rollouts
(train/rollout/partial.py) on SmolLM2-135M cut to 4 layers, three ways, in one run:

  compacted  the rounds as calls of the compacted sampler (each resumed row prefilled again)
  calls      the rounds as calls of the paged engine (each resumed row prefilled again)
  pool       the paged engine on one pool kept for the step (train/rollout/partial_pool.py)

    python tools/bench_partial_pool.py                       # 16 prompts x 4, 128 tokens, N=32
    python tools/bench_partial_pool.py --partial_rollout_tokens=16 --steps=4

A row ends at EOS or its first "." (as bench_turns.py's turns), so lengths vary and groups
are carried between steps. Every way runs the same steps from the same records and keys
(checked: steps_identical, every trained row's tokens). Each way runs the steps once to
compile, then --repeats times interleaved; the fastest counts. Printed:

  pool_time_ratio           pool / the faster of compacted and calls
  <way>_s                   wall time of the steps' sampling and scoring
  <way>_prefilled           prompt and history tokens prefilled, per step
  decoded                   tokens decoded per step (the same every way)
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tools import bench_dynamic, bench_turns  # noqa: E402

WAYS = {"compacted": None, "calls": 0, "pool": 0}  # way -> the sampler's kv_cache_tokens


def steps(model: tuple, records: list, way: str, settings: dict) -> tuple[list, dict, float]:
    """settings["steps"] steps of partial rollouts: the trained rows' tokens per step, the
    summed partial/* counts and the seconds."""
    from jaxrl4llm.sampling.frontend import Sampler
    from jaxrl4llm.train.config import RolloutConfig
    from jaxrl4llm.train.rollout import partial, partial_pool

    config, params, tokenizer = model
    sampler = Sampler(config, tokenizer, stop_ids=settings["stop"], kv_cache_tokens=WAYS[way])
    rollout = RolloutConfig(
        prompts_per_step=settings["prompts"], group_size=settings["group"],
        max_new_tokens=settings["budget"], max_prompt_tokens=256,
        partial_rollout_tokens=settings["partial_rollout_tokens"], max_staleness=2,
    )  # fmt: skip
    ctx: Any = types.SimpleNamespace(  # what sample_and_score reads of a RolloutContext
        rollout=rollout, sampler=sampler, reward_fn=bench_dynamic.LengthVerifier(3),
        data=types.SimpleNamespace(messages=settings["messages"]),
    )  # fmt: skip
    pending = iter(records)
    more = lambda: [next(pending) for _ in range(settings["prompts"])]  # noqa: E731
    applies, carried, rows = partial_pool.applies, partial.Carried(), []
    counts: dict[str, float] = {}
    if way == "calls":
        partial_pool.applies = lambda sampler: False
    t0 = time.perf_counter()
    try:
        for k in range(settings["steps"]):
            out, carried, m = partial.sample_and_score(
                ctx, params, carried, more(), jax.random.key(k), more
            )
            rows.append(np.asarray(jax.device_get(out.samples.out.tokens_BT)))
            for name in ("prefilled_tokens", "decoded_tokens", "rounds"):
                counts[name] = counts.get(name, 0.0) + m[f"partial/{name}"].value
    finally:
        partial_pool.applies = applies
    return rows, counts, time.perf_counter() - t0


def compare(model: tuple, records: list, settings: dict, repeats: int) -> dict[str, Any]:
    results = {way: steps(model, records, way, settings) for way in WAYS}  # compiles
    seconds = {way: results[way][2] for way in WAYS}
    for _ in range(repeats):
        for way in WAYS:
            seconds[way] = min(seconds[way], steps(model, records, way, settings)[2])
    ref_rows, ref_counts, _ = results["compacted"]
    n = settings["steps"]
    report: dict[str, Any] = {
        "pool_time_ratio": seconds["pool"] / min(seconds["compacted"], seconds["calls"]),
        "steps_identical": all(
            all(np.array_equal(a, b) for a, b in zip(ref_rows, results[way][0])) for way in WAYS
        ),
        "decoded": ref_counts["decoded_tokens"] / n,
        "rounds": ref_counts["rounds"] / n,
    }
    for way in WAYS:
        report[f"{way}_s"] = seconds[way]
        report[f"{way}_prefilled"] = results[way][1]["prefilled_tokens"] / n
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_turns.parser_with_model_flags(__doc__)
    for flag, default in (("partial_rollout_tokens", 32), ("steps", 3), ("repeats", 1)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args(argv)
    keys = ("prompts", "group", "budget", "partial_rollout_tokens", "steps")
    settings = {k: getattr(args, k) for k in keys}
    count = args.prompts * 8 * args.steps  # records enough for every step's new groups
    model, records, settings = bench_dynamic.arithmetic(args.layers, count, settings)
    device = jax.devices()[0].platform
    print(f"partial rollouts: SmolLM2-135M, {args.layers} layers, device {device}")
    bench_turns.print_report(compare(model, records, settings, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
