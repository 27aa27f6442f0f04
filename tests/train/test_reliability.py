"""Run-level reliability on the toy policy: restarts, torn metrics, the workdir lock."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import registry
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra.errors import TrainingDivergedError
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.infra.workdir_lock import LOCK_NAME, WorkdirInUseError
from jaxrl4llm.train.trained import load_trained_policy
from jaxrl4llm.train.update.state import OptimizerConfig


def _config(model_dir, data, workdir, **overrides):
    base = dict(
        model=model_dir,
        data=data,
        instruction="",
        prompts_per_step=4,
        group_size=2,
        max_prompt_tokens=16,
        max_new_tokens=1,
        algorithm=rl.get_preset("grpo"),
        optimizer=OptimizerConfig(learning_rate=1e-2),
        num_steps=3,
        mesh="data:1,fsdp:1,tensor:1",
        eval_prompts=0,
        checkpoint_every=1000,
        workdir=str(workdir),
        answer_mode="lenient",
        trackers="",
    )
    base.update(overrides)
    return TrainConfig().replace(**base)


def test_a_restart_without_a_checkpoint_logs_each_step_once(
    toy_model_dir, copy_task_file, tmp_path
):
    # What a run killed at step 2, before its first checkpoint, leaves behind (last line torn).
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": 0.0}) + "\n" for s in (1, 2))
        + '{"step": 3, "rew'
    )
    result = loop.run(_config(toy_model_dir, copy_task_file, tmp_path), devices=jax.devices()[:1])
    assert result["step"] == 3
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    assert (tmp_path / "curves.png").exists()  # the end-of-run plot read the file


def test_a_second_run_on_a_held_workdir_fails_before_writing(
    toy_model_dir, copy_task_file, tmp_path
):
    other = subprocess.Popen(["sleep", "60"])  # a live process on this host holds the lock
    try:
        (tmp_path / LOCK_NAME).write_text(
            json.dumps({"pid": other.pid, "host": socket.gethostname()})
        )
        with pytest.raises(WorkdirInUseError, match=rf"pid {other.pid}"):
            loop.run(_config(toy_model_dir, copy_task_file, tmp_path), devices=jax.devices()[:1])
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]  # no config.json, no metrics
    finally:
        other.kill()
        other.wait()


def test_a_damaged_latest_checkpoint_resumes_from_the_previous_one(
    toy_model_dir, copy_task_file, tmp_path, caplog
):
    config = _config(toy_model_dir, copy_task_file, tmp_path, num_steps=2, checkpoint_every=1)
    loop.run(config, devices=jax.devices()[:1])
    step_dir = tmp_path / "checkpoints" / "2" / "state"
    array_file = max(
        (os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs), key=os.path.getsize
    )
    with open(array_file, "r+b") as f:  # 16 flipped bytes mid-file: a bad disk
        f.seek(os.path.getsize(array_file) // 2)
        chunk = f.read(16)
        f.seek(-16, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))
    result = loop.run(config.replace(num_steps=3), devices=jax.devices()[:1])
    assert "checkpoints/2 is unusable" in caplog.text
    assert result["step"] == 3
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == [1, 2, 3]


def _nan_advantages_at(steps):
    """loop.rollout, with every advantage NaN at the given (1-based) steps."""
    real, calls = loop.rollout, []

    def rollout(*args, **kwargs):
        batch, metrics = real(*args, **kwargs)
        calls.append(1)
        if len(calls) in steps:
            batch = batch.replace(advantages=jnp.full_like(batch.advantages, jnp.nan))
        return batch, metrics

    return rollout


def test_a_non_finite_step_is_skipped_and_training_goes_on(
    toy_model_dir, copy_task_file, tmp_path, monkeypatch
):
    monkeypatch.setattr(loop, "rollout", _nan_advantages_at({2}))
    config = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path,
        num_steps=4,
        max_nonfinite_steps=2,
        mini_batch_size=4,
    )  # two updates per step, both skipped at step 2
    result = loop.run(config, devices=jax.devices()[:1])
    assert result["step"] == 4
    assert [r["optim/skipped_updates"] for r in read_metrics(str(tmp_path))] == [0, 2, 0, 0]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(result["state"])))


def test_a_run_that_keeps_skipping_stops_without_saving_nan(
    toy_model_dir, copy_task_file, tmp_path, monkeypatch
):
    monkeypatch.setattr(loop, "rollout", _nan_advantages_at({1, 2, 3, 4, 5, 6}))
    config = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path,
        num_steps=6,
        checkpoint_every=1,
        max_nonfinite_steps=2,
    )
    with pytest.raises(
        TrainingDivergedError,
        match=r"Stopped at step 2: every update of the "
        r"last 2 steps .* The last checkpoint is step 1",
    ):
        loop.run(config, devices=jax.devices()[:1])
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
    _, _, saved, _ = load_trained_policy(str(tmp_path))  # verified: finite, the initial model
    _, initial, _ = registry.load_model(toy_model_dir, with_tokenizer=False)
    for a, b in zip(jax.tree.leaves(jax.device_get(saved)), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(a, b)
