"""The environment interface: what answers a model's turns over one trajectory.

One Environment object per trajectory (a rollout row). `reset(record)` starts it on a prompt
record; `step(turn_text)` takes the text of the model's latest turn and returns a StepResult:
the observation the model sees next (None: nothing), this turn's reward contribution (the
trajectory's reward is their sum) and whether the trajectory ends. Environments are plain
Python and picklable: each `reset` and `step` runs in a worker process of the reward pool
(envs/runner.py), which gets the object, runs the call and sends the object back, so one
that hangs or crashes costs its own row, never the trainer.

A model turn ends at EOS, at its token budget or at one of the environment's `stop_strings`
(a tool call's end marker, e.g. "</calc>"; included in the turn text). An environment sees
only text: the handler (envs/handler.py) wraps its observations in the model's chat template
(a turn of role `observation_role`, or inline in the model's turn when that is None) and
tokenizes them.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar, Literal

from jaxrl4llm.rewards.base import Job, record_metadata, run_in_process
from jaxrl4llm.rewards.formats import think_answer_format
from jaxrl4llm.rewards.registry import TASK_VERIFIERS, RewardConfig, make_verifiers
from jaxrl4llm.rewards.shaping import shape

StepStatus = Literal["ok", "error", "timeout"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one model turn got back.

    status: how the turn's tool call or move went: "ok", "error" (the tool failed: a bad
        expression, a program that raised, an unreadable move), "timeout" (the tool ran out
        of time); counted in the run's metrics, never an exception.
    """

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    tool_call: bool = False  # the turn called a tool
    status: StepStatus = "ok"


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """An environment without options."""


class Environment(abc.ABC):
    """One trajectory's environment. Subclasses set `Options` (a frozen dataclass of scalar
    fields: the `--env=NAME?key=value` options), `stop_strings` and `observation_role`."""

    Options: ClassVar[type] = NoOptions
    stop_strings: ClassVar[tuple[str, ...]] = ()  # ends of a tool call; end a model turn
    observation_role: ClassVar[str | None] = "user"  # None: inline in the model's turn

    def __init__(self, options: Any = None, reward: RewardConfig | None = None):
        self.options = self.Options() if options is None else options
        self.reward = RewardConfig() if reward is None else reward

    @classmethod
    def check(cls, reward: RewardConfig) -> None:
        """Raises a UserError when this environment cannot run here (a missing sandbox)."""

    @abc.abstractmethod
    def reset(self, record: Any) -> str | None:
        """Starts a trajectory on `record`; returns the text of the first user turn in place
        of the record's prompt, or None to keep the prompt."""

    @abc.abstractmethod
    def step(self, turn_text: str) -> StepResult:
        """The outcome of the model's turn `turn_text` (its stop string included)."""


def answer_reward(text: str, record: Any, reward: RewardConfig) -> float:
    """The reward of `text` as the final answer to `record`: the record's task verifier run
    here (inside a pool worker) and shaped as the run's reward (--reward_scale,
    --format_penalty; the overlong punishment counts tokens and is not applied here)."""
    task = str(record_metadata(record).get("task", reward.default_task))
    if task not in TASK_VERIFIERS:
        valid = ", ".join(TASK_VERIFIERS)
        raise ValueError(f"record task {task!r} has no verifier; valid: {valid}")
    verifier = make_verifiers(reward)[TASK_VERIFIERS[task]]
    item = verifier.plan([text], [record])[0]
    verdict = run_in_process(item) if isinstance(item, Job) else item
    shaping = dataclasses.replace(reward.shaping, overlong_buffer=0)
    rewards, _ = shape([verdict], shaping, formatted=[think_answer_format(text)])
    value = float(rewards[0])
    return value if math.isfinite(value) else 0.0


class VerifierEnvironment(Environment):
    """The single-turn environment: the model's one turn is its final answer, scored by the
    record's verifier (today's rollouts, through the multi-turn machinery)."""

    def reset(self, record: Any) -> str | None:
        self.record = record
        return None

    def step(self, turn_text: str) -> StepResult:
        return StepResult(reward=answer_reward(turn_text, self.record, self.reward), done=True)
