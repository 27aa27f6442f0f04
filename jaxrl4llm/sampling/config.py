"""RolloutConfig: how prompts are sampled (P prompts, G samples of each, lengths, the sampling
strategy, the row layout); the `rollout` group of the training config, read by the sampling
context of the trainer and the evaluator."""

from __future__ import annotations

import dataclasses

from jaxrl4llm.config.options import group, require
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turns import TurnLimits

# --rollout_engine's values: the trainer's one engine (RolloutConfig.rollout_engine).
ROLLOUT_ENGINES = ("paged",)


# The algorithm presets whose recipe samples dynamically (DAPO, arXiv:2503.14476 §3.2).
DYNAMIC_SAMPLING_PRESETS = frozenset({"dapo"})


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling: a rollout knob that --algorithm=dapo turns on (the group follows
    the --algorithm preset; these flags override it).

    dynamic_sampling: Resample (next prompts) until the batch holds prompts_per_step groups
        with both correct and wrong samples (DAPO; on with --algorithm=dapo).
    max_resample_rounds: Cap on dynamic sampling's extra rollout rounds per step; a batch
        still short is filled with groups without spread (kept out of the loss by
        --reject_all_correct / --reject_all_wrong).
    """

    dynamic_sampling: bool = False
    max_resample_rounds: int = 10

    def __post_init__(self):
        require(
            isinstance(self.max_resample_rounds, int) and self.max_resample_rounds >= 0,
            f"--max_resample_rounds={self.max_resample_rounds!r} must be an int >= 0 "
            "(extra rounds per step).",
        )

    @classmethod
    def for_preset(cls, algorithm: str) -> "DynamicSampling":
        """The values --algorithm=`algorithm` sets."""
        return cls(dynamic_sampling=algorithm in DYNAMIC_SAMPLING_PRESETS)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How a step samples: P prompts, G samples of each.

    prompts_per_step: Prompts per step P, global (all hosts).
    group_size: Samples per prompt G; a step's batch is B = P * G rows, a group G contiguous
        rows.
    max_prompt_tokens: Longest prompt in tokens.
    max_new_tokens: Longest completion in tokens.
    long_prompts: Prompts over --max_prompt_tokens: stop with an error, or drop and count them.
    share_prompts: Run each group's prompt once (sampler prefill; reference, old-policy and
        update passes): the same result with less compute and memory.
    rollout_micro_batch: Rows decoding at once in the rollout (the page pool holds them at
        full length unless --kv_cache_tokens says otherwise), and rows per reference /
        old-logprob pass, run one after another (0 = all rows at once); bounds the KV cache
        and activation memory.
    partial_rollout_tokens: Partial rollouts: sample in rounds of at most this many new tokens
        per row until P groups have finished; unfinished rows carry over to the next step
        with their tokens and logprobs (0 = off; see train/rollout/partial.py).
    max_staleness: With --partial_rollout_tokens: steps a group may wait in the carried buffer
        before it is dropped (and counted).
    rollout_engine: The rollout engine, one for every rollout kind: paged (a pool of KV
        pages: rows hold only the pages their tokens fill, a group's prompt pages are
        shared, and queued groups start as pages free; see sampling/paged.py and
        docs/architecture.md). The only value; the flag stays so that flagfiles naming it
        parse. The fixed-batch compacted sampler (sampling/decode.py) is the tests'
        exactness reference, not a trainer engine.
    kv_cache_tokens: Tokens of KV the rollout's page pool holds (0 = as many rows as decode
        at once at full length, so none is ever preempted: every row of a call, or
        --rollout_micro_batch rows; per batch shard on a mesh).
    decode_slots: Deprecated alias: S > 0 means
        --kv_cache_tokens=S*(max_prompt_tokens+max_new_tokens), the KV S fixed slots held.
    dynamic: DAPO's dynamic sampling (follows the --algorithm preset).
    turns: Multi-turn rollouts (with an environment): turns and token budgets per trajectory.
    env: Environment that answers the model's turns, NAME?key=value&... (verifier,
        calculator, python, guess; see docs/environments.md); empty: single-turn rollouts
        scored by the reward function.
    """

    prompts_per_step: int = 8
    group_size: int = 4
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    sampling: SamplingConfig = group(SamplingConfig)
    long_prompts: str = "error"
    share_prompts: bool = True
    rollout_micro_batch: int = 0
    partial_rollout_tokens: int = 0
    max_staleness: int = 2
    rollout_engine: str = "paged"
    kv_cache_tokens: int = 0
    decode_slots: int = 0
    dynamic: DynamicSampling = group(
        DynamicSampling, preset=DynamicSampling.for_preset, preset_from="algorithm"
    )
    turns: TurnLimits = group(TurnLimits)
    env: str = ""

    @property
    def pool_tokens(self) -> int:
        """The page pool in tokens (0: the rows decoding at once at full length);
        --kv_cache_tokens, else the KV of --decode_slots's slots."""
        if self.decode_slots > 0 and not self.kv_cache_tokens:
            return self.decode_slots * (self.max_prompt_tokens + self.max_new_tokens)
        return self.kv_cache_tokens

    @property
    def layout(self) -> RowLayout:
        """How a rollout batch's rows are laid out (see sampling.layout)."""
        return RowLayout(self.group_size, self.share_prompts)
