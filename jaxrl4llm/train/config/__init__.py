"""TrainConfig: everything a run needs, as a tree of frozen sub-configs, one per concern.

Every leaf field is a command-line flag with a flat name (jaxrl4llm.config.options is the mechanism,
jaxrl4llm.config.cli defines the flags): its type, default and help come from the field and its
class docstring's "name: text" line, so a new field is a new flag. Where a field's flag name
differs from the field name (`--model` for model.name, `--lr_schedule` for
optimizer.schedule), or its values are a fixed set, the mount below says so. The groups that
layers below the trainer read too live with them: DataConfig (data/config.py), RolloutConfig
(sampling/config.py), EvalConfig (eval/config.py); the trainer's own are in
train/config/groups.py. train/config/checks.py `validate` checks a whole TrainConfig.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

from jaxrl4llm import rl
from jaxrl4llm.config import options
from jaxrl4llm.config.errors import FlagError, flag_errors
from jaxrl4llm.config.options import group, require
from jaxrl4llm.data.config import DataConfig
from jaxrl4llm.eval.config import EvalConfig
from jaxrl4llm.models import peft_format
from jaxrl4llm.models.lora import LoraConfig
from jaxrl4llm.rewards.code import MODES as CODE_MODES
from jaxrl4llm.rewards.math_verifier import ANSWER_MODES
from jaxrl4llm.rewards.registry import TASK_VERIFIERS, RewardConfig
from jaxrl4llm.rewards.sandbox import ISOLATION as CODE_ISOLATION
from jaxrl4llm.rewards.shaping import SCALES
from jaxrl4llm.sampling.buckets import LONG_PROMPT_MODES
from jaxrl4llm.sampling.config import RolloutConfig
from jaxrl4llm.train.config.groups import (
    DTYPES,
    CriticOptions,
    ModelOptions,
    RouterConfig,
    RunConfig,
    UpdateConfig,
)
from jaxrl4llm.train.config.optimizer import SCHEDULES, OptimizerConfig

# Below this learning rate, bfloat16 parameters lose most Adam steps to rounding (a step of
# about lr moves a weight of size ~0.01-0.1 by less than half its bf16 spacing).
BF16_MIN_LEARNING_RATE = 1e-5


def param_dtype(name: str) -> Any:
    """ "float32" / "bfloat16" (the --param_dtype values) -> the jax dtype."""
    return {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16}[name]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; WORKDIR/config.json holds it (to_json / from_json)."""

    model: ModelOptions = group(
        ModelOptions,
        flags={"name": "model"},
        choices={"param_dtype": DTYPES, "compute_dtype": DTYPES},
    )
    data: DataConfig = group(DataConfig, flags={"source": "data", "revision": "data_revision"})
    rollout: RolloutConfig = group(
        RolloutConfig,
        choices={"long_prompts": LONG_PROMPT_MODES},
    )
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
    router: RouterConfig = group(RouterConfig)
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
        return (a.kl_coef > 0 and a.kl_in is not None) or self.update.log_kl_ref

    @property
    def records_routing(self) -> bool:
        """Whether the rollout's sampler records a mixture of experts' routing (routing replay
        and the router/flip_frac metric): single-turn rollouts do, by either engine; the
        multi-turn and partial ones cannot (--routing_replay is refused with them)."""
        r = self.rollout
        return not (r.env or r.partial_rollout_tokens)

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
            _move_trainer_knobs(data)
            _one_engine(data.get("rollout", {}))
            return options.from_dict(cls, data)
        _one_engine(data)
        data.update({k: data["algorithm"].pop(k) for k in _TRAINER_KNOBS if k in data["algorithm"]})
        algorithm = options.from_dict(rl.AlgorithmConfig, data.pop("algorithm"))
        optimizer = options.from_dict(OptimizerConfig, data.pop("optimizer"))
        known = options.option_map(cls)
        return cls().replace(
            algorithm=algorithm,
            optimizer=optimizer,
            **{k: v for k, v in data.items() if k in known},
        )


# Knobs that algorithm held in config.json before they moved to the trainer's groups:
# {knob: the path of its group now}.
_TRAINER_KNOBS = {
    "dynamic_sampling": ("rollout", "dynamic"),
    "max_resample_rounds": ("rollout", "dynamic"),
    "log_kl_ref": ("update",),
}


def _one_engine(rollout: dict[str, Any]) -> None:
    """A config.json written when the compacted sampler was a trainer engine: the paged
    engine, which gives its samples, so that such a run resumes and its checkpoints
    evaluate."""
    if rollout.get("rollout_engine") == "compacted":
        rollout["rollout_engine"] = "paged"


def _move_trainer_knobs(data: dict[str, Any]) -> None:
    """A config.json written when these knobs were the algorithm's: moved to their groups, so
    that a DAPO run resumes with its dynamic sampling."""
    algorithm = data.get("algorithm", {})
    for knob, path in _TRAINER_KNOBS.items():
        if knob in algorithm:
            node = data
            for name in path:
                node = node.setdefault(name, {})
            node.setdefault(knob, algorithm.pop(knob))
