"""experiments.doctor: one row per check; a mesh that does not divide, a full disk and a
missing model each fail their row (exit 2 from the command line)."""

import collections
import os
import subprocess
import sys

import jax
import pytest

from experiments import doctor
from jaxrl4llm.train.config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Usage = collections.namedtuple("Usage", "total used free")


def _config(model, data, workdir, **overrides):
    return TrainConfig().replace(
        model=model,
        data=data,
        prompts_per_step=4,
        group_size=2,
        max_prompt_tokens=16,
        max_new_tokens=4,
        workdir=str(workdir),
        reward_workers=1,
        keep_checkpoints=2,
        **overrides,
    )


def _rows(checks):
    return {c.name: (c.status, c.detail) for c in checks}


@pytest.fixture(scope="module")
def good_checks(toy_model_dir, copy_task_file, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("doctor") / "run"
    return doctor.run_checks(_config(toy_model_dir, copy_task_file, workdir), jax.devices())


def test_a_good_config_passes_every_check(good_checks):
    rows = _rows(good_checks)
    assert [c.name for c in good_checks] == [
        "devices",
        "mesh",
        "flags",
        "model",
        "host memory",
        "disk",
        "data",
        "reward workers",
        "device memory",
    ]
    assert all(status in ("ok", "-") for status, _ in rows.values()), rows
    assert rows["devices"][1].startswith("8 x cpu")
    assert rows["mesh"][1] == "--mesh=data:1,fsdp:-1,tensor:1 -> data:1, fsdp:8, expert:1, tensor:1"
    assert rows["data"][0] == "ok" and rows["reward workers"][0] == "ok"
    assert rows["device memory"][0] == "-"  # CPUs report no device memory


def test_a_mesh_that_does_not_divide_fails(toy_model_dir, copy_task_file, tmp_path):
    config = _config(toy_model_dir, copy_task_file, tmp_path, mesh="data:3,fsdp:-1,tensor:1")
    rows = _rows(doctor.run_checks(config, jax.devices()))
    assert rows["mesh"][0] == "FAIL"
    assert "does not divide the 8 available devices" in rows["mesh"][1]
    assert rows["device memory"][0] == "-"


def test_a_full_disk_fails(toy_model_dir, copy_task_file, tmp_path):
    from jaxrl4llm.models.config import ModelConfig

    config = _config(toy_model_dir, copy_task_file, tmp_path / "run")
    # The toy model's float32 params, its two Adam moments, 3 checkpoints (2 kept + 1 saving).
    need = 3 * 3 * 4 * ModelConfig.from_hf_config(toy_model_dir).num_params
    rows = _rows(
        doctor.run_checks(
            config, jax.devices(), disk_usage=lambda path: Usage(10**12, 10**12, need - 1)
        )
    )
    assert rows["disk"][0] == "FAIL" and "lower --keep_checkpoints" in rows["disk"][1]
    rows = _rows(
        doctor.run_checks(config, jax.devices(), disk_usage=lambda path: Usage(10**12, 0, need))
    )
    assert rows["disk"][0] == "ok"


def test_a_missing_model_exits_2_from_the_command_line(copy_task_file, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.doctor",
            f"--model={tmp_path / 'no_model'}",
            f"--data={copy_task_file}",
            f"--workdir={tmp_path / 'run'}",
            "--reward_workers=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert " FAIL " in rows["model"] and "no_model" in rows["model"]
    assert rows["disk"].split()[1] == "-" and rows["data"].split()[1] == "ok"
    assert "1 check(s) failed: model." in result.stdout
