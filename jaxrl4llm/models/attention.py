"""Grouped-query attention: the full score matrix for short contexts, memory-efficient kernels
for long ones.

Every implementation computes the same thing at every query that sees a key (a query that
sees none, a padding slot, gets a finite value nothing reads). Query t of a row sits at key
slot t + offset; it sees key s iff key_valid_BS[b, s] and s <= t + offset (causal over
slots), and with a sliding window of W (Mistral) also s > t + offset - W: the query and the
W - 1 slots before it, as transformers' sliding-window mask keeps them. Packed rows (several
sequences in one row) pass int32 segment ids as key_valid_BS (0: no token; segments are
contiguous): a query then also needs the key's segment to be its own, the segment at its own
slot t + offset, so attention is block-diagonal causal. Packed rows whose sequences share a
prompt also pass each query's prefix segment (`query_prefix_BT`, self-attention only): the
segment holding its group's prompt, which it sees beside its own (its own id where it has
none). One rule covers the three uses:
self-attention (offset 0), a KV cache (offset = the first new slot) and a shared prefix
(keys = prefix ++ row, offset = prefix length). Rows are a left-padded prompt followed by
contiguous real tokens, so a distance in slots is a distance in real tokens (RoPE positions)
between any two real tokens, and the window counts real tokens.

  reference  the whole [B, K, G, T, S] score matrix: fastest for short contexts and for the
             sampler's one-query decode steps.
  chunked    online softmax (flash attention in plain jnp): a map over query blocks, a scan
             over key blocks, and a custom VJP that recomputes each block's scores in the
             backward pass, so forward and backward hold one [bq, bk] block of scores and
             O(T * H) state; remat-friendly. It computes only the block pairs that hold a
             visible pair (`block_visibility`: past the causal diagonal, outside the window,
             between packed rows' segments nothing is computed). The default on CPU and
             wherever no kernel fits; on packed rows from two blocks of `packed_block` up.
  splash     the Pallas TPU splash-attention kernel (causal mask with an offset, segment ids
             for padding), per device under shard_map. Its segment ids are equality only:
             prefix segments run the chunked path instead ("auto") or are refused.
  cudnn      jax.nn.dot_product_attention's cuDNN flash kernel on GPU (bf16/fp16), per device
             under shard_map. "xla" runs the same call with XLA's implementation (tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl4llm import parallel

_F32 = jnp.float32
# Masked scores: large and finite so that fully masked rows (pads) stay NaN-free.
MASKED = -1e30
# Block padding past the last key: below MASKED, so it never outweighs a masked real key.
_PADDED = 2 * MASKED
IMPLS = ("auto", "reference", "chunked", "splash", "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which implementation runs and its block sizes (hashable: a static jit argument).

    impl "auto": the reference for one query per row (decode) or fewer keys than
    `min_chunked_keys` (packed rows: than two blocks of `packed_block`); otherwise splash on
    TPU (head_dim a multiple of 128), cuDNN on GPU (bf16 / fp16), the chunked online softmax
    elsewhere. The chunked path runs blocks of block_q x block_k, and of packed_block x
    packed_block on packed rows, whose block-diagonal it skips block by block (finer blocks
    skip more; `block_visibility`).
    """

    impl: str = "auto"
    block_q: int = 512
    block_k: int = 512
    min_chunked_keys: int = 1024
    packed_block: int = 256
    # False: the chunked kernel computes every block pair (tools/bench_attention.py's baseline).
    skip_blocks: bool = True

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"AttentionConfig.impl={self.impl!r}: choose one of {IMPLS}.")
        if min(self.block_q, self.block_k, self.packed_block) < 1:
            raise ValueError("AttentionConfig block sizes must be positive.")

    def blocks(self, segmented: bool) -> tuple[int, int]:
        """The chunked path's (query block, key block) for packed (segmented) or plain rows."""
        return (self.packed_block,) * 2 if segmented else (self.block_q, self.block_k)

    def resolve(
        self, num_queries: int, num_keys: int, head_dim: int, dtype: Any, segmented: bool = False
    ) -> str:
        if self.impl != "auto":
            return self.impl
        min_keys = 2 * self.packed_block if segmented else self.min_chunked_keys
        if num_queries == 1 or num_keys < min_keys:
            return "reference"
        backend = jax.default_backend()
        if backend == "tpu" and head_dim % 128 == 0:
            return "splash"
        if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
            return "cudnn"
        return "chunked"


def _causal(key_slots: jax.Array, query_slots: jax.Array, window: int | None) -> jax.Array:
    """bool [T, S] from query slots [T] and key slots [S]: s <= t and, with a window W,
    s > t - W."""
    visible = key_slots[None, :] <= query_slots[:, None]
    if window is not None:
        visible &= key_slots[None, :] > query_slots[:, None] - window
    return visible


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


def _same_segment(key_segments, query_ids):
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
) -> jax.Array:
    """bool [B, T, S]: query t sees key s iff key_valid[b, s] (segment ids: the key is in the
    query's segment or its prefix segment), s <= t + offset and (with a sliding window W)
    s > t + offset - W."""
    S = key_valid_BS.shape[1]
    causal_TS = _causal(jnp.arange(S), jnp.arange(num_queries) + offset, window)
    if not is_segmented(key_valid_BS):
        return causal_TS[None] & key_valid_BS[:, None, :]
    return causal_TS[None] & _same_segment(
        key_valid_BS, query_segments(key_valid_BS, num_queries, offset, query_prefix_BT)
    )


def attention(
    q_BTNH: jax.Array,
    k_BKHS: jax.Array,
    v_BKSH: jax.Array,
    key_valid_BS: jax.Array,
    offset: Any = 0,
    config: AttentionConfig = AttentionConfig(),
    sharding: parallel.ActivationSharding | None = None,
    window: int | None = None,
    query_prefix_BT: jax.Array | None = None,
) -> jax.Array:
    """Attention of queries [B, T, N, H] over keys [B, K, H, S] / values [B, K, S, H];
    q heads n*G .. n*G+G-1 share kv head n. Returns [B, T, N*H] float32. `window`: the
    sliding window W (None: full causal attention), static. `query_prefix_BT` (segment ids
    only): each query's prefix segment, which it sees beside its own (module docstring).

    Matmuls run in the keys' dtype with float32 accumulation; softmax is float32.
    """
    B, T, N, H = q_BTNH.shape
    K, S = k_BKHS.shape[1], k_BKHS.shape[3]
    q_BKGTH = (q_BTNH.reshape(B, T, K, N // K, H) * (H**-0.5)).transpose(0, 2, 3, 1, 4)
    q_BKGTH = q_BKGTH.astype(k_BKHS.dtype)
    segmented = is_segmented(key_valid_BS)
    impl = config.resolve(T, S, H, k_BKHS.dtype, segmented)
    if query_prefix_BT is not None and impl == "splash":
        if config.impl == "splash":
            raise ValueError(
                "attention impl 'splash' takes segment ids by equality only; packed rows "
                "with shared prompts (query_prefix_BT) need impl 'auto' or 'chunked'."
            )
        impl = "chunked"
    if impl == "reference":
        visible_BTS = visible_mask(key_valid_BS, T, offset, window, query_prefix_BT)
        out = _reference(q_BKGTH, k_BKHS, v_BKSH, visible_BTS)
    elif impl == "chunked":
        out = _chunked(
            q_BKGTH,
            k_BKHS,
            v_BKSH,
            key_valid_BS,
            query_segments(key_valid_BS, T, jnp.asarray(offset, jnp.int32), query_prefix_BT),
            jnp.asarray(offset, jnp.int32),
            min(config.blocks(segmented)[0], T),
            min(config.blocks(segmented)[1], S),
            window,
            config.skip_blocks,
        )
    else:
        if not isinstance(offset, int):
            raise ValueError(
                f"attention impl {impl!r} needs a static (int) offset; the decode "
                "step's traced cache index runs the reference implementation."
            )
        kernel = _splash if impl == "splash" else functools.partial(_dot_product, impl=impl)
        out = _per_device(
            kernel,
            q_BKGTH,
            k_BKHS,
            v_BKSH,
            key_valid_BS,
            offset,
            window,
            config,
            sharding,
            query_prefix_BT,
        )
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N * H)


def _reference(q_BKGTH, k_BKHS, v_BKSH, visible_BTS):
    scores_BKGTS = jnp.einsum("bkgth,bkhs->bkgts", q_BKGTH, k_BKHS, preferred_element_type=_F32)
    scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, MASKED)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    return jnp.einsum(
        "bkgts,bksh->bkgth", probs_BKGTS.astype(v_BKSH.dtype), v_BKSH, preferred_element_type=_F32
    )


# ----------------------------------------------------------------------------- chunked


def _pad_to(x: jax.Array, axis: int, multiple: int, value: Any = 0) -> jax.Array:
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
    """Masked scores of one (query block, key block) pair: [B, K, G, bq, bk] float32."""
    # Under jax.checkpoint a mask computed from integer inputs alone is "known" and gets
    # saved as a residual, stacked over every block pair (GBs at long context); tied to the
    # queries it is recomputed with the scores instead.
    q_blk, valid_blk, qseg_blk = lax.optimization_barrier((q_blk, valid_blk, qseg_blk))
    bq, bk = q_blk.shape[3], k_blk.shape[3]
    s = jnp.einsum("bkgth,bkhs->bkgts", q_blk, k_blk, preferred_element_type=_F32)
    causal = _causal(s0 + jnp.arange(bk), t0 + jnp.arange(bq) + offset, window)
    # valid_blk: the key's segment (1 for a bool mask's real key), 0 masked key, -1 block
    # padding (past the last key); qseg_blk: the queries' segments.
    visible = causal[None, :, :] & _same_segment(valid_blk, qseg_blk)
    s = jnp.where(visible[:, None, None], s, MASKED)
    return jnp.where((valid_blk >= 0)[:, None, None, None, :], s, _PADDED)


def _blocked_inputs(q, k, v, key_valid_BS, query_ids_BT2, bq, bk):
    # Block-padding queries: segments 0, so they see no key.
    valid = _pad_to(key_valid_BS.astype(jnp.int32), 1, bk, value=-1)
    qseg = _pad_to(query_ids_BT2, 1, bq)
    return (
        _split_blocks(_pad_to(q, 3, bq), 3, bq),
        _split_blocks(_pad_to(k, 3, bk), 3, bk),
        _split_blocks(_pad_to(v, 2, bk), 2, bk),
        _split_blocks(valid, 1, bk),
        _split_blocks(qseg, 1, bq),
    )


def row_block_visibility(key_valid_BS, query_ids_BT2, offset, bq, bk, window, xp: Any = jnp):
    """bool [B, query blocks, key blocks]: whether row b has a query in block i that sees a
    key in block j (`xp`: jax.numpy on device, numpy for the host's FLOP model). Segments
    are contiguous and increase along a row, so a block's segments form a range; the test is
    conservative (a query block's prefix segments are taken as the range between their least
    and greatest), never false for a visible pair."""
    T, S = query_ids_BT2.shape[1], key_valid_BS.shape[1]
    B, n_q, n_k = key_valid_BS.shape[0], -(-T // bq), -(-S // bk)
    # -1: block padding past the last key; 0: block padding queries, which see nothing.
    keys = xp.pad(key_valid_BS.astype(xp.int32), ((0, 0), (0, n_k * bk - S)), constant_values=-1)
    ids = xp.pad(query_ids_BT2.astype(xp.int32), ((0, 0), (0, n_q * bq - T), (0, 0)))
    keys, ids = keys.reshape(B, n_k, bk), ids.reshape(B, n_q, bq, 2)
    real_q = ids[..., 0] > 0  # block padding and packed padding see nothing
    none = np.iinfo(np.int32).max

    def span(x, real):
        return xp.where(real, x, none).min(-1), xp.where(real, x, 0).max(-1)

    k_lo, k_hi = (x[:, None, :] for x in span(keys, keys > 0))
    own_lo, own_hi = (x[:, :, None] for x in span(ids[..., 0], real_q))
    pre_lo, pre_hi = (x[:, :, None] for x in span(ids[..., 1], real_q))
    # Empty spans (lo = int32 max, hi = 0) meet nothing.
    segments = ((k_lo <= own_hi) & (own_lo <= k_hi)) | ((k_lo <= pre_hi) & (pre_lo <= k_hi))
    first_q = xp.arange(n_q) * bq + offset
    last_q = xp.minimum(xp.arange(1, n_q + 1) * bq, T) - 1 + offset
    first_k = xp.arange(n_k) * bk
    last_k = xp.minimum(xp.arange(1, n_k + 1) * bk, S) - 1
    visible = first_k[None, :] <= last_q[:, None]
    if window is not None:
        visible &= last_k[None, :] > first_q[:, None] - window
    return segments & visible[None]


def block_visibility(key_valid_BS, query_ids_BT2, offset, bq, bk, window):
    """bool [query blocks, key blocks]: whether some row has a visible (query, key) pair in
    the block pair. The chunked kernel computes only these pairs: the causal mask, the window
    and packed rows' block diagonal skip the rest."""
    return row_block_visibility(key_valid_BS, query_ids_BT2, offset, bq, bk, window).any(0)


def _block_table(key_valid_BS, query_ids, offset, bq, bk, window, skip):
    """The block pairs the kernel computes: block_visibility's, or every pair (skip False)."""
    table = block_visibility(key_valid_BS, query_ids, offset, bq, bk, window)
    return table if skip else jnp.ones_like(table)


def _safe(row_sum):
    """Row sums with the queries that met no computed block (they see no key) set to 1, so
    their output is 0 rather than NaN."""
    return jnp.where(row_sum > 0, row_sum, 1.0)


def _flash_forward(q, k, v, key_valid_BS, query_ids, offset, bq, bk, window, skip):
    """(out [B, K, G, T, H] f32, logsumexp [B, K, G, T] f32)."""
    T = q.shape[3]
    q_n, k_n, v_n, valid_n, qseg_n = _blocked_inputs(q, k, v, key_valid_BS, query_ids, bq, bk)
    starts_k = jnp.arange(k_n.shape[0]) * bk
    table = _block_table(key_valid_BS, query_ids, offset, bq, bk, window, skip)

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
            jnp.full((B, K, G, bq), _PADDED, _F32),
            jnp.zeros((B, K, G, bq), _F32),
            jnp.zeros((B, K, G, bq, H), _F32),
        )
        xs = (k_n, v_n, valid_n, starts_k, visible_n)
        (m, row_sum, acc), _ = lax.scan(key_block, init, xs)
        return acc / _safe(row_sum)[..., None], m + jnp.log(_safe(row_sum))

    starts_q = jnp.arange(q_n.shape[0]) * bq
    out_n, lse_n = lax.map(query_block, (q_n, qseg_n, starts_q, table))
    return _merge_blocks(out_n, 3)[:, :, :, :T], _merge_blocks(lse_n, 3)[..., :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _chunked(q, k, v, key_valid_BS, query_ids, offset, bq, bk, window, skip):
    return _flash_forward(q, k, v, key_valid_BS, query_ids, offset, bq, bk, window, skip)[0]


def _chunked_fwd(q, k, v, key_valid_BS, query_ids, offset, bq, bk, window, skip):
    out, lse = _flash_forward(q, k, v, key_valid_BS, query_ids, offset, bq, bk, window, skip)
    return out, (q, k, v, key_valid_BS, query_ids, offset, out, lse)


def _chunked_bwd(bq, bk, window, skip, residuals, dout):
    """Flash-attention backward: per (key block, query block) pair, recompute the
    probabilities from the saved logsumexp; dq accumulates over key blocks, dk / dv over
    query blocks."""
    q, k, v, key_valid_BS, query_ids, offset, out, lse = residuals
    T, S = q.shape[3], k.shape[3]
    delta = jnp.sum(dout * out, axis=-1)  # [B, K, G, T]
    q_n, k_n, v_n, valid_n, qseg_n = _blocked_inputs(q, k, v, key_valid_BS, query_ids, bq, bk)
    do_n = _split_blocks(_pad_to(dout, 3, bq), 3, bq).astype(v.dtype)
    lse_n = _split_blocks(_pad_to(lse, 3, bq), 3, bq)
    delta_n = _split_blocks(_pad_to(delta, 3, bq), 3, bq)
    starts_q = jnp.arange(q_n.shape[0]) * bq

    table = _block_table(key_valid_BS, query_ids, offset, bq, bk, window, skip)

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

            def skip(carry):
                return carry, jnp.zeros(q_blk.shape, _F32)

            return lax.cond(visible, accumulate, skip, carry)

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
    return dq, dk, dv, None, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ----------------------------------------------------------------------------- kernels


def _per_device(
    kernel,
    q_BKGTH,
    k_BKHS,
    v_BKSH,
    key_valid_BS,
    offset: int,
    window: int | None,
    config: AttentionConfig,
    sharding: parallel.ActivationSharding | None,
    query_prefix_BT: jax.Array | None = None,
):
    """Runs a per-device kernel; on a mesh under shard_map over batch rows and kv heads
    (a Pallas or cuDNN custom call is opaque to the SPMD partitioner, which would otherwise
    gather every operand onto each device)."""
    run = functools.partial(kernel, offset=offset, window=window, config=config)
    rows = (key_valid_BS,) if query_prefix_BT is None else (key_valid_BS, query_prefix_BT)
    if sharding is None:
        return run(q_BKGTH, k_BKHS, v_BKSH, *rows)
    B, K = k_BKHS.shape[:2]
    batch = sharding.spec(("batch",), (B,))[0]
    heads = sharding.spec(("kv_heads",), (K,))[0]
    P = jax.sharding.PartitionSpec
    return jax.shard_map(
        run,
        mesh=sharding.mesh,
        in_specs=(P(batch, heads), P(batch, heads), P(batch, heads)) + (P(batch),) * len(rows),
        out_specs=P(batch, heads),
        check_vma=False,
    )(q_BKGTH, k_BKHS, v_BKSH, *rows)


def _query_segments(key_valid_BS, T: int, offset: int, Tp: int) -> jax.Array:
    """A query's segment is its own key's validity, so every query sees at least its own key
    (the kernels need no empty rows); block-padding queries count as real (they see every
    real key before them)."""
    own = key_valid_BS[:, offset : offset + T].astype(jnp.int32)
    return jnp.pad(own, ((0, 0), (0, Tp - T)), constant_values=1)


def _splash(
    q_BKGTH,
    k_BKHS,
    v_BKSH,
    key_valid_BS,
    *,
    offset: int,
    window: int | None,
    config: AttentionConfig,
):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, K, G, T, H = q_BKGTH.shape
    S = k_BKHS.shape[3]
    bq, bk = min(config.block_q, _round_up(T, 128)), min(config.block_k, _round_up(S, 128))
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)
    # LocalMask keeps t + offset - left <= s <= t + offset + right.
    causal = (
        masks.CausalMask((Tp, Sp), offset)
        if window is None
        else masks.LocalMask((Tp, Sp), (window - 1, 0), offset)
    )
    mask = masks.MultiHeadMask([causal] * G)
    sizes = splash.BlockSizes(
        block_q=bq, block_kv=bk, block_q_dkv=bq, block_kv_dkv=bk, block_q_dq=bq, block_kv_dq=bk
    )
    kernel = splash.make_splash_mqa_single_device(
        mask, block_sizes=sizes, interpret=jax.default_backend() != "tpu"
    )
    q = _pad_to(q_BKGTH, 3, bq)
    k = _pad_to(k_BKHS, 3, bk).swapaxes(2, 3)  # [B, K, Sp, H]
    v = _pad_to(v_BKSH, 2, bk)
    q_seg = _query_segments(key_valid_BS, T, offset, Tp)
    kv_seg = _pad_to(key_valid_BS.astype(jnp.int32), 1, bk)

    def one(q_GTH, k_SH, v_SH, qs, ks):
        return kernel(q_GTH, k_SH, v_SH, segment_ids=splash.SegmentIds(q=qs, kv=ks))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    out = jax.vmap(per_head)(q, k, v, q_seg, kv_seg)
    return out[:, :, :, :T].astype(_F32)


def _dot_product(
    q_BKGTH,
    k_BKHS,
    v_BKSH,
    key_valid_BS,
    query_prefix_BT=None,
    *,
    offset: int,
    window: int | None,
    config: AttentionConfig,
    impl: str,
):
    del config
    B, K, G, T, H = q_BKGTH.shape
    q_BTNH = q_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)
    visible_B1TS = visible_mask(key_valid_BS, T, offset, window, query_prefix_BT)[:, None]
    out_BTNH = jax.nn.dot_product_attention(
        q_BTNH,
        k_BKHS.transpose(0, 3, 1, 2),
        v_BKSH.transpose(0, 2, 1, 3),
        mask=visible_B1TS,
        scale=1.0,
        implementation=impl,
    )
    return out_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).astype(_F32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
