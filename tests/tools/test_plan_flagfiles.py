"""tools/plan.py on a scaled-down copy of every shipped flagfile: each one's algorithm and
settings, a tiny model of its architecture's family, 4 simulated devices, a few rows of 16 +
16 tokens. Slow (every program of each flagfile is compiled): `pytest -m slow`."""

from __future__ import annotations

import dataclasses
import glob
import os
import sys

import pytest
from absl import flags

from jaxrl4llm.models.config import TINY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import plan  # noqa: E402

FLAGFILES = sorted(glob.glob(os.path.join(REPO, "experiments", "configs", "*.flags")))
DEVICES = 4
# What a tiny model keeps of the real architecture: its family's computation and context.
_FAMILY = (
    "attention_bias",
    "qk_norm",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "max_position_embeddings",
    "model_type",
)


def tiny_like(model_config):
    return dataclasses.replace(TINY, num_layers=1, **{f: getattr(model_config, f) for f in _FAMILY})


def scaled_down(config) -> list[str]:
    """Flags that shrink `config` (a flagfile's TrainConfig) to 2 prompts of its group size
    and 16 + 16 tokens on DEVICES devices, keeping its shape: several mini-batches when it
    has several, row chunks when it chunks, micro-batches smaller than the mini-batch when
    its are."""
    G = config.rollout.group_size
    B = 2 * G
    mini = B // 2 if config.mini_batch < config.batch_size else B
    micro = max(DEVICES, mini // 2) if config.micro_batch < config.mini_batch else mini
    out = [
        "--prompts_per_step=2",
        f"--mini_batch_size={mini}",
        f"--micro_batch_size={micro}",
        "--max_prompt_tokens=16",
        "--max_new_tokens=16",
        f"--topology=cpu-{DEVICES}",
    ]
    if config.rollout.rollout_micro_batch:
        out.append(f"--rollout_micro_batch={G}")
    if config.rollout.decode_slots:
        out.append(f"--decode_slots={DEVICES}")
    if config.reward.overlong_buffer:
        out.append("--overlong_buffer=4")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("flagfile", FLAGFILES, ids=os.path.basename)
def test_every_flagfile_plans_scaled_down(flagfile, monkeypatch, capsys):
    FLAGS = flags.FLAGS
    try:
        FLAGS.unparse_flags()
        FLAGS(["plan", f"--flagfile={flagfile}"])
        config = plan.train.config_from_flags()
        real = plan.programs.architecture(config.model.name)
        FLAGS.unparse_flags()
        FLAGS(["plan", f"--flagfile={flagfile}", *scaled_down(config)])
        monkeypatch.setattr(plan.programs, "architecture", lambda name: tiny_like(real))
        plan.main([])
    finally:
        FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert "every program fits" in out
    programs = ["create", "rollout", "logprobs", "update"]
    if config.needs_critic:
        programs += ["critic values", "critic update"]
    for program in programs:
        assert f"\n{program} " in out, (program, out)
