"""The paged engine's programs that the planner does not lower (tools/plan.py --target_kernels
lowers the step's own: tests/tools/test_plan_target.py), exported for a TPU with jax.export
inside parallel.lowering_for: DAPO's dynamic sampling by admission runs the engine in
segments (sampling/paged_segments.py), each admitting queued groups (their prompts
prefilled) and decoding. On a TPU, by the engine's own rules, a model of head_dim 128 decodes
with the Pallas paged attention kernel and prefills prompts of 1024 tokens with splash: both
kernels must lower to Mosaic on a mesh splitting the batch only (where XLA was once left a
Pallas call to partition), the heads only, and both. Multi-turn rollouts on pages prefill
their prompts with splash too (their decode reads pages with the gather on every platform):
the prefill program, taken with the arguments the rollout calls it with, lowers as well."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.models import transformer
from jaxrl4llm.models.architectures import ARCHITECTURES
from jaxrl4llm.sampling import multiturn, paged_driver, paged_rounds, paged_turns_mesh
from jaxrl4llm.sampling.frontend import Sampler
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turns import TurnLimits

from tests.sampling.test_multiturn import FakeHandler

# Qwen3-8B's family and heads of 128, one small layer: the kernels' shapes, not its size.
MODEL = dataclasses.replace(
    ARCHITECTURES["qwen3-8b-base"], num_layers=1, hidden_size=256, intermediate_size=512,
    num_heads=4, num_kv_heads=2, vocab_size=1024,
)  # fmt: skip


MESHES = [
    "data:1,fsdp:8,expert:1,tensor:1", "data:1,fsdp:1,expert:1,tensor:8",
    "data:2,fsdp:2,expert:1,tensor:2",
]  # fmt: skip
SPLASH = "splash_mqa_fwd_segmented_no_residuals"


def _kernels(exported) -> set[str]:
    return set(re.findall(r'kernel_name = "([^"]+)"', exported.mlir_module()))


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_the_admission_segment_lowers_its_kernels_for_a_tpu(mesh_spec):
    """8 slots of 4 rows on each batch shard, prompts 1024 wide, 64 new tokens: the segment
    program (admit, prefill the pending groups, decode) calls the paged kernel and splash."""
    sizes = [int(axis.split(":")[1]) for axis in mesh_spec.split(",")]
    mesh = parallel.make_mesh(mesh_spec, jax.devices()[: int(np.prod(sizes))])
    params = transformer.init_params(MODEL, jax.random.key(0), jnp.bfloat16)
    sampler = Sampler(MODEL, mesh=mesh, stop_ids=(1,), pad_id=0, kv_cache_tokens=0)
    sampler_params = sampler.shard_params(params)
    shards = sizes[0] * sizes[1]
    sampling = SamplingConfig(temperature=1.0)
    with parallel.lowering_for("tpu"):
        # begin's programs (the decode weights, an empty run) hold no kernel: they run here.
        driver = paged_driver.Driver(sampler, sampling, 8 * shards, 4, 64, 1024, 8 * shards)
        driver.begin(sampler_params)
        exported = driver.program.export("tpu")(
            driver.weights, driver.queue, driver.state, driver.stop_S, driver.pad_id
        )
    assert _kernels(exported) == {"paged_flash_attention_kernel_inline_seq_dim", SPLASH}


def _exported_on_first_call(monkeypatch, module, name: str, out: dict) -> None:
    """module.name (a jitted program) exported for a TPU the first time the rollout calls
    it (per `program` it is given, where it takes one), with those arguments (out[key]: the
    export, or the error), then run here as usual."""
    program = getattr(module, name)

    def call(*args, **kwargs):
        key = name + (f":{kwargs['program']}" if "program" in kwargs else "")
        if key not in out:
            with parallel.lowering_for("tpu"):
                try:
                    out[key] = jax.export.export(program, platforms=["tpu"])(*args, **kwargs)
                except Exception as e:  # noqa: BLE001  (reported by the test's assertion)
                    out[key] = e
        return program(*args, **kwargs)

    monkeypatch.setattr(module, name, call)


@pytest.mark.parametrize("mesh_spec", MESHES[:1] + MESHES[2:])
def test_the_multi_turn_programs_on_pages_lower_for_a_tpu(mesh_spec, monkeypatch):
    """16 rows (8 prompts of 1000 tokens x 2) of a multi-turn rollout on pages, a pool per
    batch shard, run here: each program exported for a TPU with the arguments the rollout
    first gives it. The prefill runs splash; the decode segment gathers pages and an
    observation's chunk attends with the reference at its traced offset (no kernel)."""
    sizes = [int(axis.split(":")[1]) for axis in mesh_spec.split(",")]
    mesh = parallel.make_mesh(mesh_spec, jax.devices()[: int(np.prod(sizes))])
    params = transformer.init_params(MODEL, jax.random.key(0), jnp.bfloat16)
    out: dict = {}
    for name in ("_prefill", "segment_shards", "_row_program"):
        _exported_on_first_call(monkeypatch, paged_turns_mesh, name, out)
    prompts = np.random.default_rng(0).integers(7, MODEL.vocab_size, (8, 1000)).tolist()
    multiturn.generate_turns(
        params, MODEL, prompts, SamplingConfig(temperature=1.0), 32, jax.random.key(1),
        FakeHandler(stops=[[t] for t in range(0, MODEL.vocab_size, 2)]),  # even tokens end turns
        TurnLimits(max_turns=2, max_observation_tokens=8),
        stop_ids=(1,), n=2, mesh=mesh, kv_cache_tokens=0,
    )  # fmt: skip
    failed = {k: v for k, v in out.items() if isinstance(v, Exception)}
    assert not failed, failed
    assert {k: _kernels(v) for k, v in out.items()} == {
        "_prefill": {SPLASH}, "segment_shards": set(), "_row_program:observe": set()
    }  # fmt: skip


@pytest.mark.parametrize("mesh_spec", MESHES[:1] + MESHES[2:])
def test_the_partial_rollout_pool_lowers_for_a_tpu(mesh_spec, monkeypatch):
    """A partial-rollout step's pool (sampling/paged_rounds.py), a pool per batch shard: 8
    groups of 2 rows with prompts of 1000 tokens started (their prompts prefilled with
    splash) and decoded for a round (pages gathered: no kernel), each program exported for a
    TPU with the arguments it is first given."""
    sizes = [int(axis.split(":")[1]) for axis in mesh_spec.split(",")]
    mesh = parallel.make_mesh(mesh_spec, jax.devices()[: int(np.prod(sizes))])
    params = transformer.init_params(MODEL, jax.random.key(0), jnp.bfloat16)
    sampler = Sampler(MODEL, mesh=mesh, stop_ids=(1,), pad_id=0, kv_cache_tokens=0)
    out: dict = {}
    _exported_on_first_call(monkeypatch, paged_rounds, "run_on_shards", out)
    _exported_on_first_call(monkeypatch, paged_turns_mesh, "segment_shards", out)
    shards = sizes[0] * sizes[1]
    pool = paged_rounds.StepPool(
        sampler, sampler.shard_params(params), SamplingConfig(temperature=1.0),
        slots=2 * shards, group=2, max_new_tokens=32, max_prompt_tokens=1024,
    )  # fmt: skip
    prompts = np.random.default_rng(0).integers(7, MODEL.vocab_size, (2 * shards, 1000))
    pool.start(prompts.tolist(), jax.random.split(jax.random.key(1), 4 * shards), 8)
    pool.run()
    failed = {k: v for k, v in out.items() if isinstance(v, Exception)}
    assert not failed, failed
    assert {k: _kernels(v) for k, v in out.items()} == {
        "run_on_shards:start": {SPLASH}, "segment_shards": set()
    }  # fmt: skip
