"""Parallelism: the device mesh and multi-host start-up (mesh.py), and the logical-axis
sharding rules that lay arrays out on it (sharding.py). Callers use `parallel.NAME`.
"""

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
    "MESH_AXES",
    "ActivationSharding",
    "LogicalRules",
    "MeshSpec",
    "batch_sharding",
    "constrain",
    "constrain_tree",
    "data_parallel_size",
    "inside_batch_shard",
    "logical_to_partition_spec",
    "logical_to_sharding",
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
