"""The sampler gathers its weights once, before the decode loop, not in every decode step.

Read in the HLO right after SPMD partitioning (hlo_analysis.partitioned_hlo): the CPU
compiler's final HLO has weight gathers hoisted out of the loop whatever the program asked,
while the TPU and GPU compilers run them where the partitioner put them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import TINY
from jaxrl4llm.planner import hlo_analysis
from jaxrl4llm.sampling import continuous, decode, paged_mesh, sampler
from jaxrl4llm.sampling.strategies import SamplingConfig

# The 7B plans' architecture features: untied unembedding, q/k/v biases.
MODEL = dataclasses.replace(TINY, tie_word_embeddings=False, attention_bias=True)
ROWS, PROMPT, NEW = 16, 16, 8


def _lower(mesh_spec: str, num_chunks: int, slots: int = 0, pages: int = 0):
    mesh = parallel.make_mesh(mesh_spec, jax.devices()[: math.prod(_sizes(mesh_spec))])
    # Stored as the trainer stores them: bfloat16, laid out by the default rules.
    structs = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16),
        transformer.param_shapes(MODEL),
        is_leaf=lambda x: type(x) is tuple,
    )
    shardings = parallel.logical_to_sharding(
        transformer.param_logical_axes(MODEL), mesh, shapes=structs
    )
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), structs, shardings
    )

    def rows(shape, dtype):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=parallel.batch_sharding(mesh, len(shape))
        )

    inputs = (
        params,
        rows((ROWS, PROMPT), jnp.int32),
        rows((ROWS, PROMPT), bool),
        rows((ROWS,), bool),
        rows((ROWS,), jax.random.key(0).dtype),
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    common = dict(model_config=MODEL, sampling=SamplingConfig(), max_new_tokens=NEW, mesh=mesh)
    if pages:  # the paged engine: one pool, or one per batch shard (paged_mesh.engine)
        engine = paged_mesh.engine(mesh, parallel.DEFAULT_RULES)
        return mesh, engine.lower(*inputs, num_pages=pages, max_rows=8, **common)
    if slots:  # the continuous-batching decoder
        return mesh, continuous.generate_slots.lower(*inputs, slots=slots, **common)
    return mesh, sampler.generate_tokens.lower(
        *inputs, prompt_group=1, num_chunks=num_chunks, cache_dtype=jnp.bfloat16, **common
    )


def _sizes(mesh_spec: str) -> list[int]:
    return [int(part.split(":")[1]) for part in mesh_spec.split(",")]


def _gathered_bytes(mesh) -> int:
    """Per-device bytes of every FSDP-sharded weight once whole over fsdp (bfloat16), still
    split over tensor: the logical axes read directly, not through the sharding code."""
    tensor = mesh.shape["tensor"]
    total = 0
    for axes, shape in zip(
        jax.tree.leaves(transformer.param_logical_axes(MODEL), is_leaf=lambda x: type(x) is tuple),
        jax.tree.leaves(transformer.param_shapes(MODEL), is_leaf=lambda x: type(x) is tuple),
    ):
        if "embed" not in axes:
            continue
        split = [d for a, d in zip(axes, shape) if a in ("vocab", "heads", "kv_heads", "mlp")]
        total += 2 * math.prod(shape) // (tensor if split and split[0] % tensor == 0 else 1)
    return total


@pytest.mark.parametrize(
    "mesh_spec,num_chunks,slots",
    [
        ("data:1,fsdp:8,tensor:1", 1, 0),
        ("data:1,fsdp:4,tensor:2", 2, 0),
        ("data:1,fsdp:8,tensor:1", 1, 8),
    ],
)
def test_decode_loop_gathers_no_weight(mesh_spec, num_chunks, slots):
    mesh, lowered = _lower(mesh_spec, num_chunks, slots)
    _, hlo = hlo_analysis.partitioned_hlo(lowered)
    assert " while(" in hlo  # the decode loop is there
    repeated = hlo_analysis.loop_invariant_collectives(hlo)
    assert not repeated, [(op.kind, op.result, op.op_name) for op in repeated]
    # The weights are gathered once, before the loops, each exactly once.
    ops = hlo_analysis.collectives(hlo)
    once = [op for op in ops if f"/{decode.WEIGHTS_SCOPE}/" in op.op_name]
    assert once and all(op.kind == "all-gather" and op.executions == 1 for op in once)
    assert sum(op.bytes for op in once) == _gathered_bytes(mesh)


@pytest.mark.parametrize("mesh_spec", ["data:1,fsdp:1,tensor:2", "data:2,fsdp:2,tensor:2"])
def test_the_paged_engines_loop_repeats_no_collective_of_its_weights(mesh_spec):
    """The paged engine on a mesh that splits heads, and on one that also splits the batch
    (one engine per batch shard, its heads split): its loop (admission, prefill, decode steps)
    holds no collective whose operands do not change from one iteration to the next, e.g. a
    weight gathered again at every step. Every collective that runs more than once (in the
    loop) joins only the devices of one batch shard (tensor's 2): the shards' loops run
    different step counts, and a collective across shards would wait forever."""
    _, lowered = _lower(mesh_spec, 1, pages=40)
    _, hlo = hlo_analysis.partitioned_hlo(lowered)
    assert " while(" in hlo
    looped = [op for op in hlo_analysis.collectives(hlo, unknown_trip_count=2) if op.executions > 1]
    assert looped, "the heads' split should need collectives"
    assert all(op.group_size == 2 for op in looped), [
        (op.kind, op.group_size, op.op_name) for op in looped if op.group_size != 2
    ]
    repeated = hlo_analysis.loop_invariant_collectives(hlo)
    assert not repeated, [(op.kind, op.result, op.op_name) for op in repeated]
