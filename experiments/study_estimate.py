"""What a study will cost before it starts: its runs' time and checkpoint disk, and a refusal
when the disk cannot hold them.

Disk: a checkpoint holds the train state (train/update/state.py TrainState): the parameters and
AdamW's two moments, each of the parameters' dtype (--param_dtype), so a parameter costs
3 x its bytes (12 for float32; PPO's critic adds its own state). Orbax compresses the
arrays (zstd), which saves 5-15% on trained weights, so this is an upper bound (the
quickstart's 134.5M parameters: 1.61 GB estimated, 1.49 GB on disk). The parameter count comes
from the model's architecture (a Hugging Face folder's config.json, or the table in
models/config.py). A run keeps min(--keep_checkpoints, its saves) checkpoints; while it
saves, one more is on disk (orbax deletes the oldest only after the new one is finalized).
Without --prune_checkpoints every run's checkpoints stay, so the study needs their sum;
with it only the run in progress holds checkpoints.

Time: the steps left times a per-step time: the mean time/step_s of the runs already in the
study root (the same arm's when it has some, else any selected arm's, else any run's in the
root: a process given some --arms sees the others'), else CPU_SECONDS_PER_PARAM_TOKEN
x parameters x rows per step x tokens per row, a 2-core CPU's rate measured on the
quickstart (an accelerator is far faster: the estimate then only bounds it).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
from collections.abc import Sequence

from experiments import study_stats
from experiments.study_spec import Run, resolve_config
from jaxrl4llm.config import paths
from jaxrl4llm.config.errors import UserError
from jaxrl4llm.models.architectures import ARCHITECTURES
from jaxrl4llm.models.config import PRESETS, ModelConfig
from jaxrl4llm.train.config import TrainConfig, param_dtype
from jaxrl4llm.train.infra.metrics import read_metrics

# Seconds per step per parameter per token of the step's rows (prompts x group, prompt +
# completion budget): the quickstart (SmolLM2-135M, 16 rows x 192 tokens) took 6.4 min for its
# 24 steps on 2 idle CPU cores, 16 s per step: 16 / (134.5e6 x 16 x 192) = 3.9e-11. On 2
# cores shared with other jobs (load average 13) it took 68 s per step, 4x this.
CPU_SECONDS_PER_PARAM_TOKEN = 3.9e-11
GB = 1e9


class InsufficientDiskError(UserError):
    """The study root's disk cannot hold the checkpoints the study's runs will keep."""


@dataclasses.dataclass(frozen=True)
class RunEstimate:
    label: str
    arm: str
    steps_left: int
    num_params: int | None  # None: the model's architecture is not known here
    checkpoint_bytes: int | None  # one checkpoint (policy state, and PPO's critic state)
    kept: int  # checkpoints on disk once the run has finished
    peak: int  # ... while it saves one
    existing_bytes: int  # its checkpoints already on disk (an unfinished run)


def model_num_params(model: str) -> int | None:
    """Parameter count of --model without loading its weights, when its architecture is known:
    a Hugging Face folder's config.json, else a registered or table name."""
    if os.path.isfile(os.path.join(model, "config.json")):
        return ModelConfig.from_hf_config(model).num_params
    name = os.path.basename(os.path.normpath(model)).lower()
    known = ARCHITECTURES.get(name) or PRESETS.get(name)
    return None if known is None else known.num_params


def checkpoint_bytes(config: TrainConfig, num_params: int) -> int:
    """Bytes of one checkpoint: params + two Adam moments, each of the params' dtype, and the
    critic's state beside it for PPO (the backbone and a scalar head: no unembedding)."""
    per_param = 3 * param_dtype(config.model.param_dtype)(0).dtype.itemsize
    total = num_params * per_param
    if config.needs_critic:
        total *= 2  # an upper bound: the critic has no unembedding
    return total


def _saves(num_steps: int, every: int) -> int:
    """Distinct steps a run saves: every `every`, and the last step when it is not one."""
    return num_steps // every + (1 if num_steps % every else 0)


def estimate_run(run: Run, config: TrainConfig) -> RunEstimate:
    """`run`'s steps left and checkpoints; `config` is its resolved TrainConfig."""
    status, last = study_stats.run_status(run.workdir, run.num_steps)
    num_params = model_num_params(config.model.name)
    saves = _saves(run.num_steps, config.run.checkpoint_every)
    keep = config.run.keep_checkpoints
    return RunEstimate(
        label=run.label,
        arm=run.arm,
        steps_left=0 if status == "finished" else run.num_steps - last,
        num_params=num_params,
        checkpoint_bytes=None if num_params is None else checkpoint_bytes(config, num_params),
        kept=min(keep, saves),
        peak=min(keep + 1, saves),
        existing_bytes=study_stats.folder_bytes(paths.join(run.workdir, "checkpoints")),
    )


def disk_needed(runs: Sequence[RunEstimate], prune: bool) -> int:
    """Bytes still to be written for the checkpoints of the runs left to train."""
    pending = [
        (r, r.checkpoint_bytes) for r in runs if r.steps_left > 0 and r.checkpoint_bytes is not None
    ]
    if not pending:
        return 0
    peaks = [r.peak * size - r.existing_bytes for r, size in pending]
    if prune:  # each finished run's checkpoints are deleted before the next run starts
        return max(0, *peaks)
    kept = [r.kept * size - r.existing_bytes for r, size in pending]
    extra = max((r.peak - r.kept) * size for r, size in pending)
    return max(0, sum(kept) + extra)


def seconds_per_step(
    run: Run, config: TrainConfig, num_params: int | None, runs: Sequence[Run]
) -> tuple[float | None, str]:
    """(seconds per step, where the number comes from) for `run`: see the module docstring."""
    # The root's other runs too: a study process given some --arms sees the others' steps.
    root_runs = sorted(
        glob.glob(os.path.join(os.path.dirname(os.path.dirname(run.workdir)), "*", "seed_*"))
    )
    sources = ([r.workdir for r in runs if r.arm == run.arm], [r.workdir for r in runs], root_runs)
    for source in sources:
        times = [
            rec["time/step_s"]
            for workdir in source
            if paths.exists(paths.join(workdir, "metrics.jsonl"))
            for rec in read_metrics(workdir)
            if rec.get("time/step_s") is not None
        ]
        if times:
            return sum(times) / len(times), f"mean time/step_s of {len(times)} logged steps"
    if num_params is None:
        return None, "unknown model size"
    rows = config.rollout.prompts_per_step * config.rollout.group_size
    tokens = config.rollout.max_prompt_tokens + config.rollout.max_new_tokens
    return (
        CPU_SECONDS_PER_PARAM_TOKEN * num_params * rows * tokens,
        "2-core CPU rate per parameter-token, no run logged yet",
    )


def free_bytes(root: str) -> int:
    """Free bytes on the disk that holds `root` (or its nearest existing parent)."""
    folder = os.path.abspath(root)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


def summary(name: str, scale: str, runs: Sequence[Run], root: str, prune: bool) -> str:
    """The lines printed before a study starts; raises InsufficientDiskError when the root's
    disk cannot hold the checkpoints still to be written."""
    estimates: list[RunEstimate] = []
    seconds: list[float | None] = []
    sources: set[str] = set()
    for run in runs:
        config = resolve_config(run.argv[3:], run.label)
        est = estimate_run(run, config)
        estimates.append(est)
        if est.steps_left:
            per_step, source = seconds_per_step(run, config, est.num_params, runs)
            seconds.append(None if per_step is None else per_step * est.steps_left)
            sources.add(source)
    pending = [e for e in estimates if e.steps_left]
    if not pending:
        time_text = "nothing to train"
    elif None in seconds:
        time_text = "time unknown (the model's size is not known here)"
    else:
        known = [s for s in seconds if s is not None]  # all of them, here
        time_text = f"about {_duration(sum(known))} ({'; '.join(sorted(sources))})"
    lines = [
        (
            f"{name} ({scale}): {len(runs)} runs, {len(pending)} to train "
            f"({len(runs) - len(pending)} finished), {sum(e.steps_left for e in pending)} "
            f"steps; {time_text}."
        )
    ]
    sized = [(e, e.checkpoint_bytes) for e in pending if e.checkpoint_bytes is not None]
    if not sized:
        lines.append(
            "Disk: not estimated (the model's parameter count is not known here)."
            if pending
            else "Disk: nothing more to write."
        )
        return "\n".join(lines)
    if paths.is_remote(root):
        lines.append(f"Disk: {root} is object storage; its free space is not checked.")
        return "\n".join(lines)
    need, free = disk_needed(estimates, prune), free_bytes(root)
    each, each_bytes = max(sized, key=lambda pair: pair[0].kept * pair[1])
    assert each.num_params is not None  # known whenever its checkpoint's size is
    per_run = (
        f"each run keeps up to {each.kept} checkpoint(s) of "
        f"{each_bytes / GB:.2f} GB ({each.num_params / 1e6:.1f}M params: "
        "params + 2 Adam moments)"
    )
    if need > free:
        pruned = disk_needed(estimates, prune=True)
        fixes = (
            []
            if prune
            else [
                (
                    f"--prune_checkpoints (deletes each finished run's "
                    f"checkpoints: {pruned / GB:.1f} GB needed)"
                )
            ]
        )
        fixes += [
            "fewer checkpoints per run (--keep_checkpoints=1 in the study's flags)",
            "another --root on a larger disk",
        ]
        raise InsufficientDiskError(
            f"Not enough disk for study {name} in {root}: {free / GB:.1f} GB free, "
            f"{need / GB:.1f} GB needed ({len(sized)} runs to train; {per_run}). Use "
            f"{', or '.join(fixes)}."
        )
    lines.append(
        f"Disk: {per_run}; {need / GB:.1f} GB needed"
        f"{' (with --prune_checkpoints)' if prune else ''}, {free / GB:.1f} GB free "
        f"in {root}."
    )
    return "\n".join(lines)
