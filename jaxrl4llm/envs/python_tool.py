"""A Python interpreter for maths, in ToRL's format (arXiv:2503.23383, Section 2).

The model writes a ```python block and then ```output; generation stops there, the last
python block of the turn runs in the code sandbox (rewards/sandbox.py, the --code_* limits),
and its output is appended inside the model's turn as ToRL does: "\\n<output>\\n```\\n", where
an error keeps only its last line and an output of 256 characters or more keeps its first and
last 128. Past `max_calls` calls the model's ```output gets nothing (it writes on, as
ToRL's rollout does once its calls are spent). The turn without a call is the final answer,
verified by the record's verifier (math-verify for maths).
"""

from __future__ import annotations

import dataclasses
import re

from jaxrl4llm.envs.base import StepStatus
from jaxrl4llm.envs.calculator import ToolEnvironment
from jaxrl4llm.rewards.registry import RewardConfig
from jaxrl4llm.rewards.sandbox import resolve_isolation, run_program

OUTPUT_MARKER = "```output"
_PYTHON_BLOCK = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)
HALF = 128  # ToRL keeps the first and last 128 characters of a long output


@dataclasses.dataclass(frozen=True)
class PythonOptions:
    max_calls: int = 1  # ToRL's C: code runs per trajectory
    max_code_chars: int = 8000  # a longer block is an error, not a run

    def __post_init__(self):
        if self.max_calls < 0 or self.max_code_chars < 1:
            raise ValueError(
                f"max_calls must be >= 0 and max_code_chars >= 1, got {self.max_calls}, "
                f"{self.max_code_chars}"
            )


def torl_output(stdout: str, stderr: str, status: str) -> str:
    """What the model sees of a run, as ToRL's rollout shows it."""
    text = (stdout if status == "ok" else stderr or stdout).strip()
    if status == "timeout":
        text = "TimeoutError: the program ran out of time"
    elif status != "ok" and "Error" in text:
        text = text.splitlines()[-1]
    if len(text) >= 2 * HALF:
        text = text[:HALF] + "..." + text[-HALF:]
    return f"\n{text}\n```\n"


class PythonEnvironment(ToolEnvironment):
    Options = PythonOptions
    stop_strings = (OUTPUT_MARKER,)
    observation_role = None  # inline in the model's turn, as ToRL

    @classmethod
    def check(cls, reward: RewardConfig) -> None:
        resolve_isolation(reward.code.sandbox)  # DependencyError naming the fix when none

    def tool_call(self, turn_text: str) -> str | None:
        text = turn_text.rstrip()
        if not text.endswith(OUTPUT_MARKER):
            return None
        blocks = _PYTHON_BLOCK.findall(text[: -len(OUTPUT_MARKER)])
        return blocks[-1] if blocks else ""

    def run_tool(self, call: str) -> tuple[str, StepStatus]:
        if not call.strip():
            return torl_output(
                "", "SyntaxError: no ```python block before ```output", "exit"
            ), "error"
        if len(call) > self.options.max_code_chars:
            message = f"ValueError: code longer than {self.options.max_code_chars} characters"
            return torl_output("", message, "exit"), "error"
        run = run_program(call, "", self.reward.code.sandbox)
        status: StepStatus = (
            "ok" if run.status == "ok" else "timeout" if run.status == "timeout" else "error"
        )
        return torl_output(run.stdout, run.stderr, run.status), status
