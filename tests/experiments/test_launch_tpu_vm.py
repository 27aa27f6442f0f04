"""tpu-vm without Google Cloud: the command each worker runs, run here with bash (it detaches
the trainer from the ssh session, and a second start reattaches), and whole launches against
a stand-in `gcloud` whose two "workers" are folders of this machine: a spot slice preempted
mid-run is recreated and the run resumes."""

import os
import signal
import subprocess
import time

import pytest

from experiments import launch
from experiments.launch_backends import make_plan
from experiments.launch_plans import LaunchOptions
from experiments.launch_tpu_vm import start_command, status_command

from tests.experiments.test_launch import _tool

MODULE = "experiments.train"
# A stand-in trainer: records its arguments, then waits for $HOME/release (its exit code).
WAITING_TRAINER = """\
echo "started $*" >> "$HOME/starts"
while [ ! -f "$HOME/release" ]; do sleep 0.1; done
exit "$(cat "$HOME/release")"
"""


def _worker(home, command):
    """Runs a worker's command as ssh would (its own session); returns its stdout."""
    env = dict(os.environ, HOME=str(home))
    proc = subprocess.Popen(
        ["bash", "-c", command], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    out, _ = proc.communicate(timeout=10)
    try:  # the ssh session ends: its process group is hung up (a detached run is not in it)
        os.killpg(proc.pid, signal.SIGHUP)
    except ProcessLookupError:
        pass
    return out


def _status(home, opts):
    return _worker(home, status_command(opts, MODULE)).strip()


def test_worker_runs_the_trainer_detached_and_a_second_start_reattaches(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    _tool(tmp_path, "trainer", WAITING_TRAINER)
    opts = LaunchOptions(
        backend="tpu-vm",
        name="v5p",
        zone="z",
        repo_dir=str(tmp_path),
        python=str(tmp_path / "trainer"),
    )
    workdir = str(tmp_path / "run")
    command = start_command(opts, ["--num_steps=2"], workdir, MODULE)
    t0 = time.monotonic()
    assert "started it" in _worker(home, command)
    assert time.monotonic() - t0 < 5  # returned while the trainer runs
    time.sleep(0.3)
    assert _status(home, opts) == "jaxrl4llm-status running"  # survived the hang-up
    assert "still runs it" in _worker(home, command) and "attaching" in _worker(home, command)
    (home / "release").write_text("75")
    deadline = time.monotonic() + 10
    while _status(home, opts) == "jaxrl4llm-status running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _status(home, opts) == "jaxrl4llm-status 75"
    assert (home / "starts").read_text().splitlines() == [
        f"started -m {MODULE} --distributed --num_steps=2"
    ]
    assert (tmp_path / "run" / "logs" / f"worker-{os.uname().nodename}.log").exists()
    (home / "jaxrl4llm-runs" / "v5p" / "exit").unlink()  # ended without a code: lost
    assert _status(home, opts) == "jaxrl4llm-status lost"


# Two workers (HOME=$FAKE/worker0, worker1) that ssh reaches while the queued resource is ACTIVE.
GCLOUD = """\
echo "$*" >> "$FAKE/calls"
for a in "$@"; do case "$a" in --command=*) cmd=${a#--command=} ;; esac; done
qr=$(cat "$FAKE/qr" 2>/dev/null)
case "$1 $2 $3 $4" in
  "compute tpus queued-resources describe") [ -n "$qr" ] && echo "$qr" || exit 1 ;;
  "compute tpus queued-resources create") echo ACTIVE > "$FAKE/qr" ;;
  "compute tpus queued-resources delete") rm "$FAKE/qr" ;;
  "compute tpus tpu-vm describe") echo "${FAKE_VM:-READY}" ;;
  "compute tpus tpu-vm ssh")
    [ "$qr" = ACTIVE ] || { echo "ssh: connect to host: Connection refused" >&2; exit 255; }
    for w in 0 1; do
      mkdir -p "$FAKE/worker$w"
      HOME="$FAKE/worker$w" bash -c "$cmd" || exit $?
    done ;;
esac
"""
# Attempt 1: the slice is preempted (the queued resource SUSPENDED) and both workers exit 75
# after their SIGTERM save; attempt 2 (a recreated slice) finishes.
SPOT_TRAINER = """\
n=$(cat "$HOME/attempts" 2>/dev/null || echo 0); echo $((n + 1)) > "$HOME/attempts"
echo "$JAX_PLATFORMS $JAXRL4LLM_GRACE_PERIOD_S $*" >> "$HOME/seen"
sleep 0.5
if [ "$n" = 0 ]; then echo SUSPENDED > "$FAKE/qr"; exit 75; fi
exit 0
"""


def _spot_launch(tmp_path, monkeypatch, **changes):
    fake = tmp_path / "fake"
    fake.mkdir()
    _tool(fake, "gcloud", GCLOUD)
    _tool(fake, "trainer", SPOT_TRAINER)
    opts = LaunchOptions(
        backend="tpu-vm",
        name="v5p-16",
        zone="us-east5-a",
        spot=True,
        accelerator="v5p-16",
        runtime_version="v2-alpha-tpuv5",
        setup_command='echo setup >> "$HOME/setups"',
        repo_dir=str(tmp_path),
        python=str(fake / "trainer"),
        grace_period_s=30,
        poll_s=1,
        max_restarts=2,
        launch_dir=str(tmp_path / "launch"),
    )
    opts = LaunchOptions(**{**opts.__dict__, **changes})
    plan = make_plan(opts, [f"--workdir={tmp_path / 'run'}"])
    monkeypatch.setenv("FAKE", str(fake))
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    messages: list[str] = []
    return launch.launch(plan, opts.max_restarts, log=messages.append), fake, messages


def test_spot_slice_preempted_is_recreated_and_the_run_resumes(tmp_path, monkeypatch):
    code, fake, messages = _spot_launch(tmp_path, monkeypatch)
    assert code == 0, messages
    assert "resubmitting" in messages[0] and messages[-1] == "launch: the job finished."
    calls = (fake / "calls").read_text().splitlines()
    verbs = [c.split()[3] for c in calls if c.startswith("compute tpus queued-resources")]
    # attempt 1: none yet -> create; attempt 2: SUSPENDED -> delete, create
    assert [v for v in verbs if v != "describe"] == ["create", "delete", "create"]
    create = next(c for c in calls if "queued-resources create" in c)
    assert "--accelerator-type=v5p-16 --runtime-version=v2-alpha-tpuv5 --spot" in create
    for w in (0, 1):
        worker = fake / f"worker{w}"
        assert (worker / "setups").read_text() == "setup\nsetup\n"  # on each new slice
        seen = (worker / "seen").read_text().splitlines()
        assert seen == [f"tpu 30 -m experiments.train --distributed --workdir={tmp_path}/run"] * 2
        assert (worker / "jaxrl4llm-runs" / "v5p-16" / "exit").read_text().strip() == "0"


def test_spot_preemptions_past_max_restarts_stop(tmp_path, monkeypatch):
    code, fake, messages = _spot_launch(tmp_path, monkeypatch, max_restarts=0)
    assert code == 75 and "--max_restarts=0 used up" in messages[-1]


def test_a_preempted_on_demand_vm_stops_with_what_to_do(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    _tool(fake, "gcloud", GCLOUD)  # no queued resource: ssh fails
    opts = LaunchOptions(backend="tpu-vm", name="v5p", zone="z", poll_s=0, launch_dir=str(tmp_path))
    plan = make_plan(opts, ["--workdir=gs://b/r"])
    wait = plan.steps[-1][0]
    for path, text in plan.files.items():
        open(path, "w").write(text)
    env = dict(os.environ, FAKE=str(fake), FAKE_VM="PREEMPTED", PATH=f"{fake}:{os.environ['PATH']}")
    ran = subprocess.run(wait.argv, env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 1
    assert "the TPU VM v5p is PREEMPTED: recreate it" in ran.stderr


def test_tpu_vm_plan_starts_detached_and_copies_logs_to_a_gs_workdir():
    opts = LaunchOptions(backend="tpu-vm", name="v5p-16", zone="us-east5-a", project="proj")
    plan = make_plan(opts, ["--workdir=gs://bucket/run1", "--num_steps=3"])
    (start,), (wait,) = plan.steps
    argv = list(start.argv)
    assert argv[:8] == [
        "gcloud", "compute", "tpus", "tpu-vm", "ssh", "v5p-16", "--zone=us-east5-a",
        "--project=proj",
    ]  # fmt: skip
    assert argv[8] == "--worker=all"
    command = argv[9].removeprefix("--command=")
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0
    assert "nohup setsid bash -c" in command and "JAX_PLATFORMS=tpu" in command
    assert 'gcloud storage cp "$S/worker.log" gs://bucket/run1/logs/"worker-$(hostname).log"' in (
        command
    )
    assert plan.log_dir == "gs://bucket/run1/logs"
    (script,) = plan.files.values()
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    assert wait.argv[0] == "bash"
    with pytest.raises(
        ValueError, match="--backend=tpu-vm --spot needs --accelerator, --runtime_version"
    ):
        make_plan(LaunchOptions(**{**opts.__dict__, "spot": True}), ["--workdir=gs://b/r"])
