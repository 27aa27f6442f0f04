"""TrainConfig: everything a run needs, as one frozen dataclass, validated before compiling."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxrl4llm import rl
from jaxrl4llm.parallel import MeshSpec
from jaxrl4llm.train.state import OptimizerConfig

DTYPES = ("float32", "bfloat16")


def param_dtype(name: str) -> Any:
    """"float32" / "bfloat16" (the --param_dtype values) -> the jax dtype."""
    import jax.numpy as jnp
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # Model.
    model: str = "smollm2-135m-instruct"   # registered name, HF folder or .gguf file
    param_dtype: str = "float32"
    remat: bool = False                    # rematerialise each layer in the backward pass
    share_prompts: bool = True             # teacher-forced passes run a group's prompt once
    # Data and prompts.
    data: str = "synthetic:arithmetic"
    eval_data: str | None = None           # default: the held-out split of `data`
    prompt_field: str | None = None        # None: auto-detect (problem, question, prompt, ...)
    answer_field: str | None = None        # None: auto-detect (answer, solution, ...)
    instruction: str | None = None         # None: the data package's default instruction
    system_prompt: str | None = None
    # Rollout.
    prompts_per_step: int = 8              # P, global (all hosts)
    group_size: int = 4                    # G samples per prompt; a batch is B = P * G rows
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    long_prompts: str = "error"            # "error" or "drop" (skip and count)
    rollout_micro_batch: int = 0           # rows per sampler / reference / old-logprob pass
                                           # (0 = all rows at once); sizes the KV cache
    # Algorithm and reward.
    algorithm: rl.AlgorithmConfig = dataclasses.field(default_factory=rl.algorithms.grpo)
    reward_scale: str = "01"               # "01" or "pm1"
    format_penalty: float = 0.0
    overlong_buffer: int = 0               # DAPO soft overlong punishment (0 = off)
    reward_workers: int = 2
    answer_mode: str = "boxed"             # "boxed" or "lenient" (falls back to the last number)
    # Optimisation.
    optimizer: OptimizerConfig = OptimizerConfig()
    mini_batch_size: int = 0               # rows per optimizer update (0 = the whole batch)
    ppo_epochs: int = 1                    # passes over each rollout batch
    micro_batch_size: int = 0              # rows per gradient-accumulation slice (0 = mini-batch)
    recompute_old_logprobs: bool = True    # else use the sampler's logprobs as pi_old
    # Run.
    num_steps: int = 20
    mesh: str = "data:1,fsdp:-1,tensor:1"
    eval_every: int = 0                    # steps between evals (0 = only at the end)
    eval_prompts: int = 64
    eval_samples: int = 1                  # k for avg@k / pass@k (1 = greedy accuracy only)
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    workdir: str = "workdirs/run"
    seed: int = 0
    tensorboard: bool = True

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def mini_batch(self) -> int:
        return self.mini_batch_size or self.batch_size

    @property
    def micro_batch(self) -> int:
        return self.micro_batch_size or self.mini_batch

    @property
    def updates_per_step(self) -> int:
        return self.ppo_epochs * (self.batch_size // self.mini_batch)

    @property
    def needs_reference(self) -> bool:
        a = self.algorithm
        return a.kl_coef > 0 and a.kl_in is not None

    @property
    def reshuffles_rows(self) -> bool:
        """Whether updates see the rollout's rows reshuffled (several mini-batches or epochs)."""
        return self.mini_batch != self.batch_size or self.ppo_epochs > 1

    @property
    def needs_old_logprobs(self) -> bool:
        """pi_old differs from pi only when a rollout feeds more than one update."""
        return self.updates_per_step > 1

    def validate(self, num_devices: int, data_parallel: int | None = None) -> "TrainConfig":
        """Raises a clear error for any bad value, before anything is loaded or compiled."""
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        check(self.param_dtype in DTYPES, f"--param_dtype={self.param_dtype!r}: choose {DTYPES}.")
        check(self.prompts_per_step >= 1, "--prompts_per_step must be >= 1.")
        check(self.group_size >= 1, "--group_size must be >= 1.")
        check(self.max_new_tokens >= 1 and self.max_prompt_tokens >= 1,
              "--max_new_tokens and --max_prompt_tokens must be >= 1.")
        check(self.ppo_epochs >= 1, "--ppo_epochs must be >= 1.")
        check(self.num_steps >= 1, "--num_steps must be >= 1.")
        check(self.long_prompts in ("error", "drop"), "--long_prompts: choose error or drop.")
        check(self.reward_scale in ("01", "pm1"), "--reward_scale: choose 01 or pm1.")
        check(self.eval_every >= 0 and self.eval_prompts >= 0 and self.eval_samples >= 1,
              "--eval_every/--eval_prompts must be >= 0 and --eval_samples >= 1.")
        B = self.batch_size
        check(B % self.mini_batch == 0,
              f"--mini_batch_size={self.mini_batch} does not divide the batch of "
              f"{B} rows (prompts_per_step {self.prompts_per_step} x group_size "
              f"{self.group_size}); pick a divisor of {B}.")
        check(self.mini_batch % self.micro_batch == 0,
              f"--micro_batch_size={self.micro_batch} does not divide the mini-batch of "
              f"{self.mini_batch} rows; pick a divisor of {self.mini_batch}.")
        if data_parallel is None:
            data_parallel = _data_parallel_size(self.mesh, num_devices)
        check(self.micro_batch % data_parallel == 0,
              f"The micro-batch of {self.micro_batch} rows cannot be split over the "
              f"{data_parallel} data-parallel devices of --mesh={self.mesh}; make "
              "--micro_batch_size a multiple of data*fsdp.")
        R = self.rollout_micro_batch
        check(R == 0 or (R > 0 and B % R == 0 and R % self.group_size == 0
                         and R % data_parallel == 0),
              f"--rollout_micro_batch={R} must divide the batch of {B} rows and be a multiple "
              f"of --group_size={self.group_size} and of the {data_parallel} data-parallel "
              f"devices of --mesh={self.mesh} (or 0: all rows at once).")
        rl.validate(self.algorithm, self.group_size)
        self.optimizer.validate()
        return self

    @property
    def field_names(self) -> dict[str, str]:
        """make_source keyword arguments for the prompt / answer columns the user named."""
        names = {"prompt_field": self.prompt_field, "answer_field": self.answer_field}
        return {k: v for k, v in names.items() if v}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        """Inverse of to_json (e.g. a workdir's config.json)."""
        fields = json.loads(text)
        algorithm = dict(fields.pop("algorithm"))
        if algorithm.get("binary_reward") is not None:
            algorithm["binary_reward"] = tuple(algorithm["binary_reward"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(algorithm=rl.AlgorithmConfig(**algorithm),
                   optimizer=OptimizerConfig(**fields.pop("optimizer")),
                   **{k: v for k, v in fields.items() if k in known})


def _data_parallel_size(mesh: str, num_devices: int) -> int:
    data, fsdp, _ = MeshSpec.parse(mesh).resolve(num_devices)
    return data * fsdp


def algorithm_overrides(algorithm: rl.AlgorithmConfig, **knobs: Any) -> rl.AlgorithmConfig:
    """Applies the knobs that are not None on top of a preset."""
    given = {k: v for k, v in knobs.items() if v is not None}
    return dataclasses.replace(algorithm, **given) if given else algorithm
