"""planner/estimate.py on a mixture of experts: the expert weights split over expert x fsdp,
the rest over fsdp, and an MoE layer's activations (the numbers worked by hand)."""

from __future__ import annotations

import dataclasses

import jax

from jaxrl4llm.models.config import TINY
from jaxrl4llm.models.moe_config import MoeConfig
from jaxrl4llm.planner import estimate as plan_estimate
from jaxrl4llm.train.config import TrainConfig

# 2 layers of width 64 (attention 12288 weights and 128 of norms each), every MLP 4 experts of
# width 32, 2 per token: router 64 x 4 = 256, experts 3 x 64 x 32 x 4 = 24576 per layer;
# tied embedding 256 x 64 = 16384, final norm 64. Np = 2 x 37248 + 16384 + 64 = 90944.
MOE = dataclasses.replace(
    TINY,
    model_type="qwen3_moe",
    moe=MoeConfig(num_experts=4, experts_per_token=2, moe_intermediate_size=32),
)
CONFIG = TrainConfig().replace(
    prompts_per_step=2, group_size=4, micro_batch_size=4, mesh="data:1,fsdp:2,expert:2,tensor:1"
)


def _mesh(shape: tuple[int, ...]) -> jax.sharding.Mesh:
    axes = ("data", "fsdp", "expert", "tensor")
    return jax.make_mesh(shape, axes, devices=jax.devices()[:4])


def test_moe_weights_are_split_over_expert_and_fsdp():
    assert MOE.num_params == 90944
    est = plan_estimate.Estimate(CONFIG, MOE, _mesh((1, 2, 2, 1)))
    # Ne = 2 x 24576 = 49152 split over expert:2 -> Nb = 90944 - 49152 + 24576 = 66368,
    # float32 over fsdp:2: Pb = 66368 x 4 / 2.
    assert est.Nb == 66368 and est.Pb == 132736
    # The layers a device gathers: 2 x 37248 - 49152 + 24576.
    assert est.nWl == 49920
    # No dense layer; an MoE layer gathers X = 2 rows of width 64 per row, and one chunk of
    # 32768 copies holds their width 64 and three projections of 32, in float32.
    assert (est.F, est.C) == (0, 128)
    assert est.Q == 32768 * (64 + 3 * 32) * 4
    # Textbook FSDP per micro-batch: 3 x Nb x 4 bytes.
    assert est.textbook_update_collectives(1) == 3 * 66368 * 4


def test_a_dense_model_is_estimated_as_before_on_an_expert_axis():
    """The expert axis is data-parallel for a dense model: nothing split over it."""
    est = plan_estimate.Estimate(CONFIG, TINY, _mesh((1, 2, 2, 1)))
    assert est.Nb == TINY.num_params and est.Pb == TINY.num_params * 4 / 2
    assert (est.F, est.C) == (TINY.intermediate_size, 0)
