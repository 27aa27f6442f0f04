"""`make_reward_fn`: a batch-level reward function that routes each record to its verifier.

Each record names its task in `metadata["task"]`, so one RewardFn scores a mixed dataset.
Every verifier's jobs of a batch go to one VerifierPool in one `run`: the whole batch shares
the workers, each item has its own deadline and the batch one deadline.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxrl4llm.rewards.base import Job, RewardBatch, Verdict, record_metadata, run_plan
from jaxrl4llm.rewards.code import CodeConfig, CodeVerifier
from jaxrl4llm.rewards.countdown import CountdownConfig, CountdownVerifier
from jaxrl4llm.rewards.formats import think_answer_format
from jaxrl4llm.rewards.gym import GymVerifier
from jaxrl4llm.rewards.knights_knaves import KnightsKnavesVerifier
from jaxrl4llm.rewards.math_verifier import BUDGET_FRACTION, MathConfig, MathVerifier
from jaxrl4llm.rewards.pool import PoolConfig, VerifierPool
from jaxrl4llm.rewards.sandbox import SandboxConfig
from jaxrl4llm.rewards.shaping import ShapingConfig, shape

# task name (record metadata or make_reward_fn's argument) -> verifier name
TASK_VERIFIERS = {
    "math": "math",
    "arithmetic": "math",  # integer answers: decided by the fast path, never the pool
    "countdown": "countdown",
    "knights_knaves": "knights_knaves",
    "gym": "gym",  # a reasoning-gym task (data/gym.py): its own scorer in the pool
    "code": "code",  # a Python program run against tests in the sandbox (code.py)
    "guess": "math",  # the guessing game (envs/guess.py) scored in one turn: its last number
}
# Worker modules a verifier needs, imported when a worker starts (not on its first job,
# whose item deadline an import of reasoning-gym, ~1.5 s, would eat into).
PRELOAD = {"gym": "reasoning_gym"}
KINDS = ("auto", *TASK_VERIFIERS)


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Every option of make_reward_fn (flag-friendly scalars).

    scale: Reward of a wrong answer: 0 ("01") or -1 ("pm1"); a correct one gets 1. "logic_rl":
        Logic-RL's reward, format (+1 for <think>...</think><answer>...</answer>, else -1)
        plus answer (+2 correct, -1.5 wrong, -2 unparsed or bad format).
    format_penalty: Subtracted from the reward of a completion without a final answer.
    max_new_tokens: L_max of the overlong punishment (the trainer sets --max_new_tokens).
    overlong_buffer: DAPO soft overlong punishment window L_buffer in tokens (0 = off).
    overlong_penalty: DAPO overlong punishment at (and past) L_max.
    answer_mode: Math final answer: the last \\boxed{}; lenient also accepts the last number.
    countdown_use_all: Countdown answers must use every given number.
    num_workers: Verifier worker processes.
    item_timeout_s: Seconds one verification may take before it scores as a timeout.
    batch_timeout_s: Fixed part of a batch's deadline: each verification adds its allowance
        divided by num_workers (0.1 s each; 0.5 s per test of a code completion).
    memory_limit_mb: Memory limit of each verifier worker process, in MB.
    default_task: Verifier of records that name no task (metadata["task"]).
    code_reward: Code: "all_pass" (1 when every test passes) or "fraction" (the share passed).
    code_isolation: Code sandbox layer: "auto" (bwrap, else unshare), "bwrap", "unshare".
    unsafe_code_execution: Run code rewards without any isolation layer when none works
        here (as your user, with only rlimits: the programs can read your files).
    code_wall_s: Wall-clock seconds of one test run of a model-written program.
    code_memory_mb: Address-space limit of a model-written program, in MB.
    """

    scale: str = "01"
    format_penalty: float = 0.0
    max_new_tokens: int | None = None
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    answer_mode: str = "boxed"
    countdown_use_all: bool = False
    num_workers: int = 2  # verifier worker processes
    item_timeout_s: float = 5.0  # wall clock for one verification, from when a worker starts it
    batch_timeout_s: float = 60.0  # a batch's deadline: this plus its jobs' allowances / workers
    memory_limit_mb: int = 4096
    default_task: str = "math"  # for records without metadata["task"] under kind="auto"
    code_reward: str = "all_pass"
    code_isolation: str = "auto"
    unsafe_code_execution: bool = False
    code_wall_s: float = 2.0
    code_memory_mb: int = 512

    def __post_init__(self):
        if self.default_task not in TASK_VERIFIERS:
            raise ValueError(
                f"unknown default_task {self.default_task!r}; valid: {', '.join(TASK_VERIFIERS)}"
            )
        if self.num_workers < 1:
            raise ValueError(
                f"--reward_workers={self.num_workers}: the verifier worker processes must be >= 1."
            )
        for name in ("item_timeout_s", "batch_timeout_s", "code_wall_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"--{name}={value} must be a positive number of seconds.")
        self.code  # noqa: B018 - checks the code options (sandbox limits, mode) now

    @property
    def shaping(self) -> ShapingConfig:
        return ShapingConfig(
            scale=self.scale,
            format_penalty=self.format_penalty,
            max_new_tokens=self.max_new_tokens,
            overlong_buffer=self.overlong_buffer,
            overlong_penalty=self.overlong_penalty,
        )

    @property
    def pool(self) -> PoolConfig:
        return PoolConfig(
            num_workers=self.num_workers,
            item_timeout_s=self.item_timeout_s,
            batch_timeout_s=self.batch_timeout_s,
            memory_limit_mb=self.memory_limit_mb,
        )

    @property
    def code(self) -> CodeConfig:
        sandbox = SandboxConfig(
            isolation=self.code_isolation,
            unsafe=self.unsafe_code_execution,
            wall_s=self.code_wall_s,
            cpu_s=max(1, round(self.code_wall_s)),
            memory_mb=self.code_memory_mb,
        )
        return CodeConfig(
            mode=self.code_reward, sandbox=sandbox, budget_s=BUDGET_FRACTION * self.item_timeout_s
        )

    @property
    def math(self) -> MathConfig:
        return MathConfig.for_item_deadline(self.item_timeout_s, answer_mode=self.answer_mode)


def make_verifiers(config: RewardConfig) -> dict[str, Any]:
    """verifier name (TASK_VERIFIERS' values) -> the verifier, configured from `config`."""
    return {
        "math": MathVerifier(config.math),
        "countdown": CountdownVerifier(CountdownConfig(use_all=config.countdown_use_all)),
        "knights_knaves": KnightsKnavesVerifier(),
        "gym": GymVerifier(),
        "code": CodeVerifier(config.code),  # its sandbox is checked at the first code row
    }


class RewardFn:
    """score(completions, records, lengths=None) -> RewardBatch. Close it (or use `with`)."""

    def __init__(self, kind: str = "auto", config: RewardConfig = RewardConfig()):
        if kind not in KINDS:
            raise ValueError(f"unknown reward kind {kind!r}; valid: {', '.join(KINDS)}")
        self.kind = kind
        self.config = config
        self.shaping = config.shaping  # validated now, not at the first step
        self.pool = VerifierPool(config.pool)  # workers start at the first job
        self.verifiers = make_verifiers(config)

    def __enter__(self) -> RewardFn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()

    def task_of(self, record: Any) -> str:
        if self.kind != "auto":
            return self.kind
        task = record_metadata(record).get("task", self.config.default_task)
        if task not in TASK_VERIFIERS:
            raise ValueError(
                f"record has metadata task {task!r}, which has no verifier; valid: "
                f"{', '.join(TASK_VERIFIERS)} (set the source's task=...)"
            )
        return task

    def _preload(self, modules: list[str]) -> None:
        """Restarts the (lazily started) pool with `modules` imported at worker start."""
        missing = [m for m in modules if m not in self.pool.config.preload]
        if missing:
            self.pool.close()
            self.pool = VerifierPool(
                dataclasses.replace(
                    self.pool.config, preload=self.pool.config.preload + tuple(missing)
                )
            )

    def answer_keys(self, completions: Sequence[str], records: Sequence[Any]) -> list[str | None]:
        """Each completion's final answer as its task's verifier reads it, normalised for
        voting (maj@k): equal keys are the same answer. None: no answer."""
        return [
            self.verifiers[TASK_VERIFIERS[self.task_of(r)]].answer_key(c, r)
            for c, r in zip(completions, records)
        ]

    def verdicts(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict]:
        if len(completions) != len(records):
            raise ValueError(
                f"got {len(completions)} completions for {len(records)} records; "
                "repeat each record once per sample (G times) before scoring"
            )
        groups: dict[str, list[int]] = {}
        for i, record in enumerate(records):
            groups.setdefault(TASK_VERIFIERS[self.task_of(record)], []).append(i)
        self._preload([PRELOAD[name] for name in groups if name in PRELOAD])
        plan: list[Verdict | Job] = [Verdict(False, "error")] * len(records)
        for name, indices in groups.items():
            found = self.verifiers[name].plan(
                [completions[i] for i in indices], [records[i] for i in indices]
            )
            for i, item in zip(indices, found):
                plan[i] = item
        return run_plan(self.pool, plan)

    def score(
        self,
        completions: Sequence[str],
        records: Sequence[Any],
        lengths: Sequence[int] | np.ndarray | None = None,
    ) -> RewardBatch:
        """Rewards for B completions of B records; `lengths`: completion tokens (for overlong).
        Rows whose verification did not finish are `.failed` (reward 0): mask them out."""
        verdicts = self.verdicts(completions, records)
        formatted = (
            [think_answer_format(c) for c in completions]
            if self.shaping.scale == "logic_rl"
            else None
        )
        rewards, correct = shape(verdicts, self.shaping, lengths, formatted)
        return RewardBatch(
            rewards=rewards,
            correct=correct,
            reasons=[v.reason for v in verdicts],
            details=[v.detail for v in verdicts],
        )

    __call__ = score


def make_reward_fn(task_or_kind: str = "auto", **options: Any) -> RewardFn:
    """A RewardFn for one task ("math", "arithmetic", "countdown", "knights_knaves", "gym",
    "code") or
    "auto" (route by each record's metadata["task"]). Options: the fields of RewardConfig."""
    valid = {f.name for f in dataclasses.fields(RewardConfig)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(
            f"unknown reward option(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}"
        )
    return RewardFn(task_or_kind, RewardConfig(**options))
