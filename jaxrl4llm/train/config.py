"""TrainConfig: everything a run needs, as a tree of frozen sub-configs, one per concern.

Every leaf field is a command-line flag with a flat name (jaxrl4llm.config.options is the mechanism,
jaxrl4llm.config.cli defines the flags): its type, default and help come from the field and its
class docstring's "name: text" line, so a new field is a new flag. Where a field's flag name
differs from the field name (`--model` for model.name, `--lr_schedule` for
optimizer.schedule), or its values are a fixed set, the mount below says so. The groups that
layers below the trainer read too live with them: DataConfig (data/config.py), RolloutConfig
(sampling/config.py), EvalConfig (eval/config.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax

from jaxrl4llm import envs, parallel, rl
from jaxrl4llm.config import options
from jaxrl4llm.config.errors import FlagError, flag_errors
from jaxrl4llm.config.options import group, require
from jaxrl4llm.data import prompts
from jaxrl4llm.data.config import DataConfig
from jaxrl4llm.eval.config import EvalConfig
from jaxrl4llm.models import peft_format
from jaxrl4llm.models.lora import LoraConfig
from jaxrl4llm.rewards.code import MODES as CODE_MODES
from jaxrl4llm.rewards.math_verifier import ANSWER_MODES
from jaxrl4llm.rewards.registry import TASK_VERIFIERS, RewardConfig
from jaxrl4llm.rewards.sandbox import ISOLATION as CODE_ISOLATION
from jaxrl4llm.rewards.shaping import SCALES
from jaxrl4llm.sampling import rounds
from jaxrl4llm.sampling.buckets import LONG_PROMPT_MODES
from jaxrl4llm.sampling.config import RolloutConfig
from jaxrl4llm.train import partial, trackers
from jaxrl4llm.train.state import SCHEDULES, OptimizerConfig

DTYPES = ("float32", "bfloat16")
# Below this learning rate, bfloat16 parameters lose most Adam steps to rounding (a step of
# about lr moves a weight of size ~0.01-0.1 by less than half its bf16 spacing).
BF16_MIN_LEARNING_RATE = 1e-5


def param_dtype(name: str) -> Any:
    """ "float32" / "bfloat16" (the --param_dtype values) -> the jax dtype."""
    return {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16}[name]


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Which policy to train and how its parameters are held.

    name: Registered model name (smollm2-135m-instruct is embedded), Hugging Face model folder
        or .gguf file.
    param_dtype: Parameter dtype.
    compute_dtype: Dtype the sampler, teacher-forced passes and update compute in (default:
        the parameter dtype); bfloat16 with --param_dtype=float32 is mixed precision: float32
        master weights and optimizer state, bfloat16 matmuls accumulated in float32.
    remat: Rematerialise each layer in the backward pass (less memory, one more forward).
    init_adapter: A PEFT LoRA adapter folder (adapter_model.safetensors +
        adapter_config.json) the LoRA adapters start from instead of fresh ones; its rank,
        alpha and targets are the run's (--lora_rank, --lora_alpha, --lora_targets left at
        their defaults, or equal to the file's).
    """

    name: str = "smollm2-135m-instruct"
    param_dtype: str = "float32"
    compute_dtype: str | None = None
    remat: bool = False
    init_adapter: str | None = None

    def compute_config(self, model_config: Any) -> Any:
        """The loaded model's ModelConfig with this run's --compute_dtype."""
        return dataclasses.replace(model_config, compute_dtype=self.compute_dtype)


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """How a rollout batch becomes optimizer updates.

    mini_batch_size: Rows per optimizer update (0 = the whole batch).
    micro_batch_size: Rows per gradient-accumulation slice (0 = the mini-batch).
    micro_batch_length_classes: Completion lengths a micro-batch may run at. 1: every
        micro-batch at the mini-batch's longest completion (bucketed). K > 1: the mini-batch's
        rows are sorted by length into the micro-batches, and each micro-batch runs at the
        shortest of K lengths (the longest, then halving) that holds its rows: the same
        update on fewer padded positions, for K branches of the compiled update.
    micro_batch_tokens: Token budget N of a packed micro-batch (0 = off: micro-batches of
        --micro_batch_size rows). N > 0: the policy update packs each mini-batch's sequences
        (real prompt + completion tokens, no padding; a group's shared prompt once per row)
        into micro-batches of rows of at most N / (data x fsdp) tokens per device in all
        (train/packing.py): the same update, run packed where that models fewer FLOPs than
        the padded update; the rollout's reference, old-logprob and value passes likewise.
        Full fine-tuning or LoRA, one host.
    ppo_epochs: Passes over each rollout batch.
    recompute_old_logprobs: Recompute pi_old with a teacher-forced pass (else use the
        sampler's logprobs).
    max_nonfinite_steps: Consecutive steps whose every update had a NaN / inf loss or
        gradient (skipped, the state kept) after which the run stops with an error.
    """

    mini_batch_size: int = 0
    micro_batch_size: int = 0
    micro_batch_length_classes: int = 1
    micro_batch_tokens: int = 0
    ppo_epochs: int = 1
    recompute_old_logprobs: bool = True
    max_nonfinite_steps: int = 3


@dataclasses.dataclass(frozen=True)
class CriticOptions:
    """PPO's critic (algorithms with advantage=gae, e.g. --algorithm=ppo).

    model: The critic's starting weights: an HF folder / GGUF / registered name of the
        policy's family (a folder exported by tools/export_hf.py holds its value head); none =
        the policy's weights with a zero head.
    learning_rate: The critic's AdamW learning rate (none = 10 x --learning_rate); its
        warm-up, schedule and clipping are the policy's.
    warmup_steps: First steps that update only the critic (the policy is not updated).
    """

    model: str | None = None
    learning_rate: float | None = None
    warmup_steps: int = 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Length, devices, outputs and seed of a run.

    num_steps: Training steps (rollouts).
    mesh: Device mesh, e.g. data:1,fsdp:-1,tensor:1 (-1: the remaining devices).
    checkpoint_every: Steps between checkpoints.
    keep_checkpoints: Checkpoints to keep.
    workdir: Output folder; a run resumes from its checkpoints.
    seed: Random seed.
    trackers: Where metrics go beside metrics.jsonl, comma-separated: tensorboard, wandb,
        mlflow (empty: none). wandb and mlflow are optional extras; both work offline.
    tensorboard: Keep tensorboard in --trackers (--notensorboard drops it).
    distributed: Call jax.distributed.initialize (multi-host; cluster auto-detection).
    """

    num_steps: int = 20
    mesh: str = "data:1,fsdp:-1,tensor:1"
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    workdir: str = "workdirs/run"
    seed: int = 0
    trackers: str = "tensorboard"
    tensorboard: bool = True
    distributed: bool = False

    @property
    def tracker_names(self) -> tuple[str, ...]:
        """The trackers this run writes to (--trackers, less tensorboard with
        --notensorboard)."""
        return tuple(
            n for n in trackers.parse(self.trackers) if n != "tensorboard" or self.tensorboard
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; WORKDIR/config.json holds it (to_json / from_json)."""

    model: ModelOptions = group(
        ModelOptions,
        flags={"name": "model"},
        choices={"param_dtype": DTYPES, "compute_dtype": DTYPES},
    )
    data: DataConfig = group(DataConfig, flags={"source": "data", "revision": "data_revision"})
    rollout: RolloutConfig = group(RolloutConfig, choices={"long_prompts": LONG_PROMPT_MODES})
    reward: RewardConfig = group(
        RewardConfig,
        flags={"scale": "reward_scale", "num_workers": "reward_workers"},
        choices={
            "scale": SCALES,
            "answer_mode": ANSWER_MODES,
            "default_task": tuple(TASK_VERIFIERS),
            "code_reward": CODE_MODES,
            "code_isolation": CODE_ISOLATION,
        },
        derived={"max_new_tokens": "max_new_tokens"},
    )
    algorithm: rl.AlgorithmConfig = group(
        rl.presets.grpo,
        flags={"name": "algorithm"},
        preset=rl.get_preset,
        choices={
            "name": tuple(sorted(rl.PRESETS)),
            "advantage": rl.algorithms.ADVANTAGES,
            "mean": rl.advantages.MEANS,
            "std": rl.advantages.STDS,
            "objective": rl.algorithms.OBJECTIVES,
            "agg": rl.AGG_MODES,
            "kl_in": rl.algorithms.KL_PLACES,
            "kl_estimator": rl.KL_ESTIMATORS,
            "importance": rl.algorithms.IMPORTANCE,
            "positives": rl.filters.POSITIVE_SELECTIONS,
            "rejected_rows": rl.algorithms.REJECTED_ROWS,
            "is_correction": rl.CORRECTIONS,
            "is_level": rl.IS_LEVELS,
        },
    )
    optimizer: OptimizerConfig = group(
        OptimizerConfig,
        flags={"schedule": "lr_schedule", "b1": "adam_b1", "b2": "adam_b2", "eps": "adam_eps"},
        choices={"schedule": SCHEDULES},
    )
    update: UpdateConfig = group(UpdateConfig)
    lora: LoraConfig = group(
        LoraConfig,
        flags={
            "rank": "lora_rank",
            "alpha": "lora_alpha",
            "dropout": "lora_dropout",
            "targets": "lora_targets",
        },
    )
    critic: CriticOptions = group(
        CriticOptions,
        flags={
            "model": "critic_model",
            "learning_rate": "critic_learning_rate",
            "warmup_steps": "critic_warmup_steps",
        },
    )
    evaluation: EvalConfig = group(EvalConfig)
    run: RunConfig = group(RunConfig)

    def __post_init__(self):
        options.fill_derived(self)  # reward.max_new_tokens follows rollout.max_new_tokens

    def replace(self, **values: Any) -> "TrainConfig":
        """This config with options set by flag name (see options.replace), e.g.
        `config.replace(algorithm="lite_ppo", clip_high=0.28, num_steps=4)`."""
        return options.replace(self, **values)

    # ---- derived sizes and switches -------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def mini_batch(self) -> int:
        return self.update.mini_batch_size or self.batch_size

    @property
    def micro_batch(self) -> int:
        return self.update.micro_batch_size or self.mini_batch

    @property
    def updates_per_step(self) -> int:
        return self.update.ppo_epochs * (self.batch_size // self.mini_batch)

    @property
    def update_algorithm(self) -> rl.AlgorithmConfig:
        """The algorithm the update runs: seq-mean-token-sum-norm's constant (max_tokens)
        pinned to --max_new_tokens, its value before rollouts were trimmed to their longest
        completion (by default it is the padded length, which now varies per batch)."""
        a = self.algorithm
        if a.max_tokens is not None:
            return a
        return dataclasses.replace(a, max_tokens=self.rollout.max_new_tokens)

    @property
    def needs_reference(self) -> bool:
        a = self.algorithm
        return (a.kl_coef > 0 and a.kl_in is not None) or a.log_kl_ref

    @property
    def needs_critic(self) -> bool:
        """PPO: a value model is trained beside the policy."""
        return self.algorithm.advantage == "gae"

    @property
    def reshuffles_rows(self) -> bool:
        """Whether updates see the rollout's rows reshuffled (several mini-batches or epochs)."""
        return self.mini_batch != self.batch_size or self.update.ppo_epochs > 1

    @property
    def needs_old_logprobs(self) -> bool:
        """pi_old differs from pi only when a rollout feeds more than one update."""
        return self.updates_per_step > 1

    @property
    def keeps_behaviour_logprobs(self) -> bool:
        """Whether the update gets the sampler's logprobs beside the trainer's pi_old (the gap
        is logged, --is_correction reweights by it): always, except when pi_old is the
        sampler's own (several updates per rollout and --norecompute_old_logprobs). It costs
        no pass: on-policy the update's own logprobs are pi_old."""
        return not (self.needs_old_logprobs and not self.update.recompute_old_logprobs)

    def validate(
        self, num_devices: int, data_parallel: int | None = None, num_hosts: int | None = None
    ) -> "TrainConfig":
        """Raises a FlagError naming the flag and the fix for any bad value, before anything
        is loaded or compiled: the run's one check of its whole config (train.loop.run calls
        it first, before the workdir lock). num_hosts: the run's processes (default: this
        run's; tools/plan.py passes its topology's)."""
        with flag_errors():  # a sub-config's ValueError names its flag too
            self._validate_all(
                num_devices, data_parallel, jax.process_count() if num_hosts is None else num_hosts
            )
        return self

    @property
    def one_host_only(self) -> list[str]:
        """The set flags whose rows are picked on the host, so run on one host only."""
        a, r = self.algorithm, self.rollout
        return [
            flag
            for flag, on in (
                ("--advantage=remax", a.advantage == "remax"),
                (
                    f"--partial_rollout_tokens={r.partial_rollout_tokens}",
                    r.partial_rollout_tokens > 0,
                ),
                (
                    f"--micro_batch_tokens={self.update.micro_batch_tokens}",
                    self.update.micro_batch_tokens > 0,
                ),
            )
            if on
        ]

    def validate_context(self, context: int, model: str | None = None) -> "TrainConfig":
        """Raises a FlagError when a prompt of --max_prompt_tokens plus its completion (the
        run's --max_new_tokens, or an --eval_sets item's max_new_tokens) does not fit the
        model's context of `context` positions (its max_position_embeddings)."""
        r = self.rollout
        lengths = [("--max_new_tokens", r.max_new_tokens)] + [
            (f"--eval_sets item {s.name}'s max_new_tokens", s.max_new_tokens)
            for s in self.evaluation.sets
            if s.max_new_tokens is not None
        ]
        with flag_errors():
            for what, new_tokens in lengths:
                require(
                    r.max_prompt_tokens + new_tokens <= context,
                    f"--max_prompt_tokens={r.max_prompt_tokens} + {what}={new_tokens} = "
                    f"{r.max_prompt_tokens + new_tokens} tokens exceed the context of "
                    f"--model={model or self.model.name} ({context} positions): lower "
                    "them so that their sum is at most the context.",
                )
        return self

    def with_init_adapter(self) -> "TrainConfig":
        """This config with --init_adapter's LoRA rank, alpha and targets (a FlagError when
        one set on the command line differs from the file's); itself without --init_adapter.
        The run resolves it first (train.loop.run), so its config.json holds the file's."""
        path = self.model.init_adapter
        if path is None:
            return self
        try:
            theirs = peft_format.read_lora_config(path)
        except OSError as exc:
            raise FlagError(
                f"--init_adapter={path}: cannot read {peft_format.ADAPTER_CONFIG} there "
                f"({exc.strerror or exc}); pass a PEFT adapter folder "
                f"({peft_format.ADAPTER_WEIGHTS} + {peft_format.ADAPTER_CONFIG})."
            ) from exc
        except (ValueError, KeyError) as exc:  # KeyError: a config without r / lora_alpha
            raise FlagError(f"--init_adapter={path}: {exc}") from exc
        ours, default = self.lora, LoraConfig()
        for field, flag in (
            ("rank", "lora_rank"),
            ("alpha", "lora_alpha"),
            ("targets", "lora_targets"),
        ):
            mine, file_value = getattr(ours, field), getattr(theirs, field)
            show = lambda v: ",".join(v) if isinstance(v, tuple) else f"{v:g}"  # noqa: E731
            require(
                mine in (getattr(default, field), file_value),
                f"--{flag}={show(mine)} differs from the adapter's {show(file_value)} in "
                f"--init_adapter={path}; drop --{flag} (the file's is used) or pass "
                f"--{flag}={show(file_value)}.",
            )
        lora = dataclasses.replace(
            ours, rank=theirs.rank, alpha=theirs.alpha, targets=theirs.targets
        )
        return dataclasses.replace(self, lora=lora)

    def precision_warnings(self) -> list[str]:
        """What the run should be told at start about its dtypes: bfloat16 parameters at a
        small learning rate lose most updates to rounding (bf16 keeps 8 bits of mantissa, so
        a step smaller than ~1/256 of a weight rounds away). LoRA trains float32 adapters on
        the frozen base, whatever its dtype: nothing to tell."""
        lr = self.optimizer.learning_rate
        bf16_trained = self.model.param_dtype == "bfloat16" and not self.lora.enabled
        if bf16_trained and lr < BF16_MIN_LEARNING_RATE:
            return [
                f"--param_dtype=bfloat16 with --learning_rate={lr:g} (< "
                f"{BF16_MIN_LEARNING_RATE:g}): most updates round away in bfloat16 "
                "weights. Set --param_dtype=float32 --compute_dtype=bfloat16 (float32 "
                "master weights, bfloat16 matmuls)."
            ]
        return []

    def _validate_all(self, num_devices: int, data_parallel: int | None, num_hosts: int) -> None:
        self._validate_values()
        self._validate_turns()
        self._validate_reward()
        if self.rollout.env:
            envs.parse_env(self.rollout.env)  # FlagError naming --env and the valid names
            require(
                num_hosts == 1,
                f"--env={self.rollout.env} runs multi-turn rollouts, which run on one host "
                f"(this run has {num_hosts}): their host loop starts a program for each "
                "reply as it arrives, and the hosts of one run cannot start them in the same "
                "order. Run on one host (a mesh of its devices works) or drop --env.",
            )
        self._validate_data()
        run, e = self.run, self.evaluation
        require(
            not os.path.exists(run.workdir) or os.path.isdir(run.workdir),
            f"--workdir={run.workdir} is a file, not a folder: name a new or existing "
            "folder for the run's outputs.",
        )
        require(
            e.eval_every >= 0 and e.eval_prompts >= -1 and e.eval_samples >= 1,
            "--eval_every must be >= 0, --eval_prompts >= -1 (-1 = all) and --eval_samples >= 1.",
        )
        e.sets  # raises on a malformed --eval_sets, naming the item
        prompts.expand(self.data.system_prompt)
        prompts.expand(self.data.instruction, "--instruction")
        prompts.example_turns(self.data.example)
        self._validate_batches(num_devices, data_parallel)
        self._validate_packing(num_devices, data_parallel, num_hosts)
        rl.validate(self.algorithm, self.rollout.group_size)
        self._validate_critic()
        self._validate_partial(num_hosts)
        a = self.algorithm
        require(
            a.is_correction is None or self.keeps_behaviour_logprobs,
            f"--is_correction={a.is_correction} reweights by the trainer's pi_old over the "
            f"sampler's logprobs, but with {self.updates_per_step} updates per rollout and "
            "--norecompute_old_logprobs pi_old is the sampler's (ratio 1); set "
            "--recompute_old_logprobs or drop --is_correction.",
        )
        require(
            not (a.advantage == "remax" and num_hosts > 1),
            rounds.ONE_HOST_ONLY,
        )
        self.optimizer.validate()
        self.lora.validate()
        require(
            self.model.init_adapter is None or self.lora.enabled,
            f"--init_adapter={self.model.init_adapter} starts LoRA adapters, but --lora_rank "
            "is 0: resolve the adapter's settings first (TrainConfig.with_init_adapter), "
            "or drop --init_adapter.",
        )

    def _validate_values(self) -> None:
        """Each value on its own: finite numbers, known dtypes, counts >= 1."""
        r, u, run = self.rollout, self.update, self.run
        for name, value in options.flatten(self).items():  # nan / inf slip through float()
            numbers = value if isinstance(value, tuple) else (value,)
            require(
                all(math.isfinite(x) for x in numbers if isinstance(x, float)),
                f"--{name}={options.format_value(value)} is not a finite number.",
            )
        require(
            self.model.param_dtype in DTYPES,
            f"--param_dtype={self.model.param_dtype!r}: choose {DTYPES}.",
        )
        require(
            self.model.compute_dtype in (None,) + DTYPES,
            f"--compute_dtype={self.model.compute_dtype!r}: choose {DTYPES}.",
        )
        require(r.prompts_per_step >= 1, "--prompts_per_step must be >= 1.")
        require(r.group_size >= 1, "--group_size must be >= 1.")
        require(
            r.max_new_tokens >= 1 and r.max_prompt_tokens >= 1,
            "--max_new_tokens and --max_prompt_tokens must be >= 1.",
        )
        require(u.ppo_epochs >= 1, "--ppo_epochs must be >= 1.")
        require(
            u.micro_batch_tokens >= 0,
            f"--micro_batch_tokens={u.micro_batch_tokens} must be >= 0 (0 = off).",
        )
        require(
            u.micro_batch_length_classes >= 1,
            f"--micro_batch_length_classes={u.micro_batch_length_classes} must be >= 1 "
            "(1 = every micro-batch at the mini-batch's longest completion).",
        )
        require(u.max_nonfinite_steps >= 1, "--max_nonfinite_steps must be >= 1.")
        require(run.num_steps >= 1, "--num_steps must be >= 1.")
        require(
            run.checkpoint_every >= 1,
            f"--checkpoint_every={run.checkpoint_every} must be "
            ">= 1 (the run also saves at its end and when preempted).",
        )
        require(
            run.keep_checkpoints >= 1,
            f"--keep_checkpoints={run.keep_checkpoints} must be "
            ">= 1: a run resumes from its latest checkpoint; to save less often, raise "
            "--checkpoint_every.",
        )
        require(r.long_prompts in LONG_PROMPT_MODES, "--long_prompts: choose error or drop.")
        trackers.check_installed(run.tracker_names)  # a bad name: ValueError naming the flag
        require(
            r.decode_slots >= 0,
            f"--decode_slots={r.decode_slots} must be >= 0 (0: every "
            "row at once, finished rows compacted away).",
        )

    def _validate_turns(self) -> None:
        """Multi-turn rollouts' limits (--max_turns, --max_total_tokens, ...)."""
        r = self.rollout
        t = r.turns
        require(t.max_turns >= 1, f"--max_turns={t.max_turns} must be >= 1 (1: single-turn).")
        require(
            t.max_total_tokens >= 0 and t.max_observation_tokens >= 0,
            f"--max_total_tokens={t.max_total_tokens} and --max_observation_tokens="
            f"{t.max_observation_tokens} must be >= 0 (--max_total_tokens=0: "
            "--max_new_tokens).",
        )
        require(
            t.max_turns == 1 or r.partial_rollout_tokens == 0,
            f"--max_turns={t.max_turns} does not combine with --partial_rollout_tokens: "
            "multi-turn trajectories finish within their step; drop one of them.",
        )

    def _data_parallel(self, num_devices: int) -> int:
        """data x fsdp of --mesh on `num_devices` devices (an abstract mesh: no device used)."""
        sizes = parallel.MeshSpec.parse(self.run.mesh).resolve(num_devices)
        return parallel.data_parallel_size(jax.sharding.AbstractMesh(sizes, parallel.MESH_AXES))

    def _validate_batches(self, num_devices: int, data_parallel: int | None) -> None:
        """Mini-, micro- and rollout micro-batches divide the batch and fill the mesh."""
        r, run = self.rollout, self.run
        B = self.batch_size
        require(
            B % self.mini_batch == 0,
            f"--mini_batch_size={self.mini_batch} does not divide the batch of "
            f"{B} rows (prompts_per_step {r.prompts_per_step} x group_size "
            f"{r.group_size}); pick a divisor of {B}.",
        )
        require(
            self.mini_batch % self.micro_batch == 0,
            f"--micro_batch_size={self.micro_batch} does not divide the mini-batch of "
            f"{self.mini_batch} rows; pick a divisor of {self.mini_batch}.",
        )
        if data_parallel is None:
            data_parallel = self._data_parallel(num_devices)
        require(
            self.micro_batch % data_parallel == 0,
            f"The micro-batch of {self.micro_batch} rows cannot be split over the "
            f"{data_parallel} data-parallel devices of --mesh={run.mesh}; make "
            "--micro_batch_size a multiple of data*fsdp.",
        )
        R = r.rollout_micro_batch
        require(
            R == 0 or (R > 0 and B % R == 0 and R % r.group_size == 0 and R % data_parallel == 0),
            f"--rollout_micro_batch={R} must divide the batch of {B} rows and be a multiple "
            f"of --group_size={r.group_size} and of the {data_parallel} data-parallel "
            f"devices of --mesh={run.mesh} (or 0: all rows at once).",
        )
        require(
            r.decode_slots % data_parallel == 0,
            f"--decode_slots={r.decode_slots} must be a multiple of the {data_parallel} "
            f"data-parallel devices of --mesh={run.mesh} (each decodes as many slots), "
            "or 0.",
        )

    def _validate_packing(
        self, num_devices: int, data_parallel: int | None, num_hosts: int
    ) -> None:
        """--micro_batch_tokens: every sequence fits one device's row; what packing excludes."""
        N, r = self.update.micro_batch_tokens, self.rollout
        if N == 0:
            return
        dp = data_parallel or self._data_parallel(num_devices)
        longest = r.max_prompt_tokens + r.max_new_tokens
        require(
            N >= dp * longest,
            f"--micro_batch_tokens={N} must be 0 (off) or >= {dp * longest}: each of the "
            f"{dp} data-parallel devices of --mesh={self.run.mesh} packs rows of "
            f"N / {dp} tokens, and the longest sequence is --max_prompt_tokens="
            f"{r.max_prompt_tokens} + --max_new_tokens={r.max_new_tokens} = {longest} tokens.",
        )
        require(
            self.update.micro_batch_length_classes == 1,
            f"--micro_batch_length_classes={self.update.micro_batch_length_classes} sorts "
            f"padded micro-batches by length; with --micro_batch_tokens={N} the update packs "
            "its sequences instead: drop one.",
        )
        require(
            num_hosts == 1,
            f"--micro_batch_tokens={N} packs each mini-batch on the host, which needs all "
            f"of its rows: run on one host (this run has {num_hosts}) or set it to 0.",
        )

    def _validate_critic(self) -> None:
        c = self.critic
        require(c.warmup_steps >= 0, f"--critic_warmup_steps={c.warmup_steps} must be >= 0.")
        require(
            c.learning_rate is None or c.learning_rate > 0,
            f"--critic_learning_rate={c.learning_rate} must be > 0 (or unset: 10 x "
            "--learning_rate).",
        )
        require(
            self.needs_critic
            or (c.model is None and c.learning_rate is None and c.warmup_steps == 0),
            f"--critic_model / --critic_learning_rate / --critic_warmup_steps are set but "
            f"--algorithm={self.algorithm.name} trains no critic; use --algorithm=ppo (or "
            "--advantage=gae), or drop the critic flags.",
        )

    def _validate_partial(self, num_hosts: int) -> None:
        """Partial rollouts: the budget, the staleness bound and what they do not combine with."""
        r, a = self.rollout, self.algorithm
        N, K = r.partial_rollout_tokens, r.max_staleness
        require(K >= 0, f"--max_staleness={K} must be >= 0 (steps a carried group may wait).")
        if not N:
            require(
                K == RolloutConfig.max_staleness,
                f"--max_staleness={K} applies only to partial rollouts: set "
                "--partial_rollout_tokens too, or drop --max_staleness.",
            )
            return
        require(
            0 < N < r.max_new_tokens,
            f"--partial_rollout_tokens={N} must be in [1, --max_new_tokens="
            f"{r.max_new_tokens}) (0 = off): a budget of --max_new_tokens or more finishes "
            "every row in one round.",
        )
        unsupported = [
            flag
            for flag, on in (
                ("--dynamic_sampling", a.dynamic_sampling),
                ("--advantage=remax", a.advantage == "remax"),
                ("--norecompute_old_logprobs", not self.update.recompute_old_logprobs),
            )
            if on
        ]
        require(
            not unsupported,
            f"--partial_rollout_tokens={N} does not combine with {', '.join(unsupported)}: "
            "partial rollouts fill the batch with finished groups themselves and take pi_old "
            "from the recomputed logprobs; drop those, or set --partial_rollout_tokens=0.",
        )
        require(num_hosts == 1, partial.ONE_HOST_ONLY)

    def _validate_data(self) -> None:
        """Flags that a data source would ignore (the source itself is read, and checked, by
        the trainer before the model loads)."""
        d = self.data
        kind = (
            d.source.partition(":")[0]
            if ":" in d.source
            else ("name" if d.source.isidentifier() else "file")
        )
        require(
            d.revision is None or kind in ("hf", "name"),
            f"--data_revision={d.revision} applies to hf: sources and registered names "
            f"only, not --data={d.source}; drop it.",
        )
        own = [
            f"--{k}"
            for k, v in (("prompt_field", d.prompt_field), ("answer_field", d.answer_field))
            if v
        ]
        require(
            not own or kind not in ("synthetic", "gym", "name"),
            f"{' and '.join(own)} name columns, but --data={d.source} brings its own "
            "fields; drop them (they apply to hf:, jsonl:, parquet: and tfds: sources).",
        )

    def _validate_reward(self) -> None:
        """The reward flags that rewards.shaping and the verifier pool would otherwise refuse
        only when the reward function is built, after the model has loaded."""
        w, r = self.reward, self.rollout
        require(w.scale in SCALES, f"--reward_scale: choose one of {SCALES}.")
        require(
            w.format_penalty >= 0,
            f"--format_penalty={w.format_penalty} must be >= 0 (it is "
            "subtracted from the reward of a completion without a final answer).",
        )
        require(
            not (w.scale == "logic_rl" and w.format_penalty),
            f"--format_penalty={w.format_penalty} does not apply to --reward_scale=logic_rl, "
            "which has its own format reward; leave --format_penalty at 0.",
        )
        require(
            0 <= w.overlong_buffer <= r.max_new_tokens,
            f"--overlong_buffer={w.overlong_buffer} must be in [0, --max_new_tokens="
            f"{r.max_new_tokens}] (0 = no overlong punishment).",
        )
        require(
            w.overlong_penalty >= 0,
            f"--overlong_penalty={w.overlong_penalty} must be >= 0 (it is subtracted).",
        )
        require(
            w.memory_limit_mb >= 0,
            f"--memory_limit_mb={w.memory_limit_mb} must be >= 0 (0 = no limit).",
        )
        w.shaping, w.pool  # their own checks, now rather than when the reward is built

    # ---- config.json ----------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(options.to_dict(self), indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        """Inverse of to_json (e.g. a workdir's config.json), also for the flat layout that
        config.json had before the tree (every key a flag name; algorithm and optimizer
        nested)."""
        data = json.loads(text)
        if not isinstance(data.get("model"), str):
            return options.from_dict(cls, data)
        algorithm = options.from_dict(rl.AlgorithmConfig, data.pop("algorithm"))
        optimizer = options.from_dict(OptimizerConfig, data.pop("optimizer"))
        known = options.option_map(cls)
        return cls().replace(
            algorithm=algorithm,
            optimizer=optimizer,
            **{k: v for k, v in data.items() if k in known},
        )
