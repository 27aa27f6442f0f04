"""What `python -m experiments.launch` runs on each kind of cluster, as data: the files it
writes (a Kubernetes manifest, an sbatch script) and the commands it runs, built by pure
functions of the launch options and the training arguments, so that they can be printed
(--dry_run) and checked without a cluster.

    plan = make_plan(opts, ["--flagfile=experiments/configs/quickstart.flags"])
    plan.files    # {path: text} written before the first command
    plan.steps    # each a tuple of processes run at once; a step's code ends an attempt

Every backend runs `python -m experiments.train --distributed ARGS` once per host with the
same ARGS, and reduces the hosts' exit codes by `combined_exit_code`: 75 (preempted,
checkpoint saved) when any host was preempted, else the first failure, else 0.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from typing import Sequence

from jaxrl4llm.config.errors import EXIT_PREEMPTED

BACKENDS = ("local", "tpu-vm", "gke", "slurm")
TRAIN_MODULE = "experiments.train"
COORDINATOR_PORT = 8476  # jax.distributed's coordinator, on the first host
REMOTE_PREFIXES = ("gs://", "s3://")  # workdirs that orbax writes but a shell cannot append to

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
        (gcloud ssh on every worker of a TPU VM slice), gke (a Kubernetes indexed Job applied
        with kubectl), slurm (an sbatch script, one task per node).
    name: The job's name (Kubernetes Job, SLURM job, log folder); for tpu-vm the TPU's name.
    num_hosts: Hosts (processes) of the job: local processes, Kubernetes pods, SLURM nodes.
        tpu-vm runs on every worker of the slice.
    max_restarts: Resubmissions after a preemption (exit code 75); any other failure stops.
    dry_run: Print the files and commands, run nothing.
    launch_dir: Where the generated files and the local logs go (default: WORKDIR/launch,
        or launch/NAME when the workdir is a gs:// path).
    env_vars: Extra environment variables of every host, KEY=VALUE,KEY=VALUE.
    python: The Python interpreter on the hosts (default: python3; local: this one).
    repo_dir: The repository's folder on the hosts (tpu-vm, slurm; gke: the image's workdir).
    zone: tpu-vm: the TPU's zone.
    project: tpu-vm: the Google Cloud project (default: gcloud's configured one).
    image: gke: the container image holding the repository and its packages.
    namespace: gke: the Kubernetes namespace.
    accelerator: gke: the node selector's accelerator, e.g. tpu-v5p-slice,
        tpu-v5-lite-podslice or nvidia-h100-80gb.
    tpu_topology: gke: the TPU slice topology, e.g. 2x2x2 (empty for GPUs).
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
    zone: str = ""
    project: str = ""
    image: str = ""
    namespace: str = "default"
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
    """One attempt of a launch: write `files`, then run `steps` in order, each step's processes
    at once; the attempt's exit code is the first step's non-zero code (its processes' codes
    combined), else 0."""

    files: dict[str, str]
    steps: tuple[tuple[Process, ...], ...]
    log_dir: str  # where the hosts' logs go

    def describe(self) -> str:
        parts = []
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
    from jaxrl4llm.train.config_groups import RunConfig

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


def _train_argv(opts: LaunchOptions, train_args: Sequence[str]) -> tuple[str, ...]:
    return (opts.python or "python3", "-m", TRAIN_MODULE, "--distributed", *train_args)


def _base_env(platform: str, opts: LaunchOptions) -> tuple[tuple[str, str], ...]:
    # Unbuffered: a host's log shows each step as it ends, also when the job is killed.
    return (("JAX_PLATFORMS", platform), ("PYTHONUNBUFFERED", "1")) + parse_env(opts.env_vars)


def make_plan(opts: LaunchOptions, train_args: Sequence[str], module: str = TRAIN_MODULE) -> Plan:
    """The plan of `opts.backend` for the training arguments `train_args`. `module` replaces
    experiments.train on the local backend (tests run a stand-in that exits 75)."""
    if opts.backend not in BACKENDS:
        raise ValueError(f"--backend={opts.backend}: choose one of {', '.join(BACKENDS)}.")
    if opts.num_hosts < 1 or opts.max_restarts < 0:
        raise ValueError(
            f"--num_hosts={opts.num_hosts} must be >= 1 and --max_restarts="
            f"{opts.max_restarts} >= 0."
        )
    workdir = workdir_of(train_args)
    builders = {"local": _local, "tpu-vm": _tpu_vm, "gke": _gke, "slurm": _slurm}
    return builders[opts.backend](opts, list(train_args), workdir, module)


def _require(opts: LaunchOptions, *names: str) -> None:
    missing = [f"--{n}" for n in names if not getattr(opts, n)]
    if missing:
        raise ValueError(
            f"--backend={opts.backend} needs {', '.join(missing)} (python -m "
            "experiments.launch --help describes each)."
        )


def _local(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> Plan:
    """N processes on this machine joined by jax.distributed on localhost, each with
    --devices_per_process fake CPU devices: the multi-host path without a cluster."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = os.path.join(launch_dir(opts, workdir), "logs")
    argv = (opts.python or sys.executable, "-m", module, "--distributed", *train_args)
    env = (
        ("JAX_PLATFORMS", "cpu"),
        ("PYTHONUNBUFFERED", "1"),
        ("XLA_FLAGS", f"--xla_force_host_platform_device_count={opts.devices_per_process}"),
        ("JAX_COORDINATOR_ADDRESS", f"127.0.0.1:{port}"),
        ("JAX_NUM_PROCESSES", str(opts.num_hosts)),
    ) + parse_env(opts.env_vars)
    processes = tuple(
        Process(argv, env + (("JAX_PROCESS_ID", str(i)),), os.path.join(logs, f"worker{i}.log"))
        for i in range(opts.num_hosts)
    )
    return Plan(files={}, steps=(processes,), log_dir=logs)


def _tpu_vm(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> Plan:
    """`gcloud compute tpus tpu-vm ssh NAME --worker=all`: every worker of the slice runs the
    same command (jax.distributed finds its peers from the TPU metadata) and tees its output
    to WORKDIR/logs/worker-HOST.log, copied there at the end when the workdir is gs://."""
    _require(opts, "zone")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in _base_env("tpu", opts))
    train = shlex.join(_train_argv(opts, train_args))
    remote_logs = os.path.join(workdir, "logs")
    logs = "/tmp/jaxrl4llm-logs" if is_remote(workdir) else remote_logs
    log = f"{logs}/worker-$(hostname).log"
    command = (
        f"cd {opts.repo_dir} && mkdir -p {shlex.quote(logs)} && "
        f"{env} {train} 2>&1 | tee {log}; rc=${{PIPESTATUS[0]}}; "
    )
    if is_remote(workdir):
        command += f"gcloud storage cp {log} {shlex.quote(remote_logs)}/; "
    command += "exit $rc"
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", opts.name, f"--zone={opts.zone}"]
    if opts.project:
        argv.append(f"--project={opts.project}")
    argv += ["--worker=all", f"--command={command}"]
    return Plan(files={}, steps=((Process(tuple(argv)),),), log_dir=remote_logs)


def _gke(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> Plan:
    """An indexed Job of --num_hosts pods behind a headless Service (pod 0 is the
    coordinator), applied with kubectl; the launcher waits for it and reads each pod's exit
    code. A resubmission deletes the old Job first."""
    _require(opts, "image", "accelerator", "chips_per_host")
    tpu = opts.accelerator.startswith("tpu")
    folder = launch_dir(opts, workdir)
    manifest = os.path.join(folder, f"{opts.name}.yaml")
    files = {manifest: gke_manifest(opts, train_args, tpu)}
    kubectl = ("kubectl", f"--namespace={opts.namespace}")
    job = f"job/{opts.name}"
    wait = (
        f"kubectl --namespace={opts.namespace} wait --for=condition=Complete {job} "
        f"--timeout=-1s & kubectl --namespace={opts.namespace} wait "
        f"--for=condition=Failed {job} --timeout=-1s & wait -n; kill %1 %2 2>/dev/null\n"
        f"CODES=$(kubectl --namespace={opts.namespace} get pods "
        f"--selector=batch.kubernetes.io/job-name={opts.name} -o jsonpath="
        "'{range .items[*]}{.status.containerStatuses[0].state.terminated.exitCode} {end}')\n"
        f"{COMBINE_CODES_BASH}\nexit $rc"
    )
    steps = (
        (Process((*kubectl, "delete", "--ignore-not-found", "-f", manifest)),),
        (Process((*kubectl, "apply", "-f", manifest)),),
        (Process(("bash", "-c", wait)),),
    )
    return Plan(
        files=files,
        steps=steps,
        log_dir=f"kubectl logs --selector=batch.kubernetes.io/job-name={opts.name}",
    )


def gke_manifest(opts: LaunchOptions, train_args: Sequence[str], tpu: bool) -> str:
    """The Service and indexed Job (YAML, two documents). TPU pods: GKE sets the slice's
    worker ids and hostnames and jax.distributed reads them; GPU pods: the coordinator is
    pod 0 through the headless Service, the process id the pod's completion index."""
    import yaml

    env = [{"name": k, "value": v} for k, v in _base_env("tpu" if tpu else "cuda", opts)]
    train = shlex.join(_train_argv(opts, train_args))
    if not tpu:
        env += [
            {
                "name": "JAX_COORDINATOR_ADDRESS",
                "value": f"{opts.name}-0.{opts.name}:{COORDINATOR_PORT}",
            },
            {"name": "JAX_NUM_PROCESSES", "value": str(opts.num_hosts)},
        ]
        train = f"JAX_PROCESS_ID=$JOB_COMPLETION_INDEX exec {train}"
    resource = "google.com/tpu" if tpu else "nvidia.com/gpu"
    selector = {
        "cloud.google.com/gke-tpu-accelerator"
        if tpu
        else "cloud.google.com/gke-accelerator": opts.accelerator
    }
    if tpu and opts.tpu_topology:
        selector["cloud.google.com/gke-tpu-topology"] = opts.tpu_topology
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": opts.name, "namespace": opts.namespace},
        "spec": {"clusterIP": "None", "selector": {"batch.kubernetes.io/job-name": opts.name}},
    }
    container = {
        "name": "train",
        "image": opts.image,
        "command": ["bash", "-c", train],
        "env": env,
        "ports": [{"containerPort": COORDINATOR_PORT}],
        "resources": {"limits": {resource: opts.chips_per_host}},
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": opts.name, "namespace": opts.namespace},
        "spec": {
            "completionMode": "Indexed",
            "completions": opts.num_hosts,
            "parallelism": opts.num_hosts,
            "backoffLimit": 0,  # a failed host fails the job; the launcher resubmits
            "template": {
                "spec": {
                    "subdomain": opts.name,
                    "restartPolicy": "Never",
                    "nodeSelector": selector,
                    "containers": [container],
                }
            },
        },
    }
    return yaml.safe_dump_all([service, job], sort_keys=False)


def _slurm(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> Plan:
    """`sbatch --wait` of a script with one task per node: srun starts the trainer on each,
    the first node is the coordinator; each task's log and exit code go to the launch folder
    (shared storage on a SLURM cluster)."""
    _require(opts, "partition")
    folder = os.path.abspath(launch_dir(opts, workdir))  # the script cds to --repo_dir
    script = os.path.join(folder, f"{opts.name}.sbatch")
    files = {script: sbatch_script(opts, train_args, os.path.join(folder, "logs"))}
    return Plan(
        files=files,
        steps=((Process(("sbatch", "--wait", script)),),),
        log_dir=os.path.join(folder, "logs"),
    )


def sbatch_script(opts: LaunchOptions, train_args: Sequence[str], logs: str) -> str:
    """The sbatch script: one task per node, every node with --chips_per_host GPUs."""
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
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in _base_env("cuda", opts))
    train = shlex.join(_train_argv(opts, train_args))
    task = (
        f"JAX_PROCESS_ID=$SLURM_PROCID {train} > {shlex.quote(logs)}/worker-$SLURM_PROCID.log"
        f" 2>&1; echo $? > {shlex.quote(logs)}/exit-$SLURM_PROCID"
    )
    return "\n".join(
        ["#!/bin/bash"]
        + [f"#SBATCH {d}" for d in directives]
        + [
            "set -u",
            f"mkdir -p {shlex.quote(logs)} && rm -f {shlex.quote(logs)}/exit-*",
            f"cd {opts.repo_dir}",
            exports,
            "# The first node of the allocation coordinates jax.distributed.",
            'COORDINATOR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"export JAX_COORDINATOR_ADDRESS=$COORDINATOR:{COORDINATOR_PORT}",
            "export JAX_NUM_PROCESSES=$SLURM_NNODES",
            f"srun --ntasks={opts.num_hosts} --ntasks-per-node=1 bash -c {shlex.quote(task)}",
            f"CODES=$(cat {shlex.quote(logs)}/exit-* 2>/dev/null || echo 1)",
            COMBINE_CODES_BASH,
            "exit $rc",
            "",
        ]
    )
