"""tools/plan.py with --micro_batch_tokens: the packed update compiles from abstract inputs,
and its activation estimate follows the token budget, not rows x max length."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxrl4llm.models.config import TINY
from jaxrl4llm.planner import estimate as plan_estimate
from jaxrl4llm.planner import programs as plan_programs
from jaxrl4llm.planner import topology
from jaxrl4llm.train.config import TrainConfig

MODEL = dataclasses.replace(TINY, vocab_size=512, num_layers=3)


def _config(**overrides):
    values = dict(
        prompts_per_step=4,
        group_size=4,
        max_prompt_tokens=16,
        max_new_tokens=16,
        micro_batch_size=8,
        mesh="data:1,fsdp:8,tensor:1",
    )
    return TrainConfig().replace(**{**values, **overrides})


def test_packed_activation_estimate_follows_the_token_budget():
    mesh = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:8])
    m, D = MODEL, MODEL.hidden_size
    small, large = (
        plan_estimate.Estimate(_config(micro_batch_tokens=n), MODEL, mesh) for n in (256, 512)
    )
    # Per device 32 more tokens: remat checkpoints (layers x D), the recomputed MLP (6 F) and
    # 4 D more float32 values each.
    per_token = (m.num_layers * D + 6 * m.intermediate_size + 4 * D) * 4
    assert large.update(1, 0.0) - small.update(1, 0.0) == pytest.approx(256 / 8 * per_token)
    # Rows and max length do not enter: a mini-batch twice as large costs the same.
    assert plan_estimate.Estimate(
        _config(micro_batch_tokens=256, mini_batch_size=32, micro_batch_size=32), MODEL, mesh
    ).update(1, 0.0) == pytest.approx(small.update(1, 0.0))
    # The critic keeps padded rows. 16 rows x 32 tokens / 256 = 2 micro-batches at most.
    assert small.update(1, 0.0, packed=False) == pytest.approx(
        plan_estimate.Estimate(_config(), MODEL, mesh).update(1, 0.0)
    )
    assert small.packed_micro_batches() == 2


def test_plan_of_a_packed_run_compiles_the_packed_update():
    config = _config(micro_batch_tokens=256)
    result = plan_programs.plan(config, MODEL, topology.topology("cpu-8"), jax.devices()[:8])
    rows = {r.program: r for r in result.rows}
    update = rows["update"]
    assert update.flops > 0 and 0.2 < update.total / update.estimate < 5
