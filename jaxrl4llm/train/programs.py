"""The compiled programs of one training step, built once from the run's configuration.

`StepPrograms` is their one owner: the trainer calls them (train/rollout/stage.py, the
update stage in train/updater.py), tools/plan.py lowers exactly these on abstract inputs
(planner/programs.py), and the benchmarks time them. Each is a `jaxrl4llm.program.Program`:
the jitted function with the run's static settings bound, called with arrays only. The
settings that depend on a batch's rows (how its rows split into chunks of whole prompt
groups) are computed here too, from the row count, so a planner and a run holding the same
shapes cannot choose differently.

    name            function                          per call
    create          state.TrainState.create           params (the trained ones)
    sample          sampling.sampler.decode_program   prompt rows, keys, stop ids
    segment         sampling.paged_segments.segment   laid-out weights, queue, state, stop ids
                    (DAPO by admission: `by_admission`, instead of sample)
    logprobs        update.logprobs.completion_logprobs_jit    params, sequences
    packed_logprobs update.packing.logprobs_jit       params, packed rows, mask
    values          update.critic.values_jit          critic params, sequences
    packed_values   update.critic.packed_values_jit   critic params, packed rows, mask
    advantages      update.advantages.advantages      rewards, verdicts, masks, logprobs
    policy_update   update.step.train_step            state, mini-batch (+ packed rows)
    critic_update   update.critic.critic_step         critic state, mini-batch
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.program import Program
from jaxrl4llm.sampling import paged, paged_mesh, paged_segments, sampler
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.optimizer import OptimizerConfig
from jaxrl4llm.train.update import advantages, critic, logprobs, packing, step
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.state import create_jit


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The step's programs for one run: `config` (validated), the policy's `model_config`
    (with --compute_dtype) and the run's `mesh` (None: no mesh, one device)."""

    config: TrainConfig
    model_config: ModelConfig
    mesh: Mesh | None

    @property
    def sharding(self) -> parallel.ActivationSharding | None:
        return None if self.mesh is None else parallel.ActivationSharding(self.mesh)

    @property
    def data_parallel(self) -> int:
        return 1 if self.mesh is None else parallel.data_parallel_size(self.mesh)

    @property
    def temperature(self) -> float:
        return self.config.rollout.sampling.effective_temperature

    @property
    def num_micro(self) -> int:
        return self.config.mini_batch // self.config.micro_batch

    @property
    def routing_record(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) of the sampler's routing record, which a mixture
        of experts' single-turn rollouts keep (TrainConfig.records_routing); None
        when there is none."""
        if not (self.model_config.moe_layers and self.config.records_routing):
            return None
        return len(self.model_config.moe_layers), self.model_config.moe.experts_per_token

    # -- settings that follow from a batch's rows ----------------------------------------

    def teacher_forced_chunks(self, rows: int) -> tuple[int, int]:
        """(prompt_group, num_chunks) of the rollout's teacher-forced passes over `rows`
        rows: chunks of at most --rollout_micro_batch rows holding whole groups, each
        group's prompt run once when the layout shares it."""
        layout = self.config.rollout.layout
        group = layout.group_size if rows % layout.group_size == 0 else 1
        chunks = parallel.num_row_chunks(rows, self.config.rollout.rollout_micro_batch, group)
        return layout.prompt_group(rows, chunks, self.data_parallel), chunks

    def update_group(self, batch: UpdateBatch) -> int:
        """The prompt group of a mini-batch's micro-batches: rows still in their groups run
        each group's prompt once."""
        rows = batch.keep_B.shape[0]
        return batch.layout.prompt_group(rows, self.num_micro, self.data_parallel)

    # -- the programs -----------------------------------------------------------------------

    def create(self, trained: Any) -> Program:
        """TrainState.create for the trained params `trained` (arrays or abstract), its
        optimizer state born with the params' sharding (state.create_state)."""
        optimizer = self.config.optimizer
        fn = create_jit(trained, optimizer)
        return Program("create", fn, dict(optimizer=optimizer, seed=self.config.run.seed))

    def sample(
        self,
        prompt_group: int,
        num_chunks: int,
        *,
        greedy: bool = False,
        compact: bool = True,
        cache_dtype: Any = None,
        rows: int = 0,
        prompt_len: int = 0,
    ) -> Program:
        """The rollout's decode program for rows in `num_chunks` chunks of whole groups of
        `prompt_group` (sampler.generate picks both for a bucket of rows; `greedy`: some
        rows decode greedily, ReMax's baseline). `cache_dtype`: the KV cache's (default:
        the backend's choice, decode.cache_dtype_for; a planner on CPU passes the one the
        planned accelerator would choose). With the paged engine, `rows` x `prompt_len` is
        the bucket, which sizes its page pool (paged.program_settings, as sampler.generate)."""
        r = self.config.rollout
        paged_settings = paged.program_settings(
            r.pool_tokens,
            r.rollout_micro_batch,
            rows,
            prompt_len,
            r.max_new_tokens,
            prompt_group,
            shards=paged_mesh.shards(self.mesh, parallel.DEFAULT_RULES),
        )
        return sampler.decode_program(
            model_config=self.model_config,
            sampling=r.sampling,
            max_new_tokens=r.max_new_tokens,
            mesh=self.mesh,
            rules=parallel.DEFAULT_RULES,
            prompt_group=prompt_group,
            num_chunks=num_chunks,
            compact=compact,
            greedy=greedy,
            cache_dtype=cache_dtype,
            kv_pages=paged_settings.get("kv_pages", 0),
            max_rows=paged_settings.get("max_rows", 0),
            record_routing=self.routing_record is not None,
        )

    @property
    def by_admission(self) -> bool:
        """Whether the rollout samples DAPO's dynamic sampling by admission (rounds.admits on
        the run's one engine: single-turn, without ReMax's greedy rows): `segment`'s program,
        not `sample`'s."""
        c = self.config
        return (
            c.rollout.dynamic.dynamic_sampling
            and c.algorithm.advantage != "remax"
            and (not c.rollout.env)
        )

    @property
    def admission_layout(self) -> tuple[int, int]:
        """By admission: (slots, decode rows) of each batch shard over the step's groups, as
        paged_driver.Driver lays them out on one host (paged_segments.shard_layout; on
        several, each host's groups over its own shards, as many per shard)."""
        r = self.config.rollout
        D = paged_mesh.shards(self.mesh, parallel.DEFAULT_RULES)
        groups = self.config.batch_size // r.group_size
        return paged_segments.shard_layout(groups, r.group_size, D, D, r.rollout_micro_batch)

    def segment(self) -> Program:
        """By admission: the paged engine's segment program over `admission_layout`'s decode
        rows."""
        r, mesh = self.config.rollout, self.mesh
        _, rows = self.admission_layout
        return paged_segments.segment_program(
            r.sampling,
            mesh if mesh is not None and mesh.size > 1 else None,
            parallel.DEFAULT_RULES,
            model_config=self.model_config,
            max_new_tokens=r.max_new_tokens,
            decode_rows=rows,
            group=r.group_size,
            record_routing=self.routing_record is not None,
        )

    def logprobs(self, rows: int) -> Program:
        """Teacher-forced logprobs (reference, recomputed pi_old) of `rows` padded rows."""
        prompt_group, num_chunks = self.teacher_forced_chunks(rows)
        static = dict(
            config=self.model_config,
            temperature=self.temperature,
            prompt_group=prompt_group,
            num_chunks=num_chunks,
            sharding=self.sharding,
        )
        return Program("logprobs", logprobs.completion_logprobs_jit, static)

    def values(self, rows: int) -> Program:
        """PPO's critic values of `rows` padded rows."""
        prompt_group, num_chunks = self.teacher_forced_chunks(rows)
        static = dict(
            config=self.model_config,
            prompt_group=prompt_group,
            num_chunks=num_chunks,
            sharding=self.sharding,
        )
        return Program("values", critic.values_jit, static)

    @property
    def packed_logprobs(self) -> Program:
        """`logprobs` on the batch's sequences packed (--micro_batch_tokens)."""
        static = dict(config=self.model_config, temperature=self.temperature)
        return Program(
            "packed_logprobs", packing.logprobs_jit, dict(static, sharding=self.sharding)
        )

    @property
    def packed_values(self) -> Program:
        """`values` on the batch's sequences packed (--micro_batch_tokens)."""
        static = dict(config=self.model_config, sharding=self.sharding)
        return Program("packed_values", critic.packed_values_jit, static)

    @property
    def advantages(self) -> Program:
        """The algorithm's advantages (and PPO's returns) of the global batch."""
        static = dict(
            config=self.config.algorithm, group_size=self.config.rollout.layout.group_size
        )
        return Program("advantages", advantages.advantages, static)

    def policy_update(self, prompt_group: int, length_classes: tuple[int, ...]) -> Program:
        """One optimizer step of the policy on a mini-batch (`length_classes`: its
        micro-batches' completion lengths, --micro_batch_length_classes)."""
        lora = self.config.lora if self.config.lora.enabled else None
        static = self._update_static(prompt_group, self.config.optimizer)
        router = self.config.router
        static.update(
            temperature=self.temperature,
            lora=lora,
            length_classes=length_classes,
            router_coefs=(router.router_aux_loss_coef, router.router_z_loss_coef),
        )
        return Program("policy_update", step.train_step, static)

    def critic_update(self, prompt_group: int) -> Program:
        """One optimizer step of PPO's critic on a mini-batch."""
        static = self._update_static(prompt_group, self.critic_optimizer)
        return Program("critic_update", critic.critic_step, static)

    def _update_static(self, prompt_group: int, optimizer: OptimizerConfig) -> dict[str, Any]:
        """The settings both updates share (step.UPDATE_STATICS)."""
        c = self.config
        return dict(
            model_config=self.model_config,
            algorithm=c.update_algorithm,
            optimizer=optimizer,
            num_micro=self.num_micro,
            remat=c.model.remat,
            sharding=self.sharding,
            prompt_group=prompt_group,
        )

    @property
    def critic_optimizer(self) -> OptimizerConfig:
        """The critic's optimizer settings: the policy's, with --critic_learning_rate."""
        return critic.optimizer_config(self.config.optimizer, self.config.critic.learning_rate)
