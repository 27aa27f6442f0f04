"""Arithmetic: "What is 37 + 5?" with an integer answer; the embedded default task.

hard_fraction > 0 mixes in nearly unsolvable problems: that fraction of the examples (drawn
per example, so deterministic per index) is the product of two hard_digits-digit numbers,
marked metadata["hard"]. A small model then keeps meeting groups whose samples are all wrong
throughout training (the Minimalist paper's Figure 4 mechanism: experiments/studies/).
"""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction
from typing import Any

from jaxrl4llm.data.records import DataError

OPERATORS = "+-*/"


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    digits: int = 2  # operands are uniform in [0, 10**digits)
    num_operands: int = 2
    ops: str = "+-"  # any of + - * / ; '/' only where the result is an integer
    allow_negative: bool = False  # False: redraw when the answer is negative (easier)
    hard_fraction: float = 0.0  # this fraction of examples: hard_digits x hard_digits products
    hard_digits: int = 3

    def __post_init__(self):
        if not 1 <= self.digits <= 9:
            raise DataError(f"arithmetic digits must be in 1..9, got {self.digits}")
        if not 2 <= self.num_operands <= 8:
            raise DataError(f"arithmetic num_operands must be in 2..8, got {self.num_operands}")
        if not self.ops or set(self.ops) - set(OPERATORS):
            raise DataError(
                f"arithmetic ops must be a non-empty string of {OPERATORS!r}, "
                f"got {self.ops!r} (e.g. ops=+-*)"
            )
        if not 0.0 <= self.hard_fraction <= 1.0:
            raise DataError(f"arithmetic hard_fraction must be in [0, 1], got {self.hard_fraction}")
        if not 2 <= self.hard_digits <= 9:
            raise DataError(f"arithmetic hard_digits must be in 2..9, got {self.hard_digits}")


def evaluate(operands: list[int], operators: list[str]) -> Fraction:
    """Exact value with the usual precedence (* and / before + and -), left to right."""
    terms, signs = [Fraction(operands[0])], []
    for op, value in zip(operators, operands[1:]):
        if op in "*/":
            terms[-1] = terms[-1] * value if op == "*" else terms[-1] / value
        else:
            signs.append(op)
            terms.append(Fraction(value))
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total


def generate(config: ArithmeticConfig, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    # The draw only when mixing, so a plain config's examples stay what they were.
    if config.hard_fraction > 0:
        if rng.random() < config.hard_fraction:
            low, high = 10 ** (config.hard_digits - 1), 10**config.hard_digits - 1
            a, b = rng.randint(low, high), rng.randint(low, high)
            return f"What is {a} * {b}?", str(a * b), {"expression": f"{a} * {b}", "hard": True}
        question, answer, meta = _generate_easy(config, rng)
        return question, answer, {**meta, "hard": False}
    return _generate_easy(config, rng)


def _generate_easy(config: ArithmeticConfig, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    high = 10**config.digits - 1
    while True:
        operands = [rng.randint(0, high) for _ in range(config.num_operands)]
        operators = [rng.choice(config.ops) for _ in range(config.num_operands - 1)]
        if any(op == "/" and value == 0 for op, value in zip(operators, operands[1:])):
            continue
        value = evaluate(operands, operators)
        if value.denominator != 1 or (value < 0 and not config.allow_negative):
            continue
        expression = " ".join(
            [str(operands[0])] + [f"{op} {v}" for op, v in zip(operators, operands[1:])]
        )
        return f"What is {expression}?", str(value.numerator), {"expression": expression}
