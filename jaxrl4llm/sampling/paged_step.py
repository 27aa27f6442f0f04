"""The paged engine's decode step (sampling/paged.py): one token per row attending to its
row's pages of the pool (page_pool.py's gather reference), the new keys and values returned
for the caller to write."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import decode
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling.page_pool import PagePool


def paged_decode_step(
    params: Any,
    model_config: ModelConfig,
    token_S: jax.Array,
    position_S: jax.Array,
    table_SM: jax.Array,
    pool: PagePool,
    sharding: parallel.ActivationSharding | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """decode.slot_decode_step on pages: row i's token at logical slot position_S[i]
    attends to its row's slots before it, read from the pages of table_SM, and to itself
    (with a sliding window W, the last W). The pool is only read: returns (next-token logits
    [S, V], each layer's new keys [S, K, H], its new values [S, K, H]) for the caller to
    write (write_new_tokens), so a program that picks among decode steps by their shapes
    passes the pool through unchanged."""
    L = table_SM.shape[1] * pool.page_size
    key_L = jnp.arange(L)
    valid_SL = key_L[None, :] <= position_S[:, None]
    if model_config.sliding_window is not None:
        valid_SL &= key_L[None, :] > position_S[:, None] - model_config.sliding_window
    kv_fns = [
        functools.partial(
            _paged_kv,
            k_pages=k_pages,
            v_pages=v_pages,
            table_SM=table_SM,
            position_S=position_S,
            valid_SL=valid_SL,
        )
        for k_pages, v_pages in zip(pool.k_pages, pool.v_pages)
    ]
    logits_SV, new = decode.one_token_pass(
        params, model_config, token_S, position_S, kv_fns, sharding
    )
    ks, vs = zip(*new)
    return logits_SV, tuple(ks), tuple(vs)


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
    reference path), the new token's key and value placed in that copy at its slot."""
    S = position_S.shape[0]
    rows = jnp.arange(S)
    keys = pages_lib.gather_keys(k_pages, table_SM)
    values = pages_lib.gather_values(v_pages, table_SM)
    keys = keys.at[rows, :, :, position_S].set(k_SKH1[..., 0].astype(keys.dtype), mode="drop")
    values = values.at[rows, :, position_S].set(v_SK1H[:, :, 0].astype(values.dtype), mode="drop")
    return keys, values, valid_SL, keys.shape[-1] - 1, (k_SKH1[..., 0], v_SK1H[:, :, 0])
