"""experiments.launch without a cluster: the sbatch script checked by parsing it and running
it against stand-in SLURM tools, and the local backend's N processes with their resubmission
after exit code 75. GKE, tpu-vm and SLURM's jax start-up: test_launch_gke.py,
test_launch_tpu_vm.py, test_launch_slurm.py."""

import json
import os
import stat
import subprocess
import sys
import textwrap

from experiments import launch
from experiments.launch_backends import make_plan
from experiments.launch_plans import LaunchOptions, combined_exit_code, workdir_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_ARGS = [
    "--flagfile=experiments/configs/quickstart.flags",
    "--workdir=gs://bucket/run1",
    "--mesh=data:2,fsdp:-1,tensor:1",
]


def _tool(folder, name, body):
    """A stand-in for a cluster tool (srun, scontrol, kubectl) on PATH."""
    path = folder / name
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_combined_exit_code_prefers_preemption_then_the_first_failure():
    assert combined_exit_code([0, 0]) == 0
    assert combined_exit_code([1, 75, 0]) == 75
    assert combined_exit_code([0, 3, 1]) == 3


def test_workdir_comes_from_the_command_line_over_the_flagfile(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("--num_steps=3\n--workdir=/shared/from_file\n")
    assert workdir_of([f"--flagfile={flagfile}"]) == "/shared/from_file"
    assert workdir_of([f"--flagfile={flagfile}", "--workdir=/x"]) == "/x"
    assert workdir_of(["--num_steps=2"]) == "workdirs/run"


def _slurm_stand_ins(tmp_path):
    """scontrol, srun (the task once per node) and a "trainer" that records its environment
    and exits 75 on node 1 (preempted), 0 elsewhere; returns their folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "scontrol", 'printf "node-a\\nnode-b\\nnode-c\\n"\n')
    _tool(
        bin_dir,
        "srun",
        """\
        shift 2  # --ntasks, --ntasks-per-node
        for i in 0 1 2; do SLURM_PROCID=$i "$@"; done
        """,
    )
    _tool(
        bin_dir,
        "python-stand-in",
        f"""\
        echo "$JAX_COORDINATOR_ADDRESS $JAX_NUM_PROCESSES $JAX_PROCESS_ID $*" \
            > {tmp_path}/seen-$JAX_PROCESS_ID
        [ "$JAX_PROCESS_ID" = 1 ] && exit 75
        exit 0
        """,
    )
    return bin_dir


def test_sbatch_script_parses_and_reports_a_preempted_task(tmp_path):
    opts = LaunchOptions(
        backend="slurm",
        name="rl1",
        num_hosts=3,
        partition="gpu",
        chips_per_host=8,
        account="acct",
        launch_dir=str(tmp_path / "launch"),
        repo_dir=str(tmp_path),
        python="python-stand-in",
    )
    plan = make_plan(opts, TRAIN_ARGS)
    ((path, text),) = plan.files.items()
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0
    directives = [
        line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH")
    ]
    assert {
        "--nodes=3",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--partition=gpu",
        "--account=acct",
    } <= set(directives)
    assert plan.steps == ((launch.Process(("sbatch", "--wait", path)),),)
    bin_dir = _slurm_stand_ins(tmp_path)
    submitted = []  # run_attempt writes the script, then "submits" it here
    assert launch.run_attempt(plan, runner=lambda step: submitted.append(step) or 0) == 0
    assert submitted == list(plan.steps)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="n[a-c]",
        SLURM_NNODES="3",
    )
    ran = subprocess.run(["bash", path], env=env, timeout=20, capture_output=True, text=True)
    assert ran.returncode == 75, ran.stderr
    for i in range(3):
        seen = (tmp_path / f"seen-{i}").read_text().split()
        assert seen[:3] == ["node-a:8476", "3", str(i)]
        assert seen[3:] == ["-m", "experiments.train", "--distributed", *TRAIN_ARGS]
    assert os.path.exists(tmp_path / "launch" / "logs" / "worker-2.log")


FAKE_TRAINER = """\
import json, os, sys
state = os.path.join(os.environ["FAKE_STATE"], "attempts-" + os.environ["JAX_PROCESS_ID"])
attempt = len(open(state).read()) if os.path.exists(state) else 0
open(state, "a").write("x")
print(json.dumps({"argv": sys.argv[1:], "pid": os.environ["JAX_PROCESS_ID"],
                  "n": os.environ["JAX_NUM_PROCESSES"],
                  "coord": os.environ["JAX_COORDINATOR_ADDRESS"],
                  "xla": os.environ["XLA_FLAGS"]}))
codes = [int(c) for c in os.environ["FAKE_CODES"].split(",")]
sys.exit(codes[min(attempt, len(codes) - 1)])
"""


def _local_launch(tmp_path, codes, max_restarts):
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    opts = LaunchOptions(
        backend="local",
        num_hosts=3,
        devices_per_process=2,
        max_restarts=max_restarts,
        env_vars=f"FAKE_STATE={tmp_path},FAKE_CODES={codes},PYTHONPATH={tmp_path}",
        python=sys.executable,
    )
    plan = make_plan(
        opts, ["--num_steps=2", f"--workdir={tmp_path / 'run'}"], module="fake_trainer"
    )
    messages = []
    return launch.launch(plan, opts.max_restarts, log=messages.append), plan, messages


def test_local_backend_resubmits_after_preemption(tmp_path):
    code, plan, messages = _local_launch(tmp_path, "75,0", max_restarts=2)
    assert code == 0
    assert [(tmp_path / f"attempts-{i}").read_text() for i in range(3)] == ["xx"] * 3
    assert "resubmitting" in messages[0] and messages[-1] == "launch: the job finished."
    seen = [
        json.loads((tmp_path / "run" / "launch" / "logs" / f"worker{i}.log").read_text())
        for i in range(3)
    ]
    assert [s["pid"] for s in seen] == ["0", "1", "2"]
    assert {s["n"] for s in seen} == {"3"} and len({s["coord"] for s in seen}) == 1
    assert all(
        s["argv"] == ["--distributed", "--num_steps=2", f"--workdir={tmp_path / 'run'}"]
        for s in seen
    )
    assert all(s["xla"] == "--xla_force_host_platform_device_count=2" for s in seen)


def test_local_backend_stops_on_a_failure_and_after_max_restarts(tmp_path):
    (tmp_path / "a").mkdir()
    code, _, messages = _local_launch(tmp_path / "a", "3", max_restarts=5)
    assert code == 3 and (tmp_path / "a" / "attempts-0").read_text() == "x"
    assert "exit code 3; not resubmitted" in messages[-1]
    (tmp_path / "b").mkdir()
    code, _, messages = _local_launch(tmp_path / "b", "75", max_restarts=1)
    assert code == 75 and (tmp_path / "b" / "attempts-0").read_text() == "xx"
    assert "--max_restarts=1 used up" in messages[-1]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.launch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )


def test_cli_dry_run_prints_and_a_missing_option_is_one_line():
    dry = _cli(
        "--backend=slurm",
        "--partition=gpu",
        "--num_hosts=2",
        "--dry_run",
        "--launch_dir=/tmp/never-written",
        "--",
        *TRAIN_ARGS,
    )
    assert dry.returncode == 0, dry.stderr
    assert "#SBATCH --nodes=2" in dry.stdout and "sbatch --wait" in dry.stdout
    assert not os.path.exists("/tmp/never-written")
    bad = _cli("--backend=gke", "--", *TRAIN_ARGS)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "Error: --backend=gke needs --image, --accelerator, --chips_per_host (python -m "
        "experiments.launch --help describes each)."
    ]


def test_a_failed_host_stops_its_peers_after_the_grace_period():
    step = (
        launch.Process((sys.executable, "-c", "import sys; sys.exit(3)")),
        launch.Process((sys.executable, "-c", "import time; time.sleep(120)")),
    )
    assert launch.run_step(step, grace_s=0.5) == 3
