"""Parallelism: the device mesh and multi-host start-up (mesh.py), the logical-axis
sharding rules that lay arrays out on it (sharding.py) and the platform traces are for
(backend.py). Callers use `parallel.NAME`.
"""

from jaxrl4llm.parallel.backend import EXPORT_PLATFORMS, backend, lowering_for
from jaxrl4llm.parallel.mesh import MESH_AXES, MeshSpec, make_mesh, maybe_initialize_distributed
from jaxrl4llm.parallel.sharding import (
    DEFAULT_RULES,
    ActivationSharding,
    LogicalRules,
    batch_sharding,
    constrain,
    constrain_tree,
    data_parallel_size,
    inside_batch_shard,
    logical_to_partition_spec,
    logical_to_sharding,
    merge_strided,
    mesh_axes,
    num_row_chunks,
    on_batch_axes,
    shard_pytree,
    split_strided,
    without_batch_axes,
)

__all__ = [
    "DEFAULT_RULES",
    "EXPORT_PLATFORMS",
    "MESH_AXES",
    "ActivationSharding",
    "LogicalRules",
    "MeshSpec",
    "backend",
    "batch_sharding",
    "constrain",
    "constrain_tree",
    "data_parallel_size",
    "inside_batch_shard",
    "logical_to_partition_spec",
    "logical_to_sharding",
    "lowering_for",
    "make_mesh",
    "maybe_initialize_distributed",
    "merge_strided",
    "mesh_axes",
    "num_row_chunks",
    "on_batch_axes",
    "shard_pytree",
    "split_strided",
    "without_batch_axes",
]
