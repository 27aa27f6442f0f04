"""Knights and knaves (the logic task of Logic-RL / REINFORCE++): who tells the truth?

Knights always tell the truth, knaves always lie. Each inhabitant makes one statement about the
others; a brute-force solver over all 2**n assignments keeps only puzzles with exactly one
consistent assignment. Statements are a claim ("B is a knave") or one connective over two
claims (and, or, if-then, iff) or a negated claim, so the English is never ambiguous.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

from jaxrl4llm.data.records import DataError

NAMES = ("Zoey", "Oliver", "Emma", "Liam", "Ava", "Noah", "Mia", "Lucas", "Sofia", "Ethan",
         "Chloe", "Mason", "Aria", "Logan", "Layla", "Jacob", "Nora", "Henry", "Ruby", "Owen",
         "Grace", "Jack", "Stella", "Aiden", "Hazel", "Samuel", "Violet", "David", "Aurora",
         "Joseph", "Lily", "Daniel", "Penelope", "Isaac", "Scarlett", "Elijah", "Riley", "Gabriel")
_MAX_TRIES = 2000

# A statement is ("is", person, is_knight) | ("not", s) | (op, s1, s2), op in and/or/imp/iff.
Statement = tuple


@dataclasses.dataclass(frozen=True)
class KnightsKnavesConfig:
    min_people: int = 3      # each puzzle has min_people..max_people inhabitants (2..8)
    max_people: int = 3      # the paper trains on 3..7 and tests out of distribution on 8
    compound: float = 0.6    # probability that a statement uses a connective

    def __post_init__(self):
        if not 2 <= self.min_people <= self.max_people <= 8:
            raise DataError("knights_knaves needs 2 <= min_people <= max_people <= 8, got "
                            f"min_people={self.min_people}, max_people={self.max_people}")
        if not 0.0 <= self.compound <= 1.0:
            raise DataError(f"knights_knaves compound must be in [0, 1], got {self.compound}")


def truth(statement: Statement, knights: tuple[bool, ...]) -> bool:
    kind = statement[0]
    if kind == "is":
        return knights[statement[1]] == statement[2]
    if kind == "not":
        return not truth(statement[1], knights)
    a, b = truth(statement[1], knights), truth(statement[2], knights)
    return {"and": a and b, "or": a or b, "imp": (not a) or b, "iff": a == b}[kind]


def solutions(statements: list[Statement]) -> list[tuple[bool, ...]]:
    """Every assignment (True = knight) where each speaker's statement is true iff a knight."""
    return [knights for knights in itertools.product((True, False), repeat=len(statements))
            if all(knights[i] == truth(s, knights) for i, s in enumerate(statements))]


def render(statement: Statement, names: list[str]) -> str:
    kind = statement[0]
    if kind == "is":
        return f"{names[statement[1]]} is a {'knight' if statement[2] else 'knave'}"
    if kind == "not":
        return f"it is not the case that {render(statement[1], names)}"
    a, b = render(statement[1], names), render(statement[2], names)
    return {"and": f"{a} and {b}", "or": f"{a} or {b}", "imp": f"if {a} then {b}",
            "iff": f"{a} if and only if {b}"}[kind]


def _random_statement(speaker: int, n: int, compound: float, rng: random.Random) -> Statement:
    others = [j for j in range(n) if j != speaker]

    def claim() -> Statement:
        return ("is", rng.choice(others), rng.random() < 0.5)

    if rng.random() >= compound:
        return claim()
    kind = rng.choice(("and", "or", "imp", "iff", "not"))
    if kind == "not":
        return ("not", claim())
    a, b = claim(), claim()
    while len(others) > 1 and b[1] == a[1]:  # two different people, when there are two
        b = claim()
    return (kind, a, b)


def format_answer(names: list[str], knights: tuple[bool, ...]) -> str:
    return ", ".join(f"{name} is a {'knight' if k else 'knave'}" for name, k in zip(names, knights))


def generate(config: KnightsKnavesConfig, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    n = rng.randint(config.min_people, config.max_people)
    for _ in range(_MAX_TRIES):
        names = rng.sample(NAMES, n)
        statements = [_random_statement(i, n, config.compound, rng) for i in range(n)]
        found = solutions(statements)
        if len(found) == 1:
            break
    else:
        raise DataError(f"knights_knaves: no uniquely solvable puzzle in {_MAX_TRIES} tries "
                        f"with {config}")
    said = " ".join(f'{names[i]} says, "{render(s, names)[0].upper()}{render(s, names)[1:]}."'
                    for i, s in enumerate(statements))
    listing = ", ".join(names[:-1]) + f" and {names[-1]}"
    question = (
        "A very special island is inhabited only by knights and knaves. Knights always tell the "
        f"truth, and knaves always lie. You meet {n} inhabitants: {listing}. {said} "
        "So who is a knight and who is a knave? Give the final answer as one claim per "
        "inhabitant, e.g. \\boxed{Name is a knight, Name is a knave, ...}.")
    knights = found[0]
    metadata = {"names": names, "solution": list(knights), "statements": repr(statements)}
    return question, format_answer(names, knights), metadata
