"""The chunked attention kernel: online softmax (flash attention in plain jnp) over query
and key blocks, with a custom VJP that recomputes each block's scores in the backward pass,
so forward and backward hold one [bq, bk] block of scores and O(T * H) state
(remat-friendly). It computes only the block pairs masks.block_visibility marks (skip=True):
nothing past the causal diagonal, outside the window or between packed rows' segments.
attention.attention chooses it and its blocks (AttentionConfig)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl4llm.models.masks import MASKED, PADDED, block_visibility, causal, same_segment

_F32 = jnp.float32
# The kernel's per-row inputs: (key_valid_BS, query_ids, offset, positions_BS).
Rows = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def pad_to(x: jax.Array, axis: int, multiple: int, value: Any = 0) -> jax.Array:
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _split_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """[..., n*block (at axis), ...] -> [n, ..., block, ...] (blocks leading)."""
    shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _merge_blocks(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of _split_blocks."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])


def _block_scores(q_blk, k_blk, valid_blk, qseg_blk, t0, s0, offset, window):
    """Masked scores of one (query block, key block) pair: [B, K, G, bq, bk] float32.
    valid_blk: (the keys' segments, their positions); qseg_blk: (the queries' (own, prefix)
    segments, their positions)."""
    # Under jax.checkpoint a mask computed from integer inputs alone is "known" and gets
    # saved as a residual, stacked over every block pair (GBs at long context); tied to the
    # queries it is recomputed with the scores instead.
    q_blk, valid_blk, qseg_blk = lax.optimization_barrier((q_blk, valid_blk, qseg_blk))
    (valid_blk, kpos_blk), (qseg_blk, qpos_blk) = valid_blk, qseg_blk
    bq, bk = q_blk.shape[3], k_blk.shape[3]
    s = jnp.einsum("bkgth,bkhs->bkgts", q_blk, k_blk, preferred_element_type=_F32)
    causal_TS = causal(s0 + jnp.arange(bk), t0 + jnp.arange(bq) + offset, None)
    # valid_blk: the key's segment (1 for a bool mask's real key), 0 masked key, -1 block
    # padding (past the last key); qseg_blk: the queries' segments. The window counts
    # positions (masks.visible_mask).
    visible = causal_TS[None, :, :] & same_segment(valid_blk, qseg_blk)
    if window is not None:
        visible &= kpos_blk[:, None, :] > qpos_blk[:, :, None] - window
    s = jnp.where(visible[:, None, None], s, MASKED)
    return jnp.where((valid_blk >= 0)[:, None, None, None, :], s, PADDED)


def _blocked_inputs(q, k, v, key_valid_BS, query_ids_BT2, offset, positions_BS, bq, bk):
    """q, k, v split into blocks; per key block (segments, positions), per query block
    ((own, prefix) segments, positions)."""
    T = q.shape[3]
    # Block-padding queries: segments 0, so they see no key.
    valid = pad_to(key_valid_BS.astype(jnp.int32), 1, bk, value=-1)
    qseg = pad_to(query_ids_BT2, 1, bq)
    query_positions = lax.dynamic_slice_in_dim(positions_BS, offset, T, 1)
    return (
        _split_blocks(pad_to(q, 3, bq), 3, bq),
        _split_blocks(pad_to(k, 3, bk), 3, bk),
        _split_blocks(pad_to(v, 2, bk), 2, bk),
        (_split_blocks(valid, 1, bk), _split_blocks(pad_to(positions_BS, 1, bk), 1, bk)),
        (_split_blocks(qseg, 1, bq), _split_blocks(pad_to(query_positions, 1, bq), 1, bq)),
    )


def _block_table(key_valid_BS, query_ids, offset, positions_BS, bq, bk, window, skip):
    """The block pairs the kernel computes: block_visibility's, or every pair (skip False)."""
    table = block_visibility(key_valid_BS, query_ids, offset, bq, bk, window, positions_BS)
    return table if skip else jnp.ones_like(table)


def _safe(row_sum):
    """Row sums with the queries that met no computed block (they see no key) set to 1, so
    their output is 0 rather than NaN."""
    return jnp.where(row_sum > 0, row_sum, 1.0)


def _flash_forward(q, k, v, key_valid_BS, query_ids, offset, positions_BS, bq, bk, window, skip):
    """(out [B, K, G, T, H] f32, logsumexp [B, K, G, T] f32)."""
    T = q.shape[3]
    rows = (key_valid_BS, query_ids, offset, positions_BS)
    q_n, k_n, v_n, valid_n, qseg_n = _blocked_inputs(q, k, v, *rows, bq, bk)
    starts_k = jnp.arange(k_n.shape[0]) * bk
    table = _block_table(*rows, bq, bk, window, skip)

    def query_block(args):
        q_blk, qseg_blk, t0, visible_n = args
        B, K, G, _, H = q_blk.shape

        def key_block(carry, xs):
            k_blk, v_blk, valid_blk, s0, visible = xs

            def accumulate(carry):
                m, row_sum, acc = carry
                s = _block_scores(q_blk, k_blk, valid_blk, qseg_blk, t0, s0, offset, window)
                m_new = jnp.maximum(m, s.max(axis=-1))
                p = jnp.exp(s - m_new[..., None])
                scale = jnp.exp(m - m_new)
                pv = jnp.einsum(
                    "bkgts,bksh->bkgth", p.astype(v_blk.dtype), v_blk, preferred_element_type=_F32
                )
                return m_new, row_sum * scale + p.sum(axis=-1), acc * scale[..., None] + pv

            return lax.cond(visible, accumulate, lambda c: c, carry), None

        init = (
            jnp.full((B, K, G, bq), PADDED, _F32),
            jnp.zeros((B, K, G, bq), _F32),
            jnp.zeros((B, K, G, bq, H), _F32),
        )
        xs = (k_n, v_n, valid_n, starts_k, visible_n)
        (m, row_sum, acc), _ = lax.scan(key_block, init, xs)
        return acc / _safe(row_sum)[..., None], m + jnp.log(_safe(row_sum))

    starts_q = jnp.arange(q_n.shape[0]) * bq
    out_n, lse_n = lax.map(query_block, (q_n, qseg_n, starts_q, table))
    return _merge_blocks(out_n, 3)[:, :, :, :T], _merge_blocks(lse_n, 3)[..., :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def chunked(q, k, v, key_valid_BS, query_ids, offset, positions_BS, bq, bk, window, skip):
    """Attention [B, K, G, T, H] f32 (attention.attention's rule): `query_ids` [B, T, 2]
    (masks.query_segments), `positions_BS` int32 [B, S] each key slot's position, by which
    the sliding `window` counts."""
    rows = (key_valid_BS, query_ids, offset, positions_BS)
    return _flash_forward(q, k, v, *rows, bq, bk, window, skip)[0]


def _chunked_fwd(q, k, v, key_valid_BS, query_ids, offset, positions_BS, bq, bk, window, skip):
    rows = (key_valid_BS, query_ids, offset, positions_BS)
    out, lse = _flash_forward(q, k, v, *rows, bq, bk, window, skip)
    return out, (q, k, v, rows, out, lse)


def _chunked_bwd(bq, bk, window, skip, residuals, dout):
    """Flash-attention backward: per (key block, query block) pair, recompute the
    probabilities from the saved logsumexp; dq accumulates over key blocks, dk / dv over
    query blocks."""
    rows: Rows
    q, k, v, rows, out, lse = residuals
    offset = rows[2]
    T, S = q.shape[3], k.shape[3]
    delta = jnp.sum(dout * out, axis=-1)  # [B, K, G, T]
    q_n, k_n, v_n, valid_n, qseg_n = _blocked_inputs(q, k, v, *rows, bq, bk)
    do_n = _split_blocks(pad_to(dout, 3, bq), 3, bq).astype(v.dtype)
    lse_n = _split_blocks(pad_to(lse, 3, bq), 3, bq)
    delta_n = _split_blocks(pad_to(delta, 3, bq), 3, bq)
    starts_q = jnp.arange(q_n.shape[0]) * bq

    table = _block_table(*rows, bq, bk, window, skip)

    def key_block(dq_n, xs):
        k_blk, v_blk, valid_blk, s0, visible_n = xs

        def query_block(carry, ys):
            q_blk, qseg_blk, do_blk, lse_blk, delta_blk, t0, visible = ys

            def accumulate(carry):
                dk, dv = carry
                s = _block_scores(q_blk, k_blk, valid_blk, qseg_blk, t0, s0, offset, window)
                p = jnp.exp(s - lse_blk[..., None])
                dv = dv + jnp.einsum(
                    "bkgts,bkgth->bksh", p.astype(v.dtype), do_blk, preferred_element_type=_F32
                )
                dp = jnp.einsum("bkgth,bksh->bkgts", do_blk, v_blk, preferred_element_type=_F32)
                ds = p * (dp - delta_blk[..., None])
                dq_blk = jnp.einsum(
                    "bkgts,bkhs->bkgth", ds.astype(k.dtype), k_blk, preferred_element_type=_F32
                )
                dk = dk + jnp.einsum(
                    "bkgts,bkgth->bkhs", ds.astype(q.dtype), q_blk, preferred_element_type=_F32
                )
                return (dk, dv), dq_blk

            def no_pair(carry):
                return carry, jnp.zeros(q_blk.shape, _F32)

            return lax.cond(visible, accumulate, no_pair, carry)

        zeros = (jnp.zeros(k_blk.shape, _F32), jnp.zeros(v_blk.shape, _F32))
        ys = (q_n, qseg_n, do_n, lse_n, delta_n, starts_q, visible_n)
        (dk, dv), dq_contrib = lax.scan(query_block, zeros, ys)
        return dq_n + dq_contrib, (dk, dv)

    starts_k = jnp.arange(k_n.shape[0]) * bk
    dq_n, (dk_n, dv_n) = lax.scan(
        key_block, jnp.zeros(q_n.shape, _F32), (k_n, v_n, valid_n, starts_k, table.T)
    )
    dq = _merge_blocks(dq_n, 3)[:, :, :, :T].astype(q.dtype)
    dk = _merge_blocks(dk_n, 3)[..., :S].astype(k.dtype)
    dv = _merge_blocks(dv_n, 2)[:, :, :S].astype(v.dtype)
    return dq, dk, dv, None, None, None, None


chunked.defvjp(_chunked_fwd, _chunked_bwd)
