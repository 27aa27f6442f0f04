"""Countdown: reach a target from given numbers with + - * /, each number at most once.

Every puzzle is built from a random expression over all its numbers, so it has a solution
(stored as the record's answer); the verifier accepts any other valid expression too.
"""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction
from typing import Any

from jaxrl4llm.data.records import DataError

_MAX_TRIES = 1000
# The answer format, as the record's instruction (used instead of the default one).
INSTRUCTION = (
    "Think step by step, then give the expression (not its value) as the final "
    "answer within \\boxed{}, e.g. \\boxed{(1 + 2) * 3}."
)


@dataclasses.dataclass(frozen=True)
class CountdownTaskConfig:
    num_numbers: int = 4  # how many numbers are given (2..6)
    max_number: int = 99  # numbers are uniform in [1, max_number]
    min_target: int = 1
    max_target: int = 100

    def __post_init__(self):
        if not 2 <= self.num_numbers <= 6:
            raise DataError(f"countdown num_numbers must be in 2..6, got {self.num_numbers}")
        if self.max_number < 1 or not 0 <= self.min_target <= self.max_target:
            raise DataError(
                "countdown needs max_number >= 1 and 0 <= min_target <= max_target, "
                f"got {self.max_number}, {self.min_target}, {self.max_target}"
            )


def _random_solution(numbers: list[int], rng: random.Random) -> tuple[str, Fraction]:
    """Combines all numbers pairwise in random order and with random ops (exact division only)."""
    items = [(str(n), Fraction(n)) for n in numbers]
    while len(items) > 1:
        (text_a, a), (text_b, b) = (
            items.pop(rng.randrange(len(items))),
            items.pop(rng.randrange(len(items))),
        )
        op = rng.choice("+-*/")
        if op == "/" and (b == 0 or (a / b).denominator != 1):
            op = "+"
        if op == "-" and a < b:  # keep intermediate values non-negative, as in the game
            (text_a, a), (text_b, b) = (text_b, b), (text_a, a)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if op == "/" else Fraction(0)}[op]
        items.append((f"({text_a} {op} {text_b})", value))
    text, value = items[0]
    return text[1:-1], value


def generate(config: CountdownTaskConfig, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    for _ in range(_MAX_TRIES):
        numbers = [rng.randint(1, config.max_number) for _ in range(config.num_numbers)]
        solution, value = _random_solution(numbers, rng)
        if value.denominator == 1 and config.min_target <= value <= config.max_target:
            target = int(value)
            question = (
                f"Using the numbers {numbers}, create an equation that equals {target}. "
                "You can use basic arithmetic operations (+, -, *, /) and each number "
                "can only be used once."
            )
            return (
                question,
                solution,
                {"numbers": numbers, "target": target, "instruction": INSTRUCTION},
            )
    raise DataError(
        f"countdown: no target in [{config.min_target}, {config.max_target}] after "
        f"{_MAX_TRIES} tries with {config}; widen the target range"
    )
