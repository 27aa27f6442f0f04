"""What `python -m experiments.launch` runs on each kind of cluster, as data: the files it
writes (a Kubernetes manifest, an sbatch script) and the commands it runs, built by pure
functions of the launch options and the training arguments, so that they can be printed
(--dry_run) and checked without a cluster.

    plan = make_plan(opts, ["--flagfile=experiments/configs/quickstart.flags"])
    plan.files    # {path: text} written before the first command
    plan.steps    # each a tuple of processes run at once; a step's code ends an attempt

Every backend runs `python -m experiments.train --distributed ARGS` once per host with the
same ARGS, and reduces the hosts' exit codes by `combined_exit_code`: 75 (preempted,
checkpoint saved) when any host was preempted, else the first failure, else 0. This module
holds the plan's types, the local and SLURM backends; experiments/launch_gke.py and
experiments/launch_tpu_vm.py the others.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from typing import Sequence

from jaxrl4llm.config.errors import EXIT_PREEMPTED

BACKENDS = ("local", "tpu-vm", "gke", "slurm")
TRAIN_MODULE = "experiments.train"
COORDINATOR_PORT = 8476  # jax.distributed's coordinator, on the first host
REMOTE_PREFIXES = ("gs://", "s3://")  # workdirs that orbax writes but a shell cannot append to
# The seconds between SIGTERM and SIGKILL, told to the trainer (jaxrl4llm/train/loop.py reads
# it and warns when a step and its save take longer).
GRACE_ENV = "JAXRL4LLM_GRACE_PERIOD_S"

# A SLURM node's address (NodeAddr, which may differ from its name) in `scontrol show node`.
NODE_ADDR_SED = r"s/.*NodeAddr=\([^ ]*\).*/\1/p"
# `combined_exit_code` in bash: CODES holds one exit code per host, RC gets the job's.
COMBINE_CODES_BASH = f"""\
rc=0
for code in $CODES; do
  if [ "$code" = {EXIT_PREEMPTED} ]; then rc={EXIT_PREEMPTED}; break; fi
  if [ "$rc" = 0 ] && [ "$code" != 0 ]; then rc=$code; fi
done"""


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """Where and how the training command runs (the training flags follow `--`).

    backend: Where the hosts run: local (N processes on this machine, for tests), tpu-vm
        (gcloud ssh on every worker of a TPU VM slice, run detached), gke (a Kubernetes
        indexed Job or JobSet applied with kubectl), slurm (an sbatch script, one task per
        node).
    name: The job's name (Kubernetes Job, SLURM job, log folder); for tpu-vm the TPU's name.
    num_hosts: Hosts (processes) of the job: local processes, Kubernetes pods (all slices
        together), SLURM nodes. tpu-vm runs on every worker of the slice.
    max_restarts: Resubmissions after a preemption (exit code 75); any other failure stops.
        tpu-vm --spot: a preempted slice is recreated for each.
    dry_run: Print the files and commands, run nothing.
    launch_dir: Where the generated files and the local logs go (default: WORKDIR/launch,
        or launch/NAME when the workdir is a gs:// path).
    env_vars: Extra environment variables of every host, KEY=VALUE,KEY=VALUE.
    python: The Python interpreter on the hosts (default: python3; local: this one).
    repo_dir: The repository's folder on the hosts (tpu-vm, slurm; gke: the image's workdir).
    grace_period_s: Seconds a preempted host has between SIGTERM and SIGKILL to save its
        checkpoint: gke: the pods' terminationGracePeriodSeconds; slurm: SIGTERM this long
        before the time limit (--signal); local: before a failed host's peers are killed;
        every backend tells the trainer, which warns when a step and its save take longer.
        0: the platform's own (GKE 30 s, GCE preemption 30 s).
    poll_s: gke, tpu-vm: seconds between two looks at the job's state while waiting.
    zone: tpu-vm: the TPU's zone.
    project: tpu-vm: the Google Cloud project (default: gcloud's configured one).
    spot: tpu-vm: create the slice as a spot queued resource (--accelerator,
        --runtime_version) and recreate it after a preemption, up to --max_restarts times.
    runtime_version: tpu-vm --spot: the TPU software version, e.g. v2-alpha-tpuv5.
    setup_command: tpu-vm --spot: a shell command run on every worker of a newly created
        slice before training (clone the repository, install it).
    image: gke: the container image holding the repository and its packages.
    namespace: gke: the Kubernetes namespace.
    gke_kind: gke: job (an indexed Job: one slice or GPU node group) or jobset (a JobSet of
        --num_slices indexed Jobs, the GKE way to run multi-slice TPU).
    num_slices: gke jobset: TPU slices joined over the data-center network (multi-slice).
    accelerator: gke: the node selector's accelerator, e.g. tpu-v5p-slice,
        tpu-v5-lite-podslice or nvidia-h100-80gb; tpu-vm --spot: the slice's accelerator
        type, e.g. v5p-16.
    tpu_topology: gke: the TPU slice topology, e.g. 2x2x2 (empty for GPUs); its chips over
        --chips_per_host give the hosts of each slice.
    chips_per_host: gke: TPU chips or GPUs each pod requests; slurm: GPUs per node.
    partition: slurm: the partition.
    account: slurm: the account to charge (default: the user's).
    time_limit: slurm: the job's time limit (HH:MM:SS).
    devices_per_process: local: fake CPU devices per process.
    """

    backend: str = "local"
    name: str = "jaxrl4llm"
    num_hosts: int = 1
    max_restarts: int = 3
    dry_run: bool = False
    launch_dir: str | None = None
    env_vars: str = ""
    python: str = ""
    repo_dir: str = "~/jaxrl4llm"
    grace_period_s: int = 0
    poll_s: int = 60
    zone: str = ""
    project: str = ""
    spot: bool = False
    runtime_version: str = ""
    setup_command: str = ""
    image: str = ""
    namespace: str = "default"
    gke_kind: str = "job"
    num_slices: int = 1
    accelerator: str = ""
    tpu_topology: str = ""
    chips_per_host: int = 0
    partition: str = ""
    account: str = ""
    time_limit: str = "24:00:00"
    devices_per_process: int = 2


@dataclasses.dataclass(frozen=True)
class Process:
    """One command: its argv, the environment it adds, and the file its output goes to (None:
    the launcher's own console)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    log: str | None = None

    def shell(self) -> str:
        """The command as one shell line (what --dry_run prints)."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env]
        line = shlex.join(self.argv)
        line = " ".join(env + [line]) if env else line
        return f"{line} > {shlex.quote(self.log)} 2>&1" if self.log else line


@dataclasses.dataclass(frozen=True)
class Plan:
    """One attempt of a launch: make `folders`, write `files`, then run `steps` in order, each
    step's processes at once; the attempt's exit code is the first step's non-zero code (its
    processes' codes combined), else 0."""

    files: dict[str, str]
    steps: tuple[tuple[Process, ...], ...]
    log_dir: str  # where the hosts' logs go
    folders: tuple[str, ...] = ()  # made before the first step (sbatch's --output folder)

    def describe(self) -> str:
        parts = [f"# ---- mkdir -p {shlex.quote(folder)}\n" for folder in self.folders]
        for path, text in self.files.items():
            parts.append(f"# ---- {path}\n{text.rstrip()}\n")
        for i, step in enumerate(self.steps, 1):
            together = " (at once)" if len(step) > 1 else ""
            parts.append(f"# ---- step {i}{together}\n" + "\n".join(p.shell() for p in step))
        parts.append(f"# ---- logs: {self.log_dir}")
        return "\n".join(parts) + "\n"


def combined_exit_code(codes: Sequence[int]) -> int:
    """The job's exit code from its hosts': preempted (75) if any host was preempted (its peers
    may then fail in a collective), else the first failure, else 0."""
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    return next((c for c in codes if c != 0), 0)


def is_remote(path: str) -> bool:
    return path.startswith(REMOTE_PREFIXES)


def workdir_of(train_args: Sequence[str]) -> str:
    """The --workdir the training arguments give (in a --flagfile or on the command line, the
    last one winning as absl reads them), else the trainer's default."""
    from jaxrl4llm.train.config.groups import RunConfig

    workdir = RunConfig.workdir
    for arg in train_args:
        if arg.startswith("--flagfile="):
            path = arg.partition("=")[2]
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    found = workdir_of([line.strip() for line in f])
                if found != RunConfig.workdir:
                    workdir = found
        elif arg.startswith("--workdir="):
            workdir = arg.partition("=")[2]
    return workdir


def parse_env(text: str) -> tuple[tuple[str, str], ...]:
    """KEY=VALUE,KEY=VALUE -> ((KEY, VALUE), ...). An item that does not start with KEY= goes
    on the previous value (`A=1,2,B=3`: A is "1,2"); a first item without one raises
    ValueError."""
    pairs: list[list[str]] = []
    for item in text.split(",") if text else ():
        key, sep, value = item.partition("=")
        if sep and key.strip().isidentifier():
            pairs.append([key.strip(), value])
        elif pairs:
            pairs[-1][1] += "," + item
        else:
            raise ValueError(
                f"--env_vars={text!r} must start with KEY=VALUE (e.g. "
                "--env_vars=TF_CPP_MIN_LOG_LEVEL=1,XLA_FLAGS=--xla_dump_to=/tmp/hlo)."
            )
    return tuple((k, v) for k, v in pairs)


def launch_dir(opts: LaunchOptions, workdir: str) -> str:
    if opts.launch_dir:
        return opts.launch_dir
    return (
        os.path.join("launch", opts.name) if is_remote(workdir) else os.path.join(workdir, "launch")
    )


def train_argv(
    opts: LaunchOptions, train_args: Sequence[str], module: str = TRAIN_MODULE
) -> tuple[str, ...]:
    return (opts.python or "python3", "-m", module, "--distributed", *train_args)


def base_env(
    platform: str, opts: LaunchOptions, extra: tuple[tuple[str, str], ...] = ()
) -> tuple[tuple[str, str], ...]:
    """Every host's environment: the platform, unbuffered output (a host's log shows each
    step as it ends, also when the job is killed), the grace period, `extra`, then
    --env_vars (last: they win)."""
    env: tuple[tuple[str, str], ...] = (("JAX_PLATFORMS", platform), ("PYTHONUNBUFFERED", "1"))
    if opts.grace_period_s:
        env += ((GRACE_ENV, str(opts.grace_period_s)),)
    return env + extra + parse_env(opts.env_vars)


def require(opts: LaunchOptions, *names: str, what: str = "") -> None:
    """Raises ValueError naming the flags of `names` left empty (`what` needs them: default
    --backend=BACKEND)."""
    missing = [f"--{n}" for n in names if not getattr(opts, n)]
    if missing:
        raise ValueError(
            f"{what or f'--backend={opts.backend}'} needs {', '.join(missing)} (python -m "
            "experiments.launch --help describes each)."
        )


def check_name(opts: LaunchOptions) -> None:
    """A Kubernetes object's or a TPU's name: lowercase letters, digits and dashes."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?", opts.name):
        raise ValueError(
            f"--name={opts.name!r}: --backend={opts.backend} needs a name of lowercase "
            "letters, digits and dashes that starts with a letter (at most 52), e.g. "
            "--name=grpo-7b."
        )


def local_plan(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> Plan:
    """N processes on this machine joined by jax.distributed on localhost, each with
    --devices_per_process fake CPU devices: the multi-host path without a cluster."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = os.path.join(launch_dir(opts, workdir), "logs")
    argv = (opts.python or sys.executable, "-m", module, "--distributed", *train_args)
    env = base_env(
        "cpu",
        opts,
        (
            ("XLA_FLAGS", f"--xla_force_host_platform_device_count={opts.devices_per_process}"),
            ("JAX_COORDINATOR_ADDRESS", f"127.0.0.1:{port}"),
            ("JAX_NUM_PROCESSES", str(opts.num_hosts)),
        ),
    )
    processes = tuple(
        Process(argv, env + (("JAX_PROCESS_ID", str(i)),), os.path.join(logs, f"worker{i}.log"))
        for i in range(opts.num_hosts)
    )
    return Plan(files={}, steps=(processes,), log_dir=logs)


def slurm_plan(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> Plan:
    """`sbatch --wait` of a script with one task per node: srun starts the trainer on each,
    the first node is the coordinator; each task's log and exit code go to the launch folder
    (shared storage on a SLURM cluster), made before sbatch runs (SLURM fails a job whose
    --output folder is missing, with no output at all)."""
    require(opts, "partition")
    folder = os.path.abspath(launch_dir(opts, workdir))  # the script cds to --repo_dir
    script = os.path.join(folder, f"{opts.name}.sbatch")
    logs = os.path.join(folder, "logs")
    files = {script: sbatch_script(opts, train_args, logs, module)}
    return Plan(
        files=files,
        steps=((Process(("sbatch", "--wait", script)),),),
        log_dir=logs,
        folders=(logs,),
    )


def sbatch_script(
    opts: LaunchOptions, train_args: Sequence[str], logs: str, module: str = TRAIN_MODULE
) -> str:
    """The sbatch script: one task per node, every node with --chips_per_host GPUs; each task
    drives all its node's GPUs (jaxrl4llm/parallel/slurm.py gives jax.distributed their
    ids)."""
    directives = [
        f"--job-name={opts.name}",
        f"--partition={opts.partition}",
        f"--nodes={opts.num_hosts}",
        "--ntasks-per-node=1",
        f"--time={opts.time_limit}",
        f"--output={logs}/sbatch-%j.out",
    ]
    if opts.chips_per_host:
        directives.append(f"--gpus-per-node={opts.chips_per_host}")
    if opts.account:
        directives.append(f"--account={opts.account}")
    if opts.grace_period_s:  # SIGTERM to the tasks this long before the time limit
        directives.append(f"--signal=TERM@{opts.grace_period_s}")
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in base_env("cuda", opts))
    train = shlex.join(train_argv(opts, train_args, module))
    # SIGTERM (preemption, --signal, scancel) reaches every process of the job: the shells
    # only note it (a trap, not inherited), so each records its trainer's exit code (75 once
    # it saved) and the script combines them.
    task = (
        f"trap true TERM; JAX_PROCESS_ID=$SLURM_PROCID {train} > "
        f"{shlex.quote(logs)}/worker-$SLURM_PROCID.log 2>&1; "
        f"echo $? > {shlex.quote(logs)}/exit-$SLURM_PROCID"
    )
    return "\n".join(
        ["#!/bin/bash"]
        + [f"#SBATCH {d}" for d in directives]
        + [
            "set -u",
            "trap 'echo \"launch: SIGTERM: waiting for the tasks to save\" >&2' TERM",
            f"mkdir -p {shlex.quote(logs)} && rm -f {shlex.quote(logs)}/exit-*",
            f"cd {opts.repo_dir}",
            exports,
            "# The first node of the allocation coordinates jax.distributed, at its address.",
            'FIRST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f'COORDINATOR=$(scontrol show node "$FIRST" | sed -n "{NODE_ADDR_SED}")',
            f"export JAX_COORDINATOR_ADDRESS=${{COORDINATOR:-$FIRST}}:{COORDINATOR_PORT}",
            "export JAX_NUM_PROCESSES=$SLURM_NNODES",
            f"srun --ntasks={opts.num_hosts} --ntasks-per-node=1 bash -c {shlex.quote(task)}",
            f"CODES=$(cat {shlex.quote(logs)}/exit-* 2>/dev/null || echo 1)",
            COMBINE_CODES_BASH,
            "exit $rc",
            "",
        ]
    )
