"""Reward shaping: {0,1} or {-1,1} scale, a format penalty, DAPO's soft overlong punishment,
and Logic-RL's format + answer reward."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxrl4llm.rewards.base import FAILED_REASONS, Verdict

SCALES = ("01", "pm1", "logic_rl")
# Logic-RL's answer score (verl/utils/reward_score/kk.py `compute_score` in Unakar/Logic-RL):
# +2 a full match, -1.5 a mismatch, -2 when the answer is missing or cannot be parsed (or the
# format is wrong); the format score is +1 / -1 on top.
LOGIC_RL_ANSWER = {"correct": 2.0, "wrong": -1.5}
LOGIC_RL_UNPARSED = -2.0


@dataclasses.dataclass(frozen=True)
class ShapingConfig:
    scale: str = "01"  # "01": 1 / 0; "pm1": 1 / -1; "logic_rl": format + answer
    format_penalty: float = 0.0  # subtracted when the completion has no final answer
    max_new_tokens: int | None = None  # DAPO overlong: L_max
    overlong_buffer: int = 0  # DAPO overlong: L_buffer (0 = off)
    overlong_penalty: float = 1.0  # DAPO overlong: penalty at (and past) L_max

    def __post_init__(self):
        if self.scale not in SCALES:
            raise ValueError(f"unknown reward scale {self.scale!r}; valid: {', '.join(SCALES)}")
        if self.scale == "logic_rl" and self.format_penalty:
            raise ValueError(
                "format_penalty does not apply to scale logic_rl, which has its own "
                "format reward; leave format_penalty at 0"
            )
        if self.format_penalty < 0:
            raise ValueError(
                f"format_penalty must be >= 0 (it is subtracted), got {self.format_penalty}"
            )
        if self.overlong_buffer < 0:
            raise ValueError(f"overlong_buffer must be >= 0, got {self.overlong_buffer}")
        if self.overlong_buffer > 0:
            if self.max_new_tokens is None or self.overlong_buffer > self.max_new_tokens:
                raise ValueError(
                    "overlong_buffer > 0 needs max_new_tokens >= overlong_buffer, got "
                    f"max_new_tokens={self.max_new_tokens}, "
                    f"overlong_buffer={self.overlong_buffer}"
                )


def overlong_penalty(lengths: np.ndarray, config: ShapingConfig) -> np.ndarray:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13), as a non-positive float32 [B].

    0 while length <= L_max - L_buffer, then linear down to -penalty at L_max, -penalty beyond.
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    if config.overlong_buffer == 0:
        return np.zeros(lengths.shape, np.float32)
    assert config.max_new_tokens is not None  # __post_init__: overlong_buffer > 0 needs it
    start = config.max_new_tokens - config.overlong_buffer
    frac = np.clip((lengths - start) / config.overlong_buffer, 0.0, 1.0)
    return (-config.overlong_penalty * frac).astype(np.float32)


def logic_rl_rewards(verdicts: Sequence[Verdict], formatted: Sequence[bool]) -> np.ndarray:
    """Logic-RL's total score: format (+1 / -1) + answer (+2 / -1.5 / -2, -2 if bad format)."""
    return np.array(
        [
            (1.0 if ok else -1.0)
            + (LOGIC_RL_ANSWER.get(v.reason, LOGIC_RL_UNPARSED) if ok else LOGIC_RL_UNPARSED)
            for v, ok in zip(verdicts, formatted)
        ],
        dtype=np.float32,
    )


def shape(
    verdicts: Sequence[Verdict],
    config: ShapingConfig,
    lengths: Sequence[int] | np.ndarray | None = None,
    formatted: Sequence[bool] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(rewards float32 [B], correct bool [B]) from verdicts; `lengths` are completion tokens.
    Scale logic_rl needs `formatted` (rewards.formats.think_answer_format per completion) and
    counts an answer as correct only when the format is right, as Logic-RL's reward does.

    A row whose verification did not finish (FAILED_REASONS) is not scored: reward 0, whatever
    the scale and penalties (training masks it out; RewardBatch.failed).
    """
    correct = np.array([v.correct for v in verdicts], dtype=bool)
    if config.scale == "logic_rl":
        if formatted is None or len(formatted) != len(verdicts):
            raise ValueError("scale logic_rl needs one format check per completion (formatted)")
        rewards = logic_rl_rewards(verdicts, formatted)
        correct = correct & np.asarray(formatted, dtype=bool)
    else:
        low = 0.0 if config.scale == "01" else -1.0
        # Partial credit (a verdict's score, e.g. the fraction of code tests passed) maps
        # linearly onto [low, 1]; a verdict without one scores 1 when correct, else 0.
        score = np.array(
            [float(v.correct) if v.score is None else v.score for v in verdicts], dtype=np.float64
        )
        rewards = (low + (1.0 - low) * score).astype(np.float32)
    if config.format_penalty:
        no_answer = np.array([v.reason == "no_answer" for v in verdicts], dtype=bool)
        rewards = rewards - np.float32(config.format_penalty) * no_answer
    if config.overlong_buffer:
        if lengths is None:
            raise ValueError(
                "overlong_buffer > 0 needs the completion lengths in tokens: pass "
                "lengths=... to the reward function"
            )
        if len(lengths) != len(verdicts):
            raise ValueError(f"got {len(lengths)} lengths for {len(verdicts)} completions")
        rewards = rewards + overlong_penalty(np.asarray(lengths), config)
    failed = np.array([v.reason in FAILED_REASONS for v in verdicts], dtype=bool)
    return np.where(failed, 0.0, rewards).astype(np.float32), correct
