"""What a resume may change: a run on a workdir with checkpoints is compared with the
settings saved in WORKDIR/config.json before anything is written.

A checkpoint is the state of one model trained by one algorithm on one data stream. A resume
with another model, algorithm, data, batch, sampling, reward or optimizer structure would
continue that state as if it were something else (a same-shape model silently resumes on the
old weights; another shape fails inside orbax), so it is refused, naming each flag with its
saved and new value. The changes below do not change what the saved state means; they are
allowed and logged:

- length and cadence: --num_steps, --checkpoint_every, --keep_checkpoints, --trackers,
  --tensorboard, --max_nonfinite_steps;
- where it runs: --workdir, --mesh, --distributed (a checkpoint restores onto any mesh);
- evaluation: --eval_data, --eval_every, --eval_prompts, --eval_samples, --eval_sets;
- the verifier pool's resources: --reward_workers, --item_timeout_s, --batch_timeout_s,
  --memory_limit_mb;
- memory / speed knobs that compute the same update: --micro_batch_size,
  --micro_batch_length_classes, --micro_batch_tokens, --rollout_micro_batch, --decode_slots,
  --rollout_engine, --kv_cache_tokens,
  --remat, --share_prompts;
- the learning-rate schedule: --learning_rate, --warmup_steps, --lr_schedule, --decay_steps,
  --critic_learning_rate (the Adam moments stay valid; lowering the rate after a spike is a
  common deliberate change);
- where LoRA adapters started: --init_adapter (a resume restores them from the checkpoint;
  their rank, alpha and targets are still checked).
"""

from __future__ import annotations

from absl import logging

from jaxrl4llm.config import options, paths
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra.errors import ResumeMismatchError

RESUMABLE = frozenset(
    {
        "num_steps",
        "checkpoint_every",
        "keep_checkpoints",
        "trackers",
        "tensorboard",
        "max_nonfinite_steps",
        "workdir",
        "mesh",
        "distributed",
        "eval_data",
        "eval_every",
        "eval_prompts",
        "eval_samples",
        "eval_sets",
        "reward_workers",
        "item_timeout_s",
        "batch_timeout_s",
        "memory_limit_mb",
        "micro_batch_size",
        "micro_batch_length_classes",
        "micro_batch_tokens",
        "rollout_micro_batch",
        "decode_slots",
        "rollout_engine",
        "kv_cache_tokens",
        "remat",
        "share_prompts",
        "compute_dtype",
        "learning_rate",
        "warmup_steps",
        "lr_schedule",
        "decay_steps",
        "critic_learning_rate",
        "init_adapter",
    }
)
_FIRST = ("model", "algorithm")  # named first: the usual mistake


def _has_checkpoint(workdir: str) -> bool:
    folder = paths.join(workdir, "checkpoints")
    return any(name.isdigit() for name in paths.listdir(folder))


def check_resume(workdir: str, config: TrainConfig) -> None:
    """Raises ResumeMismatchError if `workdir` holds checkpoints of a run whose saved
    config.json differs from `config` in a flag outside RESUMABLE; logs each allowed change.
    A workdir without checkpoints (nothing to resume) or without config.json is not checked."""
    path = paths.join(workdir, "config.json")
    if not (_has_checkpoint(workdir) and paths.exists(path)):
        return
    try:
        saved = TrainConfig.from_json(paths.read_text(path))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logging.warning("Cannot read %s (%s): resuming without comparing its settings.", path, exc)
        return
    old, new = options.flatten(saved), options.flatten(config)
    changed = sorted(
        (name for name in new if old.get(name) != new[name]),
        key=lambda name: (_FIRST + (name,)).index(name),
    )
    refused = [name for name in changed if name not in RESUMABLE]
    if refused:
        listed = "; ".join(
            f"--{name}: {_show(old[name])} saved, {_show(new[name])} now" for name in refused[:8]
        )
        more = f" (and {len(refused) - 8} more)" if len(refused) > 8 else ""
        raise ResumeMismatchError(
            f"{workdir} holds checkpoints trained with other settings than this run's, which "
            f"a resume cannot change: {listed}{more}. Train in a new --workdir, or rerun with "
            f"the values saved in {path} to resume."
        )
    for name in changed:
        logging.warning(
            "Resuming %s with --%s changed: %s -> %s.",
            workdir,
            name,
            _show(old[name]),
            _show(new[name]),
        )


def _show(value: object) -> str:
    return repr(value) if isinstance(value, str) else options.format_value(value)
