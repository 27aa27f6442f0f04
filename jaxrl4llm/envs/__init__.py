"""Environments that answer a model's turns: multi-turn and tool-using rollouts.

    service = EnvService("calculator?max_calls=2", tokenizer, reward_config, turn_limits)
    handler = service(row_records)     # a sampling.turns.TurnHandler for one rollout
    service.close()

An Environment (base.py) is plain Python: `reset(record)`, then `step(turn_text)` per model
turn -> StepResult(observation, reward, done). Shipped (registry.py, `--env=NAME?options`):
`verifier` (one turn, the record's verifier: today's rollouts), `calculator` (<calc>...</calc>,
exact arithmetic), `python` (ToRL's ```python / ```output, run in the code sandbox) and
`guess` (a number-guessing game over turns, data synthetic:guess). See docs/environments.md.
"""

from jaxrl4llm.envs.base import Environment, StepResult, VerifierEnvironment, answer_reward
from jaxrl4llm.envs.handler import (
    EnvService,
    EnvTurnHandler,
    open_env_service,
    stop_token_sequences,
)
from jaxrl4llm.envs.registry import ENVIRONMENTS, parse_env, register

__all__ = [
    "Environment",
    "StepResult",
    "VerifierEnvironment",
    "answer_reward",
    "EnvService",
    "EnvTurnHandler",
    "open_env_service",
    "stop_token_sequences",
    "ENVIRONMENTS",
    "parse_env",
    "register",
]
