"""The shipped environments' step logic, against outcomes worked out by hand."""

from __future__ import annotations

import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.data.tasks import generate_record
from jaxrl4llm.envs.base import StepResult, VerifierEnvironment
from jaxrl4llm.envs.calculator import (
    CalculatorEnvironment,
    CalculatorError,
    CalculatorOptions,
    calculate,
)
from jaxrl4llm.envs.guess import GuessEnvironment, GuessOptions
from jaxrl4llm.envs.python_tool import PythonEnvironment, PythonOptions, torl_output
from jaxrl4llm.rewards.registry import RewardConfig
from jaxrl4llm.rewards.sandbox import available_layer

ARITHMETIC = Record("What is 12 * 34?", "408", {"task": "arithmetic"})
LENIENT = RewardConfig(answer_mode="lenient")


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*34", "408"),
        ("12 x 34", "408"),
        ("12 × 34", "408"),
        ("(3 + 4) * 5 - 1", "34"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),
        ("2 ^ 10", "1024"),
        ("-17 // 5", "-4"),
        ("17 % 5", "2"),
        ("0.1 + 0.2", "0.3"),  # exact: fractions, not floats
    ],
)
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, why",
    [
        ("9 ** 9 ** 9", "number too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2 ** 0.5", "whole-number powers"),
        ("__import__('os').system('true')", "only numbers"),
        ("x + 1", "only numbers"),
        ("1e999", "not a finite number"),
        ("12 *", "not an arithmetic expression"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_calculator_refuses(expression, why):
    with pytest.raises(CalculatorError, match=why):
        calculate(expression)


def test_calculator_turns_calls_then_the_final_answer():
    env = CalculatorEnvironment(CalculatorOptions(max_calls=1), LENIENT)
    assert env.reset(ARITHMETIC) is None
    assert env.step("I will use the tool. <calc>12 * 34</calc>") == StepResult(
        "408", 0.0, False, tool_call=True
    )
    # The one call is spent: another gets no output, and the trajectory goes on.
    assert env.step("<calc>1+1</calc>") == StepResult()
    assert env.step("So the answer is 408.") == StepResult(reward=1.0, done=True)
    env.reset(ARITHMETIC)
    assert env.step("<calc>12 * </calc>") == StepResult(
        "error: not an arithmetic expression", tool_call=True, status="error"
    )
    assert env.step("The answer is 407.") == StepResult(reward=0.0, done=True)


def test_the_verifier_environment_is_one_turn_scored_as_the_run_scores():
    env = VerifierEnvironment(reward=RewardConfig(scale="pm1"))
    env.reset(ARITHMETIC)
    assert env.step("12 * 34 = \\boxed{408}") == StepResult(reward=1.0, done=True)
    assert env.step("\\boxed{400}") == StepResult(reward=-1.0, done=True)
    penalised = VerifierEnvironment(reward=RewardConfig(format_penalty=0.5))
    penalised.reset(ARITHMETIC)
    assert penalised.step("no idea") == StepResult(reward=-0.5, done=True)


def test_guessing_game_rewards_over_turns():
    record = generate_record("guess", seed=3, index=0)
    secret = int(record.answer)
    assert 1 <= secret <= 100 and "<guess>N</guess>" in record.metadata["instruction"]
    env = GuessEnvironment(GuessOptions(turn_cost=0.1))
    env.reset(Record("Game 1: ...", "37", {"task": "guess"}))
    turns = [
        ("<guess>50</guess>", StepResult("Lower.", -0.1)),
        ("I think <guess> 20 </guess>", StepResult("Higher.", -0.1)),
        (
            "no guess here",
            StepResult("Write your guess as <guess>N</guess>.", -0.1, status="error"),
        ),
        ("<guess>37</guess>", StepResult("Correct!", 1.0, done=True)),
    ]
    for text, expected in turns:
        assert env.step(text) == expected
    # Won at the 4th turn: 1 - 3 * 0.1.
    assert sum(result.reward for _, result in turns) == pytest.approx(0.7)


def test_torl_output_format():
    assert torl_output("42\n", "", "ok") == "\n42\n```\n"
    trace = 'Traceback (most recent call last):\n  File "main.py"\nNameError: name "a"'
    assert torl_output("", trace, "exit") == '\nNameError: name "a"\n```\n'
    long = "".join(str(i % 10) for i in range(300))
    assert torl_output(long, "", "ok") == f"\n{long[:128]}...{long[-128:]}\n```\n"


@pytest.mark.skipif(available_layer() is None, reason="no sandbox isolation layer here")
def test_python_tool_runs_the_last_block_and_verifies_with_math_verify():
    record = Record("What is 1/2 + 1/4?", "\\frac{3}{4}", {"task": "math"})
    env = PythonEnvironment(PythonOptions(max_calls=2))
    env.reset(record)
    turn = "```python\nprint(1)\n```\nAgain:\n```python\nprint(1/2 + 1/4)\n```\n```output"
    assert env.step(turn) == StepResult("\n0.75\n```\n", tool_call=True)
    failing = env.step("```python\nprint(a)\n```\n```output")
    assert failing.status == "error" and failing.observation.startswith("\nNameError: name 'a'")
    assert env.step("```python\nprint(2)\n```\n```output") == StepResult()  # calls spent
    # 0.75 and 3/4 are equal to math-verify (not to the exact-match fast path).
    assert env.step("So the answer is $\\boxed{0.75}$.") == StepResult(reward=1.0, done=True)
