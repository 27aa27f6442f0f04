"""The paged engine (paged.py) on a mesh that splits the batch: one engine and one page pool
per batch shard.

On a mesh whose batch axes (data, fsdp, expert: parallel.data_parallel_size) split the rows
D ways, `generate_sharded` runs the engine under jax.shard_map, manual over the batch axes:
each shard decodes its own B / D rows (whole groups of G consecutive rows) from its own pool
of `num_pages` pages, with at most max_rows / D of them decoding at once, and with no
collective between shards in its loop (the shards' loops run different step counts), but
for a mixture of experts whose experts the batch's `expert` axis also splits
(lockstep_axes): each shard then holds only its part of the experts, its expert group's
shards exchange tokens in every model call (models/moe.py) and so step together
(paged_lockstep.py). The weights are laid out once, before the loops, in the compute dtype
(decode_weights): whole over the batch axes but for those experts (weights split over
fsdp are gathered there). The other axes (tensor) stay with the partitioner: on a mesh that
also splits heads, each shard's engine splits its heads, pool and vocabulary over its own
devices (`inside_shard`), and its loop's collectives join only those devices (and its
expert group's, as above). A row's samples
depend only on its key (fold_in(row_key, t)), so they are the ones the engine draws on one
device. The outputs come back split over the batch like the compacted sampler's; the scalar
counts (slot_steps, PagedStats) are summed over the shards. A run in segments
(paged_segments.py) lays out its weights (`decode_weights`) and its state between programs
(`state_shardings`) as these shards' engines hold them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import decode, paged, paged_state

ENGINE = "the paged rollout engine (--rollout_engine=paged, --kv_cache_tokens)"


def batch_axes(mesh: Mesh | AbstractMesh, rules: parallel.LogicalRules) -> tuple[str, ...]:
    """The mesh axes the batch is split over (the batch rule's axes on this mesh)."""
    axes = parallel.mesh_axes(parallel.logical_to_partition_spec(("batch",), rules)[0])
    return tuple(a for a in axes if a in mesh.shape)


def shards(mesh: Mesh | AbstractMesh | None, rules: parallel.LogicalRules) -> int:
    """The batch shards (1 without a mesh): one engine and one page pool each."""
    return 1 if mesh is None else parallel.data_parallel_size(mesh, rules)


def other_axes(mesh: Mesh | AbstractMesh, rules: parallel.LogicalRules) -> str:
    """The mesh axes of size > 1 that do not split the batch, as "axis:size,..." ("": none)."""
    axes = batch_axes(mesh, rules)
    return ",".join(f"{a}:{n}" for a, n in mesh.shape.items() if n > 1 and a not in axes)


def manual_axes(mesh: Mesh | AbstractMesh, rules: parallel.LogicalRules) -> frozenset[str]:
    """The axes a batch shard's jax.shard_map is manual over: the batch axes, and every axis
    where no other one splits anything. A body left an automatic axis, even of size 1, is
    partitioned by XLA, which cannot partition a Pallas (Mosaic) call; inside_shard gives
    such a body no sharding, so it calls its kernels (splash, paged attention) bare."""
    axes = batch_axes(mesh, rules)
    return frozenset(axes if other_axes(mesh, rules) else mesh.axis_names)


def inside_shard(
    mesh: Mesh, rules: parallel.LogicalRules, lockstep: tuple[str, ...] = ()
) -> parallel.ActivationSharding | None:
    """A batch shard's activation sharding under jax.shard_map manual over the batch axes
    (the other axes left to the partitioner): None where no other axis splits anything (the
    shard's engine runs on one device), else `mesh` with rules that name no batch axis (the
    shard's weights, pool and activations split over the other axes, e.g. heads over
    tensor) but the `lockstep` axes' split of the experts (models/moe.py's _manual_experts
    reads it)."""
    if not other_axes(mesh, rules):
        return None
    inside = parallel.inside_batch_shard(rules)
    if lockstep:
        inside = tuple((n, lockstep if n == "experts" else a) for n, a in inside)
    return parallel.ActivationSharding(mesh, inside)


def lockstep_axes(
    mesh: Mesh | AbstractMesh, rules: parallel.LogicalRules, model_config: ModelConfig
) -> tuple[str, ...]:
    """The batch axes (of size > 1) that also split a mixture of experts' experts: each of
    their shards holds its part of the experts, so the shards of one expert group exchange
    tokens in every model call and step together (paged_lockstep.py). () for a dense model
    or experts that no batch axis splits."""
    if not model_config.moe_layers:
        return ()
    E = model_config.moe.num_experts
    split = parallel.logical_to_partition_spec(("experts",), rules, (E,), mesh)[0]
    axes = batch_axes(mesh, rules)
    return tuple(a for a in parallel.mesh_axes(split) if a in axes and mesh.shape[a] > 1)


def in_body(
    sharding: parallel.ActivationSharding | None,
) -> parallel.ActivationSharding | None:
    """`sharding` (inside_shard's) as code traced inside the shard_map body must name it: on
    the context's abstract mesh, whose batch axes are manual (a constraint on the concrete
    mesh clashes with the values made inside the body)."""
    if sharding is None:
        return None
    return dataclasses.replace(sharding, mesh=jax.sharding.get_abstract_mesh())


def check_rows(rows: int, D: int, group: int) -> None:
    """Refuses a batch that does not give each of the D shards whole groups."""
    if rows % (D * group):
        raise FlagError(
            f"{ENGINE} on {D} batch shards gives each shard whole groups: {rows} rows are not "
            f"a multiple of {D} shards x {group} rows per group; pad the batch to a multiple "
            f"of {D * group} rows (the trainer: --prompts_per_step a multiple of {D})."
        )


def engine(mesh: Mesh | None, rules: parallel.LogicalRules) -> Callable[..., Any]:
    """The paged engine's compiled program on `mesh`: generate_sharded where it splits the
    batch, else paged.generate_paged (the same arguments)."""
    return generate_sharded if shards(mesh, rules) > 1 else paged.generate_paged


@functools.partial(jax.jit, static_argnames=paged.STATIC)
def generate_sharded(
    params: Any,
    *inputs: jax.Array,
    mesh: Mesh,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    max_rows: int,
    prompt_group: int = 1,
    greedy_B: jax.Array | None = None,
    row_caps_B: jax.Array | None = None,
    **settings: Any,
) -> paged_state.PagedOutput:
    """paged.generate_paged (the same arguments; `inputs`: prompt_BP, prompt_mask_BP,
    active_B, row_keys_B, stop_ids_S, pad_id) on each batch shard of `mesh`, with no mesh:
    the shard's rows, `max_rows` (all shards) split over the shards, and `settings`
    (num_pages: each shard's pool, the rest as generate_paged's). The weights are laid out
    for the shards' loops once, before them (decode_weights: in the compute dtype, the
    batch axes' shards gathered but the experts' where they split them: lockstep_axes)."""
    D, G = shards(mesh, rules), prompt_group
    check_rows(inputs[0].shape[0], D, G)
    axes = batch_axes(mesh, rules)
    row: Any = P(axes)  # (Any: the specs fill PagedOutput's array fields)
    whole: Any = P()
    local_rows = max(G, max_rows // D)
    given = dict(greedy_B=greedy_B, row_caps_B=row_caps_B)
    optional = {k: v for k, v in given.items() if v is not None}

    config = settings["model_config"]
    lockstep = lockstep_axes(mesh, rules, config)
    inner = inside_shard(mesh, rules, lockstep)

    def body(params: Any, rows: tuple, stop: jax.Array, pad: jax.Array, optional: dict) -> Any:
        shard = in_body(inner)
        on = {} if shard is None else {"mesh": shard.mesh, "rules": shard.rules}
        out = paged.generate_paged(
            params, *rows, stop, pad, max_rows=local_rows, prompt_group=G, **on,
            **optional, **settings, laid_out=True, lockstep=lockstep,
        )  # fmt: skip
        total = lambda a: jax.lax.psum(a, axes)  # noqa: E731
        return out.replace(slot_steps=total(out.slot_steps), stats=jax.tree.map(total, out.stats))

    stats = [f.name for f in dataclasses.fields(paged_state.PagedStats)]
    # The routing record, where kept, is per row like the tokens (None: no leaf, no spec).
    record = row if settings.get("record_routing") and config.moe_layers else None
    weights = decode_weights(params, config, mesh, rules)
    specs = weight_specs(weights, config, mesh, rules)
    out_specs = paged_state.PagedOutput(
        **dict.fromkeys(("tokens_RT", "logprobs_RT", "length_R", "done_R"), row),
        slot_steps=whole,
        stats=paged_state.PagedStats(**dict.fromkeys(stats, whole)),
        **dict.fromkeys(("prompt_experts_RPLK", "experts_RTLK"), record),
    )
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, (row,) * 4, whole, whole, {k: row for k in optional}),
        out_specs=out_specs,
        axis_names=manual_axes(mesh, rules),
        check_vma=False,
    )
    return run(weights, inputs[:4], inputs[4], inputs[5], optional)


def weight_specs(
    weights: Any, config: ModelConfig, mesh: Mesh, rules: parallel.LogicalRules
) -> Any:
    """The jax.shard_map specs of decode_weights's `weights` for the batch shards' engines:
    whole over the batch axes but for the experts over lockstep_axes (the other axes are
    the partitioner's)."""
    lockstep = lockstep_axes(mesh, rules, config)
    experts_only = tuple((n, lockstep if n == "experts" else None) for n, _ in rules)
    axes = transformer.unstacked_logical_axes(config)
    shardings = parallel.logical_to_sharding(axes, mesh, experts_only, weights)
    return jax.tree.map(lambda sharding: sharding.spec, shardings)


@functools.partial(jax.jit, static_argnames=("model_config", "mesh", "rules"))
def decode_weights(
    params: Any,
    model_config: ModelConfig,
    mesh: Mesh | None = None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
) -> Any:
    """The weights laid out once for the shards' decode loops (decode.loop_params: in the
    compute dtype), on a mesh whole over the batch axes (each shard's engine holds every
    weight; gathered here once, in the compute dtype, not at every segment of
    paged_segments.py) but a mixture of experts' experts where a batch axis splits them
    (lockstep_axes: they stay split so), and split over the other axes as a shard's engine
    splits them (inside_shard: heads over tensor)."""
    lockstep = () if mesh is None else lockstep_axes(mesh, rules, model_config)
    inside = rules if lockstep else parallel.inside_batch_shard(rules)
    sharding = None if mesh is None else parallel.ActivationSharding(mesh, inside)
    return decode.loop_params(params, model_config, sharding)


def state_shardings(state: paged_state.PagedState, mesh: Mesh, rules: parallel.LogicalRules) -> Any:
    """Where a run's state lives on `mesh`: every array's first axis (the shards) over the
    batch axes; the pool's and the pending groups' keys and values also split over kv heads
    as the shards' engines split them (inside_shard)."""
    axes = batch_axes(mesh, rules)
    K = state.pool.k_pages[0].shape[1]
    inner = inside_shard(mesh, rules)
    heads = None if inner is None else inner.spec(("kv_heads",), (K,))[0]
    spec = lambda *dims: NamedSharding(mesh, P(axes, *dims))  # noqa: E731
    out = jax.tree.map(lambda _: spec(), state)
    cache = out.pending.cache
    return out.replace(
        pool=out.pool.replace(
            k_pages=(spec(heads),) * len(cache.k_BKHS), v_pages=(spec(heads),) * len(cache.k_BKHS)
        ),
        pending=out.pending.replace(
            cache=cache.replace(
                k_BKHS=(spec(None, heads),) * len(cache.k_BKHS),
                v_BKSH=(spec(None, heads),) * len(cache.v_BKSH),
            )
        ),
    )


def host_values(tree: Any) -> Any:
    """`tree`'s arrays on this host, whole (several hosts: gathered from every host)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def local_shards(mesh: Mesh | None, rules: parallel.LogicalRules, D: int) -> list[int]:
    """The batch shards whose devices are this host's (all of them on one host)."""
    if mesh is None or jax.process_count() == 1:
        return list(range(D))
    sharding = NamedSharding(mesh, P(batch_axes(mesh, rules)))
    return sorted(
        {
            index[0].start or 0
            for device, index in sharding.devices_indices_map((D,)).items()
            if getattr(device, "process_index", 0) == jax.process_index()
        }
    )


def from_hosts(x: Any, local: list[int], mesh: Mesh | None, rules: parallel.LogicalRules) -> Any:
    """The mesh's [D, ...] array (split over the batch axes) of which this host gives the rows
    `local` of `x`, its own shards' (the other hosts give theirs)."""
    assert mesh is not None  # several hosts imply a mesh
    sharding = NamedSharding(mesh, P(batch_axes(mesh, rules)))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x)[local])
