"""How the trainer wires issue 14's conventions: --log_kl_ref loads the reference and logs
the KL under the KL-in-loss metric name; prompts dropped as too long leave the statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.update import advantages
from jaxrl4llm.train.update.state import OptimizerConfig


def test_log_kl_ref_loads_the_reference_only_when_on(toy_model_dir, copy_task_file, tmp_path):
    def run(name, **update):
        config = TrainConfig().replace(
            model=toy_model_dir,
            data=copy_task_file,
            instruction="",
            prompts_per_step=8,
            group_size=4,
            max_prompt_tokens=16,
            max_new_tokens=1,
            algorithm="reinforce",
            optimizer=OptimizerConfig(learning_rate=1e-2),
            num_steps=2,
            mesh="data:1,fsdp:1,tensor:1",
            eval_prompts=0,
            checkpoint_every=1000,
            workdir=str(tmp_path / name),
            answer_mode="lenient",
            trackers="",
            **update,
        )
        return loop.run(config, devices=jax.devices()[:1]), read_metrics(str(tmp_path / name))

    summary, metrics = run("on", log_kl_ref=True)
    assert summary["ref_params"] is not None
    # The policy has moved after the first update: the KL to the frozen reference is > 0,
    # under the name the KL-in-loss runs log.
    assert metrics[-1]["policy/kl_ref"] > 0
    summary, metrics = run("off")
    assert summary["ref_params"] is None and "policy/kl_ref" not in metrics[-1]


def test_dropped_prompts_leave_the_batch_statistics():
    """lite_ppo's batch std: the dropped prompt's rows (reward 0 by default) must not count."""
    G, T = 4, 3
    rewards = np.array([1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0], np.float32)
    dropped = np.r_[np.zeros(8, bool), np.ones(4, bool)]
    mask = np.ones((12, T), np.float32)
    mask[dropped] = 0.0
    lp = jnp.zeros((12, T))
    adv, _, keep, _ = advantages.advantages(  # (PPO's returns: None here)
        jnp.asarray(rewards),
        jnp.asarray(rewards > 0),
        jnp.asarray(mask),
        jnp.zeros(12, bool),
        jnp.asarray(dropped),
        jnp.ones(12, bool),
        lp,
        lp,
        config=rl.get_preset("lite_ppo"),
        group_size=G,
    )
    centered = np.r_[0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    # With the dropped rows the std would be that of all 12 rewards (0.452 instead of 0.518).
    std = rewards[:8].std(ddof=1)
    assert std == pytest.approx(0.5175, abs=1e-4)
    np.testing.assert_allclose(
        np.asarray(adv), np.r_[centered / (std + 1e-6), np.zeros(4)], rtol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(keep), ~dropped)
