"""Easy code problems, generated: "read an integer n and print n * 3 + 4", with stdin/stdout tests.

The offline code task (`--data=synthetic:code?kinds=linear,sum&cases=3`): each problem is one of
KINDS with constants drawn per problem, its tests are `cases` inputs drawn per problem with
the outputs computed here, and its answer is a reference program (the verifier runs the
tests, rewards/code.py; the reference is for reading and supervised warm-up). Small enough
for the embedded model to learn from: one line of input, one line of output.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Callable

from jaxrl4llm.data.code_sets import CODE_INSTRUCTION
from jaxrl4llm.data.records import DataError

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _ints(rng: random.Random, count: int, high: int) -> list[int]:
    return [rng.randint(-high, high) for _ in range(count)]


def _word(rng: random.Random, letters: str = LETTERS) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))


# kind -> (config, rng) -> (question, reference program, input drawer, solver)
def _linear(config, rng):
    k, c = rng.randint(2, config.max_constant), rng.randint(1, config.max_constant)
    return (
        f"Read an integer n from standard input and print n * {k} + {c}.",
        f"n = int(input())\nprint(n * {k} + {c})\n",
        lambda r: f"{r.randint(-config.max_value, config.max_value)}\n",
        lambda text: str(int(text) * k + c),
    )


def _sum(config, rng):
    c = rng.randint(0, config.max_constant)
    return (
        f"Read two integers a and b, separated by a space, from standard input and print "
        f"a + b + {c}.",
        f"a, b = map(int, input().split())\nprint(a + b + {c})\n",
        lambda r: " ".join(map(str, _ints(r, 2, config.max_value))) + "\n",
        lambda text: str(sum(map(int, text.split())) + c),
    )


def _max_times(config, rng):
    k = rng.randint(2, config.max_constant)
    return (
        f"Read a line of space-separated integers from standard input and print the largest "
        f"of them multiplied by {k}.",
        f"values = list(map(int, input().split()))\nprint(max(values) * {k})\n",
        lambda r: " ".join(map(str, _ints(r, r.randint(2, 6), config.max_value))) + "\n",
        lambda text: str(max(map(int, text.split())) * k),
    )


def _count_letter(config, rng):
    letter = rng.choice(LETTERS[:8])
    return (
        f"Read one line of lowercase letters from standard input and print how many times "
        f"the letter '{letter}' appears in it.",
        f"print(input().count({letter!r}))\n",
        lambda r: _word(r, LETTERS[:8]) + _word(r, LETTERS[:8]) + "\n",
        lambda text: str(text.count(letter)),
    )


def _repeat(config, rng):
    k = rng.randint(2, min(config.max_constant, 9))
    separator = rng.choice(["-", "+", ":", "*"])
    return (
        f"Read a word from standard input and print it {k} times, joined by '{separator}'.",
        f"word = input().strip()\nprint({separator!r}.join([word] * {k}))\n",
        lambda r: _word(r) + "\n",
        lambda text: separator.join([text] * k),
    )


KINDS: dict[str, Callable[[Any, random.Random], tuple[str, str, Any, Any]]] = {
    "linear": _linear,
    "sum": _sum,
    "max_times": _max_times,
    "count_letter": _count_letter,
    "repeat": _repeat,
}


@dataclasses.dataclass(frozen=True)
class CodeTaskConfig:
    kinds: str = ",".join(KINDS)  # comma-separated KINDS names
    cases: int = 3  # stdin/stdout tests per problem
    max_value: int = 100  # test inputs' integers are in [-max_value, max_value]
    max_constant: int = 12  # the problem's constants are in [1 or 2, max_constant]

    def __post_init__(self):
        unknown = [k for k in self.kinds.split(",") if k not in KINDS]
        if unknown or not self.kinds:
            raise DataError(
                f"code kinds {unknown or self.kinds!r} unknown; valid: "
                f"{','.join(KINDS)} (comma-separated)"
            )
        if not 1 <= self.cases <= 20:
            raise DataError(f"code cases must be in 1..20, got {self.cases}")
        if self.max_value < 1 or self.max_constant < 2:
            raise DataError(
                f"code max_value must be >= 1 and max_constant >= 2, got "
                f"{self.max_value} and {self.max_constant}"
            )


def generate(config: CodeTaskConfig, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    kind = rng.choice(config.kinds.split(","))
    question, reference, draw_input, solve = KINDS[kind](config, rng)
    inputs = [draw_input(rng) for _ in range(config.cases)]
    cases = [{"input": text, "output": solve(text.strip()) + "\n"} for text in inputs]
    tests = json.dumps({"style": "stdio", "cases": cases})
    return question, reference, {"tests": tests, "kind": kind, "instruction": CODE_INSTRUCTION}
