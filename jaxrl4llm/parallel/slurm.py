"""The GPUs a SLURM task's process drives, for `jax.distributed.initialize(local_device_ids=)`.

Left unset under SLURM, jax restricts each process to the one GPU numbered SLURM_LOCALID
(`jax/_src/clusters/cluster.py`): right for one task per GPU, but one task per node owning
8 GPUs would drive GPU 0 alone. `local_device_ids` gives each task its share of the GPUs the
process sees (CUDA_VISIBLE_DEVICES, which SLURM sets to the GPUs the task owns):

    one task per node, 8 GPUs visible       -> [0, 1, ..., 7]
    one task per GPU, 8 GPUs visible        -> [SLURM_LOCALID]
    one task per GPU, bound to its own GPU  -> [0]        (--gpus-per-task=1, --gpu-bind)
    2 tasks per node, 8 GPUs visible        -> [0..3] and [4..7]
    one task per node, GPU count unknown    -> []         (no restriction: all it sees)

JAX_LOCAL_DEVICE_IDS, when set, wins (jax reads it itself).
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from jaxrl4llm.config.errors import UserError

# What jax's SlurmCluster.is_env_present requires: with these set jax picks SLURM.
SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


def under_slurm(env: Mapping[str, str]) -> bool:
    return all(name in env for name in SLURM_VARS)


def tasks_on_node(env: Mapping[str, str]) -> int | None:
    """The number of tasks SLURM runs on this task's node: SLURM_STEP_TASKS_PER_NODE (srun's
    step) or SLURM_TASKS_PER_NODE (the job), e.g. `2(x3),1` (3 nodes of 2, then 1), indexed
    by SLURM_NODEID; None when SLURM does not say."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not text:
        per_node = env.get("SLURM_NTASKS_PER_NODE")
        return int(per_node) if per_node and per_node.isdigit() else None
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else None


def visible_gpus(env: Mapping[str, str]) -> int | None:
    """How many GPUs this process sees: CUDA_VISIBLE_DEVICES (ids or UUIDs), else the
    GPUs SLURM gave the step or the job on this node; None when nothing says."""
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if name in env:
            return len([g for g in env[name].split(",") if g.strip()])
    on_node = env.get("SLURM_GPUS_ON_NODE", "")
    return int(on_node) if on_node.isdigit() else None


def local_device_ids(env: Mapping[str, str] | None = None) -> list[int] | None:
    """This SLURM task's `local_device_ids` (the module docstring's table), or None outside
    SLURM, with JAX_LOCAL_DEVICE_IDS set, or when SLURM does not say how many tasks share
    the node (jax's own choice then stands). Raises UserError when the node's GPUs do not
    split evenly over its tasks."""
    env = os.environ if env is None else env
    if not under_slurm(env) or env.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    tasks, gpus = tasks_on_node(env), visible_gpus(env)
    local_id = int(env["SLURM_LOCALID"])
    if tasks is None:
        return None
    if tasks == 1:
        return list(range(gpus)) if gpus else []
    if gpus is None:  # one task per GPU, every task seeing all of them
        return [local_id]
    if gpus == 1:  # each task bound to its own GPU
        return [0]
    if gpus % tasks:
        raise UserError(
            f"SLURM runs {tasks} tasks on this node and each sees {gpus} GPUs "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')!r}), which do not "
            "split evenly: run one task per node (--ntasks-per-node=1) or one per GPU, or "
            "set JAX_LOCAL_DEVICE_IDS for each task."
        )
    share = gpus // tasks
    return list(range(local_id * share, (local_id + 1) * share))
