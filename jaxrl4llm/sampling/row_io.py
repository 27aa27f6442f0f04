"""A sampler call's rows between the host and the devices: the prompt block with each row's
key, greedy flag and token cap (`prompt_rows`, from a `RowRequest`; the single-turn and the
multi-turn samplers lay their rows out with it), how many rows decode at once
(`batch_multiple`, `rows_per_chunk`), the rows placed on the mesh as a sampler's inputs
(`place_inputs`, `place_rows`), the dropped prompts flagged in the output
(`mark_dropped_rows`) and this host's rows of an output read back (`host_rows`).

Sample g of prompt p is keyed fold_in(fold_in(key, p), g), so a row's samples do not depend
on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import buckets
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.sampling.strategies import SamplingConfig


@jax.jit
def sample_keys(key: jax.Array, prompt_index_B: jax.Array, sample_index_B: jax.Array) -> jax.Array:
    """Key of sample g of prompt p: fold_in(fold_in(key, p), g), whatever else is batched."""
    return jax.vmap(lambda p, g: jax.random.fold_in(jax.random.fold_in(key, p), g))(
        prompt_index_B, sample_index_B
    )


@dataclasses.dataclass(frozen=True)
class RowRequest:
    """What a sampler call asks of its rows (prompt_rows): `layout.group_size` samples of
    each prompt laid out by `layout`; prompts up to `max_prompt_len` tokens (by default the
    context left after max_new_tokens), longer ones raising (long_prompts="error") or
    skipped and flagged in dropped_B ("drop"); left-padded with `pad_id` to a prompt bucket
    of at least `min_prompt_bucket`; the last `greedy_last` samples of each prompt greedy
    (ReMax's baseline completion); `row_keys` (one per real row) instead of keys derived
    from the call's key; `row_caps` (one per real row, in 0..max_new_tokens) each row's own
    token limit, 0 for a row that does not run (a prompt's n rows all or none: a group is
    prefilled together); it produces nothing, like a dropped prompt's."""

    layout: RowLayout
    max_new_tokens: int
    max_prompt_len: int | None = None
    long_prompts: str = "error"
    pad_id: int = 0
    min_prompt_bucket: int = buckets.MIN_PROMPT_BUCKET
    greedy_last: int = 0
    row_keys: jax.Array | None = None
    row_caps: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """The host side of a sampler call: the prompt block, each row's key, the greedy rows
    (bool [B], or None), the rows' token caps (int32 [B], or None) and the rows per prompt
    prefill (RowLayout.prompt_group)."""

    batch: buckets.PromptBatch
    keys_B: jax.Array
    greedy_B: np.ndarray | None
    prompt_group: int
    caps_B: np.ndarray | None = None


def prompt_rows(
    prompts: Sequence[Sequence[int]],
    model_config: ModelConfig,
    key: jax.Array,
    request: RowRequest,
    *,
    batch_multiple: int = 1,
    multihost: bool = False,
) -> PromptRows:
    """The rows of `request` (buckets.prepare_batch), keyed fold_in(fold_in(key, p), g)
    unless request.row_keys gives the real rows' keys; batch padding rows take the full
    token cap. `multihost`: prompts are this host's, so its prompt indices are offset by
    its share and every host picks the same prompt bucket."""
    n = request.layout.group_size
    limit = prompt_limit(model_config, request.max_new_tokens, request.max_prompt_len)
    min_prompt_bucket = request.min_prompt_bucket
    if multihost:
        min_prompt_bucket = max(min_prompt_bucket, _global_max_prompt_len(prompts, limit))
    batch = buckets.prepare_batch(
        prompts,
        n=n,
        max_prompt_len=limit,
        long_prompts=request.long_prompts,
        pad_id=request.pad_id,
        vocab_size=model_config.vocab_size,
        batch_multiple=batch_multiple,
        min_prompt_bucket=min_prompt_bucket,
    )
    B = batch.prompt_BP.shape[0]
    # Prompt indices are global (offset by this host's share) so no two hosts draw alike.
    prompt_index_B = batch.prompt_index_B + (jax.process_index() * len(prompts) if multihost else 0)
    greedy_last = request.greedy_last
    caps_B = _padded_row_caps(request.row_caps, batch.num_rows, B, request.max_new_tokens)
    if caps_B is not None:  # a cap of 0: the row does not run
        batch = dataclasses.replace(batch, active_B=batch.active_B & (caps_B > 0))
        caps_B = np.maximum(caps_B, 1)
    return PromptRows(
        batch=batch,
        keys_B=_keys(key, batch, prompt_index_B, request.row_keys),
        greedy_B=(batch.sample_index_B >= n - greedy_last) if greedy_last else None,
        # prepare_batch lays each prompt's n samples out as consecutive rows (batch padding
        # rows are all alike): with whole groups the prompt is prefilled once per group.
        prompt_group=request.layout.prompt_group(B),
        caps_B=caps_B,
    )


def prompt_limit(model_config: ModelConfig, max_new_tokens: int, max_prompt_len: int | None) -> int:
    """The prompt-length limit: max_prompt_len, by default the context max_new_tokens leave."""
    limit = (
        model_config.max_position_embeddings - max_new_tokens
        if max_prompt_len is None
        else max_prompt_len
    )
    if limit < 1:
        raise ValueError(
            f"No room for a prompt: --max_new_tokens={max_new_tokens} leaves "
            f"{limit} prompt tokens; lower --max_new_tokens or set "
            "--max_prompt_tokens."
        )
    return limit


def _keys(
    key: jax.Array,
    batch: buckets.PromptBatch,
    prompt_index_B: np.ndarray,
    row_keys: jax.Array | None,
) -> jax.Array:
    """Each row's key: `row_keys` for the real rows if given, else derived from `key`."""
    if row_keys is None:
        return sample_keys(key, jnp.asarray(prompt_index_B), jnp.asarray(batch.sample_index_B))
    if len(row_keys) != batch.num_rows:
        raise ValueError(
            f"row_keys has {len(row_keys)} keys; expected len(prompts) * n = {batch.num_rows}."
        )
    extra = sample_keys(
        key,
        jnp.asarray(prompt_index_B[batch.num_rows :]),
        jnp.asarray(batch.sample_index_B[batch.num_rows :]),
    )
    return (
        jnp.concatenate([row_keys, extra])
        if batch.prompt_BP.shape[0] > batch.num_rows
        else row_keys
    )


def _padded_row_caps(
    row_caps: Sequence[int] | None, num_rows: int, batch_size: int, max_new_tokens: int
) -> np.ndarray | None:
    """row_caps over the whole batch: batch padding rows (inactive) take the full limit."""
    if row_caps is None:
        return None
    caps_B = np.full(batch_size, max_new_tokens, np.int32)
    caps_B[:num_rows] = row_caps
    return caps_B


def place_inputs(
    rows: PromptRows,
    *,
    mesh: Mesh | None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    multihost: bool = False,
) -> tuple[tuple[jax.Array, ...], dict[str, jax.Array]]:
    """A sampler's row inputs on the mesh (place_rows): (prompt block, its mask, the active
    rows, the row keys) and, by name, the optional ones present (greedy_B, row_caps_B)."""
    place = functools.partial(place_rows, mesh=mesh, rules=rules, multihost=multihost)
    batch = rows.batch
    # Across hosts the keys travel as their raw data (host-local rows -> one global batch,
    # hosts' blocks in process order).
    keys_B = (
        _wrap_keys(place(np.asarray(jax.random.key_data(rows.keys_B))))
        if multihost
        else place(rows.keys_B)
    )
    inputs = (place(batch.prompt_BP), place(batch.mask_BP), place(batch.active_B), keys_B)
    optional = (("greedy_B", rows.greedy_B), ("row_caps_B", rows.caps_B))
    return inputs, {name: place(x) for name, x in optional if x is not None}


def place_rows(
    x: Any,
    *,
    mesh: Mesh | None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    multihost: bool = False,
) -> Any:
    """A per-row host array (rows first) as a sampler's batch-sharded input (rows over the
    data-parallel devices; `multihost`: this host's rows of the global batch); unchanged
    without a mesh."""
    if multihost:
        assert mesh is not None  # multihost implies a mesh
        return jax.make_array_from_process_local_data(
            parallel.batch_sharding(mesh, np.ndim(x), rules), np.asarray(x)
        )
    if mesh is not None:
        return jax.device_put(x, parallel.batch_sharding(mesh, np.ndim(x), rules))
    return x


_wrap_keys = jax.jit(jax.random.wrap_key_data)


def batch_multiple(mesh: Mesh | None, rules: parallel.LogicalRules, multihost: bool) -> int:
    """What this host's rows must pad to a multiple of: its share of the data-parallel size."""
    multiple = 1 if mesh is None else parallel.data_parallel_size(mesh, rules)
    if multihost:
        # Each host passes its own prompts; every host must build the same shapes.
        multiple = max(1, multiple // jax.process_count())
    return multiple


def rows_per_chunk(max_rows: int | None, num_rows: int, n: int, multiple: int) -> int | None:
    """Rows per chunk on this host (None: all rows at once, max_rows unset or not reached):
    whole prompts (n rows) on whole data-parallel shards."""
    if not max_rows or max_rows >= num_rows * jax.process_count():
        return None
    unit = math.lcm(n, multiple)
    return unit * max(1, max_rows // jax.process_count() // unit)


def mark_dropped_rows(
    out: SampleOutput,
    batch: buckets.PromptBatch,
    *,
    mesh: Mesh | None,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    multihost: bool = False,
) -> SampleOutput:
    """`out` with the dropped prompts flagged (and their prompt masks cleared); on one host
    without the batch-bucket padding rows."""
    if multihost:
        # Rows stay global (each host's block keeps its padding rows: see host_rows).
        dropped_B = place_rows(batch.dropped_B, mesh=mesh, rules=rules, multihost=True)
        return out.replace(
            dropped_B=dropped_B, prompt_mask_BP=_and_not(out.prompt_mask_BP, dropped_B)
        )
    dropped_B = jnp.asarray(batch.dropped_B)
    out = out.replace(dropped_B=dropped_B, prompt_mask_BP=out.prompt_mask_BP & ~dropped_B[:, None])
    if batch.prompt_BP.shape[0] > batch.num_rows:  # drop the batch-bucket padding rows
        out = jax.tree.map(lambda x: x if x.ndim == 0 else x[: batch.num_rows], out)
    return out


@jax.jit
def _and_not(mask_BP: jax.Array, dropped_B: jax.Array) -> jax.Array:
    return mask_BP & ~dropped_B[:, None]


def _global_max_prompt_len(prompts: Sequence[Sequence[int]], limit: int) -> int:
    """The longest kept prompt over all hosts (so every host picks the same bucket)."""
    from jax.experimental import multihost_utils

    local = max((len(p) for p in prompts if len(p) <= limit), default=1)
    return int(np.max(multihost_utils.process_allgather(np.int32(local))))


def host_rows(x: jax.Array, num_rows: int) -> np.ndarray:
    """This host's first `num_rows` rows of a sampler output array, as numpy.

    One process: `generate` already returns exactly its rows. Several: the global batch is
    the hosts' equal-sized blocks in process order, padding rows at the end of each block.
    """
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))[:num_rows]
    from jax.experimental import multihost_utils

    full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    block = full.shape[0] // jax.process_count()
    start = jax.process_index() * block
    return full[start : start + num_rows]


def check_generate_args(
    num_rows: int,
    sampling: Any,
    max_new_tokens: Any,
    row_caps: Sequence[int] | None,
    group_size: int = 1,
) -> None:
    if row_caps is not None:
        caps = np.asarray(row_caps)
        if (
            caps.shape != (num_rows,)
            or not np.issubdtype(caps.dtype, np.integer)
            or caps.min(initial=1) < 0
            or caps.max(initial=1) > max_new_tokens
        ):
            raise ValueError(
                f"row_caps must hold len(prompts) * n = {num_rows} ints "
                f"in 0..max_new_tokens={max_new_tokens}; got shape {caps.shape}, "
                f"dtype {caps.dtype}."
            )
        off_G = (caps == 0).reshape(-1, group_size)
        if np.any(off_G.any(axis=1) & ~off_G.all(axis=1)):
            raise ValueError(
                f"row_caps: a prompt's {group_size} rows are all 0 (the prompt does not run) "
                "or none is."
            )
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int.")
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}.")


def stop_id_array(stop_ids: Sequence[int]) -> np.ndarray:
    """Stop ids as an int32 array padded with -1 to a multiple of 8 (few distinct shapes)."""
    ids = sorted({int(s) for s in stop_ids})
    out = np.full(8 * max(1, -(-len(ids) // 8)), -1, np.int32)
    out[: len(ids)] = ids
    return out


def every_host(values: Sequence[int]) -> np.ndarray:
    """int64 [hosts, len(values)]: each host's `values`, in process order (a collective:
    every host calls it at the same point)."""
    local = np.asarray(values, np.int64)
    if jax.process_count() == 1:
        return local[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local)).reshape(-1, local.size)
