"""Do multi-turn rollouts pay on pages? Wall time and rows computed by the dense multi-turn
engine and the paged one, same prompts, keys and tool replies, in one run.

    python tools/bench_turns.py                  # SmolLM2 cut to 4 layers, 16 prompts x 4
    python tools/bench_turns.py --latency=0.5 --spread=1 --max_turns=4

A turn ends at the first "." the model writes (a stop sequence, as a tool call's closing tag
would), and a tool answers it after --latency seconds (a thread per call, like a sandbox or
an environment's step; with --spread=s each call takes latency x (1 + s x u), u uniform in
[-1, 1) and fixed per row and turn) with a fixed observation; the --max_turns-th turn ends
the trajectory. While its reply is due a row is parked. The dense engine
(sampling/turn_programs.py) still computes every row at each decode step; the paged one
(sampling/paged_turns.py, a pool of every row at full length) computes only the live rows,
at the smallest row level holding them. Each engine is compiled first (one rollout), then
timed --repeats times interleaved; the fastest counts. Printed:

  turns_time_ratio_paged   paged / dense wall time
  rows_computed            rows computed over the decode steps (dense: every row each step)
  useful                   tokens made by decode steps (model tokens but each turn's first,
                           which its prefill or observation makes) / rows computed
  rows_identical           the share of rows both engines gave the same tokens
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.config import cli  # noqa: E402
from jaxrl4llm.sampling.turns import TurnReply  # noqa: E402

ENGINES = {"dense": None, "paged": 0}  # kv_cache_tokens: None dense rows, 0 a rich pool


class ToolAfter:
    """A TurnHandler whose tool answers each turn after `latency` seconds with
    `observation`; the `max_turns`-th reply ends the trajectory."""

    def __init__(
        self,
        stop: Sequence[int],
        observation: Sequence[int],
        latency: float,
        max_turns: int,
        spread: float = 0.0,
    ):
        self.stop, self.observation = tuple(stop), tuple(observation)
        self.latency, self.max_turns, self.spread = latency, max_turns, spread
        self.turns: dict[int, int] = {}
        self.ready: list[TurnReply] = []
        self.lock = threading.Lock()

    def stop_sequences(self, row: int) -> Sequence[Sequence[int]]:
        return (self.stop,)

    def submit(self, row: int, turn_ids: Sequence[int], ended_by: str) -> None:
        turn = self.turns[row] = self.turns.get(row, 0) + 1
        reply = TurnReply(row, self.observation, done=turn >= self.max_turns, tool_call=True)
        # latency x (1 + spread x u), u uniform in [-1, 1) and fixed per (row, turn).
        u = np.random.default_rng((row, turn)).uniform(-1, 1)
        timer = threading.Timer(self.latency * (1 + self.spread * u), self._answer, (reply,))
        timer.daemon = True
        timer.start()

    def _answer(self, reply: TurnReply) -> None:
        with self.lock:
            self.ready.append(reply)

    def poll(self, timeout_s: float) -> list[TurnReply]:
        deadline = time.perf_counter() + timeout_s
        while True:
            with self.lock:
                out, self.ready = self.ready, []
            if out or time.perf_counter() >= deadline:
                return out
            time.sleep(0.002)


def rollout(model: tuple, prompts: list, engine: str, settings: dict) -> tuple[Any, Any, float]:
    """One multi-turn rollout of `prompts` by `engine`: (output, turn stats, seconds)."""
    from jaxrl4llm.sampling import multiturn
    from jaxrl4llm.sampling.strategies import SamplingConfig
    from jaxrl4llm.sampling.turns import TurnLimits

    config, params = model
    handler = ToolAfter(
        settings["stop"], settings["observation"], settings["latency"], settings["max_turns"],
        settings.get("spread", 0.0),
    )  # fmt: skip
    limits = TurnLimits(
        max_turns=settings["max_turns"], max_observation_tokens=len(settings["observation"])
    )
    t0 = time.perf_counter()
    out, stats = multiturn.generate_turns(
        params, config, prompts, SamplingConfig(temperature=1.0), settings["budget"],
        jax.random.key(1), handler, limits, stop_ids=settings["eos"], n=settings["group"],
        kv_cache_tokens=ENGINES[engine],
    )  # fmt: skip
    return out, stats, time.perf_counter() - t0


def fastest(
    names: Sequence[str], once: Callable[[str], tuple], repeats: int
) -> tuple[dict[str, float], dict[str, tuple]]:
    """Each name's run `once(name)` (its results, then its seconds) compiled first, then
    timed `repeats` times interleaved: (the fastest seconds, the last results) per name."""
    for name in names:
        once(name)  # compiles
    seconds: dict[str, float] = {}
    runs: dict[str, tuple] = {}
    for _ in range(repeats):
        for name in names:
            *results, t = once(name)
            runs[name] = tuple(results)
            seconds[name] = min(t, seconds.get(name, np.inf))
    return seconds, runs


def compare(model: tuple, prompts: list, settings: dict, repeats: int) -> dict[str, Any]:
    """The engines' best times, rows computed and useful shares (module docstring)."""
    once = lambda engine: rollout(model, prompts, engine, settings)  # noqa: E731
    seconds, runs = fastest(list(ENGINES), once, repeats)
    report: dict[str, Any] = {"turns_time_ratio_paged": seconds["paged"] / seconds["dense"]}
    for engine, (out, stats) in runs.items():
        computed = int(out.slot_steps)
        decoded = int(np.asarray(out.mask_BT).sum()) - int(stats.turns_B.sum())
        report[f"{engine}_s"] = seconds[engine]
        report[f"{engine}_rows_computed"] = computed
        report[f"{engine}_useful"] = decoded / max(computed, 1)
    a, b = (np.asarray(runs[e][0].tokens_BT) for e in ENGINES)
    report["rows_identical"] = float(np.mean(np.all(a == b, axis=1)))
    report["turns_mean"] = float(np.mean(runs["paged"][1].turns_B))
    return report


def smollm2(layers: int) -> tuple[Any, Any, Any]:
    """(config, params, tokenizer) of SmolLM2-135M cut to its first `layers` layers."""
    from jaxrl4llm.models import registry

    config, params, tokenizer = registry.load_model("smollm2-135m-instruct")
    assert tokenizer is not None  # the embedded model ships its tokenizer
    config = dataclasses.replace(config, num_layers=layers)
    params = {**params, "layers": jax.tree.map(lambda w: w[:layers], params["layers"])}
    return config, params, tokenizer


def run(layers: int, prompts: int, settings: dict, repeats: int) -> dict[str, Any]:
    """The comparison on SmolLM2-135M cut to its first `layers` layers (printed)."""
    from jaxrl4llm.data import make_source
    from jaxrl4llm.data.config import DataConfig
    from jaxrl4llm.sampling.frontend import Sampler

    config, params, tokenizer = smollm2(layers)
    source = make_source("synthetic:arithmetic", split="train")
    data = DataConfig(source="synthetic:arithmetic")
    sampler = Sampler(config, tokenizer)
    encoded = sampler.encode([data.messages(source[i]) for i in range(prompts)])
    settings = dict(
        settings,
        stop=tokenizer.encode(".", add_special_tokens=False),
        observation=tokenizer.encode(" The tool returned 42.\n", add_special_tokens=False),
        eos=sampler.stop_ids,
    )
    print(f"multi-turn engines: SmolLM2-135M, {layers} layers, device {jax.devices()[0].platform}")
    report = compare((config, params), encoded, settings, repeats)
    print_report(report)
    return report


def print_report(report: dict[str, Any]) -> None:
    print(
        " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in report.items())
    )


def parser_with_model_flags(doc: str) -> Any:
    """A bench's parser with the model's and the batch's flags (--layers, --prompts, --group,
    --budget)."""
    parser = cli.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--budget", type=int, default=128, help="completion tokens per row")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = parser_with_model_flags(__doc__)
    parser.add_argument("--max_turns", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per tool reply")
    parser.add_argument(
        "--spread", type=float, default=0.0, help="each reply takes latency x (1 + spread x u)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    settings = {k: getattr(args, k) for k in ("group", "budget", "max_turns", "latency", "spread")}
    run(args.layers, args.prompts, settings, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
