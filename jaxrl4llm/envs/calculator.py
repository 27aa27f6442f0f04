"""A calculator tool: the model writes <calc>12 * (3 + 4)</calc> and gets the exact value.

Expressions are parsed with `ast` and evaluated over exact fractions, never with eval: numbers,
+ - * / // % ** and parentheses only, with sizes bounded so that no expression (9**9**9)
can take long. `x` or `×` between numbers, `÷` and `^` are read as *, / and **, as models write
them. A turn that calls no tool is the final answer, scored by the record's verifier.
"""

from __future__ import annotations

import abc
import ast
import dataclasses
import operator
import re
from fractions import Fraction
from typing import Any

from jaxrl4llm.envs.base import Environment, StepResult, StepStatus, answer_reward

MAX_BITS = 1024  # numerators and denominators past 2**1024 are an error, not a slow job
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_SPELLINGS = (("×", "*"), ("÷", "/"), ("^", "**"), ("−", "-"))
_TIMES_X = re.compile(r"(?<=[\d)])\s*[xX]\s*(?=[\d(])")


class CalculatorError(ValueError):
    """An expression the calculator does not take; the message is what the model sees."""


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError("number too large")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number powers are supported")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if bits * abs(exponent.numerator) > MAX_BITS:
        raise CalculatorError("number too large")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    return base**exponent.numerator


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if type(node.op) in _OPERATORS:
            if right == 0 and not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
                raise CalculatorError("division by zero")
            return _checked(Fraction(_OPERATORS[type(node.op)](left, right)))
    raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed")


def calculate(expression: str, max_chars: int = 200) -> str:
    """The value of `expression`: an integer, else a decimal of 10 significant digits.
    Raises CalculatorError (its message says why) on anything else."""
    if len(expression) > max_chars:
        raise CalculatorError(f"expression longer than {max_chars} characters")
    for written, meant in _SPELLINGS:
        expression = expression.replace(written, meant)
    expression = _TIMES_X.sub("*", expression).strip()
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):
        raise CalculatorError("not an arithmetic expression") from None
    try:
        value = _evaluate(tree)
    except (ValueError, OverflowError, ZeroDivisionError) as exc:  # 1e999 is inf: no number
        if isinstance(exc, CalculatorError):
            raise
        raise CalculatorError("not a finite number") from None
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


class ToolEnvironment(Environment):
    """A tool the model calls inside its answer: a turn that ends with a call gets the tool's
    output; a turn without one is the final answer, rewarded by the record's verifier. Past
    `max_calls` calls a call gets no output (the model writes on, as ToRL's rollout does once
    its calls are spent). Subclasses parse the call and run it."""

    def reset(self, record: Any) -> str | None:
        self.record, self.calls = record, 0
        return None

    def step(self, turn_text: str) -> StepResult:
        call = self.tool_call(turn_text)
        if call is None:
            return StepResult(reward=answer_reward(turn_text, self.record, self.reward), done=True)
        if self.calls >= self.options.max_calls:
            return StepResult()
        self.calls += 1
        output, status = self.run_tool(call)
        return StepResult(observation=output, tool_call=True, status=status)

    @abc.abstractmethod
    def tool_call(self, turn_text: str) -> str | None:
        """The call's argument when the turn ends with a tool call, else None."""

    @abc.abstractmethod
    def run_tool(self, call: str) -> tuple[str, StepStatus]:
        """(the tool's output as the model sees it, "ok" / "error" / "timeout")."""


@dataclasses.dataclass(frozen=True)
class CalculatorOptions:
    max_calls: int = 4  # tool calls per trajectory; a later one gets no output
    max_chars: int = 200  # longest expression

    def __post_init__(self):
        if self.max_calls < 0 or self.max_chars < 1:
            raise ValueError(
                f"max_calls must be >= 0 and max_chars >= 1, got {self.max_calls}, {self.max_chars}"
            )


class CalculatorEnvironment(ToolEnvironment):
    Options = CalculatorOptions
    stop_strings = ("</calc>",)
    observation_role = "tool"

    def tool_call(self, turn_text: str) -> str | None:
        text = turn_text.rstrip()
        if not text.endswith("</calc>"):
            return None
        start = text.rfind("<calc>", 0, len(text) - len("</calc>"))
        return None if start < 0 else text[start + len("<calc>") : -len("</calc>")]

    def run_tool(self, call: str) -> tuple[str, StepStatus]:
        try:
            return calculate(call, self.options.max_chars), "ok"
        except CalculatorError as exc:
            return f"error: {exc}", "error"
