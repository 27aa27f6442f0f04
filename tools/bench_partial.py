"""What partial rollouts (train/rollout/partial.py) ask of the sampler, against a step without
them: tokens decoded and thrown away, and prompt tokens prefilled.

    python tools/bench_partial.py                      # both length mixes, 10 steps each
    python tools/bench_partial.py --mix=tail10 --budget=300 --steps=20

Runs partial.sample_and_score, the trainer's own rounds, step after step, on a sampler whose
completion lengths are forced (tools/bench_rollout.py's --length_mix: each row's length is
drawn when its group starts; no model runs). The sampler does what the real one would do
with the calls it gets: a row decodes from the end of its prefix until its length or its row
cap, a call prefills each prompt once per group when rows run as groups with shared prompts
and each row's prompt + prefix otherwise. Printed per mix (means over the steps):
  redecoded_share     tokens decoded that no group keeps / tokens decoded (a finished row
                      decoded again, tokens past --max_new_tokens)
  decoded_per_step    tokens decoded, against the step's trained tokens (normal_decoded)
  prefilled_per_round prompt tokens prefilled per round, and per step, against a normal
                      step's (P prompts, each once: normal_prefilled)
  kept_prefilled_per_round / _per_step
                      the same with the paged engine on one host, whose rows keep their
                      KV pages over a step's rounds (train/rollout/partial_pool.py): each
                      started group's prompt once, each unfinished row carried into the
                      step its prompt + completion but the last token, nothing else (what
                      tests/train/test_partial_pool.py shows that engine prefills)
  rounds              sampler rounds per step
  dropped_rows        rows of groups dropped for --max_staleness, per step
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.rewards.base import RewardBatch  # noqa: E402
from jaxrl4llm.sampling.sample_output import SampleOutput  # noqa: E402
from jaxrl4llm.train.config import RolloutConfig  # noqa: E402
from jaxrl4llm.train.rollout import partial  # noqa: E402
from tools.bench_rollout import mix_caps  # noqa: E402

GROUP_TOKEN = 1000  # a prompt's first token: GROUP_TOKEN + its group's number
ROW_TOKEN = 100  # every token of row j's completion: ROW_TOKEN + j


class ForcedLengthSampler:
    """Rows of group k end at lengths_of(k)[j] tokens (with a stop token below
    max_new_tokens); counts what each call decodes and prefills."""

    pad_id, mesh = 0, None
    model_config = types.SimpleNamespace(vocab_size=1 << 20)

    def __init__(self, lengths_of: Any, max_new_tokens: int):
        self.lengths_of, self.max_new_tokens = lengths_of, max_new_tokens
        self.decoded = self.prefilled = self.useful = 0
        self.progress: dict[tuple[int, int], int] = {}  # (group, row): tokens decoded once

    def _decode(self, k: int, j: int, start: int, cap: int) -> tuple[int, bool]:
        """Row j of group k decoding from `start` within `cap`: (tokens, stopped). A row
        forced to max_new_tokens has not stopped there and would go on (as a real row)."""
        T, length = self.max_new_tokens, int(self.lengths_of(k)[j])
        n = min(cap, length - start) if length < T else cap
        done = self.progress.get((k, j), 0)
        self.useful += max(0, min(start + n, T) - max(done, start))
        self.progress[(k, j)] = max(done, min(start + n, T))
        return n, length < T and start + n == length

    def generate(
        self,
        params: Any,
        prompts: Sequence[Sequence[int]],
        sampling: Any,
        budget: int,
        key: jax.Array,
        *,
        group_size: int = 1,
        share_prompts: bool = True,
        row_keys: Any = None,
        prefixes: Sequence[Sequence[int]] | None = None,
        row_caps: Sequence[int] | None = None,
    ) -> SampleOutput:
        rows = [(p, j) for p in prompts for j in range(group_size)]
        prefixes = prefixes or [()] * len(rows)
        caps = list(row_caps) if row_caps is not None else [budget] * len(rows)
        B = len(rows)
        tokens, lengths, stopped = np.zeros((B, budget), np.int32), np.zeros(B, np.int32), []
        for r, ((prompt, j), prefix, cap) in enumerate(zip(rows, prefixes, caps)):
            if cap == 0:
                stopped.append(True)
                continue
            j = j if not prefix else prefix[0] - ROW_TOKEN
            n, stop = self._decode(prompt[0] - GROUP_TOKEN, j, len(prefix), cap)
            lengths[r], tokens[r, :n] = n, ROW_TOKEN + j
            stopped.append(stop)
            shared = group_size > 1 and share_prompts
            if not (shared and j > 0):  # a shared prompt is prefilled once
                self.prefilled += len(prompt) + (0 if shared else len(prefix))
        self.decoded += int(lengths.sum())
        fields: tuple[Any, ...] = (
            tokens, np.zeros((B, budget), np.float32), np.arange(budget) < lengths[:, None],
            lengths, ~np.array(stopped), np.zeros((B, 1), np.int32), np.ones((B, 1), bool),
            np.zeros(B, bool), np.int32(lengths.max(initial=0)), np.int32(0),
        )  # fmt: skip
        return SampleOutput(*fields)  # host numpy, as read back

    def encode(self, messages: Sequence[Any]) -> list[list[int]]:
        return list(messages)

    def decode(self, out: SampleOutput, num_rows: int) -> list[str]:
        return [""] * num_rows


def _no_reward(texts: Sequence[str], records: Sequence[Any], lengths: Any) -> RewardBatch:
    n = len(texts)
    return RewardBatch(np.zeros(n, np.float32), np.zeros(n, bool), ["wrong"] * n)


def _carried_prefill(carried: partial.Carried, prompt_tokens: int) -> int:
    """What the paged engine prefills of the rows carried into a step (their KV is the
    previous policy's): each unfinished row's prompt and completion but its last token."""
    return sum(
        prompt_tokens + int(n) - 1
        for g in carried.groups
        for n, done in zip(g.lengths_G, g.done_G)
        if not done
    )


def run_mix(mix: str, args: argparse.Namespace) -> dict[str, float]:
    """The means over --steps steps of one mix (module docstring)."""
    P, G = args.prompts, args.group
    T = mix_caps(mix, 1, 0)[1]
    budget = args.budget or T // 4
    rng, drawn = np.random.default_rng(args.seed), {}

    def lengths_of(k: int) -> np.ndarray:
        if k not in drawn:
            drawn[k] = np.minimum(mix_caps(mix, G, int(rng.integers(1 << 31)))[0], T)
        return drawn[k]

    rollout = RolloutConfig(
        prompts_per_step=P, group_size=G, max_new_tokens=T,
        max_prompt_tokens=args.prompt_tokens, partial_rollout_tokens=budget,
        max_staleness=args.max_staleness,
    )  # fmt: skip
    sampler = ForcedLengthSampler(lengths_of, T)
    ctx: Any = types.SimpleNamespace(  # what sample_and_score reads of a RolloutContext
        rollout=rollout,
        sampler=sampler,
        reward_fn=types.SimpleNamespace(score=_no_reward),
        data=types.SimpleNamespace(messages=lambda k: [GROUP_TOKEN + k] * args.prompt_tokens),
    )
    counter = iter(range(1 << 30))
    more = lambda: [next(counter) for _ in range(P)]  # noqa: E731
    carried, rounds, trained, dropped, kept = partial.Carried(), 0.0, 0, 0.0, 0
    for step in range(args.steps):
        kept += _carried_prefill(carried, args.prompt_tokens)
        rows, carried, m = partial.sample_and_score(
            ctx, None, carried, more(), jax.random.key(step), more
        )
        kept += int(m["partial/new_groups"].value) * args.prompt_tokens
        rounds += m["partial/rounds"].value
        trained += int(np.sum(rows.samples.out.lengths_B))
        dropped += m["partial/dropped_rows"].value
    steps, decoded, prefilled = args.steps, sampler.decoded, sampler.prefilled
    return {
        "max_new_tokens": T,
        "budget": budget,
        "redecoded_share": 1 - sampler.useful / decoded,
        "decoded_per_step": decoded / steps,
        "normal_decoded": trained / steps,
        "prefilled_per_round": prefilled / rounds,
        "prefilled_per_step": prefilled / steps,
        "kept_prefilled_per_round": kept / rounds,
        "kept_prefilled_per_step": kept / steps,
        "normal_prefilled": P * args.prompt_tokens,
        "rounds": rounds / steps,
        "dropped_rows_per_step": dropped / steps,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mix", choices=("step0", "tail10", "both"), default="both")
    parser.add_argument("--prompts", type=int, default=32, help="P groups per step")
    parser.add_argument("--group", type=int, default=4, help="G rows per group")
    parser.add_argument("--prompt_tokens", type=int, default=128)
    parser.add_argument(
        "--budget", type=int, default=0, help="--partial_rollout_tokens (0: a quarter of T)"
    )
    parser.add_argument("--max_staleness", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for mix in ("step0", "tail10") if args.mix == "both" else (args.mix,):
        figures = run_mix(mix, args)
        print(f"mix={mix} " + " ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
