"""Guess the number: a hidden integer in [low, high], found over several turns with feedback.

The multi-turn task of `--env=guess` (envs/guess.py answers each guess "higher" or "lower").
The question names a game number so that games hash into the train and test splits (the
secret itself is never in the prompt).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from jaxrl4llm.data.records import DataError

INSTRUCTION = (
    "Find it: write one guess per turn as <guess>N</guess>; after each guess I tell you "
    "whether my number is higher or lower."
)


@dataclasses.dataclass(frozen=True)
class GuessTaskConfig:
    low: int = 1  # the secret is uniform in [low, high]
    high: int = 100

    def __post_init__(self):
        if not self.low < self.high:
            raise DataError(f"guess needs low < high, got low={self.low}, high={self.high}")


def generate(config: GuessTaskConfig, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    game = rng.randrange(10**9)
    secret = rng.randint(config.low, config.high)
    question = f"Game {game}: I am thinking of an integer from {config.low} to {config.high}."
    metadata = {"low": config.low, "high": config.high, "instruction": INSTRUCTION}
    return question, str(secret), metadata
