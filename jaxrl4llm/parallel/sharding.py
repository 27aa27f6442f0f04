"""Logical-axis sharding rules: how arrays are laid out on the (data, fsdp, expert, tensor) mesh.

Arrays carry *logical* axis names ("embed", "vocab",
"heads", ...); one rules table maps each logical name to mesh axes, so a model or a
batch never names a mesh axis itself.

    shardings = logical_to_sharding(param_axes, mesh, shapes=param_shapes)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

# Logical axis name -> mesh axis (or axes, or None for replicated).
LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: LogicalRules = (
    # Examples: split over every data-parallel axis. Outside the experts the expert axis is
    # one of them; models/moe.py brings each token to its experts' devices.
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),  # sequence positions stay whole
    ("vocab", "tensor"),
    ("embed", "fsdp"),  # FSDP shards parameters along the model width
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),  # a mixture of experts' experts (expert parallelism)
    ("layers", None),  # the scanned layer axis is never split
    ("norm", None),
)
# Logical axes whose weights stay split in the decode layout (without_batch_axes) although
# their mesh axes also carry the batch: the tokens travel to the experts, not the experts'
# weights to the tokens.
_SPLIT_IN_DECODE = ("experts",)


def _rules_dict(rules: LogicalRules) -> Mapping[str, str | tuple[str, ...] | None]:
    return dict(rules)


def logical_to_partition_spec(
    logical_axes: Sequence[str | None],
    rules: LogicalRules = DEFAULT_RULES,
    shape: Sequence[int] | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    A mesh axis is used at most once per array (the first dimension that asks for it wins).
    With `mesh`, mesh axes it lacks are left out (a mesh built without an expert axis). When
    `shape` and `mesh` are given, a dimension that the mesh axes do not divide is
    replicated instead (e.g. 3 KV heads on tensor=2), so small models still run on big meshes.
    """
    table = _rules_dict(rules)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise KeyError(f"Logical axis {name!r} has no sharding rule; known: {sorted(table)}")
        axes = tuple(a for a in mesh_axes(table[name]) if a not in used)
        if mesh is not None:
            axes = tuple(a for a in axes if a in mesh.shape)
        if shape is not None and mesh is not None and axes:
            size = int(np.prod([mesh.shape[a] for a in axes]))
            if shape[dim] % size:
                logging.log_first_n(
                    logging.INFO,
                    "Replicating dim %d (%s, size %d): not divisible by mesh axes %s",
                    8,
                    dim,
                    name,
                    shape[dim],
                    axes,
                )
                axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def mesh_axes(target: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A rule's target (or a PartitionSpec entry) as a tuple of mesh axes."""
    return () if target is None else ((target,) if isinstance(target, str) else tuple(target))


def _is_axes_leaf(x: Any) -> bool:
    # A plain tuple of names (not a NamedTuple such as optax's EmptyState()).
    return type(x) is tuple and all(a is None or isinstance(a, str) for a in x)


def logical_to_sharding(
    logical_axes_tree: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES, shapes: Any = None
) -> Any:
    """A pytree of logical-axis tuples (and optional matching shapes) -> NamedShardings."""
    if shapes is None:
        return jax.tree.map(
            lambda axes: NamedSharding(mesh, logical_to_partition_spec(axes, rules, mesh=mesh)),
            logical_axes_tree,
            is_leaf=_is_axes_leaf,
        )
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, logical_to_partition_spec(axes, rules, x.shape, mesh)),
        logical_axes_tree,
        shapes,
        is_leaf=_is_axes_leaf,
    )


def shard_pytree(
    tree: Any, logical_axes_tree: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES
) -> Any:
    """Places every array of `tree` on `mesh` according to its logical axes."""
    shardings = logical_to_sharding(logical_axes_tree, mesh, rules, shapes=tree)
    return jax.tree.map(jax.device_put, tree, shardings)


def batch_sharding(mesh: Mesh, ndim: int, rules: LogicalRules = DEFAULT_RULES) -> NamedSharding:
    """Sharding of a [B, ...] batch array: rows over the data-parallel axes, the rest whole."""
    axes = ("batch",) + (None,) * (ndim - 1)
    return NamedSharding(mesh, logical_to_partition_spec(axes, rules, mesh=mesh))


def on_batch_axes(tree: Any, mesh: Mesh) -> Any:
    """Every [B, ...] array of `tree` laid out by `batch_sharding`, so a program that takes
    them compiles for that layout whatever made them (a no-op for arrays laid out so
    already; the values never change). Arrays this host does not wholly hold keep theirs:
    a multi-host batch is laid out where it is made."""

    def place(x: jax.Array) -> jax.Array:
        if not x.is_fully_addressable:
            return x
        return jax.device_put(x, batch_sharding(mesh, x.ndim))

    return jax.tree.map(place, tree)


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """Where a program's activations live: the mesh and rules, as one hashable value that the
    model functions take as a static argument (`sharding=`; None: no mesh, no constraints).

    Activations are constrained to (batch over data x fsdp, model width whole, heads / MLP /
    vocab over tensor), so the partitioner splits the *work* like the batch: weights are
    all-gathered where they are used and gradients reduce-scattered (FSDP), instead of
    splitting activations along the model width and gathering whole batches.
    """

    mesh: Mesh | AbstractMesh  # abstract inside a shard_map body (its manual axes named)
    rules: LogicalRules = DEFAULT_RULES

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        return logical_to_partition_spec(logical_axes, self.rules, shape, self.mesh)

    def named(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.named(logical_axes, x.shape))

    def shards(self, logical_axis: str, size: int) -> int:
        """Into how many pieces a dimension of `size` with this logical axis is split."""
        axes = self.spec((logical_axis,), (size,))[0] or ()
        axes = (axes,) if isinstance(axes, str) else axes
        return int(np.prod([self.mesh.shape[a] for a in axes]))


def constrain(
    x: jax.Array, logical_axes: Sequence[str | None], sharding: ActivationSharding | None
) -> jax.Array:
    """`sharding.constrain(x, logical_axes)`, or x unchanged without a mesh."""
    return x if sharding is None else sharding.constrain(x, logical_axes)


def constrain_tree(tree: Any, logical_axes_tree: Any, sharding: ActivationSharding | None) -> Any:
    """Constrains every leaf of `tree` to its logical axes (e.g. gradients to their params')."""
    if sharding is None:
        return tree
    return jax.tree.map(
        lambda axes, x: sharding.constrain(x, axes), logical_axes_tree, tree, is_leaf=_is_axes_leaf
    )


def split_strided(x: jax.Array, num_slices: int, group: int = 1) -> jax.Array:
    """[R, ...] -> [num_slices, R / num_slices, ...], slice k holding the groups of `group`
    consecutive rows numbered k, k + num_slices, k + 2 * num_slices, ...

    Rows are split over the data-parallel devices in contiguous blocks, so a contiguous slice
    would live on 1 / num_slices of the devices; a strided one spans all of them (and when a
    device's block holds a multiple of num_slices * group rows, slicing moves nothing).
    """
    R = x.shape[0]
    if R % (num_slices * group):
        raise ValueError(
            f"{R} rows do not split into {num_slices} slices of whole groups of {group} rows."
        )
    x = x.reshape((R // (num_slices * group), num_slices, group) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape((num_slices, R // num_slices) + x.shape[3:])


def merge_strided(x: jax.Array, group: int = 1) -> jax.Array:
    """The inverse of `split_strided`: [num_slices, R / num_slices, ...] -> [R, ...]."""
    num_slices, rows = x.shape[:2]
    x = x.reshape((num_slices, rows // group, group) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape((num_slices * rows,) + x.shape[3:])


def num_row_chunks(rows: int, max_rows: int, group: int = 1) -> int:
    """The fewest strided chunks of at most `max_rows` rows (0: no cap) that split `rows`
    into whole groups of `group` rows."""
    if not max_rows or max_rows >= rows:
        return 1
    chunks = -(-rows // max_rows)
    while rows % (chunks * group):
        chunks += 1
    return chunks


def without_batch_axes(rules: LogicalRules = DEFAULT_RULES) -> LogicalRules:
    """`rules` with the batch's mesh axes taken out of every other logical axis: the layout of
    weights that multiply batch-sharded activations with no collective (FSDP's shards
    gathered, tensor parallelism kept), e.g. once before a decode loop. The experts stay
    split over their axis: models/moe.py moves the tokens to them instead."""
    batch = mesh_axes(_rules_dict(rules).get("batch"))
    out = []
    for name, target in rules:
        if name != "batch" and name not in _SPLIT_IN_DECODE and target is not None:
            axes = tuple(a for a in mesh_axes(target) if a not in batch)
            target = None if not axes else axes[0] if len(axes) == 1 else axes
        out.append((name, target))
    return tuple(out)


def inside_batch_shard(rules: LogicalRules = DEFAULT_RULES) -> LogicalRules:
    """`rules` with the batch's mesh axes taken out of every logical axis, the batch's own
    included: the layout inside jax.shard_map manual over the batch axes, where each batch
    shard's program splits its arrays over the other axes only."""
    batch = mesh_axes(_rules_dict(rules).get("batch"))
    out = []
    for name, target in rules:
        axes = tuple(a for a in mesh_axes(target) if a not in batch)
        out.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(out)


def data_parallel_size(mesh: Mesh | AbstractMesh, rules: LogicalRules = DEFAULT_RULES) -> int:
    """How many shards the batch axis is split into (the product of its mesh axes)."""
    axes = mesh_axes(logical_to_partition_spec(("batch",), rules)[0])
    return int(np.prod([mesh.shape[a] for a in axes if a in mesh.shape]))
