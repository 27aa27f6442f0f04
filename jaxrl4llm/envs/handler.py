"""The TurnHandler (sampling/turns.py) that answers model turns with environments.

    service = EnvService("calculator", tokenizer, config.reward, limits)   # once per run
    handler = service(row_records)        # per rollout: one environment per row, reset now
    records = handler.prompt_records()    # the rows' records, prompts from reset where given
    ... the engine calls handler.stop_sequences / submit / poll ...
    service.close()

Each `step` runs as a job in the reward worker pool (envs/runner.py): `submit` returns at once,
`poll` hands back the replies that are ready. A step that raises, hangs past the pool's item
deadline or kills its worker costs only its row: the reply's status says so ("error",
"timeout", "crash"), the environment keeps its state from before the step, and the model is
told in an observation. Observations are wrapped in the model's own chat template as a turn of
the environment's `observation_role` (closing the model's turn and opening its next one), and
cut to `TurnLimits.max_observation_tokens` with the template's tokens kept whole.
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Any, Sequence

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.envs import registry
from jaxrl4llm.envs.base import Environment
from jaxrl4llm.envs.runner import EnvRunner, reset_job, step_job
from jaxrl4llm.rewards.pool import JobResult, PoolConfig
from jaxrl4llm.rewards.registry import RewardConfig
from jaxrl4llm.sampling.config import RolloutConfig
from jaxrl4llm.sampling.turns import TurnEnd, TurnLimits, TurnReply

CHARS_PER_TOKEN = 8  # observations are cut to this many characters per token before tokenizing
CUT_NOTE = "\n[... cut]"
_MARK = "\u2063ASSISTANT\u2063"  # stands for the model's turn when the template is rendered
_SENTINEL = "\u2063OBSERVATION\u2063"
_TEMPLATE_USER = "\u2063QUESTION\u2063"
FAILURES = {
    "error": "The environment failed: {}",
    "timeout": "The environment did not answer in time ({}).",
    "crash": "The environment crashed: {}",
}


def stop_token_sequences(
    tokenizer: Any, stop_strings: Sequence[str]
) -> tuple[tuple[int, ...], ...]:
    """Token-id sequences that end with each stop string, as the model may write it: alone
    and after a space, a newline or a word (a tokenizer may merge a leading space into the
    stop string's first token: " </calc>" is not "</calc>" with a space before it)."""
    found: dict[tuple[int, ...], None] = {}
    for stop in stop_strings:
        for before in ("", " ", "\n", "x", "1", ")"):
            ids = tokenizer.encode(before + stop)
            for k in range(1, len(ids) + 1):  # the shortest tail that spells the stop string
                if tokenizer.decode(ids[-k:], skip_special_tokens=False).endswith(stop):
                    found[tuple(ids[-k:])] = None
                    break
    return tuple(found)


class ObservationTemplate:
    """Observation text -> token ids: the model's chat template around it, for `role`."""

    def __init__(self, tokenizer: Any, role: str | None, max_tokens: int):
        self.tokenizer = tokenizer
        self.role, before, after = _template_parts(tokenizer, role)
        self.before_ids = tokenizer.encode(before)
        self.after_ids = tokenizer.encode(after)
        self.cut_ids = tokenizer.encode(CUT_NOTE)
        self.room = max_tokens - len(self.before_ids) - len(self.after_ids)
        if self.room <= len(self.cut_ids):
            raise FlagError(
                f"--max_observation_tokens={max_tokens} leaves no room for an observation: "
                f"the chat template around it takes {max_tokens - self.room} tokens; raise it."
            )

    def ids(self, text: str) -> tuple[int, ...]:
        content = self.tokenizer.encode(text)
        if len(content) > self.room:
            content = content[: self.room - len(self.cut_ids)] + self.cut_ids
        return (*self.before_ids, *content, *self.after_ids)


def _template_parts(tokenizer: Any, role: str | None) -> tuple[str | None, str, str]:
    """(role used, text before, text after) an observation that follows the model's turn: the
    end of the model's turn and the start of the observation's, then the end of that and the
    start of the model's next turn. A template that refuses `role` gets a user turn."""
    if role is None:
        return None, "", ""
    for candidate in dict.fromkeys((role, "user")):
        messages = [
            {"role": "user", "content": _TEMPLATE_USER},
            {"role": "assistant", "content": _MARK},
            {"role": candidate, "content": _SENTINEL},
        ]
        try:
            text = tokenizer.apply_chat_template(messages)
        except Exception:  # noqa: BLE001 - jinja templates raise their own errors on roles
            continue
        tail = text[text.find(_MARK) + len(_MARK) :]
        if _MARK in text and tail.count(_SENTINEL) == 1:
            before, after = tail.split(_SENTINEL)
            return candidate, before, after
    raise ValueError(
        f"the model's chat template cannot render an observation turn (role {role!r} or "
        "'user') after an assistant turn; give the environment observation_role=None to "
        "append observations inside the model's turn"
    )


@dataclasses.dataclass
class _Row:
    env: Environment | None  # None: its reset failed (`failure` says how)
    prompt: str | None = None
    failure: JobResult | None = None
    turns: int = 0
    pending: bool = False
    done: bool = False


class EnvService:
    """What lives for a whole run: the environment's type and options, the worker threads and
    pools, the observation template and stop sequences. Calling it makes a rollout's handler.
    `pool`: the workers' PoolConfig (default: the reward's, --reward_workers and deadlines)."""

    def __init__(
        self,
        spec: str,
        tokenizer: Any,
        reward: RewardConfig = RewardConfig(),
        limits: TurnLimits = TurnLimits(),
        pool: PoolConfig | None = None,
    ):
        self.env_class, self.options = registry.parse_env(spec)
        self.env_class.check(reward)
        self.tokenizer, self.reward, self.limits = tokenizer, reward, limits
        self.template = ObservationTemplate(
            tokenizer, self.env_class.observation_role, limits.max_observation_tokens
        )
        self.stop_ids = stop_token_sequences(tokenizer, self.env_class.stop_strings)
        self.max_chars = CHARS_PER_TOKEN * limits.max_observation_tokens
        pool = reward.pool if pool is None else pool
        # Workers import the environment's module when they start, not in its first step's
        # deadline (it imports the rewards package: seconds on a loaded host).
        module = self.env_class.__module__
        self.runner = EnvRunner(dataclasses.replace(pool, preload=(*pool.preload, module)))

    def new_env(self) -> Environment:
        return self.env_class(self.options, self.reward)

    def __call__(self, records: Sequence[Any]) -> EnvTurnHandler:
        return EnvTurnHandler(self, records)

    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> EnvService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EnvTurnHandler:
    """A TurnHandler for one rollout: row i plays `records[i]` (the rollout's rows, each
    group's record repeated). The environments are reset when it is made (in the pool, in
    parallel); a row whose reset failed ends at its first turn with that status."""

    def __init__(self, service: EnvService, records: Sequence[Any]):
        self.service = service
        self.records = list(records)
        envs = [service.new_env() for _ in self.records]
        results = service.runner.run(
            [(reset_job, (env, r, service.max_chars)) for env, r in zip(envs, self.records)]
        )
        self.rows = [
            _Row(*result.value) if result.status == "ok" else _Row(None, failure=result)
            for result in results
        ]
        self._replies: queue.Queue = queue.Queue()

    def prompt_records(self) -> list[Any]:
        """The rows' records, with the prompt a `reset` returned in place of the record's."""
        return [
            r if row.prompt is None else _with_prompt(r, row.prompt)
            for r, row in zip(self.records, self.rows)
        ]

    def stop_sequences(self, row: int) -> tuple[tuple[int, ...], ...]:
        return self.service.stop_ids

    def submit(self, row: int, turn_ids: Sequence[int], ended_by: TurnEnd) -> None:
        state = self.rows[row]
        if state.pending or state.done:
            raise ValueError(
                f"row {row} got a turn while its last one is "
                f"{'still running' if state.pending else 'the end of its trajectory'}"
            )
        state.turns += 1
        last = ended_by != "stop" or state.turns >= self.service.limits.max_turns
        if state.env is None:
            assert state.failure is not None
            self._replies.put((row, last, state.failure, 0.0))
            return
        state.pending = True
        text = self.service.tokenizer.decode(turn_ids)
        self.service.runner.submit(
            step_job,
            (state.env, text, self.service.max_chars),
            lambda result, seconds: self._replies.put((row, last, result, seconds)),
        )

    def poll(self, timeout_s: float) -> list[TurnReply]:
        ready = []
        try:
            ready.append(self._replies.get(timeout=max(timeout_s, 0.0)))
            while True:
                ready.append(self._replies.get_nowait())
        except queue.Empty:
            pass
        return [self._reply(*item) for item in ready]

    def _reply(self, row: int, last: bool, result: JobResult, seconds: float) -> TurnReply:
        state = self.rows[row]
        state.pending = False
        if result.status == "ok":
            state.env, step = result.value
            state.done = last or step.done
            observation, reward = step.observation, step.reward
            status, tool_call = step.status, step.tool_call
        else:  # the environment keeps its state from before the step; the model is told
            status = result.status if result.status in FAILURES else "error"
            detail = result.value
            if status == "timeout":
                detail = f"{self.service.runner.item_timeout_s:g} s; {detail}"
            state.done = last or state.env is None  # a failed reset: nothing to play
            observation, reward, tool_call = FAILURES[status].format(detail), 0.0, False
        ids = self.service.template.ids(observation) if observation and not state.done else ()
        return TurnReply(
            row=row,
            observation_ids=ids,
            done=state.done,
            reward=reward,
            status=status,
            tool_call=tool_call,
            seconds=seconds,
        )


def _with_prompt(record: Any, prompt: str) -> Any:
    if isinstance(record, dict):
        return {**record, "prompt": prompt}
    return dataclasses.replace(record, prompt=prompt)


def open_env_service(
    rollout: RolloutConfig, tokenizer: Any, reward: RewardConfig
) -> EnvService | None:
    """The run's environment service (--env, with the turn limits of --max_turns etc.; its
    workers start now, `close` stops them), or None for single-turn rollouts (no --env)."""
    if not rollout.env:
        return None
    return EnvService(rollout.env, tokenizer, reward, rollout.turns)
