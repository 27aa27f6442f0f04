"""Batch-wide reductions that stay exact when the batch is split across devices.

Every statistic of the whole batch (a batch mean or std, whitening, GPG's scale, the
covariance selection of Clip-Cov / KL-Cov, the metrics) goes through these helpers. With
``axis_name=None`` they reduce the local array; inside ``shard_map`` (or ``pmap``) over the
batch axis ``axis_name``, they combine every shard's part, so the result equals the unsharded
one. Group statistics need no collective: groups are G contiguous rows and a shard holds
whole groups (its row count is a multiple of G).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def total(x: jnp.ndarray, axis_name: str | None) -> jnp.ndarray:
    """The sum of x over every element and every shard."""
    s = jnp.sum(x)
    return s if axis_name is None else jax.lax.psum(s, axis_name)


def maximum(x: jnp.ndarray, axis_name: str | None) -> jnp.ndarray:
    m = jnp.max(x)
    return m if axis_name is None else jax.lax.pmax(m, axis_name)


def minimum(x: jnp.ndarray, axis_name: str | None) -> jnp.ndarray:
    m = jnp.min(x)
    return m if axis_name is None else jax.lax.pmin(m, axis_name)


def global_rows(x_B: jnp.ndarray, axis_name: str | None) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(every shard's rows concatenated in shard order, the offset of this shard's first row
    in it): the unsharded batch, for the few statistics that need all of it (a top-k)."""
    if axis_name is None:
        return x_B, jnp.int32(0)
    rows = jax.lax.all_gather(x_B, axis_name, tiled=True)
    return rows, jax.lax.axis_index(axis_name) * x_B.shape[0]


def rank_descending(score_BT: jnp.ndarray, axis_name: str | None) -> jnp.ndarray:
    """int [B, T]: each entry's rank (0 = largest) among the scores of the whole batch, ties
    broken by position (row-major, shards in order), as the unsharded batch would rank it."""
    rows, offset = global_rows(score_BT, axis_name)
    order = jnp.argsort(-rows.reshape(-1), stable=True)
    ranks = jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
    ranks = ranks.reshape(rows.shape)
    return jax.lax.dynamic_slice_in_dim(ranks, offset, score_BT.shape[0], axis=0)
