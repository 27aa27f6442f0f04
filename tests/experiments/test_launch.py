"""experiments.launch without a cluster: each backend's generated command, manifest or script
checked by parsing it (and running the scripts against stand-in cluster tools), and the local
backend's N processes with their resubmission after exit code 75."""

import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap

import pytest
import yaml

from experiments import launch
from experiments.launch_plans import LaunchOptions, combined_exit_code, make_plan, workdir_of

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


def test_tpu_vm_runs_the_same_command_on_every_worker():
    opts = LaunchOptions(backend="tpu-vm", name="v5p-16", zone="us-east5-a", project="proj")
    plan = make_plan(opts, TRAIN_ARGS)
    (step,) = plan.steps
    (proc,) = step
    argv = list(proc.argv)
    assert argv[:8] == [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        "v5p-16",
        "--zone=us-east5-a",
        "--project=proj",
    ]
    assert argv[8] == "--worker=all"
    command = argv[9].removeprefix("--command=")
    # The worker's shell line: parse it as bash would split it.
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0
    words = shlex.split(command)
    train = words.index("experiments.train")
    assert words[train - 2 : train + 2 + len(TRAIN_ARGS)] == [
        "python3",
        "-m",
        "experiments.train",
        "--distributed",
        *TRAIN_ARGS,
    ]
    assert "JAX_PLATFORMS=tpu" in words
    # A gs:// workdir: the log is teed locally, then copied into WORKDIR/logs/.
    assert "tee" in words
    assert (
        "gcloud storage cp /tmp/jaxrl4llm-logs/worker-$(hostname).log gs://bucket/run1/logs/"
        in command
    )
    assert command.endswith("exit $rc")


@pytest.mark.parametrize(
    "accelerator,topology,resource",
    [("tpu-v5p-slice", "2x2x2", "google.com/tpu"), ("nvidia-h100-80gb", "", "nvidia.com/gpu")],
)
def test_gke_manifest_loads_with_the_fields_a_job_needs(tmp_path, accelerator, topology, resource):
    opts = LaunchOptions(
        backend="gke",
        name="rl1",
        num_hosts=4,
        image="us-docker.pkg.dev/p/r:1",
        accelerator=accelerator,
        tpu_topology=topology,
        chips_per_host=4,
        launch_dir=str(tmp_path),
    )
    plan = make_plan(opts, TRAIN_ARGS)
    (text,) = plan.files.values()
    service, job = yaml.safe_load_all(text)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "rl1"
    assert pod["restartPolicy"] == "Never"
    assert accelerator in pod["nodeSelector"].values()
    (container,) = pod["containers"]
    assert container["image"] == "us-docker.pkg.dev/p/r:1"
    assert container["resources"]["limits"] == {resource: 4}
    command = container["command"][2]
    assert shlex.split(command)[-len(TRAIN_ARGS) - 1 :] == ["--distributed", *TRAIN_ARGS]
    env = {e["name"]: e["value"] for e in container["env"]}
    if resource == "nvidia.com/gpu":  # coordinator: pod 0 through the headless Service
        assert env["JAX_COORDINATOR_ADDRESS"].startswith("rl1-0.rl1:")
        assert env["JAX_NUM_PROCESSES"] == "4"
        assert "JAX_PROCESS_ID=$JOB_COMPLETION_INDEX" in command
    else:
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x2"
        assert env["JAX_PLATFORMS"] == "tpu"


def test_gke_wait_script_reads_each_pods_exit_code(tmp_path):
    """The last step waits for the Job and combines the pods' codes: run it against a stand-in
    kubectl whose Job has failed, one pod preempted."""
    opts = LaunchOptions(
        backend="gke",
        name="rl1",
        num_hosts=2,
        image="img",
        accelerator="nvidia-h100-80gb",
        chips_per_host=8,
        launch_dir=str(tmp_path),
    )
    wait_step = make_plan(opts, TRAIN_ARGS).steps[-1][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(
        bin_dir,
        "kubectl",
        """\
        case "$*" in
          *condition=Failed*) exit 0 ;;
          *condition=Complete*) sleep 30 ;;
          *"get pods"*) echo "1 75 " ;;
        esac
        """,
    )
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = subprocess.run(list(wait_step.argv), env=env, timeout=20)
    assert result.returncode == 75


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
    # Run it with stand-ins: srun runs the task once per node; the "trainer" records its
    # environment and exits 75 on node 1 (preempted), 0 elsewhere.
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
