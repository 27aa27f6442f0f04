"""tools/plan.py --target_kernels (jaxrl4llm/planner/target.py): every program of a step
exported for the TPU with jax.export, on a CPU host. The kernels expected are those the run
calls on a TPU by its own rules (models/attention.py, sampling/paged_step.py): for a model of
head_dim 128, splash attention in every pass over 1024 or more keys (the prefill of 1024-token
prompts, the teacher-forced passes, the update with its backward kernels), and the paged
engine's decode reading its pages with the Pallas paged attention kernel; on every mesh
kind, the batch split alone (where the kernels were once left to XLA's partitioner, which
cannot partition them), heads alone, and both."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import pytest
from absl import flags

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models.architectures import ARCHITECTURES
from jaxrl4llm.planner import programs, target
from jaxrl4llm.planner.topology import topology

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import plan  # noqa: E402

# Qwen3-8B's family and heads of 128, one small layer: the kernels' shapes, not its size.
MODEL = dataclasses.replace(
    ARCHITECTURES["qwen3-8b-base"], num_layers=1, hidden_size=256, intermediate_size=512,
    num_heads=4, num_kv_heads=2, vocab_size=1024,
)  # fmt: skip
FLAGFILE = "--flagfile=experiments/configs/tricks_or_traps_qwen3_8b_dapo.flags"
# 8 prompts x 8 = 64 rows of 1024 + 128 tokens: a prefill over 1024 keys.
SMALL = [
    "--prompts_per_step=8", "--max_prompt_tokens=1024", "--max_new_tokens=128",
    "--mini_batch_size=32", "--micro_batch_size=8", "--rollout_micro_batch=64",
]  # fmt: skip
SPLASH = "splash_mqa_fwd_segmented_no_residuals"
BACKWARD = {
    "splash_mqa_fwd_segmented_residuals", "splash_mqa_dq_segmented_no_residuals",
    "splash_mqa_dkv_segmented_no_residuals",
}  # fmt: skip
PAGED = "paged_flash_attention_kernel_inline_seq_dim"


def _config(monkeypatch, *extra):
    monkeypatch.chdir(REPO)
    FLAGS = flags.FLAGS
    try:
        FLAGS.unparse_flags()
        FLAGS(["plan", FLAGFILE, *SMALL, *extra])
        return plan.train.config_from_flags()
    finally:
        FLAGS.unparse_flags()


@pytest.mark.parametrize(
    "mesh", ["data:1,fsdp:8,expert:1,tensor:1", "data:1,fsdp:1,expert:1,tensor:8",
             "data:2,fsdp:2,expert:1,tensor:2"],
)  # fmt: skip
def test_the_paged_engines_tpu_kernels_lower_on_every_mesh_kind(mesh, monkeypatch):
    config = _config(monkeypatch, f"--mesh={mesh}")
    lowered = target.target_kernels(config, MODEL, topology("v5p-8"), jax.devices()[:8])
    kernels = {row.program: row.kernels for row in lowered}
    assert [row.error for row in lowered] == ["", "", ""], lowered
    assert set(kernels["rollout"]) == {PAGED, SPLASH}
    assert set(kernels["logprobs"]) == {SPLASH}
    assert set(kernels["update"]) == BACKWARD
    assert target.not_lowering_line(lowered, topology("v5p-8")) is None


def test_ppos_critic_lowers_its_splash_kernels(monkeypatch):
    """PPO's critic passes run splash forward and backward as the policy's, on a mesh
    splitting the batch over data and fsdp."""
    config = _config(monkeypatch, "--algorithm=ppo", "--mesh=data:2,fsdp:4,expert:1,tensor:1")
    lowered = target.target_kernels(config, MODEL, topology("v5p-8"), jax.devices()[:8])
    kernels = {row.program: set(row.kernels) for row in lowered}
    assert kernels == {
        "rollout": {PAGED, SPLASH}, "logprobs": {SPLASH}, "update": BACKWARD,
        "critic values": {SPLASH}, "critic update": BACKWARD,
    }  # fmt: skip


def test_a_program_that_does_not_lower_is_named_with_its_error(monkeypatch, capsys):
    config = _config(monkeypatch, "--mesh=data:1,fsdp:8,expert:1,tensor:1")

    def refused(*args):  # XLA's error for a Pallas call left to its partitioner: 2 lines
        raise NotImplementedError(
            "Mosaic kernels cannot be automatically partitioned.\n"
            "Please wrap the call in a shard_map."
        )

    monkeypatch.setattr(programs, "lower_update", refused)
    topo = topology("v5p-8")
    lowered = target.target_kernels(config, MODEL, topo, jax.devices()[:8])
    # The error's first line only: the report keeps one line per program.
    first_line = "NotImplementedError: Mosaic kernels cannot be automatically partitioned."
    assert lowered[2] == target.Lowered("update", {}, first_line)
    assert target.not_lowering_line(lowered, topo) == "DOES NOT LOWER for tpu: update"
    target.print_target(lowered, topo)
    assert f"  update         DOES NOT LOWER: {first_line}\n" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["8xh100", "cpu-8"])
def test_a_topology_not_on_tpus_is_refused_before_planning(name, monkeypatch, capsys):
    """By target_kernels, and by tools/plan.py before it plans anything (exit 2)."""
    config = _config(monkeypatch)
    with pytest.raises(FlagError, match=rf"--topology={name} runs on .*Use a TPU topology"):
        target.target_kernels(config, MODEL, topology(name), jax.devices()[:8])
    try:
        flags.FLAGS(["plan", FLAGFILE, f"--topology={name}", "--target_kernels"])
        assert plan.cli.exit_code(plan.main, []) == 2
    finally:
        flags.FLAGS.unparse_flags()
    assert "Use a TPU topology" in capsys.readouterr().err
