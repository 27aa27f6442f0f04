"""Verifiable rewards: math (math-verify in a process pool), countdown, knights and knaves,
reasoning-gym tasks (their own scorers, in the same pool), Logic-RL's format reward.

    reward_fn = make_reward_fn("auto", scale="pm1", format_penalty=0.5)
    batch = reward_fn.score(completions, records, lengths=completion_lengths)
    batch.rewards  # float32 [B]; batch.correct: bool [B]; batch.metrics(): counts per reason
    batch.failed   # bool [B]: verification timed out / crashed: not a score, mask these rows
    reward_fn.close()
"""

from jaxrl4llm.rewards.base import (
    FAILED_REASONS,
    REASONS,
    Job,
    RewardBatch,
    Verdict,
    Verifier,
    run_plan,
)
from jaxrl4llm.rewards.countdown import CountdownConfig, CountdownVerifier
from jaxrl4llm.rewards.extract import extract_answer_tag, extract_boxed, extract_last_number
from jaxrl4llm.rewards.formats import think_answer_format
from jaxrl4llm.rewards.gym import GymVerifier
from jaxrl4llm.rewards.knights_knaves import KnightsKnavesVerifier, parse_claims
from jaxrl4llm.rewards.math_verifier import MathConfig, MathVerifier
from jaxrl4llm.rewards.pool import JobResult, PoolConfig, VerifierPool
from jaxrl4llm.rewards.registry import KINDS, TASK_VERIFIERS, RewardConfig, RewardFn, make_reward_fn
from jaxrl4llm.rewards.shaping import ShapingConfig, overlong_penalty, shape

__all__ = [
    "FAILED_REASONS",
    "REASONS",
    "Job",
    "RewardBatch",
    "Verdict",
    "Verifier",
    "run_plan",
    "CountdownConfig",
    "CountdownVerifier",
    "extract_answer_tag",
    "extract_boxed",
    "extract_last_number",
    "think_answer_format",
    "GymVerifier",
    "KnightsKnavesVerifier",
    "parse_claims",
    "MathConfig",
    "MathVerifier",
    "JobResult",
    "PoolConfig",
    "VerifierPool",
    "KINDS",
    "TASK_VERIFIERS",
    "RewardConfig",
    "RewardFn",
    "make_reward_fn",
    "ShapingConfig",
    "overlong_penalty",
    "shape",
]
