"""Guess the number (data: synthetic:guess): one guess per turn, "higher" / "lower" after each.

Rewards over turns: each wrong or unreadable guess costs `turn_cost`, the right one earns 1
and ends the game, so a game won at the k-th guess sums to 1 - (k - 1) * turn_cost and a
lost one to -(guesses) * turn_cost.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxrl4llm.envs.base import Environment, StepResult
from jaxrl4llm.rewards.base import record_answer

_GUESS = re.compile(r"<guess>\s*([-+]?\d{1,12})\s*</guess>\s*$")


@dataclasses.dataclass(frozen=True)
class GuessOptions:
    turn_cost: float = 0.1  # reward of each wrong or unreadable guess (subtracted)

    def __post_init__(self):
        if not 0 <= self.turn_cost <= 1:
            raise ValueError(f"turn_cost must be in [0, 1], got {self.turn_cost}")


class GuessEnvironment(Environment):
    Options = GuessOptions
    stop_strings = ("</guess>",)
    observation_role = "user"

    def reset(self, record: Any) -> str | None:
        self.secret = int(record_answer(record))
        return None

    def step(self, turn_text: str) -> StepResult:
        found = _GUESS.search(turn_text)
        cost = -self.options.turn_cost
        if found is None:
            return StepResult("Write your guess as <guess>N</guess>.", cost, status="error")
        guess = int(found.group(1))
        if guess == self.secret:
            return StepResult("Correct!", 1.0, done=True)
        return StepResult("Higher." if guess < self.secret else "Lower.", cost)
