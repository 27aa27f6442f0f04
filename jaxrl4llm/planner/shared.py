"""What every program of a plan shares (`Setup`): the run's programs (the trainer's
StepPrograms) on a mesh of the topology's simulated devices, their abstract params and
states (planner/abstract.py), the chip, the hand estimate and the bytes resident beside the
programs. planner/programs.py and planner/rollout.py plan each program from it."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.planner import abstract as abs_lib
from jaxrl4llm.planner import estimate as plan_estimate
from jaxrl4llm.planner.abstract import per_device_bytes
from jaxrl4llm.planner.topology import Chip, Topology
from jaxrl4llm.sampling import buckets, decode
from jaxrl4llm.train.config import TrainConfig, param_dtype
from jaxrl4llm.train.programs import StepPrograms
from jaxrl4llm.train.update import state as state_lib


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every program of a plan shares: the run's programs, its abstract params and
    states, and the bytes that stay resident beside the programs."""

    programs: StepPrograms
    chip: Chip
    est: plan_estimate.Estimate
    base: Any  # the policy's params (under LoRA the frozen base)
    trained: Any  # what the optimizer trains: the params, or the LoRA adapters
    params: Any  # what the policy's passes read
    state: Any  # the policy's abstract TrainState
    critic_state: Any  # PPO's; else None
    state_bytes: float
    param_bytes: float
    frozen_bytes: float  # LoRA: the frozen base, outside the state (also the reference)
    ref_bytes: float  # the reference's copy (none under LoRA)
    critic_bytes: float
    # The KV cache the planned devices' run allocates (float32 on the CPU test devices).
    cache_dtype: Any
    platform: str | None = None  # jax.export's platform to lower for (None: these devices)

    def lower(self, program: Any) -> Any:
        """`program.lower`, or its export for `platform` (planner/target.py)."""
        return program.lower if self.platform is None else program.export(self.platform)

    @property
    def config(self) -> TrainConfig:
        return self.programs.config

    @property
    def mesh(self) -> Mesh:
        assert self.programs.mesh is not None  # the planner always plans on a mesh
        return self.programs.mesh

    @property
    def lora(self) -> Any:
        return self.config.lora if self.config.lora.enabled else None

    @property
    def rollout_chunks(self) -> int:
        """The row chunks the rollout's sampler and teacher-forced passes run the batch in."""
        return self.programs.teacher_forced_chunks(self.config.batch_size)[1]

    @property
    def rows(self) -> tuple[int, int, int]:
        """(B, P, N): the rollout's rows, prompt columns (bucketed) and completion columns."""
        r = self.config.rollout
        return (
            self.config.batch_size,
            buckets.bucket_prompt_length(r.max_prompt_tokens),
            (r.max_new_tokens),
        )


def setup(
    config: TrainConfig, model_config: ModelConfig, topo: Topology, devices: Sequence[Any]
) -> Setup:
    """The run's programs on a mesh of `devices`, and their abstract params and states; the
    model computes in --compute_dtype, as the trainer's (train/services.py)."""
    c = config
    model_config = c.model.compute_config(model_config)
    mesh = parallel.make_mesh(c.run.mesh, devices)
    base = abs_lib.abstract_params(model_config, mesh, param_dtype(c.model.param_dtype))
    lora = c.lora if c.lora.enabled else None
    trained = abs_lib.abstract_adapters(model_config, lora, mesh) if lora else base
    params = abs_lib.abstract_policy(base, trained, lora)
    programs = StepPrograms(c, model_config, mesh)
    state = state_lib.abstract_state(trained, c.optimizer, c.run.seed)
    critic_state = None
    if c.needs_critic:  # PPO: the critic's state (params and Adam moments) beside every program
        critic_params = abs_lib.abstract_critic_params(params)
        critic_state = state_lib.abstract_state(
            critic_params, programs.critic_optimizer, c.run.seed
        )
    est_class = plan_estimate.LoraEstimate if lora else plan_estimate.Estimate
    compute = param_dtype(c.model.compute_dtype or c.model.param_dtype)
    cache_dtype = decode.cache_dtype_of(compute, backend=topo.backend)
    param_bytes = per_device_bytes(trained)
    return Setup(
        programs=programs,
        chip=topo.chip,
        est=est_class(c, model_config, mesh, cache_bytes=jnp.dtype(cache_dtype).itemsize),
        base=base,
        trained=trained,
        params=params,
        state=state,
        critic_state=critic_state,
        state_bytes=per_device_bytes(state),
        param_bytes=param_bytes,
        frozen_bytes=per_device_bytes(base) if lora else 0.0,
        ref_bytes=param_bytes if c.needs_reference and not lora else 0.0,
        critic_bytes=per_device_bytes(critic_state) if critic_state is not None else 0.0,
        cache_dtype=cache_dtype,
    )
