"""A sampler call's rows between the host and the devices: the prompt block with each row's
key and greedy flag (`prompt_rows`; the single-turn and the multi-turn samplers lay their rows
out with it), a per-row host array placed on the mesh (`place_rows`) and this host's rows of
an output read back (`host_rows`).

Sample g of prompt p is keyed fold_in(fold_in(key, p), g), so a row's samples do not depend
on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import buckets
from jaxrl4llm.sampling.layout import RowLayout


@jax.jit
def _row_keys(key: jax.Array, prompt_index_B: jax.Array, sample_index_B: jax.Array) -> jax.Array:
    """Key of sample g of prompt p: fold_in(fold_in(key, p), g), whatever else is batched."""
    return jax.vmap(lambda p, g: jax.random.fold_in(jax.random.fold_in(key, p), g))(
        prompt_index_B, sample_index_B
    )


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """The host side of a sampler call: the prompt block, each row's key and the greedy
    rows (bool [B], or None), and the rows per prompt prefill (RowLayout.prompt_group)."""

    batch: buckets.PromptBatch
    keys_B: jax.Array
    greedy_B: np.ndarray | None
    prompt_group: int


def prompt_rows(
    prompts: Sequence[Sequence[int]],
    model_config: ModelConfig,
    key: jax.Array,
    layout: RowLayout,
    *,
    max_new_tokens: int,
    max_prompt_len: int | None,
    long_prompts: str,
    pad_id: int,
    min_prompt_bucket: int,
    greedy_last: int = 0,
    batch_multiple: int = 1,
    multihost: bool = False,
    row_keys: jax.Array | None = None,
) -> PromptRows:
    """The rows of `layout.group_size` samples of each prompt (buckets.prepare_batch) under
    the prompt limit (max_prompt_len, by default the context left after max_new_tokens),
    keyed fold_in(fold_in(key, p), g) unless `row_keys` gives the real rows' keys, the last
    `greedy_last` samples of each prompt greedy. `multihost`: prompts are this host's, so
    its prompt indices are offset by its share and every host picks the same prompt bucket."""
    n = layout.group_size
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
    if multihost:
        min_prompt_bucket = max(min_prompt_bucket, _global_max_prompt_len(prompts, limit))
    batch = buckets.prepare_batch(
        prompts,
        n=n,
        max_prompt_len=limit,
        long_prompts=long_prompts,
        pad_id=pad_id,
        vocab_size=model_config.vocab_size,
        batch_multiple=batch_multiple,
        min_prompt_bucket=min_prompt_bucket,
    )
    B = batch.prompt_BP.shape[0]
    # Prompt indices are global (offset by this host's share) so no two hosts draw alike.
    prompt_index_B = batch.prompt_index_B + (jax.process_index() * len(prompts) if multihost else 0)
    if row_keys is None:
        keys_B = _row_keys(key, jnp.asarray(prompt_index_B), jnp.asarray(batch.sample_index_B))
    else:
        if len(row_keys) != batch.num_rows:
            raise ValueError(
                f"row_keys has {len(row_keys)} keys; expected len(prompts) * n = {batch.num_rows}."
            )
        extra = _row_keys(
            key,
            jnp.asarray(prompt_index_B[batch.num_rows :]),
            jnp.asarray(batch.sample_index_B[batch.num_rows :]),
        )
        keys_B = jnp.concatenate([row_keys, extra]) if B > batch.num_rows else row_keys
    return PromptRows(
        batch=batch,
        keys_B=keys_B,
        greedy_B=(batch.sample_index_B >= n - greedy_last) if greedy_last else None,
        # prepare_batch lays each prompt's n samples out as consecutive rows (batch padding
        # rows are all alike): with whole groups the prompt is prefilled once per group.
        prompt_group=layout.prompt_group(B),
    )


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
