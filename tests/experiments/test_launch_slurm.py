"""SLURM: what `jax.distributed.initialize` receives under SLURM (each task drives all the GPUs
it owns, not GPU SLURM_LOCALID alone), the log folder made before `sbatch`, and (opt-in,
slow) the generated script submitted to a real single-machine SLURM cluster of two nodes.

The environments below are what SLURM 22.05 (slurm-wlm) set in each task on such a cluster
with two (stand-in) GPUs per node, copied from `srun ... env`."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import jax
import pytest

from experiments import launch
from experiments.launch_backends import make_plan
from experiments.launch_plans import LaunchOptions
from jaxrl4llm import parallel
from jaxrl4llm.config.errors import UserError
from jaxrl4llm.parallel import slurm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_NTASKS": "2",
    "SLURM_GPUS_ON_NODE": "2",
}
# srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=2: task 1 (node n2)
ONE_TASK_PER_NODE = {
    **JOB,
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "SLURM_STEP_GPUS": "0,1",
}
# srun --nodes=2 --ntasks-per-node=2 --gpus-per-node=2: task 3 (node n2, its second)
ONE_TASK_PER_GPU = {
    **JOB,
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "SLURM_STEP_GPUS": "0,1",
}
# srun --nodes=2 --ntasks-per-node=2 --gpus-per-task=1: task 3 sees its own GPU only
ONE_BOUND_GPU_PER_TASK = {**ONE_TASK_PER_GPU, "CUDA_VISIBLE_DEVICES": "1", "SLURM_STEP_GPUS": "1"}


@pytest.fixture
def captured(monkeypatch):
    """A fake jax.distributed.initialize that records its keyword arguments; the variables
    of the environment this test process may have cleared."""
    calls: list[dict] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for name in list(os.environ):
        if name.startswith(("SLURM_", "JAX_")) or name == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(name)
    return calls


@pytest.mark.parametrize(
    "env,ids",
    [
        (ONE_TASK_PER_NODE, [0, 1]),  # jax alone: [0], half the node idle
        (ONE_TASK_PER_GPU, [1]),
        (ONE_BOUND_GPU_PER_TASK, [0]),  # jax alone: [1], a GPU the process does not see
        (
            {**ONE_TASK_PER_NODE, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(8)))},
            list(range(8)),
        ),
        ({**ONE_TASK_PER_GPU, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, [4, 5, 6, 7]),
    ],
    ids=["1-task-per-node", "1-task-per-gpu", "1-bound-gpu-per-task", "8-gpus", "2x4-gpus"],
)
def test_slurm_task_initializes_jax_with_all_its_gpus(captured, monkeypatch, env, ids):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # What the sbatch script exports, as experiments.train --distributed starts.
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:8476")
    monkeypatch.setenv("JAX_NUM_PROCESSES", env["SLURM_NTASKS"])
    monkeypatch.setenv("JAX_PROCESS_ID", env["SLURM_PROCID"])
    assert parallel.maybe_initialize_distributed(auto_detect=True) is True
    assert captured == [
        {
            "coordinator_address": "127.0.0.1:8476",
            "num_processes": int(env["SLURM_NTASKS"]),
            "process_id": int(env["SLURM_PROCID"]),
            "local_device_ids": ids,
        }
    ]


def test_outside_slurm_or_with_jax_local_device_ids_jax_decides(captured, monkeypatch):
    parallel.maybe_initialize_distributed(auto_detect=True)
    for name, value in ONE_TASK_PER_NODE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "3")
    parallel.maybe_initialize_distributed(auto_detect=True)
    assert [c["local_device_ids"] for c in captured] == [None, None]


def test_gpu_count_unknown_or_uneven():
    no_gpus = {k: v for k, v in ONE_TASK_PER_NODE.items() if "GPU" not in k and "CUDA" not in k}
    assert slurm.local_device_ids(no_gpus) == []  # one task: no restriction
    assert slurm.local_device_ids({**no_gpus, "SLURM_STEP_TASKS_PER_NODE": "3,2"}) == [0]
    assert slurm.tasks_on_node({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}) == 1
    with pytest.raises(UserError, match="do not split evenly"):
        slurm.local_device_ids({**ONE_TASK_PER_GPU, "SLURM_STEP_TASKS_PER_NODE": "3(x2)"})


def test_jax_keeps_the_ids_given_and_alone_would_pick_slurm_localid(monkeypatch):
    """The behaviour of jax this module works around (jax/_src/clusters/cluster.py): with
    local_device_ids unset jax picks [SLURM_LOCALID]; given ones (also []) are kept."""
    from jax._src import clusters

    for name, value in ONE_TASK_PER_NODE.items():
        monkeypatch.setenv(name, value)
    detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    assert detect(None, None, None, None, None, 10)[3] == [0]
    assert detect(None, None, None, [0, 1], None, 10)[3] == [0, 1]
    assert detect(None, None, None, [], None, 10)[3] == []


def test_log_folder_exists_when_sbatch_runs(tmp_path):
    """SLURM fails a job whose --output folder is missing, printing nothing: the launcher
    makes it before sbatch."""
    opts = LaunchOptions(
        backend="slurm", name="rl1", partition="gpu", launch_dir=str(tmp_path / "launch")
    )
    plan = make_plan(opts, ["--workdir=/shared/run"])
    (script,) = plan.files.values()
    output = next(line for line in script.splitlines() if "--output=" in line)
    folder = os.path.dirname(output.split("=", 1)[1])
    assert folder in plan.folders and not os.path.exists(folder)
    seen = []
    launch.run_attempt(plan, runner=lambda step: seen.append(os.path.isdir(folder)) or 0)
    assert seen == [True]
    assert "mkdir -p" in plan.describe().splitlines()[0]


# --- opt-in: a real SLURM (slurmctld + two slurmd on this machine) -----------------------------

SLURM_CONF = """\
ClusterName=jaxrl4llm-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={tmp}/munge.socket
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool-%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
GresTypes=gpu
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={port1} CPUs=2 RealMemory=1000 Gres=gpu:2
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={port2} CPUs=2 RealMemory=1000 Gres=gpu:2
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""
# Stand-in GPUs: SLURM sets CUDA_VISIBLE_DEVICES for any device file; jax runs on CPU.
GRES_CONF = "NodeName=n[1-2] Name=gpu File=/dev/tty[0-1]\n"

STUB = """\
import json, os, signal, sys, time
import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxrl4llm import parallel

seen = {}
real = jax.distributed.initialize
def spy(**kwargs):
    seen.update(kwargs)
    return real(**kwargs)
jax.distributed.initialize = spy
parallel.maybe_initialize_distributed(auto_detect=True)
out, rank = os.environ["STUB_OUT"], jax.process_index()
total = int(np.asarray(multihost_utils.process_allgather(np.array(rank + 1))).sum())
attempt = len([f for f in os.listdir(out) if f.startswith(f"rank{rank}-")])
with open(os.path.join(out, f"rank{rank}-{attempt}.json"), "w") as f:
    json.dump({"init": seen, "processes": jax.process_count(), "devices": jax.device_count(),
               "sum": total, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
if attempt == 0:  # wait for the test's SIGTERM (a preemption), then "save" and exit 75
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    time.sleep(120)
    sys.exit(1)
"""


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def slurm_cluster(tmp_path, monkeypatch):
    """slurmctld and two slurmd (nodes n1, n2 on this machine) with their own munged; yields
    the environment for SLURM's commands."""
    tools = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel")
    if os.geteuid() != 0 or not all(shutil.which(t) for t in tools):
        pytest.skip("needs root and slurm-wlm (apt-get install slurm-wlm)")
    tmp = tmp_path / "slurm"
    (tmp / "state").mkdir(parents=True)
    tmp.chmod(0o700)
    key = tmp / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ctld, port1, port2 = _free_ports(3)
    conf = tmp / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=socket.gethostname(), tmp=tmp, ctld_port=ctld, port1=port1, port2=port2
        )
    )
    (tmp / "gres.conf").write_text(GRES_CONF)
    monkeypatch.setenv("SLURM_CONF", str(conf))
    munge = [
        "munged", "-F", "--force", f"--socket={tmp}/munge.socket", f"--key-file={key}",
        f"--pid-file={tmp}/munged.pid", f"--log-file={tmp}/munged.log",
        f"--seed-file={tmp}/munged.seed",
    ]  # fmt: skip
    daemons = [subprocess.Popen(munge)]
    time.sleep(1)
    daemons.append(subprocess.Popen(["slurmctld", "-D"]))
    time.sleep(2)
    daemons += [subprocess.Popen(["slurmd", "-D", "-N", node]) for node in ("n1", "n2")]
    try:
        _wait_idle()
        yield
    finally:
        for proc in reversed(daemons):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_idle():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-o", "%T %D"], capture_output=True, text=True)
        if states.stdout.split() == ["idle", "2"]:
            return
        time.sleep(1)
    pytest.fail(f"the test SLURM cluster did not come up: {states.stdout} {states.stderr}")


@pytest.mark.slow
def test_generated_script_runs_on_slurm_preempted_then_resubmitted(slurm_cluster, tmp_path):
    """The launcher's sbatch script for 2 nodes of 2 (stand-in) GPUs, submitted to SLURM:
    each task joins jax.distributed with both its GPUs; a SIGTERM to the job's tasks (what
    SLURM sends at a preemption or --signal) makes them exit 75, the script 75, and the
    launcher resubmits; the second job finishes."""
    (tmp_path / "slurm_stub.py").write_text(textwrap.dedent(STUB))
    out = tmp_path / "out"
    out.mkdir()
    opts = LaunchOptions(
        backend="slurm",
        name="e2e",
        num_hosts=2,
        chips_per_host=2,
        partition="debug",
        time_limit="00:05:00",
        grace_period_s=60,
        repo_dir=REPO,
        python=sys.executable,
        launch_dir=str(tmp_path / "launch"),
        max_restarts=1,
        env_vars=(
            "JAX_PLATFORMS=cpu,XLA_FLAGS=--xla_force_host_platform_device_count=2,"
            f"PYTHONPATH={tmp_path}:{REPO},STUB_OUT={out}"
        ),
    )
    plan = make_plan(opts, [f"--workdir={tmp_path / 'run'}"], module="slurm_stub")
    messages: list[str] = []
    result: list[int] = []
    runner = threading.Thread(
        target=lambda: result.append(launch.launch(plan, 1, log=messages.append))
    )
    runner.start()
    deadline = time.monotonic() + 240
    while len(list(out.glob("rank*-0.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    job = subprocess.run(["squeue", "-h", "-o", "%i", "-n", "e2e"], capture_output=True, text=True)
    # What SLURM sends at a preemption (GraceTime) or --signal: SIGTERM to the tasks.
    subprocess.run(["scancel", "--signal=TERM", job.stdout.strip()], check=True)
    runner.join(timeout=max(deadline - time.monotonic(), 1))
    logs = sorted((tmp_path / "launch" / "logs").glob("*"))
    assert result == [0], (messages, [p.read_text()[-2000:] for p in logs])
    assert "resubmitting" in messages[0] and messages[-1] == "launch: the job finished."
    for attempt in (0, 1):
        for rank in (0, 1):
            seen = json.loads((out / f"rank{rank}-{attempt}.json").read_text())
            assert seen["init"] == {
                "coordinator_address": "127.0.0.1:8476",  # node n1's NodeAddr
                "num_processes": 2,
                "process_id": rank,
                "local_device_ids": [0, 1],  # both GPUs of the task's node
            }
            assert (seen["processes"], seen["devices"], seen["sum"]) == (2, 4, 3)
            assert seen["cuda"] == "0,1"
    assert list((tmp_path / "launch" / "logs").glob("sbatch-*.out"))
