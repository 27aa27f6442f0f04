"""The tpu-vm backend of experiments.launch: the trainer runs detached on every worker of a
TPU VM slice (a dropped ssh connection does not stop it), and the launcher polls the workers
with short ssh calls until it has ended on all of them. With --spot the slice is a spot
queued resource, created when missing and deleted and recreated after a preemption.

Per attempt: [--spot: NAME-slice.sh, the slice up] -> `gcloud ... ssh --worker=all` starting
the run (or finding it still running: rerunning the launch command reattaches) -> NAME-wait.sh.

On each worker, ~/jaxrl4llm-runs/NAME/ holds `pid` and `exit` (the run's exit code), and
`worker.log` when the workdir is gs:// (copied to WORKDIR/logs/worker-HOST.log when the run
ends); a local workdir gets WORKDIR/logs/worker-HOST.log directly. Logs are appended to,
never truncated, so a resubmission's output follows the previous attempt's.
"""

from __future__ import annotations

import os
import shlex

from experiments.launch_plans import (
    COMBINE_CODES_BASH,
    LaunchOptions,
    Plan,
    Process,
    base_env,
    check_name,
    is_remote,
    launch_dir,
    require,
    train_argv,
)
from jaxrl4llm.config.errors import EXIT_PREEMPTED

STATUS_TAG = "jaxrl4llm-status"  # each worker's status line: TAG running | TAG CODE | TAG lost
WAIT_TRIES = 10  # consecutive failed polls of the workers before the wait gives up


def run_folder(opts: LaunchOptions) -> str:
    """The run's folder on each worker (a shell word: $HOME expands there)."""
    return f'"$HOME/jaxrl4llm-runs/{opts.name}"'


def _alive(opts: LaunchOptions, module: str) -> str:
    """A shell function `alive`: whether the run's recorded pid is still this run (its
    command line names the training module, so a pid reused after a reboot is not)."""
    return f'alive() {{ [ -f "$S/pid" ] && grep -qs {module} "/proc/$(cat "$S/pid")/cmdline"; }}'


def start_command(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> str:
    """The command each worker runs through ssh: start the trainer detached (SIGHUP ignored
    from the fork on, so the session's end cannot catch it before setsid; nohup; no
    terminal) unless this run is still going, and return at once."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in base_env("tpu", opts))
    train = shlex.join(train_argv(opts, train_args, module))
    if is_remote(workdir):
        folder, log = "", '"$S/worker.log"'
    else:
        folder = shlex.quote(os.path.join(workdir, "logs"))
        log = f'{folder}/"worker-$(hostname).log"'
    run = f"(cd {opts.repo_dir} && {env} exec {train}) >> {log} 2>&1; rc=$?; "
    if is_remote(workdir):
        remote = shlex.quote(os.path.join(workdir, "logs"))
        run += f'gcloud storage cp {log} {remote}/"worker-$(hostname).log"; '
    run += 'echo $rc > "$S/exit"'
    return (
        f'S={run_folder(opts)}; mkdir -p "$S" {folder}; {_alive(opts, module)}; '
        'if alive; then echo "launch: $(hostname) still runs it (pid $(cat "$S/pid")): '
        'attaching."; else rm -f "$S/exit"; trap "" HUP; '
        f'S="$S" nohup setsid bash -c {shlex.quote(run)} > /dev/null 2>&1 < /dev/null & '
        f'echo $! > "$S/pid"; echo "launch: $(hostname) started it (pid $!), log" {log}; fi'
    )


def status_command(opts: LaunchOptions, module: str) -> str:
    """What each worker prints when polled: running, the run's exit code, or lost (ended
    without one: killed, the VM restarted)."""
    return (
        f"S={run_folder(opts)}; {_alive(opts, module)}; "
        f'if alive; then echo "{STATUS_TAG} running"; '
        f'elif [ -f "$S/exit" ]; then echo "{STATUS_TAG} $(cat "$S/exit")"; '
        f'else echo "{STATUS_TAG} lost"; fi'
    )


def _gcloud_args(opts: LaunchOptions) -> str:
    args = [f"--zone={opts.zone}"] + ([f"--project={opts.project}"] if opts.project else [])
    return shlex.join(args)


def plan(opts: LaunchOptions, train_args: list[str], workdir: str, module: str) -> Plan:
    require(opts, "zone")
    if opts.spot:
        require(opts, "accelerator", "runtime_version", what="--backend=tpu-vm --spot")
    check_name(opts)
    folder = launch_dir(opts, workdir)
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", opts.name, f"--zone={opts.zone}"]
    if opts.project:
        ssh.append(f"--project={opts.project}")
    start = (*ssh, "--worker=all", f"--command={start_command(opts, train_args, workdir, module)}")
    wait = os.path.join(folder, f"{opts.name}-wait.sh")
    files = {wait: wait_script(opts, module)}
    steps: list[tuple[Process, ...]] = [(Process(start),), (Process(("bash", wait)),)]
    if opts.spot:
        slice_script = os.path.join(folder, f"{opts.name}-slice.sh")
        files[slice_script] = slice_script_text(opts)
        steps.insert(0, (Process(("bash", slice_script)),))
    return Plan(files=files, steps=tuple(steps), log_dir=os.path.join(workdir, "logs"))


WAIT_SCRIPT = """\
#!/bin/bash
# Polls every worker of the TPU VM {name} every {poll} s until the run has ended on all of
# them, then exits with their combined exit code (a worker that lost its run counts as 1).
# The run goes on when this script is stopped: rerunning the launch command reattaches.
set -u
STATUS={status}
fails=0
while :; do
  if OUT=$(gcloud compute tpus tpu-vm ssh {name} {gcloud_args} --worker=all \\
      --command="$STATUS" 2>/dev/null); then
    fails=0
    CODES=$(printf '%s\\n' "$OUT" | tr -d '\\r' | sed -n 's/^{tag} //p' | sed 's/^lost$/1/')
    if [ -n "$CODES" ] && ! printf '%s\\n' "$CODES" | grep -qx running; then break; fi
  else
{on_unreachable}
    fails=$((fails + 1))
    if [ "$fails" -ge {tries} ]; then
      echo "launch: the workers of {name} did not answer {tries} times in a row; the run \\
may still go on: rerun the launch command to reattach." >&2
      exit 1
    fi
  fi
  sleep {poll}
done
CODES=$(echo $CODES)
{combine}
echo "launch: {name}: the workers' exit codes: $CODES"
exit $rc
"""

# What the wait does when the workers do not answer: the slice's state says whether it is
# gone (preempted: 75 for --spot, which recreates it; 1 otherwise) or the ssh call failed.
SPOT_UNREACHABLE = """\
    QR=$(gcloud compute tpus queued-resources describe {name} {gcloud_args} \\
        --format='value(state.state)' 2>/dev/null)
    case "$QR" in
      ""|ACTIVE) ;;
      *) echo "launch: the spot slice {name} is $QR (preempted): recreating it."
         exit {preempted} ;;
    esac"""
VM_UNREACHABLE = """\
    VM=$(gcloud compute tpus tpu-vm describe {name} {gcloud_args} \\
        --format='value(state)' 2>/dev/null)
    case "$VM" in
      PREEMPTED|TERMINATED|STOPPED)
        echo "launch: the TPU VM {name} is $VM: recreate it and rerun the launch command \\
(--spot recreates a spot slice itself)." >&2
        exit 1 ;;
    esac"""


def wait_script(opts: LaunchOptions, module: str) -> str:
    fields = {"name": opts.name, "gcloud_args": _gcloud_args(opts), "preempted": EXIT_PREEMPTED}
    unreachable = (SPOT_UNREACHABLE if opts.spot else VM_UNREACHABLE).format(**fields)
    return WAIT_SCRIPT.format(
        **fields,
        status=shlex.quote(status_command(opts, module)),
        poll=opts.poll_s,
        tries=WAIT_TRIES,
        tag=STATUS_TAG,
        on_unreachable=unreachable,
        combine=COMBINE_CODES_BASH,
    )


SLICE_SCRIPT = """\
#!/bin/bash
# Brings the spot slice {name} up: an ACTIVE queued resource is used as it is; a SUSPENDED
# (preempted) or FAILED one is deleted and created again; then waits until it is ACTIVE and
# runs --setup_command on every worker of a slice it did not find ACTIVE.
set -u
QR=(gcloud compute tpus queued-resources)
state() {{ "${{QR[@]}}" describe {name} {gcloud_args} --format='value(state.state)' 2>/dev/null; }}
STATE=$(state)
if [ "$STATE" = ACTIVE ]; then echo "launch: the slice {name} is up."; exit 0; fi
case "$STATE" in
  SUSPENDING|SUSPENDED|FAILED)
    echo "launch: the slice {name} is $STATE: deleting it to create it again."
    "${{QR[@]}}" delete {name} {gcloud_args} --force --quiet || exit 1
    STATE="" ;;
esac
if [ -z "$STATE" ]; then
  "${{QR[@]}}" create {name} {gcloud_args} --node-id={name} --accelerator-type={accelerator} \\
      --runtime-version={runtime_version} --spot || exit 1
fi
while :; do
  STATE=$(state)
  case "$STATE" in
    ACTIVE) break ;;
    FAILED|SUSPENDED)
      echo "launch: the queued resource {name} is $STATE before it started (gcloud compute \\
tpus queued-resources describe {name} {gcloud_args})." >&2
      exit 1 ;;
  esac
  sleep {poll}
done
echo "launch: the slice {name} is up."
{setup}
"""


def slice_script_text(opts: LaunchOptions) -> str:
    """SLICE_SCRIPT for --spot."""
    args = _gcloud_args(opts)
    setup = ""
    if opts.setup_command:
        setup = (
            f"gcloud compute tpus tpu-vm ssh {opts.name} {args} --worker=all "
            f"--command={shlex.quote(opts.setup_command)} || exit 1"
        )
    return SLICE_SCRIPT.format(
        name=opts.name,
        gcloud_args=args,
        accelerator=shlex.quote(opts.accelerator),
        runtime_version=shlex.quote(opts.runtime_version),
        poll=opts.poll_s,
        setup=setup,
    )
