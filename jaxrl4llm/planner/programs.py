"""The programs of one training step, compiled for abstract inputs on a mesh (tools/plan.py).

The programs are the trainer's own (train/programs.py, `StepPrograms`, built from the run's
configuration): the planner lowers them on abstract inputs (planner/abstract.py) carrying
the shardings the trainer gives the real arrays, so
nothing is allocated; then it measures each: memory_analysis(), the collectives and matmul
FLOPs of its HLO. The rollout's HLO right after SPMD partitioning also gives its weight
gathers: once per call before the decode loops (what the sampler does), against once per
token inside them.

With LoRA (--lora_rank > 0) the programs are the run's: the state holds the adapters and their
Adam moments only (replicated), the frozen base params stay beside it (an argument of the
update, never donated), the policy's passes read the base with the adapters, and the
reference is the base itself (no second copy).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jaxrl4llm import rl
from jaxrl4llm.models.architectures import ARCHITECTURES
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.planner import abstract as abs_lib
from jaxrl4llm.planner import rollout as rollout_lib
from jaxrl4llm.planner.abstract import per_device_bytes
from jaxrl4llm.planner.measured import Rollout, Row, measure
from jaxrl4llm.planner.shared import Setup, setup
from jaxrl4llm.planner.topology import Topology
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.update import minibatches, packing
from jaxrl4llm.train.update.batch import UpdateBatch, length_classes
from jaxrl4llm.train.update.logprobs import Sequences


@dataclasses.dataclass
class Plan:
    title: str
    mesh: str
    topology: Any
    rows: list[Row]
    update_vs_textbook: float
    rollout: Rollout
    trained_params: int  # what the optimizer trains: every parameter, or the LoRA adapters'
    expert_layout: str = ""  # abstract.expert_layout: "" without experts
    estimate: Any = None  # the hand estimate's symbols (planner/pool.py reads them)

    def rollout_seconds(self, per_token: bool) -> tuple[float, float]:
        """(rollout roofline time, its communication term) per step (every call of the
        rollout's program), the weights gathered once before the decode loops, or
        (per_token) in every prefill and decode step."""
        row = next(r for r in self.rows if r.program == "rollout")
        r, link_bw, n = self.rollout, self.topology.chip.link_bw, row.calls
        extra = r.in_loop * r.weight_uses + (r.weight_gathers if r.apart else 0.0)
        if per_token:
            extra += r.weight_gathers * (r.weight_uses - 1)
        comm = n * row.t_comm + extra / link_bw
        return max(n * row.t_compute, comm, n * row.t_hbm), comm


def architecture(model: str) -> ModelConfig:
    """The ModelConfig of --model: a local HF folder's config.json, else the architecture
    table entry named like the folder (e.g. /models/Qwen2.5-Math-7B -> qwen2.5-math-7b)."""
    if os.path.isfile(os.path.join(model, "config.json")):
        return ModelConfig.from_hf_config(model)
    name = os.path.basename(os.path.normpath(model)).lower()
    if name not in ARCHITECTURES:
        raise ValueError(
            f"--model={model!r}: no config.json there and {name!r} is not in "
            f"models/architectures.py ARCHITECTURES ({', '.join(sorted(ARCHITECTURES))}); "
            "pass --architecture=NAME or add the architecture there."
        )
    return ARCHITECTURES[name]


def plan(
    config: TrainConfig, model_config: ModelConfig, topo: Topology, devices: Sequence[Any]
) -> Plan:
    """Every program of one training step of `config`, compiled and measured."""
    s = setup(config, model_config, topo, devices)
    rows = [create_row(s)]
    rollout_row, rollout = rollout_lib.sample_row(s)
    rows += [rollout_row, *teacher_forced_rows(s), *update_rows(s)]
    update = next(r for r in rows if r.program == "update")
    textbook = s.est.textbook_update_collectives(s.programs.num_micro)
    update_bytes = sum(v for k, v in update.collectives.items() if k != "link")
    shape = dict(zip(s.mesh.axis_names, s.mesh.devices.shape))
    return Plan(
        _title(s, model_config),
        ",".join(f"{k}:{v}" for k, v in shape.items()),
        topo,
        rows,
        update_bytes / textbook,
        rollout,
        abs_lib.count(s.trained),
        abs_lib.expert_layout(s.base, model_config, s.mesh),
        estimate=s.est,
    )


def create_row(s: Setup) -> Row:
    """TrainState.create: params in, state out."""
    m = measure(s.programs.create(s.trained).lower(s.trained).compile(), 0, s.chip)
    resident = s.ref_bytes + s.critic_bytes + s.frozen_bytes
    return Row("create", resident=resident, estimate=s.est.create(resident), t_hbm=0.0, **m)


def lower_logprobs(s: Setup, B: int, P: int, T: int) -> Any:
    """The teacher-forced logprobs of B rows of P prompt and T completion columns (with
    --routing_replay, the old-policy pass's: the routing record beside them)."""
    replay = s.config.router.routing_replay
    seqs = abs_lib.sequences(s.mesh, B, P, T, s.programs.routing_record if replay else None)
    return s.lower(s.programs.logprobs(B))(s.params, seqs=seqs)


def lower_values(s: Setup, B: int, P: int, T: int) -> Any:
    """PPO's critic values of B rows of P prompt and T completion columns."""
    seqs = abs_lib.sequences(s.mesh, B, P, T)
    return s.lower(s.programs.values(B))(s.critic_state.params, seqs=seqs)


def teacher_forced_rows(s: Setup) -> list[Row]:
    """Reference / old-policy logprobs: one teacher-forced pass over the rollout's rows; PPO:
    the critic's values of the rollout, once per step."""
    c, (B, P, N) = s.config, s.rows
    group, num_chunks = s.programs.teacher_forced_chunks(B)
    calls = int(c.needs_reference) + int(c.needs_old_logprobs and c.update.recompute_old_logprobs)
    resident = s.state_bytes - s.param_bytes + s.ref_bytes + s.critic_bytes
    compiled = lower_logprobs(s, B, P, N).compile()
    rows = [
        Row(
            "logprobs",
            resident=resident,
            estimate=s.est.logprobs(num_chunks, group, resident),
            t_hbm=0.0,
            **measure(compiled, calls, s.chip),
        )
    ]
    if s.critic_state is not None:
        compiled = lower_values(s, B, P, N).compile()
        resident = (
            s.state_bytes
            + s.ref_bytes
            + s.critic_bytes
            + s.frozen_bytes
            - per_device_bytes(s.critic_state.params)
        )
        rows.append(
            Row(
                "critic values",
                resident=resident,
                t_hbm=0.0,
                estimate=s.est.logprobs(num_chunks, group, resident, unembed=False),
                **measure(compiled, 1, s.chip),
            )
        )
    return rows


def mini_batch(s: Setup, P: int, N: int) -> UpdateBatch:
    """One mini-batch of the rollout's rows (P prompt, N completion columns) as the update
    receives it."""
    c, M = s.config, s.config.mini_batch
    seqs: Sequences = abs_lib.sequences(
        s.mesh, M, P, N, s.programs.routing_record, c.router.routing_replay
    )
    adv = jax.eval_shape(
        functools.partial(rl.compute_advantages, c.algorithm, group_size=c.rollout.group_size),
        jax.ShapeDtypeStruct((M,), jnp.float32),
        jax.ShapeDtypeStruct((M,), bool),
        jax.ShapeDtypeStruct((M, N), bool),
        truncated_B=jax.ShapeDtypeStruct((M,), bool),
        logp_BT=jax.ShapeDtypeStruct((M, N), jnp.float32),
        ref_logp_BT=jax.ShapeDtypeStruct((M, N), jnp.float32),
        baseline_B=jax.ShapeDtypeStruct((M,), jnp.float32),  # ReMax
        baseline_correct_B=jax.ShapeDtypeStruct((M,), bool),
        values_BT=jax.ShapeDtypeStruct((M, N), jnp.float32) if c.needs_critic else None,
    )[0]
    sort = minibatches.sorts_by_length(c)
    layout = c.rollout.layout.shuffled() if c.reshuffles_rows or sort else c.rollout.layout
    return dataclasses.replace(abs_lib.update_batch(c, s.mesh, seqs, adv), layout=layout)


def lower_update(s: Setup, P: int, N: int) -> Any:
    """The policy's update on a mini-batch of P prompt and N completion columns (packed
    with --micro_batch_tokens; LoRA: the frozen base beside the state)."""
    c = s.config
    batch = mini_batch(s, P, N)
    policy_batch, packed = batch, None
    if c.update.micro_batch_tokens:  # the packed rows hold the prompts
        policy_batch, packed = packing.for_update(batch), abs_lib.packed_rows(c, s.mesh)
    sort = minibatches.sorts_by_length(c)
    classes = length_classes(N, c.update.micro_batch_length_classes) if sort else ()
    program = s.programs.policy_update(s.programs.update_group(batch), classes)
    frozen = s.base if s.lora else None
    return s.lower(program)(s.state, policy_batch, packed=packed, frozen=frozen, dropout_key=None)


def lower_critic_update(s: Setup, P: int, N: int) -> Any:
    """PPO's critic update on a mini-batch of P prompt and N completion columns."""
    batch = mini_batch(s, P, N)
    program = s.programs.critic_update(s.programs.update_group(batch))
    return s.lower(program)(s.critic_state, batch)


def update_rows(s: Setup) -> list[Row]:
    """The policy's update on one mini-batch (and PPO's critic update)."""
    c, (B, P, N) = s.config, s.rows
    trips = s.est.packed_micro_batches() if c.update.micro_batch_tokens else 1
    compiled = lower_update(s, P, N).compile()
    group = s.programs.update_group(mini_batch(s, P, N))
    m = measure(compiled, c.updates_per_step, s.chip, unknown_trip_count=trips)
    per_row = P * 5 + N * (4 + 1 + 4 * (1 + c.needs_reference + c.needs_old_logprobs))
    rollout_batch = B / s.programs.data_parallel * (per_row + N * 4 * 2 * c.needs_critic)
    resident = s.ref_bytes + rollout_batch + s.critic_bytes
    rows = [
        Row("update", resident=resident, estimate=s.est.update(group, resident), t_hbm=0.0, **m)
    ]
    if s.critic_state is not None:
        compiled = lower_critic_update(s, P, N).compile()
        resident = s.state_bytes + s.ref_bytes + rollout_batch + s.frozen_bytes
        rows.append(
            Row(
                "critic update",
                resident=resident,
                t_hbm=0.0,
                estimate=s.est.update(group, resident, unembed=False, packed=False),
                **measure(compiled, c.updates_per_step, s.chip),
            )
        )
    return rows


def _title(s: Setup, model_config: ModelConfig) -> str:
    c, (B, _, N), num_chunks = s.config, s.rows, s.rollout_chunks
    lora = s.lora
    return (
        f"{os.path.basename(c.run.workdir)}: {model_config.num_params / 1e9:.2f}B params "
        f"{c.model.param_dtype}, {c.rollout.prompts_per_step} prompts x "
        f"{c.rollout.group_size} = {B} rows, "
        f"{c.rollout.max_prompt_tokens}+{N} tokens, mini-batch {c.mini_batch}, "
        f"micro-batch {c.micro_batch}, rollout chunk {B // num_chunks} rows, "
        f"remat {c.model.remat}"
        + (
            f"; LoRA rank {lora.rank} on {','.join(lora.targets)}: "
            f"{abs_lib.count(s.trained) / 1e6:.1f}M adapter params, frozen base (also the "
            "reference)"
            if lora
            else ""
        )
    )
