"""Environments by name: `--env=NAME?key=value&key=value` (as the synthetic data sources).

    parse_env("calculator?max_calls=2")   # -> (CalculatorEnvironment, its Options(max_calls=2))
    register("echo", EchoEnvironment)     # a user's own (see docs/environments.md)

An empty spec is no environment: the single-turn rollout, scored by the reward function.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any
from urllib.parse import unquote

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.data.records import DataError
from jaxrl4llm.data.rows import convert_option
from jaxrl4llm.envs.base import Environment, VerifierEnvironment
from jaxrl4llm.envs.calculator import CalculatorEnvironment
from jaxrl4llm.envs.guess import GuessEnvironment
from jaxrl4llm.envs.python_tool import PythonEnvironment

ENVIRONMENTS: dict[str, type[Environment]] = {
    "verifier": VerifierEnvironment,  # one turn, scored by the record's verifier
    "calculator": CalculatorEnvironment,  # <calc>expression</calc>, evaluated exactly
    "python": PythonEnvironment,  # ToRL's ```python blocks run in the code sandbox
    "guess": GuessEnvironment,  # the number-guessing game (synthetic:guess)
}


def register(name: str, env_class: type[Environment]) -> None:
    """Makes `--env=name` build `env_class` (an Environment subclass)."""
    if not (isinstance(env_class, type) and issubclass(env_class, Environment)):
        raise TypeError(f"register({name!r}, ...) needs an Environment subclass")
    ENVIRONMENTS[name] = env_class


def parse_env(spec: str) -> tuple[type[Environment], Any]:
    """`NAME?key=value&...` -> (the environment class, its Options). Raises FlagError naming
    --env and the valid names or options."""
    name, _, query = spec.partition("?")
    if name not in ENVIRONMENTS:
        raise FlagError(
            f"--env={spec}: unknown environment {name!r}; valid: {', '.join(sorted(ENVIRONMENTS))}"
        )
    env_class = ENVIRONMENTS[name]
    types = typing.get_type_hints(env_class.Options)
    fields = {f.name: types[f.name] for f in dataclasses.fields(env_class.Options)}
    valid = ", ".join(f"{k} ({v.__name__})" for k, v in fields.items()) or "none"
    values: dict[str, Any] = {}
    try:
        for item in filter(None, query.split("&")):
            key, eq, value = (unquote(part) for part in item.partition("="))
            if not eq or key not in fields:
                raise DataError(f"unknown option {item!r}; valid options: {valid}")
            values[key] = convert_option(value, fields[key], key, valid)
        return env_class, env_class.Options(**values)
    except (DataError, ValueError) as exc:
        raise FlagError(f"--env={spec}: {exc}") from None
