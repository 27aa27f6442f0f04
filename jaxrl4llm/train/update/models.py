"""What a run trains (`Models`): the policy's state, PPO's critic state and the frozen
reference or LoRA base, as the update and the checkpoints see them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxrl4llm.models.lora import LoraConfig
from jaxrl4llm.train.update import adapters
from jaxrl4llm.train.update.state import TrainState

_increment = jax.jit(lambda step: step + 1)  # keeps the step a global (replicated) array


@dataclasses.dataclass(frozen=True)
class Models:
    """What the run trains, and the frozen reference: the policy's state (params, optimizer
    state, step, key), PPO's critic state (else None), the reference params (a separate
    copy, when the algorithm needs one; else None). With LoRA (`lora`), the state's params
    are the adapters, `base_params` the frozen base, and the reference is the base itself
    (the adapters off: no copy)."""

    state: TrainState
    critic_state: TrainState | None
    ref_params: Any
    base_params: Any = None
    lora: LoraConfig | None = None

    def policy_params(self) -> Any:
        """The params the policy samples and scores with (the base + adapters under LoRA)."""
        return adapters.policy(self.lora, self.base_params, self.state.params)

    def saved(self) -> Any:
        """What a checkpoint holds: the policy's state, with PPO's critic beside it."""
        if self.critic_state is None:
            return self.state
        return {"policy": self.state, "critic": self.critic_state}

    def restored(self, saved: Any) -> "Models":
        if self.critic_state is None:
            return dataclasses.replace(self, state=saved)
        return dataclasses.replace(self, state=saved["policy"], critic_state=saved["critic"])

    def next_step(self) -> "Models":
        """The step counters advanced after a training step."""
        critic_state = self.critic_state
        if critic_state is not None:
            critic_state = critic_state.replace(step=_increment(critic_state.step))
        return dataclasses.replace(
            self,
            state=self.state.replace(step=_increment(self.state.step)),
            critic_state=critic_state,
        )
