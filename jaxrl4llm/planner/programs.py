"""The programs of one training step, compiled for abstract inputs on a mesh (tools/plan.py).

Every input is a jax.ShapeDtypeStruct with the sharding the trainer gives it, so nothing is
allocated; each program is lowered and compiled exactly as the trainer's jit boundaries
compile it, then measured: memory_analysis(), the collectives and matmul FLOPs of its HLO.
The rollout's HLO right after SPMD partitioning also gives its weight gathers: once per call
before the decode loops (what the sampler does), against once per token inside them.

With LoRA (--lora_rank > 0) the programs are the run's: the state holds the adapters and their
Adam moments only (replicated), the frozen base params stay beside it (an argument of the
update, never donated), the policy's passes read the base with the adapters, and the
reference is the base itself (no second copy).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl4llm import parallel, rl
from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ARCHITECTURES, ModelConfig
from jaxrl4llm.models.lora import LoraConfig
from jaxrl4llm.planner import estimate as plan_estimate
from jaxrl4llm.planner import hlo_analysis
from jaxrl4llm.sampling import buckets, decode, sampler
from jaxrl4llm.train.config import TrainConfig, param_dtype
from jaxrl4llm.train.update import critic, logprobs, packing, step
from jaxrl4llm.train.update import state as state_lib


@dataclasses.dataclass
class Row:
    program: str
    calls: int  # per training step
    args: float  # bytes per device
    temp: float
    output: float
    alias: float  # outputs written into donated arguments
    resident: float  # live arrays outside the program (state, reference, batch)
    estimate: float  # hand estimate of `total`
    collectives: dict  # payload bytes per call by kind, and "link" bytes
    flops: float  # matmul FLOPs per call per device
    t_compute: float
    t_comm: float
    t_hbm: float

    @property
    def total(self) -> float:
        return self.args + self.temp + self.output - self.alias + self.resident

    @property
    def seconds(self) -> float:
        return max(self.t_compute, self.t_comm, self.t_hbm)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The rollout's rows and weight traffic. Bytes are per device, sent over a ring
    (hlo_analysis.Collective.link_bytes), read from the HLO right after SPMD partitioning."""

    rows: int  # sampled per training step
    slots: int  # rows decoded at once (a chunk)
    max_new_tokens: int
    weight_gathers: float  # the weights' gathers before the decode loops, per call
    in_loop: float  # collectives one iteration of each loop repeats on unchanged
    # values, summed over the loops (0)

    @property
    def weight_uses(self) -> int:
        """Forward passes over the weights per call: prefill + decode steps of every chunk."""
        return self.rows // self.slots * self.max_new_tokens


@dataclasses.dataclass
class Plan:
    title: str
    mesh: str
    topology: Any
    rows: list[Row]
    update_vs_textbook: float
    rollout: Rollout
    trained_params: int  # what the optimizer trains: every parameter, or the LoRA adapters'

    def rollout_seconds(self, per_token: bool) -> tuple[float, float]:
        """(rollout roofline time, its communication term) per call, the weights gathered
        once before the decode loops, or (per_token) in every prefill and decode step."""
        row = next(r for r in self.rows if r.program == "rollout")
        r, link_bw = self.rollout, self.topology.chip.link_bw
        extra = r.in_loop * r.weight_uses
        if per_token:
            extra += r.weight_gathers * (r.weight_uses - 1)
        comm = row.t_comm + extra / link_bw
        return max(row.t_compute, comm, row.t_hbm), comm


def architecture(model: str) -> ModelConfig:
    """The ModelConfig of --model: a local HF folder's config.json, else the architecture
    table entry named like the folder (e.g. /models/Qwen2.5-Math-7B -> qwen2.5-math-7b)."""
    if os.path.isfile(os.path.join(model, "config.json")):
        return ModelConfig.from_hf_config(model)
    name = os.path.basename(os.path.normpath(model)).lower()
    if name not in ARCHITECTURES:
        raise ValueError(
            f"--model={model!r}: no config.json there and {name!r} is not in "
            f"models/config.py ARCHITECTURES ({', '.join(sorted(ARCHITECTURES))}); "
            "pass --architecture=NAME or add the architecture there."
        )
    return ARCHITECTURES[name]


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_params(model_config: ModelConfig, mesh, dtype) -> Any:
    shapes = transformer.param_shapes(model_config)
    shardings = parallel.logical_to_sharding(
        transformer.param_logical_axes(model_config),
        mesh,
        shapes=jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=lambda x: isinstance(x, tuple)
        ),
    )
    return jax.tree.map(
        lambda s, sh: _abstract(s, dtype, sh),
        shapes,
        shardings,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def abstract_adapters(model_config: ModelConfig, lora: LoraConfig, mesh) -> dict[str, Any]:
    """LoRA adapters as adapters.trainable lays them out: float32, replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(
        lambda s: _abstract(s, jnp.float32, replicated),
        lora_lib.adapter_shapes(model_config, lora),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def abstract_policy(base: Any, trained: Any, lora: LoraConfig | None) -> Any:
    """The params the policy's passes read (adapters.policy): the trained params, or under
    LoRA the base with the adapter leaves in its layers (lora_lib.combine's tree)."""
    if lora is None:
        return trained
    return {**base, "layers": {**base["layers"], **trained["layers"]}}


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _rows(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    return _abstract(shape, dtype, parallel.batch_sharding(mesh, len(shape)))


def _link_bytes(ops) -> float:
    return sum(op.link_bytes for op in ops)


def _measure(compiled, calls: int, chip, unknown_trip_count: int = 1) -> dict:
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    ops = hlo_analysis.collectives(hlo, unknown_trip_count=unknown_trip_count)
    summary = hlo_analysis.summarize(ops)
    flops = hlo_analysis.matmul_flops(hlo, unknown_trip_count=unknown_trip_count)
    return dict(
        calls=calls,
        args=mem.argument_size_in_bytes,
        temp=mem.temp_size_in_bytes,
        output=mem.output_size_in_bytes,
        alias=mem.alias_size_in_bytes,
        collectives=summary,
        flops=flops,
        t_compute=flops / chip.peak_flops,
        t_comm=summary.get("link", 0.0) / chip.link_bw,
    )


def _packed_update(
    c: TrainConfig, mesh, batch: step.UpdateBatch, est: plan_estimate.Estimate
) -> tuple[step.UpdateBatch, Any, int]:
    """(batch, packed, loop trips) of the policy update as the trainer runs it: with
    --micro_batch_tokens=N the mini-batch's prompts cut to no columns and its sequences in
    ceil(M / dp) micro-batches of dp rows x N / dp slots (the longest row length), of which
    `est.packed_micro_batches()` run; else (batch, None, 1)."""
    N = c.update.micro_batch_tokens
    if not N:
        return batch, None, 1
    dp = parallel.data_parallel_size(mesh)
    K, M = -(-c.mini_batch // dp), c.mini_batch
    rows = parallel.ActivationSharding(mesh).named((None, "batch", None), (K, dp, N // dp))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    slots = _abstract((K, dp, N // dp), jnp.int32, rows)
    packed = packing.PackedBatch(
        **dict.fromkeys(packing.SLOT_FIELDS, slots),
        micro_M=_abstract((M,), jnp.int32, whole),
        start_M=_abstract((M,), jnp.int32, whole),
        num_micro=_abstract((), jnp.int32, whole),
    )
    return packing.for_update(batch), packed, est.packed_micro_batches()


def _bytes(tree) -> float:
    """Per-device bytes of a tree of abstract arrays (shards, not whole arrays)."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def abstract_critic_params(params: Any) -> dict[str, Any]:
    """PPO's critic params as critic.from_policy lays them out: the policy's without the
    unembedding, and a head shaped, typed and placed like the final norm."""
    return {
        "backbone": {k: v for k, v in params.items() if k != "unembed"},
        critic.HEAD: params["final_norm"],
    }


def plan(config: TrainConfig, model_config: ModelConfig, topo, devices) -> Plan:
    c, chip = config, topo.chip
    mesh = parallel.make_mesh(c.run.mesh, devices)
    sharding = parallel.ActivationSharding(mesh)
    dp = parallel.data_parallel_size(mesh)
    dtype = param_dtype(c.model.param_dtype)
    base = abstract_params(model_config, mesh, dtype)
    lora = c.lora if c.lora.enabled else None
    # What the optimizer trains (the state's params) and what the policy's passes read.
    trained = abstract_adapters(model_config, lora, mesh) if lora else base
    params = abstract_policy(base, trained, lora)
    optimizer = c.optimizer
    state_shardings = state_lib.state_shardings(trained, optimizer)
    abstract_state = state_lib.abstract_state(trained, optimizer, c.run.seed)
    est = (
        plan_estimate.LoraEstimate(c, model_config, mesh)
        if lora
        else plan_estimate.Estimate(c, model_config, mesh)
    )
    rows: list[Row] = []
    state_bytes, param_bytes = _bytes(abstract_state), _bytes(trained)
    # LoRA: the frozen base lives outside the state and is the reference (no copy).
    frozen_bytes = _bytes(base) if lora else 0.0
    ref_bytes = param_bytes if c.needs_reference and not lora else 0.0
    # PPO: the critic's state (params and Adam moments) lives beside every program.
    critic_state = (
        state_lib.abstract_state(
            abstract_critic_params(params),
            critic.optimizer_config(optimizer, c.critic.learning_rate),
            c.run.seed,
        )
        if c.needs_critic
        else None
    )
    critic_bytes = _bytes(critic_state) if critic_state is not None else 0.0

    # create: params in, state out.
    create = jax.jit(
        state_lib.TrainState.create, static_argnums=(1, 2), out_shardings=state_shardings
    )
    m = _measure(create.lower(trained, optimizer, c.run.seed).compile(), 0, chip)
    rows.append(
        Row(
            "create",
            resident=ref_bytes + critic_bytes + frozen_bytes,
            estimate=est.create(ref_bytes + critic_bytes + frozen_bytes),
            t_hbm=0.0,
            **m,
        )
    )

    # rollout: all rows of a step, in row chunks.
    G, B = c.rollout.group_size, c.batch_size
    P = buckets.bucket_prompt_length(c.rollout.max_prompt_tokens)
    N = c.rollout.max_new_tokens
    num_chunks = parallel.num_row_chunks(B, c.rollout.rollout_micro_batch, G)
    key_dtype = jax.random.key(0).dtype
    # ReMax samples one more (greedy) row per prompt in the same call, chunked and padded as
    # sampler.generate does it: chunks of whole prompts on whole data-parallel shards.
    remax = c.algorithm.advantage == "remax"
    Gs, Bs, sample_chunks = G + int(remax), B // G * (G + int(remax)), num_chunks
    if remax:
        unit, R = math.lcm(Gs, dp), c.rollout.rollout_micro_batch
        chunk = unit * max(1, R // unit) if R and R < Bs else unit
        sample_chunks = -(-Bs // chunk) if R and R < Bs else 1
        Bs = -(-Bs // chunk) * chunk
    lowered = sampler.generate_tokens.lower(
        params,
        _rows(mesh, (Bs, P), jnp.int32),
        _rows(mesh, (Bs, P), bool),
        _rows(mesh, (Bs,), bool),
        _rows(mesh, (Bs,), key_dtype),
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        model_config=model_config,
        sampling=c.rollout.sampling,
        max_new_tokens=N,
        mesh=mesh,
        prompt_group=Gs,
        num_chunks=sample_chunks,
        cache_dtype=dtype,
        greedy_B=_rows(mesh, (Bs,), bool) if remax else None,
    )
    # One device: nothing is partitioned, no collective to read.
    compiled, partitioned = (
        hlo_analysis.partitioned_hlo(lowered) if mesh.size > 1 else (lowered.compile(), "")
    )
    m = _measure(compiled, 1, chip, unknown_trip_count=N)
    scope = f"/{decode.WEIGHTS_SCOPE}/"
    rollout = Rollout(
        Bs,
        Bs // sample_chunks,
        N,
        _link_bytes(op for op in hlo_analysis.collectives(partitioned) if scope in op.op_name),
        _link_bytes(hlo_analysis.loop_invariant_collectives(partitioned)),
    )
    resident = state_bytes - param_bytes + ref_bytes + critic_bytes
    rows.append(
        Row(
            "rollout",
            resident=resident,
            estimate=est.rollout(num_chunks, resident),
            t_hbm=est.rollout_hbm_bytes(num_chunks) / chip.hbm_bw,
            **m,
        )
    )

    # reference / old-policy logprobs: one teacher-forced pass over the rollout's rows.
    seqs = logprobs.Sequences(
        prompt_tokens_BP=_rows(mesh, (B, P), jnp.int32),
        prompt_mask_BP=_rows(mesh, (B, P), bool),
        completion_tokens_BT=_rows(mesh, (B, N), jnp.int32),
        completion_mask_BT=_rows(mesh, (B, N), bool),
    )
    calls = int(c.needs_reference) + int(c.needs_old_logprobs and c.update.recompute_old_logprobs)
    temperature = c.rollout.sampling.effective_temperature
    tf_group = c.rollout.layout.prompt_group(B, num_chunks, dp)
    compiled = logprobs.completion_logprobs_jit.lower(
        params,
        model_config,
        seqs,
        temperature,
        prompt_group=tf_group,
        num_chunks=num_chunks,
        sharding=sharding,
    ).compile()
    m = _measure(compiled, calls, chip)
    rows.append(
        Row(
            "logprobs",
            resident=resident,
            estimate=est.logprobs(num_chunks, tf_group, resident),
            t_hbm=0.0,
            **m,
        )
    )
    if critic_state is not None:  # PPO: the critic's values of the rollout, once per step
        compiled = critic.values_jit.lower(
            critic_state.params,
            model_config,
            seqs,
            prompt_group=tf_group,
            num_chunks=num_chunks,
            sharding=sharding,
        ).compile()
        resident = (
            state_bytes + ref_bytes + critic_bytes + frozen_bytes - _bytes(critic_state.params)
        )
        rows.append(
            Row(
                "critic values",
                resident=resident,
                t_hbm=0.0,
                estimate=est.logprobs(num_chunks, tf_group, resident, unembed=False),
                **_measure(compiled, 1, chip),
            )
        )

    # update: one optimizer step on a mini-batch.
    M, num_micro = c.mini_batch, c.mini_batch // c.micro_batch
    mb_seqs = jax.tree.map(lambda x: _rows(mesh, (M,) + x.shape[1:], x.dtype), seqs)
    adv = jax.eval_shape(
        functools.partial(rl.compute_advantages, c.algorithm, group_size=G),
        jax.ShapeDtypeStruct((M,), jnp.float32),
        jax.ShapeDtypeStruct((M,), bool),
        jax.ShapeDtypeStruct((M, N), bool),
        truncated_B=jax.ShapeDtypeStruct((M,), bool),
        logp_BT=jax.ShapeDtypeStruct((M, N), jnp.float32),
        ref_logp_BT=jax.ShapeDtypeStruct((M, N), jnp.float32),
        baseline_B=jax.ShapeDtypeStruct((M,), jnp.float32),  # ReMax
        baseline_correct_B=jax.ShapeDtypeStruct((M,), bool),
        values_BT=jax.ShapeDtypeStruct((M, N), jnp.float32)  # PPO
        if c.needs_critic
        else None,
    )[0]
    logp = _rows(mesh, (M, N), jnp.float32)
    batch = step.UpdateBatch(
        seqs=mb_seqs,
        advantages=_rows(mesh, adv.shape, jnp.float32),
        keep_B=_rows(mesh, (M,), bool),
        old_logp_BT=logp if c.needs_old_logprobs else None,
        ref_logp_BT=logp if c.needs_reference else None,
        behaviour_logp_BT=logp if c.keeps_behaviour_logprobs else None,
        old_values_BT=logp if c.needs_critic else None,
        returns_BT=logp if c.needs_critic else None,
    )
    layout = c.rollout.layout.shuffled() if c.reshuffles_rows else c.rollout.layout
    update_group = layout.prompt_group(M, num_micro, dp)
    policy_batch, packed, trips = _packed_update(c, mesh, batch, est)
    compiled = step.train_step.lower(
        abstract_state,
        policy_batch,
        packed=packed,
        model_config=model_config,
        algorithm=c.update_algorithm,
        optimizer=optimizer,
        num_micro=num_micro,
        temperature=temperature,
        remat=c.model.remat,
        prompt_group=update_group,
        sharding=sharding,
        lora=lora,
        frozen=base if lora else None,
    ).compile()
    m = _measure(compiled, c.updates_per_step, chip, unknown_trip_count=trips)
    rollout_batch = (
        B
        / dp
        * (
            P * 5
            + N * (4 + 1 + 4 * (1 + c.needs_reference + c.needs_old_logprobs + 2 * c.needs_critic))
        )
    )
    resident = ref_bytes + rollout_batch + critic_bytes
    rows.append(
        Row(
            "update", resident=resident, estimate=est.update(update_group, resident), t_hbm=0.0, **m
        )
    )
    if critic_state is not None:  # PPO: the critic's update on every mini-batch
        compiled = critic.critic_step.lower(
            critic_state,
            batch,
            model_config=model_config,
            algorithm=c.update_algorithm,
            optimizer=critic.optimizer_config(optimizer, c.critic.learning_rate),
            num_micro=num_micro,
            remat=c.model.remat,
            prompt_group=update_group,
            sharding=sharding,
        ).compile()
        resident = state_bytes + ref_bytes + rollout_batch + frozen_bytes
        rows.append(
            Row(
                "critic update",
                resident=resident,
                t_hbm=0.0,
                estimate=est.update(update_group, resident, unembed=False, packed=False),
                **_measure(compiled, c.updates_per_step, chip),
            )
        )
    textbook = est.textbook_update_collectives(num_micro)
    update_bytes = sum(v for k, v in m["collectives"].items() if k != "link")
    shape = dict(zip(mesh.axis_names, mesh.devices.shape))
    title = (
        f"{os.path.basename(c.run.workdir)}: {model_config.num_params / 1e9:.2f}B params "
        f"{c.model.param_dtype}, {c.rollout.prompts_per_step} prompts x {G} = {B} rows, "
        f"{c.rollout.max_prompt_tokens}+{N} tokens, mini-batch {M}, "
        f"micro-batch {c.micro_batch}, rollout chunk {B // num_chunks} rows, "
        f"remat {c.model.remat}"
        + (
            f"; LoRA rank {lora.rank} on {','.join(lora.targets)}: "
            f"{_count(trained) / 1e6:.1f}M adapter params, frozen base (also the reference)"
            if lora
            else ""
        )
    )
    return Plan(
        title,
        ",".join(f"{k}:{v}" for k, v in shape.items()),
        topo,
        rows,
        update_bytes / textbook,
        rollout,
        _count(trained),
    )
