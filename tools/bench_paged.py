"""Does the paged rollout engine pay? Wall time of one rollout under a memory budget and
without one, against today's other options, on both forced length mixes, in one run.

    python tools/bench_paged.py                 # SmolLM2 cut to 4 layers, step0 and tail10
    python tools/bench_rollout.py --time        # runs this after its own report

For each --length_mix (tools/bench_rollout.py: rows stop at caps drawn from the mix, no stop
tokens, so the work does not depend on the weights) one bucket of P prompts x G samples is
decoded by
  compact        the compacted sampler, every row at once (sampling/decode.py)
  paged_rich     the paged engine with a pool of every row at full length (sampling/paged.py)
and, under a KV budget of a quarter of the rows at full length (prompt bucket + the mix's
max_new_tokens, what a fixed batch or a fixed slot reserves per row),
  compact_bound  the compacted sampler in chunks of a quarter of the rows (--rollout_micro_batch)
  slots_bound    continuous batching in a quarter of the rows' slots (sampling/continuous.py)
  paged_bound    the paged engine with a pool of that budget.
Each is compiled first (a warm-up with one token per row), then timed --repeats times
interleaved with the others; the fastest time counts (the machine's load varies). Printed per
mix: the times, the ratios

  paged_time_ratio_bound   paged_bound / the best of compact_bound and slots_bound
  paged_time_ratio_rich    paged_rich / compact

and the paged engine's work: `sampler_useful_paged` (decoded tokens beyond each row's first /
rows computed over its decode steps), rows and pages per decode step, preemptions, and
whether every row equals the compacted sampler's (`rows_identical`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.config import cli  # noqa: E402

ENGINES = ("compact", "paged_rich", "compact_bound", "slots_bound", "paged_bound")
# (prompts, samples per prompt) per mix: tail10's 1024-token limit makes its rows long.
SIZES = {"step0": (32, 4), "tail10": (16, 4)}


def _samplers(model_config: Any, tokenizer: Any, rows: int, P: int, N: int) -> dict[str, Any]:
    """The five decoders of the module docstring for `rows` rows of a P-token prompt bucket."""
    from jaxrl4llm.sampling.frontend import Sampler

    bound = rows // 4
    options: dict[str, Any] = {"min_prompt_bucket": P, "stop_ids": ()}
    return {
        "compact": Sampler(model_config, tokenizer, **options),
        "paged_rich": Sampler(model_config, tokenizer, kv_cache_tokens=0, **options),
        "compact_bound": Sampler(model_config, tokenizer, max_rows=bound, **options),
        "slots_bound": Sampler(model_config, tokenizer, decode_slots=bound, **options),
        "paged_bound": Sampler(model_config, tokenizer, kv_cache_tokens=bound * (P + N), **options),
    }


def _timed(sampler: Any, params: Any, prompts: Any, N: int, group: int, caps: Any) -> tuple:
    from jaxrl4llm.sampling.strategies import SamplingConfig

    t0 = time.perf_counter()
    out = sampler.generate(
        params,
        prompts,
        SamplingConfig(temperature=1.0),
        N,
        jax.random.key(1),
        group_size=group,
        row_caps=caps,
    )
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def compare(model_config: Any, params: Any, tokenizer: Any, mix: str, repeats: int) -> dict:
    """One mix's times, ratios and the paged engine's work (module docstring)."""
    from jaxrl4llm.data import make_source
    from jaxrl4llm.data.config import DataConfig
    from tools.bench_rollout import mix_caps, same_rows

    num_prompts, group = SIZES[mix]
    rows = num_prompts * group
    caps, N = mix_caps(mix, rows, 1)
    source = make_source("synthetic:arithmetic", split="train")
    data = DataConfig(source="synthetic:arithmetic")
    first = _samplers(model_config, tokenizer, rows, 16, N)["compact"]
    prompts = first.encode([data.messages(source[i]) for i in range(num_prompts)])
    warm, _ = _timed(first, params, prompts, N, group, np.ones(rows, np.int64))
    P = warm.prompt_tokens_BP.shape[1]  # the bucket every decoder runs at
    samplers = _samplers(model_config, tokenizer, rows, P, N)
    for s in samplers.values():
        _timed(s, params, prompts, N, group, np.ones(rows, np.int64))
    seconds: dict[str, float] = {}
    outs: dict[str, Any] = {}
    for _ in range(repeats):
        for name, s in samplers.items():
            outs[name], t = _timed(s, params, prompts, N, group, caps)
            seconds[name] = min(t, seconds.get(name, np.inf))
    return _report(mix, rows, caps, seconds, outs, same_rows)


def _report(mix: str, rows: int, caps: Any, seconds: dict, outs: dict, same_rows: Any) -> dict:
    stats = jax.tree.map(int, outs["paged_bound"].engine_stats)
    useful = float(np.sum(caps) - rows)
    best_bound = min(seconds["compact_bound"], seconds["slots_bound"])
    return {
        "mix": mix,
        **{f"{name}_s": round(t, 2) for name, t in seconds.items()},
        "paged_time_ratio_bound": seconds["paged_bound"] / best_bound,
        "paged_time_ratio_rich": seconds["paged_rich"] / seconds["compact"],
        "sampler_useful_paged": useful / int(outs["paged_bound"].slot_steps),
        "sampler_useful_paged_rich": useful / int(outs["paged_rich"].slot_steps),
        "sampler_useful_compact_bound": useful / int(outs["compact_bound"].slot_steps),
        "rows_per_step_paged": stats.live_rows / stats.steps,
        "pages_per_step_paged": stats.pages_in_use / stats.steps,
        "preemptions": stats.preemptions,
        "rows_identical": min(same_rows(outs["compact"], outs[n]) for n in ENGINES[1:]),
    }


def _print(row: dict) -> None:
    for key, value in row.items():
        if key != "mix":
            text = f"{value:.3f}" if isinstance(value, float) else value
            print(f"mix={row['mix']} {key}={text}", flush=True)


def run(layers: int = 4, mixes: Sequence[str] = ("step0", "tail10"), repeats: int = 2) -> list:
    """The comparison on SmolLM2-135M cut to its first `layers` layers (printed as it goes)."""
    from jaxrl4llm.models import registry

    model_config, params, tokenizer = registry.load_model("smollm2-135m-instruct")
    model_config = dataclasses.replace(model_config, num_layers=layers)
    params = {**params, "layers": jax.tree.map(lambda w: w[:layers], params["layers"])}
    print(f"paged engine: SmolLM2-135M, {layers} layers, device {jax.devices()[0].platform}")
    rows = []
    for mix in mixes:
        rows.append(compare(model_config, params, tokenizer, mix, repeats))
        _print(rows[-1])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mixes", default="step0,tail10")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    run(args.layers, args.mixes.split(","), args.repeats)
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
