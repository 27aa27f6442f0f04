"""Local processes joined by jax.distributed train like one process: two of 2 CPU devices
each like one 4-device process; four (through experiments.launch, preempted and resubmitted
after step 1) like one 8-device process."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra.metrics import read_metrics

from tests.compacted_reference import WORKER_PATCH, compacted_rollouts
from tests.train.float_checks import LINEAR_OPT

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
from jaxrl4llm import parallel
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
port, pid, config_json = sys.argv[1], int(sys.argv[2]), sys.argv[3]
parallel.maybe_initialize_distributed(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
assert jax.device_count() == 4 and jax.local_device_count() == 2
summary = loop.run(TrainConfig.from_json(open(config_json).read()))
print("FINAL_STEP", summary["step"], flush=True)
print("METRICS", json.dumps({k: float(v) for k, v in summary["metrics"].items()}), flush=True)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(model_dir, data, workdir):
    # Greedy decoding and plain Reinforce: the samples and the loss do not depend on how
    # the rows are split over hosts, so one process and two must agree. LINEAR_OPT: with
    # Adam's default eps a near-zero gradient's rounding, which differs between the layouts,
    # would move a weight by +-lr and step 2 would start from another policy.
    return TrainConfig().replace(
        model=model_dir,
        data=data,
        instruction="",
        prompts_per_step=8,
        group_size=4,
        max_prompt_tokens=16,
        max_new_tokens=1,
        temperature=0.0,
        algorithm=rl.get_preset("reinforce"),
        optimizer=LINEAR_OPT,
        num_steps=2,
        mesh="data:2,fsdp:2,tensor:1",
        eval_prompts=0,
        checkpoint_every=1,
        workdir=str(workdir),
        answer_mode="lenient",
        trackers="",
    )


def _two_workers(config: TrainConfig, tmp_path, compacted: bool = False) -> list[dict]:
    """Runs `config` in two local processes of 2 CPU devices each (WORKER; `compacted`: the
    rollouts by the compacted sampler, tests/compacted_reference.py); each one's last
    metrics, after checking that both trained config.run.num_steps steps."""
    config_json = tmp_path / "config.json"
    config_json.write_text(config.to_json())
    script = tmp_path / "worker.py"
    patched = WORKER.replace("port, pid,", WORKER_PATCH + "port, pid,")
    script.write_text(patched if compacted else WORKER)
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    # Output goes to files, not pipes: a worker blocked on a full pipe that nobody reads (the
    # other worker's is read first) would stall the collectives of both.
    logs = [(tmp_path / f"worker{pid}.out", tmp_path / f"worker{pid}.err") for pid in (0, 1)]
    procs = []
    for pid, (out_path, err_path) in zip((0, 1), logs):
        with open(out_path, "w") as out, open(err_path, "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(port), str(pid), str(config_json)],
                    env=env,
                    stdout=out,
                    stderr=err,
                    text=True,
                )
            )
    for p in procs:
        p.wait(timeout=600)
    last = []
    for p, (out_path, err_path) in zip(procs, logs):
        assert p.returncode == 0, err_path.read_text()[-4000:]
        out = out_path.read_text()
        assert f"FINAL_STEP {config.run.num_steps}" in out
        last.append(json.loads(out.split("METRICS ", 1)[1].splitlines()[0]))
    return last


def test_two_processes_match_one(toy_model_dir, copy_task_file, tmp_path):
    """Two processes (the paged engine: a page pool per batch shard, sampling/paged_mesh.py,
    over the 4 devices of both hosts) train as one process whose rollouts the compacted
    sampler decodes (the tests' reference): 6 greedy tokens per row, the same rewards,
    losses and gradients; each host saves the checkpoints."""
    two = _config(toy_model_dir, copy_task_file, tmp_path / "two").replace(max_new_tokens=6)
    _two_workers(two, tmp_path)
    one = _config(toy_model_dir, copy_task_file, tmp_path / "one").replace(max_new_tokens=6)
    with compacted_rollouts():
        assert loop.run(one, devices=jax.devices()[:4])["step"] == 2
    a, b = read_metrics(str(tmp_path / "one")), read_metrics(str(tmp_path / "two"))
    assert [r["step"] for r in b] == [1, 2]  # host 0 alone writes the metrics
    for ra, rb in zip(a, b):
        assert rb["reward/accuracy"] == pytest.approx(ra["reward/accuracy"])
        assert rb["response/length_mean"] == ra["response/length_mean"]
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rb["optim/grad_norm"], ra["optim/grad_norm"], rtol=1e-4)
        assert "rollout/rows_per_decode_step" in rb and "rollout/rows_per_decode_step" not in ra
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints"))[:2] == ["1", "2"]


# The 4-host run's flags; the 1-process run gets the same values through TrainConfig.replace.
FOUR_HOSTS = dict(
    instruction="",
    prompts_per_step=8,
    group_size=4,
    max_prompt_tokens=16,
    max_new_tokens=1,
    temperature=0.0,
    algorithm="reinforce",
    learning_rate=LINEAR_OPT.learning_rate,
    adam_eps=LINEAR_OPT.eps,
    num_steps=3,
    mesh="data:2,fsdp:4,tensor:1",
    eval_prompts=0,
    checkpoint_every=1,
    answer_mode="lenient",
    trackers="",
)


def _children(pid):
    """The ids of the processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _wait_for_step(path, step, proc, timeout_s=900):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and any(
            json.loads(line)["step"] >= step
            for line in path.read_text().splitlines()
            if line.strip()
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} in {path} (launcher exit {proc.poll()})")


@pytest.mark.slow
def test_four_processes_preempted_and_resubmitted_match_one(
    toy_model_dir, copy_task_file, tmp_path
):
    """experiments.launch's local backend: 4 processes of 2 CPU devices each; SIGTERM to
    every worker after step 1, the launcher resubmits (exit 75), the run resumes from its
    checkpoint, and the metrics of steps 1-3 equal a 1-process run on 8 devices."""
    workdir = tmp_path / "four"
    train_flags = [
        f"--model={toy_model_dir}",
        f"--data={copy_task_file}",
        f"--workdir={workdir}",
    ] + [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in FOUR_HOSTS.items()]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    log = tmp_path / "launcher.out"
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "experiments.launch",
                "--backend=local",
                "--num_hosts=4",
                "--devices_per_process=2",
                "--max_restarts=1",
                "--",
                *train_flags,
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for_step(workdir / "metrics.jsonl", 1, launcher)
        workers = _children(launcher.pid)
        assert len(workers) == 4
        for pid in workers:  # preempt every host, as a reclaimed slice does
            os.kill(pid, signal.SIGTERM)
        assert launcher.wait(timeout=900) == 0, log.read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = log.read_text()
    assert "was preempted (exit 75); resubmitting" in text and "the job finished" in text
    worker_logs = workdir / "launch" / "logs"
    assert "Resumed from step" in (worker_logs / "worker0.log").read_text()

    one = loop.run(
        TrainConfig().replace(
            model=toy_model_dir, data=copy_task_file, workdir=str(tmp_path / "one"), **FOUR_HOSTS
        )
    )
    assert one["step"] == 3
    a, b = read_metrics(str(tmp_path / "one")), read_metrics(str(workdir))
    assert [r["step"] for r in b] == [1, 2, 3]  # each step logged once, by host 0
    for ra, rb in zip(a, b):
        assert rb["reward/accuracy"] == pytest.approx(ra["reward/accuracy"])
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rb["optim/grad_norm"], ra["optim/grad_norm"], rtol=1e-4)
    assert sorted(os.listdir(workdir / "checkpoints"))[:3] == ["1", "2", "3"]


def test_dynamic_sampling_on_two_processes(toy_model_dir, copy_task_file, tmp_path):
    """DAPO's dynamic sampling across hosts. In rounds (the compacted sampler, the tests'
    reference; the paged engine's sampler calls run them so with ReMax's rows): each host
    fills its own groups, and every round the hosts exchange their kept counts, so both run
    the same sampler calls and stop after the same round (a disagreement would hang the
    collectives); the toy model rarely copies its prompt at temperature 1, so groups lack a
    correct row and resampling runs to its cap. By admission (the paged engine: each host
    queues its own groups into its own batch shards, the hosts agree at every segment on what
    runs and in the end take as many chunks of records as the rounds do): the rounds' rewards,
    losses and rounds."""
    config = _config(toy_model_dir, copy_task_file, tmp_path / "rounds").replace(
        algorithm=rl.get_preset("dapo"),
        temperature=1.0,
        max_new_tokens=4,
        max_resample_rounds=2,
        optimizer=LINEAR_OPT,
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    last = _two_workers(config, tmp_path / "a", compacted=True)
    written = read_metrics(str(tmp_path / "rounds"))  # host 0's
    assert [r["step"] for r in written] == [1, 2]
    for name in (
        "rollout/rounds",
        "rollout/frac_groups_filtered",
        "rollout/groups_short",
        "reward/accuracy_sampled",
    ):
        assert last[0][name] == last[1][name] == pytest.approx(written[-1][name]), name
    for r in written:
        assert 1 <= r["rollout/rounds"] <= 3
        # Over both hosts: 8 groups per round, each host short by what it did not keep.
        kept = (1 - r["rollout/frac_groups_filtered"]) * 8 * r["rollout/rounds"]
        assert r["rollout/groups_short"] == pytest.approx(max(8 - kept, 0), abs=4)

    paged = config.replace(workdir=str(tmp_path / "admission"))
    last = _two_workers(paged, tmp_path / "b")
    assert last[0]["rollout/rounds"] == last[1]["rollout/rounds"]  # the chunks both took
    a, b = read_metrics(str(tmp_path / "rounds")), read_metrics(str(tmp_path / "admission"))
    assert [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        assert "rollout/groups_admitted" in rb and "rollout/groups_admitted" not in ra
        # A host's engine holds its 8 / 2 groups at once, in its 2 of the 4 batch shards.
        assert rb["rollout/group_slots"] == 4
        assert rb["rollout/rounds"] == ra["rollout/rounds"]
        assert rb["reward/accuracy"] == pytest.approx(ra["reward/accuracy"])
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], rtol=1e-5, atol=1e-6)
    assert any(r["rollout/rounds"] > 1 for r in a)  # resampling ran: the test can fail
