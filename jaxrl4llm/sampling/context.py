"""RolloutContext: what stays fixed across the trainer's rollouts and the evaluator's draws:
the sampling front-end, the reward function, how records become prompts and how they are
sampled (RolloutConfig).

The reward function and the prompt format are typed by what sampling asks of them (the
protocols below), so this layer imports neither rewards/ nor data/: rewards.RewardFn and
data.config.DataConfig are what the trainer and the evaluator pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Self, Sequence

import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling.config import RolloutConfig
from jaxrl4llm.sampling.frontend import Sampler
from jaxrl4llm.sampling.turns import HandlerFactory


class RowVerdicts(Protocol):
    """A reward function's verdicts on B rows (rewards.RewardBatch)."""

    @property
    def rewards(self) -> np.ndarray: ...  # float32 [B]

    @property
    def correct(self) -> np.ndarray: ...  # bool [B]

    @property
    def failed(self) -> np.ndarray: ...  # bool [B]: verification did not finish

    def take(self, rows: np.ndarray) -> Self: ...

    def join(self, *others: Self) -> Self: ...


def has_spread(verdicts: RowVerdicts, group_size: int) -> np.ndarray:
    """bool [groups]: the group's valid rows hold both a correct and a wrong one (DAPO eq. 11;
    groups of `group_size` consecutive rows)."""
    valid = ~verdicts.failed
    correct = (verdicts.correct & valid).reshape(-1, group_size)
    wrong = (~verdicts.correct & valid).reshape(-1, group_size)
    return correct.any(axis=1) & wrong.any(axis=1)


class RewardFunction(Protocol):
    """Scores completions against their records (rewards.RewardFn)."""

    def score(
        self, completions: Sequence[str], records: Sequence[Any], lengths: np.ndarray | None = None
    ) -> RowVerdicts: ...

    def answer_keys(
        self, completions: Sequence[str], records: Sequence[Any]
    ) -> list[str | None]: ...


class PromptFormat(Protocol):
    """How a record becomes chat messages (data.config.DataConfig)."""

    def messages(self, record: Any) -> list[dict[str, str]]: ...


@dataclasses.dataclass(frozen=True)
class RolloutContext:
    """What stays fixed across rollouts and evaluations: the sampling front-end, the reward
    function, how records become prompts and how they are sampled. With `turn_handlers` (an
    environment) rollouts are multi-turn (sampling.multiturn, limits rollout.turns) and the
    trajectories' rewards are their turns' (the reward function is not called)."""

    sampler: Sampler
    reward_fn: RewardFunction
    data: PromptFormat
    rollout: RolloutConfig
    turn_handlers: HandlerFactory | None = None

    @classmethod
    def create(
        cls,
        model_config: ModelConfig,
        tokenizer: Any,
        reward_fn: RewardFunction,
        mesh: Mesh | None,
        data: PromptFormat,
        rollout: RolloutConfig,
        turn_handlers: HandlerFactory | None = None,
        **sampler_options: Any,
    ) -> RolloutContext:
        """`sampler_options` go to Sampler (e.g. stop_ids=() to sample exactly
        max_new_tokens tokens). `turn_handlers`: see the class."""
        sampler = Sampler(
            model_config,
            tokenizer,
            mesh=mesh,
            max_prompt_len=rollout.max_prompt_tokens,
            long_prompts=rollout.long_prompts,
            max_rows=rollout.rollout_micro_batch or None,
            kv_cache_tokens=rollout.pool_tokens,
            **sampler_options,
        )
        return cls(sampler, reward_fn, data, rollout, turn_handlers)

    @property
    def sharding(self) -> parallel.ActivationSharding | None:
        """Activation layout of the teacher-forced passes and the update (None: no mesh)."""
        mesh = self.sampler.mesh
        return None if mesh is None else parallel.ActivationSharding(mesh)
