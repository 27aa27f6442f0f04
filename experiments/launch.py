"""Run `python -m experiments.train` on every host of a cluster with the same flags, and
resubmit it when it is preempted.

    python -m experiments.launch --backend=tpu-vm --name=my-v5p-16 --zone=us-east5-a \
        -- --flagfile=experiments/configs/quickstart.flags --workdir=gs://bucket/runs/q1
    python -m experiments.launch --backend=slurm --num_hosts=2 --chips_per_host=8 \
        --partition=gpu -- --flagfile=... --workdir=/shared/runs/q1 --mesh=data:2,fsdp:8
    python -m experiments.launch --backend=gke --dry_run ...   # print what it would run

The launcher's own flags come first; everything after `--` is passed to the trainer on every
host unchanged (each host also gets --distributed). The backends (experiments/launch_plans.py,
launch_gke.py, launch_tpu_vm.py) write a manifest or script where needed and run a few
commands per attempt. An attempt ending with exit code 75 (preempted: the checkpoint is
saved) is resubmitted with the same command, at most --max_restarts times; it resumes from
the workdir's latest checkpoint. Any other non-zero code stops the launcher with that code.
docs/clusters.md walks through each backend.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from typing import IO, Callable, Sequence

from absl import flags

from experiments.launch_backends import make_plan
from experiments.launch_plans import LaunchOptions, Plan, Process, combined_exit_code
from jaxrl4llm.config import cli
from jaxrl4llm.config.errors import EXIT_PREEMPTED, flag_errors

for _name in cli.define_flags(LaunchOptions):
    flags.declare_key_flag(_name)
FLAGS = flags.FLAGS
# A failed host's peers wait in a collective until jax's heartbeat gives up: they are
# stopped this long after the first failure.
PEER_GRACE_S = 30.0


def run_step(step: Sequence[Process], grace_s: float = PEER_GRACE_S) -> int:
    """Runs a step's processes at once (each with its environment and log file) and returns
    their combined exit code; when one fails, the others get `grace_s` seconds to end on
    their own (a preempted peer saves its checkpoint), then SIGTERM, then SIGKILL."""
    logs = [_open_log(p.log) for p in step]
    procs = [
        subprocess.Popen(
            list(p.argv),
            env={**os.environ, **dict(p.env)},
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
        )
        for p, log in zip(step, logs)
    ]
    failed_at = None
    while any(proc.poll() is None for proc in procs):
        if failed_at is None and any(proc.returncode for proc in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            _stop(procs, grace_s)
        time.sleep(0.2)
    for log in logs:
        if log is not None:
            log.close()
    return combined_exit_code([proc.wait() for proc in procs])


def _open_log(path: str | None) -> IO[str] | None:
    if not path:
        return None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return open(path, "w")


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to the processes still running, SIGKILL to those still running `grace_s`
    seconds later."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_attempt(plan: Plan, runner: Callable[[Sequence[Process]], int] = run_step) -> int:
    """Makes the plan's folders, writes its files and runs its steps; the first non-zero step
    code ends it."""
    for folder in plan.folders:
        os.makedirs(folder, exist_ok=True)
    for path, text in plan.files.items():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    for step in plan.steps:
        code = runner(step)
        if code:
            return code
    return 0


def launch(
    plan: Plan,
    max_restarts: int,
    runner: Callable[[Sequence[Process]], int] = run_step,
    log: Callable[[str], None] = print,
) -> int:
    """Runs the plan, again after each preemption (exit 75) up to `max_restarts` times;
    returns the last attempt's exit code."""
    for attempt in range(max_restarts + 1):
        code = run_attempt(plan, runner)
        if code != EXIT_PREEMPTED:
            break
        if attempt < max_restarts:
            log(
                f"launch: attempt {attempt + 1} was preempted (exit {EXIT_PREEMPTED}); "
                f"resubmitting ({attempt + 1} of --max_restarts={max_restarts})."
            )
    if code == EXIT_PREEMPTED:
        log(
            f"launch: preempted {max_restarts + 1} times, --max_restarts={max_restarts} "
            "used up; run the same command again to resume from the last checkpoint."
        )
    elif code:
        log(
            f"launch: the job failed with exit code {code}; not resubmitted (only 75, "
            f"preempted, is). The hosts' logs: {plan.log_dir}"
        )
    else:
        log("launch: the job finished.")
    return code


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the launcher's argv, the trainer's arguments after `--`)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


TRAIN_ARGS: list[str] = []


def main(argv: Sequence[str]) -> int:
    del argv  # cli.run refuses positional arguments; the trainer's come after `--`
    opts = cli.config_from_flags(LaunchOptions)
    with flag_errors():
        plan = make_plan(opts, TRAIN_ARGS)
    if opts.dry_run:
        sys.stdout.write(plan.describe())
        return 0
    grace = float(opts.grace_period_s or PEER_GRACE_S)
    return launch(plan, opts.max_restarts, functools.partial(run_step, grace_s=grace))


if __name__ == "__main__":
    _launcher_argv, TRAIN_ARGS[:] = split_argv(sys.argv)
    cli.run(main, argv=_launcher_argv)
