"""Countdown: an expression over the given numbers (each at most once) that equals the target.

The expression is parsed with `ast.parse(mode="eval")` and evaluated by a walker that accepts
only integer literals, parentheses and binary + - * / (exact Fraction arithmetic). Nothing is
ever passed to eval.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Mapping, Sequence

from jaxrl4llm.rewards import extract
from jaxrl4llm.rewards.base import Job, Verdict, record_answer, record_metadata, run_in_process

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_LATEX = (
    ("\\times", "*"),
    ("\\cdot", "*"),
    ("\\div", "/"),
    ("\\left", ""),
    ("\\right", ""),
    ("\\,", ""),
    ("\\!", ""),
    ("$", ""),
    ("×", "*"),
    ("·", "*"),
    ("÷", "/"),
    ("−", "-"),
    ("–", "-"),
    ("[", "("),
    ("]", ")"),
)
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_CHARS_RE = re.compile(r"[0-9\s+\-*/()]+")
MAX_EXPRESSION_CHARS = 300
MAX_RAW_CHARS = 4 * MAX_EXPRESSION_CHARS  # before cleaning (LaTeX macros, spaces)


class CountdownError(ValueError):
    """An expression that is not a valid countdown answer; `reason` is a REASONS name."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
    use_all: bool = False  # True: every given number exactly once (TinyZero); False: at most once


def clean_expression(text: str) -> str:
    """LaTeX / unicode operators to + - * /, and the expression side of `expr = target`."""
    for old, new in _LATEX:
        text = text.replace(old, new)
    for _ in range(10):  # innermost \frac{a}{b} first
        text, count = _FRAC_RE.subn(r"((\1)/(\2))", text)
        if not count:
            break
    text = text.replace("{", "(").replace("}", ")")
    sides = [s.strip() for s in text.split("=")]
    with_ops = [s for s in sides if re.search(r"[-+*/]", s)]
    return with_ops[0] if with_ops else sides[0]


def _walk(node: ast.AST, used: list[int]) -> None:
    """Collects the integer literals; rejects every node that is not a literal or + - * /."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        _walk(node.left, used)
        _walk(node.right, used)
    else:
        raise CountdownError(
            "parse_error", f"not allowed in a countdown expression: {type(node).__name__}"
        )


def _value(node: ast.AST) -> Fraction:
    # `_walk` has let through only int literals and BinOps of _OPS.
    if isinstance(node, ast.Constant):
        assert type(node.value) is int
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Div) and right == 0:
        raise ZeroDivisionError
    return _OPS[type(node.op)](left, right)


def evaluate(expression: str, numbers: Sequence[int], use_all: bool = False) -> Fraction:
    """The exact value of `expression` if it only uses `numbers` (each at most once)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CountdownError("parse_error", f"expression longer than {MAX_EXPRESSION_CHARS} chars")
    if not _CHARS_RE.fullmatch(expression):
        raise CountdownError("parse_error", "only digits, + - * / and parentheses are allowed")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CountdownError("parse_error", f"not an expression: {exc}") from None
    used: list[int] = []
    try:
        _walk(tree.body, used)
    except RecursionError:
        raise CountdownError("parse_error", "expression nested too deeply") from None
    have, want = Counter(used), Counter(int(n) for n in numbers)
    if have - want or (use_all and have != want):
        raise CountdownError(
            "invalid_numbers", f"uses {sorted(used)}, given {sorted(want.elements())}"
        )
    return _value(tree.body)  # bounded: only the given (small) numbers appear


def countdown_problem(record: Any) -> tuple[list[int], int]:
    """(numbers, target) from metadata {numbers|nums, target}."""
    meta: Mapping[str, Any] = record_metadata(record)
    numbers = meta.get("numbers", meta.get("nums"))
    target = meta.get("target")
    if numbers is None or target is None:
        raise ValueError(
            f"countdown record needs metadata 'numbers' (or 'nums') and 'target'; "
            f"got metadata keys {sorted(meta)} (answer {record_answer(record)!r})"
        )
    return [int(n) for n in numbers], int(target)


def extract_expression(completion: str) -> str | None:
    answer = extract.extract_boxed(completion)
    return answer if answer is not None else extract.extract_answer_tag(completion)


def verify_countdown(
    completion: str, numbers: tuple[int, ...], target: int, use_all: bool = False
) -> str:
    """The REASONS name for one completion (runs in a pool worker; pure string work)."""
    expression = extract_expression(completion)
    if expression is None or not expression.strip():
        return "no_answer"
    if len(expression) > MAX_RAW_CHARS:  # cleaning only shortens: cannot fit after it
        return "parse_error"
    try:
        value = evaluate(clean_expression(expression), numbers, use_all)
    except CountdownError as exc:
        return exc.reason
    except ZeroDivisionError:
        return "wrong"
    return "correct" if value == target else "wrong"


class CountdownVerifier:
    def __init__(self, config: CountdownConfig = CountdownConfig()):
        self.config = config

    def job(self, completion: str, record: Any) -> Job:
        """The pool job for one completion; a record without numbers / target raises here.
        A record's metadata "use_all" overrides the config's rule."""
        numbers, target = countdown_problem(record)
        use_all = bool(record_metadata(record).get("use_all", self.config.use_all))
        return Job(verify_countdown, (completion, tuple(numbers), target, use_all))

    def answer_key(self, completion: str, record: Any) -> str | None:
        """The answer maj@k votes on: the cleaned expression without spaces."""
        expression = extract_expression(completion)
        if expression is None or len(expression) > MAX_RAW_CHARS:
            return None
        return "".join(clean_expression(expression).split()) or None

    def verify_one(self, completion: str, record: Any) -> Verdict:
        return run_in_process(self.job(completion, record))

    def plan(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict | Job]:
        return [self.job(c, r) for c, r in zip(completions, records)]
