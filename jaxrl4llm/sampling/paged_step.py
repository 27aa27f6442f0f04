"""The paged engine's decode step (sampling/paged.py): one token per row attending to its
row's pages of the pool, by one of two implementations (`uses_kernel`):

  reference  page_pool's gather: each row's whole table prefix copied as dense keys and
             values; the pool is only read and the new keys and values are returned for the
             caller to write (CPU, GPU).
  pallas     JAX's Pallas paged attention kernel (page_pool.pallas_attention): each layer
             writes the new token's key and value into the pool, then the kernel reads only
             a row's filled pages (TPU; elsewhere in the Pallas TPU interpreter, for tests).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.models import decoder_layer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import decode
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling.page_pool import PagePool

ATTENTIONS = ("auto", "reference", "pallas")


def uses_kernel(attention: str, model_config: ModelConfig) -> bool:
    """Whether the decode step runs the Pallas kernel: "pallas" (off TPU in the Pallas
    interpreter), "reference" the gather, "auto" the kernel on TPU where it fits (head_dim a
    multiple of 128, as splash's; no sliding window: the kernel has none)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"paged attention {attention!r}: choose one of {ATTENTIONS}.")
    windowed = model_config.sliding_window is not None
    if attention == "pallas" and windowed:
        raise ValueError(
            "paged attention 'pallas': the Pallas paged attention kernel has no sliding "
            "window; this model's layers have one (use 'reference' or 'auto')."
        )
    if attention == "auto":
        tpu = parallel.backend() == "tpu"
        return tpu and not windowed and model_config.head_dim % 128 == 0
    return attention == "pallas"


def fewest_rows(max_rows: int) -> int:
    """The fewest rows a decode step computes: decode.MIN_COMPACT_ROWS (below it a step
    costs about the weights' read whatever the rows, and each level is one more compiled
    decode step)."""
    return min(max_rows, decode.MIN_COMPACT_ROWS)


# Tables of fewer pages are read whole: a quarter of them is a few pages, whose saved reads
# are worth less than another decode step to compile (the quickstart's 8-page tables took
# 12.6 s to compile with the quarter width, docs/performance.md).
WHOLE_TABLE_PAGES = 16


def widths(max_pages: int) -> tuple[int, ...]:
    """Table prefixes a decode step may read: every page, or, for tables of
    WHOLE_TABLE_PAGES or more, the first quarter (most rows of a long-tailed mix: long tables
    are sized for the longest row)."""
    if max_pages < WHOLE_TABLE_PAGES:
        return (max_pages,)
    return tuple(dict.fromkeys(max(1, -(-max_pages // d)) for d in (1, 4)))


def row_levels(max_rows: int, floor: int) -> tuple[int, ...]:
    """Rows a decode step may compute: max_rows, then steps of about 3/4 in multiples of
    `floor` down to it. Computed rows cost about their compute on CPU and halving levels
    would leave up to half of them idle; each level is one more compiled decode step."""
    sizes = [max_rows]
    while sizes[-1] > floor:
        smaller = -(-(sizes[-1] * 3 // 4) // floor) * floor
        sizes.append(max(floor, smaller if smaller < sizes[-1] else sizes[-1] - floor))
    return tuple(sizes)


def paged_decode_step(
    params: Any,
    model_config: ModelConfig,
    token_S: jax.Array,
    position_S: jax.Array,
    table_SM: jax.Array,
    pool: PagePool,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array | None]:
    """decode.slot_decode_step on pages: row i's token at logical slot position_S[i]
    attends to its row's slots before it, read from the pages of table_SM, and to itself
    (with a sliding window W, the last W). The pool is only read: returns (next-token logits
    [S, V], each layer's new keys [S, K, H], its new values [S, K, H]) for the caller to
    write (write_new_tokens), so a program that picks among decode steps by their shapes
    passes the pool through unchanged; and the fed tokens' experts [S, 1, L, K] (None in a
    dense model)."""
    L = table_SM.shape[1] * pool.page_size
    key_L = jnp.arange(L)
    valid_SL = key_L[None, :] <= position_S[:, None]
    if model_config.sliding_window is not None:
        valid_SL &= key_L[None, :] > position_S[:, None] - model_config.sliding_window
    kv_fns = _per_layer(
        _paged_kv, pool, table_SM=table_SM, position_S=position_S, valid_SL=valid_SL
    )
    return _layers(params, model_config, token_S, position_S, kv_fns, sharding)


def write_new_tokens(
    pool: PagePool,
    page_S: jax.Array,
    position_S: jax.Array,
    k_LSKH: tuple[jax.Array, ...],
    v_LSKH: tuple[jax.Array, ...],
) -> PagePool:
    """The pool with each layer's new keys and values at (page_S, position_S % page_size)."""
    offset_S = position_S % pool.page_size
    return pool.replace(
        k_pages=tuple(
            pages_lib.write_tokens(p, page_S, offset_S, k) for p, k in zip(pool.k_pages, k_LSKH)
        ),
        v_pages=tuple(
            pages_lib.write_tokens(p, page_S, offset_S, v) for p, v in zip(pool.v_pages, v_LSKH)
        ),
    )


def _paged_kv(
    k_SKH1: jax.Array,
    v_SK1H: jax.Array,
    *,
    k_pages: jax.Array,
    v_pages: jax.Array,
    table_SM: jax.Array,
    position_S: jax.Array,
    valid_SL: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, int, tuple[jax.Array, jax.Array]]:
    """apply_layer's kv_fn: the rows' pages gathered as dense keys and values (page_pool's
    reference path), the new token's key and value placed in that copy at its slot.

    The gather reads only the pool and the tables, so nothing orders it after the layers
    before this one: XLA scheduled every layer's gather at the step's start, each layer's
    dense copy live at once (as much memory again as the rows' pages; a planned 7B rollout
    on v5p did not fit). The tables read through this layer's new key (a select XLA cannot
    fold; an optimization barrier was simplified away) make the gather wait for the layer's
    input, so one layer's copy is live at a time."""
    S = position_S.shape[0]
    rows = jnp.arange(S)
    table_SM = jnp.where(jnp.isinf(k_SKH1[:, :1, 0, 0]), 0, table_SM)  # a key is never inf
    keys = pages_lib.gather_keys(k_pages, table_SM)
    values = pages_lib.gather_values(v_pages, table_SM)
    keys = keys.at[rows, :, :, position_S].set(k_SKH1[..., 0].astype(keys.dtype), mode="drop")
    values = values.at[rows, :, position_S].set(v_SK1H[:, :, 0].astype(values.dtype), mode="drop")
    return keys, values, valid_SL, keys.shape[-1] - 1, (k_SKH1[..., 0], v_SK1H[:, :, 0])


def pallas_decode_step(
    params: Any,
    model_config: ModelConfig,
    token_S: jax.Array,
    position_S: jax.Array,
    length_S: jax.Array,
    page_S: jax.Array,
    table_SM: jax.Array,
    pool: PagePool,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, PagePool, jax.Array | None]:
    """paged_decode_step by the Pallas kernel: each layer writes the rows' new keys and
    values at (page_S, position_S % page_size) (SCRATCH for rows that do not decode), then
    row i's query attends to its first length_S[i] slots (its tokens, the new one included;
    at least 1), read from the pages of table_SM. No sliding window (uses_kernel). Returns
    (next-token logits [S, V], the pool written, the fed tokens' experts [S, 1, L, K] or
    None)."""
    fns = _per_layer(
        _kernel_attend,
        pool,
        page_S=page_S,
        offset_S=position_S % pool.page_size,
        table_SM=table_SM,
        length_S=length_S,
        sharding=sharding,
    )
    attends = [decoder_layer.Attend(fn) for fn in fns]
    logits_SV, ks, vs, experts = _layers(
        params, model_config, token_S, position_S, attends, sharding
    )
    return logits_SV, pool.replace(k_pages=ks, v_pages=vs), experts


def _per_layer(fn: Any, pool: PagePool, **settings: Any) -> list[Any]:
    """fn with each layer's key and value pages and `settings` bound."""
    return [
        functools.partial(fn, k_pages=k_pages, v_pages=v_pages, **settings)
        for k_pages, v_pages in zip(pool.k_pages, pool.v_pages)
    ]


def _layers(
    params: Any,
    model_config: ModelConfig,
    token_S: jax.Array,
    position_S: jax.Array,
    fns: list[Any],
    sharding: parallel.ActivationSharding | None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array | None]:
    """decode.one_token_pass with layer l's attention by fns[l], whose aux is a (keys,
    values) pair: (logits [S, V], each layer's keys, each layer's values, the experts)."""
    logits_SV, aux, experts = decode.one_token_pass(
        params, model_config, token_S, position_S, fns, sharding
    )
    ks, vs = zip(*aux)
    return logits_SV, tuple(ks), tuple(vs), experts


def _kernel_attend(
    q_S1NH: jax.Array,
    k_SKH1: jax.Array,
    v_SK1H: jax.Array,
    *,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_S: jax.Array,
    offset_S: jax.Array,
    table_SM: jax.Array,
    length_S: jax.Array,
    sharding: parallel.ActivationSharding | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """decoder_layer.Attend's fn: the new keys and values written into the layer's pages,
    then the kernel (q scaled and cast to the pages' dtype, as attention.attention does);
    on a mesh per device under shard_map over kv heads (a Pallas call is opaque to the SPMD
    partitioner). Returns ([S, 1, N * H] float32, the layer's pages written)."""
    k_pages = pages_lib.write_tokens(k_pages, page_S, offset_S, k_SKH1[..., 0])
    v_pages = pages_lib.write_tokens(v_pages, page_S, offset_S, v_SK1H[:, :, 0])
    S, _, N, H = q_S1NH.shape
    q_SNH = (q_S1NH[:, 0] * (H**-0.5)).astype(k_pages.dtype)
    kernel = pages_lib.pallas_attention
    if sharding is not None:
        heads = sharding.spec(("kv_heads",), (k_pages.shape[0],))[0]
        P = jax.sharding.PartitionSpec
        kernel = jax.shard_map(
            kernel,
            mesh=sharding.mesh,
            in_specs=(P(None, heads), P(heads), P(heads), P(), P()),
            out_specs=P(None, heads),
            check_vma=False,
        )
    out_SNH = kernel(q_SNH, k_pages, v_pages, table_SM, length_S)
    return out_SNH.reshape(S, 1, N * H).astype(jnp.float32), (k_pages, v_pages)


def whole_logits(logits_SV: jax.Array, sharding: parallel.ActivationSharding | None) -> jax.Array:
    """The logits whole on each device of a row's shard before sampling (the paged engines',
    single- and multi-turn): from vocabulary-split logits, top-k's cut-off is a collective
    permute, which CPU's runtime joins over every device, deadlocking batch shards whose
    loops run different step counts (paged_mesh.py)."""
    return parallel.constrain(logits_SV, ("batch", None), sharding)
