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
(keys = prefix ++ row, offset = prefix length).

The window counts positions (RoPE's), p_s > p_t - W. Plain rows are a left-padded prompt
followed by contiguous real tokens, so there a distance in slots is a distance in positions
between any two real tokens, and the slots serve. Packed rows pass each slot's position
(`positions_BS`): a completion packed after its group's earlier completions is further from
the shared prompt in slots than in positions (masks.py's docstring).

  reference  the whole [B, K, G, T, S] score matrix: fastest for short contexts and for the
             sampler's one-query decode steps.
  chunked    online softmax (flash attention in plain jnp, chunked_attention.py): a map
             over query blocks, a scan over key blocks, and a custom VJP that recomputes
             each block's scores in the backward pass, so forward and backward hold one
             [bq, bk] block of scores and O(T * H) state; remat-friendly. It computes only
             the block pairs that hold a visible pair (masks.block_visibility: past the
             causal diagonal, outside the window, between packed rows' segments nothing is
             computed). The default on CPU and wherever no kernel fits; on packed rows from
             two blocks of `packed_block` up.
  splash     the Pallas TPU splash-attention kernel (causal mask with an offset, segment ids
             for padding), per device under shard_map. Its segment ids are equality only:
             prefix segments run the chunked path instead ("auto") or are refused. Its
             window counts slots, which on packed rows without prefixes are positions
             (each segment's positions run on one per slot).
  cudnn      jax.nn.dot_product_attention's cuDNN flash kernel on GPU (bf16/fp16), per device
             under shard_map. "xla" runs the same call with XLA's implementation (tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.models import chunked_attention
from jaxrl4llm.models.masks import MASKED as MASKED
from jaxrl4llm.models.masks import block_visibility as block_visibility
from jaxrl4llm.models.masks import is_segmented as is_segmented
from jaxrl4llm.models.masks import query_segments as query_segments
from jaxrl4llm.models.masks import row_block_visibility as row_block_visibility
from jaxrl4llm.models.masks import visible_mask as visible_mask

_F32 = jnp.float32
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
        self,
        num_queries: int,
        num_keys: int,
        head_dim: int,
        dtype: Any,
        segmented: bool = False,
        prefixed: bool = False,
    ) -> str:
        """The implementation that runs: `segmented` for segment ids (packed rows),
        `prefixed` with prefix segments too (splash cannot take them: chunked instead)."""
        if self.impl != "auto":
            return self.impl
        min_keys = 2 * self.packed_block if segmented else self.min_chunked_keys
        if num_queries == 1 or num_keys < min_keys:
            return "reference"
        backend = parallel.backend()
        if backend == "tpu" and head_dim % 128 == 0:
            return "chunked" if prefixed else "splash"
        if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
            return "cudnn"
        return "chunked"


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
    positions_BS: jax.Array | None = None,
) -> jax.Array:
    """Attention of queries [B, T, N, H] over keys [B, K, H, S] / values [B, K, S, H];
    q heads n*G .. n*G+G-1 share kv head n. Returns [B, T, N*H] float32. `window`: the
    sliding window W (None: full causal attention), static. `query_prefix_BT` (segment ids
    only): each query's prefix segment, which it sees beside its own (module docstring).
    `positions_BS`: each key slot's position, by which the window counts (packed rows;
    needed with prefix segments and a window); None: the slot.

    Matmuls run in the keys' dtype with float32 accumulation; softmax is float32.
    """
    B, T, N, H = q_BTNH.shape
    K, S = k_BKHS.shape[1], k_BKHS.shape[3]
    q_BKGTH = (q_BTNH.reshape(B, T, K, N // K, H) * (H**-0.5)).transpose(0, 2, 3, 1, 4)
    q_BKGTH = q_BKGTH.astype(k_BKHS.dtype)
    segmented = is_segmented(key_valid_BS)
    impl = config.resolve(T, S, H, k_BKHS.dtype, segmented, query_prefix_BT is not None)
    _check_packed(impl, window, query_prefix_BT, positions_BS)
    if impl == "reference":
        visible_BTS = visible_mask(key_valid_BS, T, offset, window, query_prefix_BT, positions_BS)
        out = _reference(q_BKGTH, k_BKHS, v_BKSH, visible_BTS)
    elif impl == "chunked":
        rows = _chunked_rows(key_valid_BS, T, offset, query_prefix_BT, positions_BS)
        bq, bk = config.blocks(segmented)
        out = chunked_attention.chunked(
            q_BKGTH, k_BKHS, v_BKSH, *rows, min(bq, T), min(bk, S), window, config.skip_blocks
        )
    else:
        out = _per_device(
            impl,
            q_BKGTH,
            k_BKHS,
            v_BKSH,
            key_valid_BS,
            offset,
            window,
            config,
            sharding,
            query_prefix_BT,
            positions_BS,
        )
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N * H)


def _check_packed(impl: str, window: int | None, query_prefix_BT: Any, positions_BS: Any) -> None:
    if query_prefix_BT is not None and impl == "splash":
        raise ValueError(
            "attention impl 'splash' takes segment ids by equality only; packed rows "
            "with shared prompts (query_prefix_BT) need impl 'auto' or 'chunked'."
        )
    if query_prefix_BT is not None and window is not None and positions_BS is None:
        raise ValueError(
            "attention: a sliding window over packed rows with prefix segments "
            "(query_prefix_BT) counts positions, not slots: pass positions_BS."
        )


def _reference(q_BKGTH, k_BKHS, v_BKSH, visible_BTS):
    scores_BKGTS = jnp.einsum("bkgth,bkhs->bkgts", q_BKGTH, k_BKHS, preferred_element_type=_F32)
    scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, MASKED)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    return jnp.einsum(
        "bkgts,bksh->bkgth", probs_BKGTS.astype(v_BKSH.dtype), v_BKSH, preferred_element_type=_F32
    )


def _chunked_rows(
    key_valid_BS: jax.Array,
    num_queries: int,
    offset: Any,
    query_prefix_BT: jax.Array | None,
    positions_BS: jax.Array | None,
) -> chunked_attention.Rows:
    """The chunked kernel's per-row inputs; without positions_BS the window counts slots."""
    B, S = key_valid_BS.shape
    if positions_BS is None:
        positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    offset_i32 = jnp.asarray(offset, jnp.int32)
    query_ids_BT2 = query_segments(key_valid_BS, num_queries, offset_i32, query_prefix_BT)
    return key_valid_BS, query_ids_BT2, offset_i32, positions_BS.astype(jnp.int32)


# ----------------------------------------------------------------------------- kernels


def _per_device(
    impl: str,
    q_BKGTH: jax.Array,
    k_BKHS: jax.Array,
    v_BKSH: jax.Array,
    key_valid_BS: jax.Array,
    offset: Any,
    window: int | None,
    config: AttentionConfig,
    sharding: parallel.ActivationSharding | None,
    query_prefix_BT: jax.Array | None = None,
    positions_BS: jax.Array | None = None,
) -> jax.Array:
    """Runs the splash, cuDNN or XLA kernel (`impl`; each needs a static offset) per device;
    on a mesh under shard_map over batch rows and kv heads (a Pallas or cuDNN custom call is
    opaque to the SPMD partitioner, which would otherwise gather every operand onto each
    device). Splash takes (key_valid_BS,) as its rows; cuDNN / XLA also the prefix segments
    and positions, given or not."""
    if not isinstance(offset, int):
        raise ValueError(
            f"attention impl {impl!r} needs a static (int) offset; the decode "
            "step's traced cache index runs the reference implementation."
        )
    kernel = _splash if impl == "splash" else functools.partial(_dot_product, impl=impl)
    run = functools.partial(kernel, offset=offset, window=window, config=config)
    if impl == "splash":
        rows: tuple[Any, ...] = (key_valid_BS,)
    else:
        S = key_valid_BS.shape[1]
        if query_prefix_BT is None:
            query_prefix_BT = query_segments(key_valid_BS, q_BKGTH.shape[3], offset)[..., 1]
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), key_valid_BS.shape)
        rows = (key_valid_BS, query_prefix_BT, positions_BS)
    if sharding is None:
        return run(q_BKGTH, k_BKHS, v_BKSH, *rows)
    B, K = k_BKHS.shape[:2]
    batch = sharding.spec(("batch",), (B,))[0]
    heads = sharding.spec(("kv_heads",), (K,))[0]
    P = jax.sharding.PartitionSpec
    # Traced inside a shard_map (a batch shard's engine, sampling/paged_mesh.py), the kernel's
    # shard_map takes that context's mesh (its batch axes manual), whatever `sharding` holds.
    context = jax.sharding.get_abstract_mesh()
    return jax.shard_map(
        run,
        mesh=context if context.manual_axes else sharding.mesh,
        in_specs=(P(batch, heads), P(batch, heads), P(batch, heads)) + (P(batch),) * len(rows),
        out_specs=P(batch, heads),
        check_vma=False,
    )(q_BKGTH, k_BKHS, v_BKSH, *rows)


def _query_segments(key_valid_BS: jax.Array, T: int, offset: int, Tp: int) -> jax.Array:
    """A query's segment is its own key's validity, so every query sees at least its own key
    (the kernels need no empty rows); block-padding queries count as real (they see every
    real key before them)."""
    own = key_valid_BS[:, offset : offset + T].astype(jnp.int32)
    return jnp.pad(own, ((0, 0), (0, Tp - T)), constant_values=1)


def _splash(
    q_BKGTH: jax.Array,
    k_BKHS: jax.Array,
    v_BKSH: jax.Array,
    key_valid_BS: jax.Array,
    *,
    offset: int,
    window: int | None,
    config: AttentionConfig,
) -> jax.Array:
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
        mask, block_sizes=sizes, interpret=parallel.backend() != "tpu"
    )
    q = chunked_attention.pad_to(q_BKGTH, 3, bq)
    k = chunked_attention.pad_to(k_BKHS, 3, bk).swapaxes(2, 3)  # [B, K, Sp, H]
    v = chunked_attention.pad_to(v_BKSH, 2, bk)
    q_seg = _query_segments(key_valid_BS, T, offset, Tp)
    kv_seg = chunked_attention.pad_to(key_valid_BS.astype(jnp.int32), 1, bk)

    def one(q_GTH, k_SH, v_SH, qs, ks):
        return kernel(q_GTH, k_SH, v_SH, segment_ids=splash.SegmentIds(q=qs, kv=ks))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    out = jax.vmap(per_head)(q, k, v, q_seg, kv_seg)
    return out[:, :, :, :T].astype(_F32)


def _dot_product(
    q_BKGTH: jax.Array,
    k_BKHS: jax.Array,
    v_BKSH: jax.Array,
    key_valid_BS: jax.Array,
    query_prefix_BT: jax.Array,
    positions_BS: jax.Array,
    *,
    offset: int,
    window: int | None,
    config: AttentionConfig,
    impl: str,
) -> jax.Array:
    del config
    B, K, G, T, H = q_BKGTH.shape
    q_BTNH = q_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)
    visible_B1TS = visible_mask(key_valid_BS, T, offset, window, query_prefix_BT, positions_BS)[
        :, None
    ]
    out_BTNH = jax.nn.dot_product_attention(
        q_BTNH,
        k_BKHS.transpose(0, 3, 1, 2),
        v_BKSH.transpose(0, 2, 1, 3),
        mask=visible_B1TS,
        scale=1.0,
        implementation="cudnn" if impl == "cudnn" else "xla",  # (impl is one of the two)
    )
    return out_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).astype(_F32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
