"""Who sees whom: the attention rule (attention.py's docstring) as masks, per (query, key)
pair (`visible_mask`) and per (query block, key block) pair (`block_visibility`, the pairs
the chunked kernel computes). Shared by every implementation and by the host's FLOP model
(train/update/packing.py).

The sliding window counts token positions, not slots. In a plain row (left padding, then
contiguous tokens) the two agree; in a packed row whose completions share one copy of their
prompt they do not (a group's second completion sits after the first, but its positions
continue from the prompt's), so packed rows pass each key slot's position (`positions_BS`)
and a query's position is the one at its own slot t + offset."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Masked scores: large and finite so that fully masked rows (pads) stay NaN-free.
MASKED = -1e30
# Block padding past the last key: below MASKED, so it never outweighs a masked real key.
PADDED = 2 * MASKED
# A device (jax.numpy) or host (numpy) array: row_block_visibility runs on either.
ArrayT = TypeVar("ArrayT", jax.Array, np.ndarray)


def causal(key_slots: jax.Array, query_slots: jax.Array, window: int | None) -> jax.Array:
    """bool [T, S] from query slots [T] and key slots [S]: s <= t and, with a window W,
    s > t - W."""
    visible = key_slots[None, :] <= query_slots[:, None]
    if window is not None:
        visible &= key_slots[None, :] > query_slots[:, None] - window
    return visible


def within_window(positions_BS: jax.Array, num_queries: int, offset: Any, window: int) -> jax.Array:
    """bool [B, T, S]: key s is inside query t's window by position, p_s > p_t - W, where
    p = positions_BS and query t's position is p at its slot t + offset."""
    query_BT = lax.dynamic_slice_in_dim(positions_BS, offset, num_queries, 1)
    return positions_BS[:, None, :] > query_BT[:, :, None] - window


def is_segmented(key_valid_BS: jax.Array) -> bool:
    """Whether key_valid_BS holds segment ids (packed rows) rather than a bool mask."""
    return key_valid_BS.dtype != jnp.bool_


def query_segments(
    key_valid_BS: jax.Array,
    num_queries: int,
    offset: Any,
    query_prefix_BT: jax.Array | None = None,
) -> jax.Array:
    """int32 [B, T, 2]: each query's (own segment, prefix segment). Its own is the segment id
    at its slot t + offset (1 for a bool mask: one segment per row); its prefix segment is
    `query_prefix_BT`'s (its own where that is None)."""
    if not is_segmented(key_valid_BS):
        ones_BT = jnp.ones((key_valid_BS.shape[0], num_queries), jnp.int32)
        return jnp.stack([ones_BT, ones_BT], axis=-1)
    own_BT = lax.dynamic_slice_in_dim(key_valid_BS.astype(jnp.int32), offset, num_queries, 1)
    prefix_BT = own_BT if query_prefix_BT is None else query_prefix_BT.astype(jnp.int32)
    return jnp.stack([own_BT, prefix_BT], axis=-1)


def same_segment(key_segments, query_ids):
    """bool [..., T, S]: key s is real (segment >= 1) and in query t's own segment or its
    prefix segment (query_ids [..., T, 2], see `query_segments`)."""
    k = key_segments[..., None, :]
    own, prefix = query_ids[..., :, 0:1], query_ids[..., :, 1:2]
    return (k > 0) & ((k == own) | (k == prefix))


def visible_mask(
    key_valid_BS: jax.Array,
    num_queries: int,
    offset: Any,
    window: int | None = None,
    query_prefix_BT: jax.Array | None = None,
    positions_BS: jax.Array | None = None,
) -> jax.Array:
    """bool [B, T, S]: query t sees key s iff key_valid[b, s] (segment ids: the key is in the
    query's segment or its prefix segment), s <= t + offset and (with a sliding window W)
    the key is within W - 1 positions before the query: p_s > p_t - W with `positions_BS`
    (packed rows; query t's position is the one at slot t + offset), else
    s > t + offset - W."""
    S = key_valid_BS.shape[1]
    slot_window = window if positions_BS is None else None
    visible_BTS = causal(jnp.arange(S), jnp.arange(num_queries) + offset, slot_window)[None]
    if window is not None and positions_BS is not None:
        visible_BTS = visible_BTS & within_window(positions_BS, num_queries, offset, window)
    if not is_segmented(key_valid_BS):
        return visible_BTS & key_valid_BS[:, None, :]
    return visible_BTS & same_segment(
        key_valid_BS, query_segments(key_valid_BS, num_queries, offset, query_prefix_BT)
    )


def row_block_visibility(
    key_valid_BS: ArrayT,
    query_ids_BT2: ArrayT,
    offset: Any,
    bq: int,
    bk: int,
    window: int | None,
    xp: Any = jnp,
    positions_BS: Any = None,
) -> ArrayT:
    """bool [B, query blocks, key blocks]: whether row b has a query in block i that sees a
    key in block j (`xp`: jax.numpy on device, numpy for the host's FLOP model). Segments
    are contiguous and increase along a row, so a block's segments form a range; the test is
    conservative (a query block's prefix segments are taken as the range between their least
    and greatest), never false for a visible pair. With `positions_BS` the window compares
    the key block's greatest position with the query block's least (visible_mask's rule),
    else the slots."""
    T, S = query_ids_BT2.shape[1], key_valid_BS.shape[1]
    B, n_q, n_k = key_valid_BS.shape[0], -(-T // bq), -(-S // bk)
    # -1: block padding past the last key; 0: block padding queries, which see nothing.
    keys = xp.pad(key_valid_BS.astype(xp.int32), ((0, 0), (0, n_k * bk - S)), constant_values=-1)
    ids = xp.pad(query_ids_BT2.astype(xp.int32), ((0, 0), (0, n_q * bq - T), (0, 0)))
    keys, ids = keys.reshape(B, n_k, bk), ids.reshape(B, n_q, bq, 2)
    # Block padding and packed padding (0) see nothing; a query sees its prefix segment's keys
    # whatever its own id, so each span counts the queries whose id there is real.
    none = np.iinfo(np.int32).max

    def span(x, real):
        return xp.where(real, x, none).min(-1), xp.where(real, x, 0).max(-1)

    k_lo, k_hi = (x[:, None, :] for x in span(keys, keys > 0))
    own_lo, own_hi = (x[:, :, None] for x in span(ids[..., 0], ids[..., 0] > 0))
    pre_lo, pre_hi = (x[:, :, None] for x in span(ids[..., 1], ids[..., 1] > 0))
    # Empty spans (lo = int32 max, hi = 0) meet nothing.
    segments = ((k_lo <= own_hi) & (own_lo <= k_hi)) | ((k_lo <= pre_hi) & (pre_lo <= k_hi))
    first_q = xp.arange(n_q) * bq + offset
    last_q = xp.minimum(xp.arange(1, n_q + 1) * bq, T) - 1 + offset
    first_k = xp.arange(n_k) * bk
    last_k = xp.minimum(xp.arange(1, n_k + 1) * bk, S) - 1
    visible = (first_k[None, :] <= last_q[:, None])[None]
    if window is not None and positions_BS is None:
        visible = visible & (last_k[None, :] > first_q[:, None] - window)[None]
    elif window is not None:
        real_q = (ids[..., 0] > 0) | (ids[..., 1] > 0)
        pos_q = _slots(positions_BS.astype(xp.int32), offset, T, xp)
        pos_q = xp.pad(pos_q, ((0, 0), (0, n_q * bq - T))).reshape(B, n_q, bq)
        pos_k = xp.pad(positions_BS.astype(xp.int32), ((0, 0), (0, n_k * bk - S)))
        least_q = xp.where(real_q, pos_q, none).min(-1)
        greatest_k = xp.where(keys > 0, pos_k.reshape(B, n_k, bk), -none).max(-1)
        visible = visible & (greatest_k[:, None, :] > least_q[:, :, None] - window)
    return segments & visible


def _slots(x_BS, offset, num, xp):
    """x_BS's columns [offset, offset + num) (offset traced on device)."""
    if xp is np:
        return x_BS[:, offset : offset + num]
    return lax.dynamic_slice_in_dim(x_BS, offset, num, 1)


def block_visibility(key_valid_BS, query_ids_BT2, offset, bq, bk, window, positions_BS=None):
    """bool [query blocks, key blocks]: whether some row has a visible (query, key) pair in
    the block pair. The chunked kernel computes only these pairs: the causal mask, the window
    and packed rows' block diagonal skip the rest."""
    return row_block_visibility(
        key_valid_BS, query_ids_BT2, offset, bq, bk, window, positions_BS=positions_BS
    ).any(0)
