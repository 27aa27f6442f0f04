"""--keep_checkpoints: only the latest N steps stay on disk; the final step's checkpoint is
always among them (it is the latest), and a rerun resumes from it."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl4llm import rl
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra import checkpoint
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.update import state
from jaxrl4llm.train.update.state import OptimizerConfig


def _state(step):
    params = {"w": jnp.asarray(np.random.default_rng(step).normal(size=(8, 8)), jnp.float32)}
    return state.TrainState.create(params, optax.adam(1e-2), seed=3).replace(step=jnp.int32(step))


def _steps_on_disk(folder):
    return sorted(int(d) for d in os.listdir(folder) if d.isdigit())


def test_keep_one_leaves_the_final_step_and_restores_it(tmp_path):
    # A 20-step run saving every 8: periodic saves at 8 and 16, the final save at 20.
    ckpt = checkpoint.Checkpointer(str(tmp_path), every=8, keep=1)
    for step in range(1, 21):
        if ckpt.should_save(step):
            ckpt.save(step, _state(step), {"iterator": {"index": step}})
            assert _steps_on_disk(tmp_path) == [step]
    ckpt.save(20, _state(20), {"iterator": {"index": 20}})  # the loop's final save
    ckpt.close()
    assert _steps_on_disk(tmp_path) == [20]
    # A new process (a rerun) restores it and keeps saving with keep=1.
    ckpt = checkpoint.Checkpointer(str(tmp_path), every=8, keep=1)
    restored, data_state = ckpt.restore(checkpoint.abstract_like(_state(0)))
    np.testing.assert_array_equal(restored.params["w"], _state(20).params["w"])
    assert int(restored.step) == 20 and data_state == {"iterator": {"index": 20}}
    ckpt.save(24, _state(24), {"iterator": {"index": 24}})
    ckpt.close()
    assert _steps_on_disk(tmp_path) == [24]


def test_keep_one_run_ends_with_its_final_checkpoint_and_resumes(
    toy_model_dir, copy_task_file, tmp_path
):
    config = TrainConfig().replace(
        model=toy_model_dir,
        data=copy_task_file,
        instruction="",
        prompts_per_step=4,
        group_size=2,
        max_prompt_tokens=16,
        max_new_tokens=1,
        algorithm=rl.get_preset("grpo"),
        optimizer=OptimizerConfig(learning_rate=1e-2),
        num_steps=3,
        checkpoint_every=2,
        keep_checkpoints=1,
        mesh="data:1,fsdp:1,tensor:1",
        eval_prompts=0,
        workdir=str(tmp_path),
        answer_mode="lenient",
        trackers="",
    )
    loop.run(config, devices=jax.devices()[:1])  # saves 2, then the final 3 (not a multiple)
    assert _steps_on_disk(tmp_path / "checkpoints") == [3]
    result = loop.run(config.replace(num_steps=4), devices=jax.devices()[:1])
    assert result["step"] == 4
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]
    assert _steps_on_disk(tmp_path / "checkpoints") == [4]
