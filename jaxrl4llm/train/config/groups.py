"""TrainConfig's own groups: the policy model's options, the update's batching, PPO's
critic and the run (length, devices, outputs, seed). The groups that layers below the trainer
read live with them (DataConfig, RolloutConfig, EvalConfig); train/config/ mounts them all
as TrainConfig's fields and their flags.
"""

from __future__ import annotations

import dataclasses

from jaxrl4llm.config.options import require
from jaxrl4llm.models.config import ModelConfig

DTYPES = ("float32", "bfloat16")
# --trackers' names (train/infra/trackers.py writes to them).
TRACKERS = ("tensorboard", "wandb", "mlflow")
# The import each tracker needs and the extra that installs it.
PACKAGES = {
    "tensorboard": ("tensorboardX", "tensorboardX"),
    "wandb": ("wandb", "jaxrl4llm[wandb]"),
    "mlflow": ("mlflow", "jaxrl4llm[mlflow]"),
}


def parse_trackers(text: str) -> tuple[str, ...]:
    """ "tensorboard,wandb" -> ("tensorboard", "wandb"); an unknown name raises ValueError."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"--trackers={text}: unknown tracker(s) {', '.join(unknown)}; choose "
            f"from {', '.join(TRACKERS)} (comma-separated, empty for none)."
        )
    return names


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

    def compute_config(self, model_config: ModelConfig) -> ModelConfig:
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
        (train/update/packing.py): the same update, run packed where that models fewer FLOPs than
        the padded update; the rollout's reference, old-logprob and value passes likewise.
        Full fine-tuning or LoRA, one host.
    ppo_epochs: Passes over each rollout batch.
    recompute_old_logprobs: Recompute pi_old with a teacher-forced pass (else use the
        sampler's logprobs).
    max_nonfinite_steps: Consecutive steps whose every update had a NaN / inf loss or
        gradient (skipped, the state kept) after which the run stops with an error.
    log_kl_ref: Log the KL to the reference (policy/kl_ref, --kl_estimator) even when no KL
        term is in the loss or reward; loads the reference model.
    """

    mini_batch_size: int = 0
    micro_batch_size: int = 0
    micro_batch_length_classes: int = 1
    micro_batch_tokens: int = 0
    ppo_epochs: int = 1
    recompute_old_logprobs: bool = True
    max_nonfinite_steps: int = 3
    log_kl_ref: bool = False


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """A mixture-of-experts policy's routers in training (models/moe.py; refused for a dense
    model).

    routing_replay: Rollout routing replay (R3, arXiv:2510.11370 §3): the sampler records the
        experts each token ran, and the policy's teacher-forced passes (old logprobs, the
        update) run those experts instead of their routers' top-k; the trainer's router
        still weighs them (its softmax at the replayed experts, renormalised where the
        family renormalises), so the router gets gradients. The reference pass routes
        itself. The compacted single-turn sampler only.
    router_aux_loss_coef: Load-balancing auxiliary loss (Switch Transformer; transformers'
        load_balancing_loss_func) times this is added to the policy loss, the mean over the
        micro-batches (0 = off, as the GSPO and Qwen3 RL recipes).
    router_z_loss_coef: Router z-loss (ST-MoE: mean logsumexp(router logits)^2) times this is
        added to the policy loss (0 = off).
    """

    routing_replay: bool = False
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            require(value >= 0, f"--{name}={value:g} must be >= 0 (0 = off).")

    @property
    def enabled(self) -> bool:
        """Whether any router option is set (each needs a mixture of experts)."""
        return self != RouterConfig()


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
    tensorboard: Deprecated alias of --trackers, kept for one release: --notensorboard drops
        tensorboard from --trackers, --tensorboard adds it (unset: --trackers alone).
    distributed: Call jax.distributed.initialize (multi-host; cluster auto-detection).
    """

    num_steps: int = 20
    mesh: str = "data:1,fsdp:-1,tensor:1"
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    workdir: str = "workdirs/run"
    seed: int = 0
    trackers: str = "tensorboard"
    tensorboard: bool | None = None
    distributed: bool = False

    @property
    def tracker_names(self) -> tuple[str, ...]:
        """The trackers this run writes to: --trackers, with the deprecated --tensorboard /
        --notensorboard adding / dropping tensorboard."""
        names = parse_trackers(self.trackers)
        if self.tensorboard is False:
            return tuple(n for n in names if n != "tensorboard")
        if self.tensorboard and "tensorboard" not in names:
            return ("tensorboard", *names)
        return names
