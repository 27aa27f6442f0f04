"""A mixture-of-experts policy through the whole trainer: a toy Qwen3-MoE learns the copy task
with GRPO and GSPO as the dense toy model does (tests/train/test_loop.py), and LoRA on a MoE
model adapts its attention or is refused with the flag to use."""

import numpy as np
import pytest

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models.moe_config import MoeConfig
from jaxrl4llm.train import loop

from tests.conftest import build_toy_model
from tests.train.test_loop import _accuracy, _config, _one_device

# 4 experts of width 32 in both layers, each token routed to 2 with renormalised weights
# (Qwen3-MoE's rule). Models mixing dense and MoE layers: tests/models/test_moe.py.
TOY_MOE = dict(model_type="qwen3_moe", qk_norm=True, moe=MoeConfig(4, 2, 32, norm_topk_prob=True))


@pytest.fixture(scope="module")
def toy_moe_dir(tmp_path_factory):
    return build_toy_model(tmp_path_factory.mktemp("toy_moe"), **TOY_MOE)


@pytest.mark.parametrize("preset", ["grpo", "gspo"])
def test_a_toy_moe_learns_the_copy_task(preset, toy_moe_dir, copy_task_file, tmp_path):
    """A random policy copies the digit with p ~ 1/32. Seeded; measured on this machine kind
    (40 steps, lr 1e-2): accuracy over the first 5 steps 0.04, over the last 5 0.94 (grpo) and
    0.81 (gspo)."""
    config = _config(toy_moe_dir, copy_task_file, tmp_path, algorithm=preset, num_steps=40)
    loop.run(config, devices=_one_device())
    accuracy = _accuracy(tmp_path)
    assert accuracy[:5].mean() < 0.15, accuracy
    assert accuracy[-5:].mean() > 0.5, accuracy


def test_lora_on_a_moe_adapts_attention_and_refuses_the_dense_mlp(
    toy_moe_dir, copy_task_file, tmp_path
):
    """Adapters on q, k, v, o train (the frozen experts and router stay as loaded); the
    default targets include gate / up / down, which the MoE layers do not have: refused before
    any step with the targets to use."""
    config = _config(
        toy_moe_dir,
        copy_task_file,
        tmp_path / "attention",
        num_steps=3,
        lora_rank=4,
        lora_alpha=8.0,
        lora_targets=("q", "k", "v", "o"),
    )
    summary = loop.run(config, devices=_one_device())
    adapters = summary["state"].params["layers"]
    assert sorted(adapters) == sorted(f"{t}_lora_{ab}" for t in "qkvo" for ab in "ab")
    # The B factors start at 0 and moved: the adapters trained.
    assert all(np.abs(np.asarray(adapters[f"{t}_lora_b"])).max() > 0 for t in "qkvo")
    with pytest.raises(FlagError, match=r"--lora_targets=q,k,v,o,gate,up,down: gate,up,down"):
        loop.run(
            config.replace(
                lora_targets=("q", "k", "v", "o", "gate", "up", "down"),
                workdir=str(tmp_path / "mlp"),
            ),
            devices=_one_device(),
        )
