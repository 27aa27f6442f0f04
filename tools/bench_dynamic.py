"""Does DAPO's dynamic sampling by admission pay? One step's groups (P prompts x G samples,
resampled until P groups hold a correct and a wrong row) gathered three ways, in one run:

  compacted  rounds of the compacted sampler (the default engine)
  rounds     rounds of the paged engine (a pool of every row at full length)
  admission  the paged engine by admission (sampling/admission.py)

    python tools/bench_dynamic.py                 # SmolLM2 cut to 4 layers, 16 prompts x 4
    python tools/bench_dynamic.py --modulus=3 --budget=256
    python tools/bench_dynamic.py --margin=1 --segment_steps=16   # admission's settings

A row ends at EOS or the first "." (as bench_turns.py's turns), so lengths vary; it is
correct iff its length is a multiple of --modulus (about 1 / modulus of the rows, whatever
the prompt), which gives each group spread with a known chance. Every way gathers the same
batch from the same records (checked: batch_identical). Each way is compiled first (one
step), then timed --repeats times interleaved; the fastest counts. Printed:

  dynamic_time_ratio_admission   admission / the faster of compacted and rounds
  <way>_s                        wall time of the step's sampling and scoring
  <way>_chunks                   rounds sampled (admission: chunks of P records drawn)
  <way>_decoded / <way>_steps    the paged engine's tokens decoded and decode steps
  admission_dropped              groups dropped while decoding when the batch was complete
"""

from __future__ import annotations

import dataclasses
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

from tools import bench_turns  # noqa: E402

WAYS = {"compacted": (None, False), "rounds": (0, False), "admission": (0, True)}


class LengthVerifier:
    """A row is correct iff its completion's length is a multiple of `modulus`."""

    def __init__(self, modulus: int):
        self.modulus = modulus

    def score(self, texts: Sequence[str], records: Sequence[Any], lengths: Any = None) -> Any:
        from jaxrl4llm.rewards.base import RewardBatch

        correct = (np.asarray(lengths) % self.modulus == 0) & (np.asarray(lengths) > 0)
        reasons = ["correct" if c else "wrong" for c in correct]
        return RewardBatch(rewards=correct.astype(np.float32), correct=correct, reasons=reasons)


@dataclasses.dataclass
class Ahead:
    """The further chunks as the trainer's data iterator gives them: a call takes the first,
    peek(i) shows the i-th after it untaken (admission samples it before it takes it)."""

    left: list

    def __call__(self) -> Any:
        return self.left.pop(0)

    def peek(self, offset: int) -> Any:
        return self.left[offset] if offset < len(self.left) else None


def step(model: tuple, chunks: list, way: str, settings: dict) -> tuple[Any, dict, float]:
    """One step's dynamic sampling of `chunks` (the step's records, then one per extra round)
    by `way`: (scored rows, metrics, seconds)."""
    from jaxrl4llm.sampling.frontend import Sampler
    from jaxrl4llm.sampling.layout import RowLayout
    from jaxrl4llm.sampling.rounds import Rounds, sample_and_score
    from jaxrl4llm.sampling.strategies import SamplingConfig

    config, params, tokenizer = model
    kv_cache_tokens, by_admission = WAYS[way]
    sampler = Sampler(config, tokenizer, stop_ids=settings["stop"], kv_cache_tokens=kv_cache_tokens)
    ctx = types.SimpleNamespace(
        sampler=sampler,
        reward_fn=LengthVerifier(settings["modulus"]),
        data=types.SimpleNamespace(messages=settings.get("messages", lambda r: r)),
        rollout=types.SimpleNamespace(
            sampling=SamplingConfig(temperature=1.0), max_new_tokens=settings["budget"]
        ),
        turn_handlers=None,
    )
    rounds = Rounds(
        dynamic_sampling=True,
        max_resample_rounds=settings["max_resample_rounds"],
        by_admission=by_admission,
    )
    more = Ahead(list(chunks[1:]))
    t0 = time.perf_counter()
    rows, metrics = sample_and_score(
        ctx,  # type: ignore[arg-type]  # the parts of a RolloutContext rounds reads
        params, chunks[0], jax.random.key(1), RowLayout(settings["group"]), rounds,
        more,
    )  # fmt: skip
    jax.block_until_ready(rows.samples.out.tokens_BT)
    return rows, metrics, time.perf_counter() - t0


def compare(model: tuple, chunks: list, settings: dict, repeats: int) -> dict[str, Any]:
    """The ways' best times, work and batches (module docstring)."""
    once = lambda way: step(model, chunks, way, settings)  # noqa: E731
    seconds, runs = bench_turns.fastest(list(WAYS), once, repeats)
    best = min(seconds["compacted"], seconds["rounds"])
    report: dict[str, Any] = {"dynamic_time_ratio_admission": seconds["admission"] / best}
    for way, (rows, metrics) in runs.items():
        out = rows.samples.out
        report[f"{way}_s"] = seconds[way]
        report[f"{way}_chunks"] = int(metrics["rollout/rounds"].value)
        if out.engine_stats is not None:
            stats = jax.tree.map(int, out.engine_stats)
            report[f"{way}_decoded"], report[f"{way}_steps"] = stats.decoded, stats.steps
    report["admission_dropped"] = int(runs["admission"][1]["rollout/groups_dropped"].value)
    tokens = [np.asarray(runs[w][0].samples.out.tokens_BT) for w in WAYS]
    report["batch_identical"] = float(np.mean([np.all(t == tokens[0], axis=1) for t in tokens]))
    return report


def arithmetic(layers: int, count: int, settings: dict) -> tuple[tuple, list, dict]:
    """SmolLM2-135M cut to `layers` layers, the first `count` records of the arithmetic
    source, and `settings` with the stop ids (EOS and ".") and the records' messages."""
    from jaxrl4llm.data import make_source
    from jaxrl4llm.data.config import DataConfig

    config, params, tokenizer = bench_turns.smollm2(layers)
    source = make_source("synthetic:arithmetic", split="train")
    stop = tuple(config.eos_token_ids) + tuple(tokenizer.encode(".", add_special_tokens=False))
    messages = DataConfig(source="synthetic:arithmetic").messages
    records = [source[i] for i in range(count)]
    return (config, params, tokenizer), records, dict(settings, stop=stop, messages=messages)


def run(layers: int, settings: dict, repeats: int) -> dict[str, Any]:
    """The comparison on SmolLM2-135M cut to its first `layers` layers (printed)."""
    P, rounds = settings["prompts"], 1 + settings["max_resample_rounds"]
    model, records, settings = arithmetic(layers, P * rounds, settings)
    chunks = [records[k * P : (k + 1) * P] for k in range(rounds)]
    print(f"dynamic sampling: SmolLM2-135M, {layers} layers, device {jax.devices()[0].platform}")
    report = compare(model, chunks, settings, repeats)
    bench_turns.print_report(report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_turns.parser_with_model_flags(__doc__)
    parser.add_argument(
        "--modulus", type=int, default=5, help="a row is correct iff its length is a multiple of it"
    )
    parser.add_argument("--max_resample_rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--margin", type=float, default=None, help="admission.MARGIN")
    parser.add_argument(
        "--segment_steps", type=int, default=None, help="paged_segments.SEGMENT_STEPS"
    )
    args = parser.parse_args(argv)
    from jaxrl4llm.sampling import admission, paged_segments

    admission.MARGIN = args.margin or admission.MARGIN
    paged_segments.SEGMENT_STEPS = args.segment_steps or paged_segments.SEGMENT_STEPS
    keys = ("prompts", "group", "budget", "modulus", "max_resample_rounds")
    run(args.layers, {k: getattr(args, k) for k in keys}, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
