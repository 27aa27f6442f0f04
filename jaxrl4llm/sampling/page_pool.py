"""The paged KV cache: a pool of fixed-size pages shared by every row, per-row page tables,
reference counts, and decode attention over a row's pages: the reference (gather) and JAX's
Pallas paged attention kernel.

A row's cache is the list of pages in its table (`table_SM`, M = pages of the longest row);
logical slot l of the row lives in page table[l // page_size] at offset l % page_size, and a
row's logical slot is its token's RoPE position (the prompt stored from slot 0, no padding).
Entries past the row's pages hold SCRATCH (= num_pages): a page no row owns, where the
writes of free slots land and which attention never reads unmasked.

Pages are allocated as a row grows and returned when it ends. A page's reference count is the
number of tables holding it: the G samples of a prompt hold the same full prompt pages (the
prompt is stored once); the last partial prompt page, which each sample goes on writing, is
copied per sample at admission (copy-on-write done eagerly). A page is free when its count is
0.

Layout: per layer keys and values [K, num_pages + 1, page_size, H] each, the layout of JAX's
Pallas paged attention kernel for TPU (jax.experimental.pallas.ops.tpu.paged_attention), so the
same pool serves that kernel (pallas_attention) and the gather reference (reference_attention).
"""

from __future__ import annotations

import contextlib
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig

# Tokens per page. 16 as in vLLM's default block: small enough that a row's last page wastes
# little, large enough that a table stays short.
PAGE_SIZE = 16
# Pages the Pallas kernel reads per step: 128 tokens of 16-token pages.
PAGES_PER_BLOCK = 8


class PagePool(flax.struct.PyTreeNode):
    """Per-layer keys and values [K, num_pages + 1, page_size, H] (page num_pages: SCRATCH)
    and the reference counts refs_N [num_pages] (0: free)."""

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    refs_N: jax.Array

    @property
    def num_pages(self) -> int:
        return self.refs_N.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[2]

    def num_free(self) -> jax.Array:
        return jnp.sum(self.refs_N == 0, dtype=jnp.int32)


def init_pool(config: ModelConfig, num_pages: int, page_size: int, dtype: Any) -> PagePool:
    """An empty pool: zero pages, every one free."""
    shape = (config.num_kv_heads, num_pages + 1, page_size, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))  # noqa: E731
    return PagePool(k_pages=zeros(), v_pages=zeros(), refs_N=jnp.zeros((num_pages,), jnp.int32))


def pages_for(tokens: Any, page_size: int) -> Any:
    """Pages that hold `tokens` tokens (ceil)."""
    return -(-tokens // page_size)


def first_free(refs_N: jax.Array, n: int) -> jax.Array:
    """The first `n` free pages in index order, SCRATCH (= num_pages) past the free ones."""
    return jnp.nonzero(refs_N == 0, size=n, fill_value=refs_N.shape[0])[0].astype(jnp.int32)


def take_free(refs_N: jax.Array, need_X: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The next free page for each True entry of need_X (bool [X], in order; SCRATCH where
    none is needed or none is left) and refs_N holding them."""
    X = need_X.shape[0]
    free_X = first_free(refs_N, X)
    pages_X = jnp.where(need_X, free_X[jnp.clip(jnp.cumsum(need_X) - 1, 0, X - 1)], refs_N.shape[0])
    return pages_X, hold(refs_N, pages_X)


def hold(refs_N: jax.Array, pages: jax.Array, count: Any = 1) -> jax.Array:
    """refs_N with `count` more references to each of `pages` (SCRATCH entries ignored)."""
    return refs_N.at[pages.reshape(-1)].add(count, mode="drop")


def release(refs_N: jax.Array, table_SM: jax.Array, rows_S: jax.Array) -> jax.Array:
    """refs_N with the references of the tables of `rows_S` (bool [S]) dropped."""
    pages = jnp.where(rows_S[:, None], table_SM, refs_N.shape[0])
    return refs_N.at[pages.reshape(-1)].add(-1, mode="drop")


def write_tokens(
    pages_KNPH: jax.Array, page_S: jax.Array, offset_S: jax.Array, x_SKH: jax.Array
) -> jax.Array:
    """One layer's key (or value) pages with token i's heads at (page_S[i], offset_S[i])."""
    x_SKH = x_SKH.astype(pages_KNPH.dtype)
    if not _no_scatter(pages_KNPH):
        return pages_KNPH.at[:, page_S, offset_S].set(jnp.swapaxes(x_SKH, 0, 1))

    page_S, offset_S = jnp.asarray(page_S), jnp.asarray(offset_S)

    def one(i: jax.Array, pages: jax.Array) -> jax.Array:
        at = (0, page_S[i], offset_S[i], 0)
        return jax.lax.dynamic_update_slice(pages, x_SKH[i][:, None, None], at)

    return jax.lax.fori_loop(0, page_S.shape[0], one, pages_KNPH)


def write_pages(pages_KNPH: jax.Array, page_M: jax.Array, x_KMPH: jax.Array) -> jax.Array:
    """One layer's key (or value) pages with page page_M[m] holding x_KMPH[:, m]."""
    x_KMPH = x_KMPH.astype(pages_KNPH.dtype)
    if not _no_scatter(pages_KNPH):
        return pages_KNPH.at[:, page_M].set(x_KMPH)

    page_M = jnp.asarray(page_M)

    def one(m: jax.Array, pages: jax.Array) -> jax.Array:
        page = jax.lax.dynamic_slice_in_dim(x_KMPH, m, 1, 1)
        return jax.lax.dynamic_update_slice_in_dim(pages, page, page_M[m], 1)

    return jax.lax.fori_loop(0, page_M.shape[0], one, pages_KNPH)


def _no_scatter(pages_KNPH: jax.Array) -> bool:
    """Pages written one at a time (dynamic_update_slice, in place) instead of by one
    scatter: XLA:CPU has no 16-bit float scatter; it converts the whole operand to float32,
    scatters and converts back, so a write into a bfloat16 pool held two float32 copies of
    it (the planner, which compiles TPU and GPU runs on the CPU, counted them: 25 GB of a 7B
    rollout). A 16-bit float pool on the CPU is the planner's case (the CPU's own runs keep
    float32 caches: decode.cache_dtype_for)."""
    dtype = pages_KNPH.dtype
    return (
        parallel.backend() == "cpu" and dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
    )


def gather_keys(k_pages_KNPH: jax.Array, table_SM: jax.Array) -> jax.Array:
    """The rows' keys as one dense array [S, K, H, M * page_size], the layout the attention
    einsum takes as stored (the reference path copies every row's whole table)."""
    K, _, P, H = k_pages_KNPH.shape
    S, M = table_SM.shape
    return k_pages_KNPH[:, table_SM].transpose(1, 0, 4, 2, 3).reshape(S, K, H, M * P)


def gather_values(v_pages_KNPH: jax.Array, table_SM: jax.Array) -> jax.Array:
    """The rows' values as one dense array [S, K, M * page_size, H]."""
    K, _, P, H = v_pages_KNPH.shape
    S, M = table_SM.shape
    return v_pages_KNPH[:, table_SM].transpose(1, 0, 2, 3, 4).reshape(S, K, M * P, H)


def reference_attention(
    q_SNH: jax.Array,
    k_pages_KNPH: jax.Array,
    v_pages_KNPH: jax.Array,
    table_SM: jax.Array,
    length_S: jax.Array,
) -> jax.Array:
    """Decode attention of one query per row over its first length_S[i] logical slots, read
    from its pages: softmax(q k) v per head (q pre-scaled, as the kernel takes it), GQA heads
    grouped on their kv head, float32 scores. [S, N, H] in q's dtype. The reference the Pallas
    kernel is tested against (tests/sampling/test_paged.py)."""
    S, N, H = q_SNH.shape
    k_SKHL = gather_keys(k_pages_KNPH, table_SM)
    v_SKLH = gather_values(v_pages_KNPH, table_SM)
    K, L = k_SKHL.shape[1], k_SKHL.shape[3]
    q_SKGH = q_SNH.reshape(S, K, N // K, H)
    scores = jnp.einsum("skgh,skhl->skgl", q_SKGH, k_SKHL, preferred_element_type=jnp.float32)
    visible_SL = jnp.arange(L)[None, :] < length_S[:, None]
    scores = jnp.where(visible_SL[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_SKLH.dtype)
    out = jnp.einsum("skgl,sklh->skgh", probs, v_SKLH, preferred_element_type=jnp.float32)
    return out.reshape(S, N, H).astype(q_SNH.dtype)


def pallas_attention(
    q_SNH: jax.Array,
    k_pages_KNPH: jax.Array,
    v_pages_KNPH: jax.Array,
    table_SM: jax.Array,
    length_S: jax.Array,
    pages_per_block: int = PAGES_PER_BLOCK,
) -> jax.Array:
    """reference_attention by JAX's Pallas paged attention kernel: it reads only a row's
    filled pages, `pages_per_block` at a time (the table padded with SCRATCH to a multiple
    of them). A row of length 0 reads its first slot (the kernel skips empty rows and leaves
    their output unset). On TPU; elsewhere in the Pallas TPU interpreter (tests). It reads
    keys and values as bfloat16 (float32 pages are rounded) and computes in float32, so on
    float32 pages it agrees with the float32 reference to ~1e-2 on unit-scale inputs."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    M = table_SM.shape[1]
    block = min(pages_per_block, M)
    scratch = k_pages_KNPH.shape[1] - 1
    table_SM = jnp.pad(table_SM, ((0, 0), (0, -M % block)), constant_values=scratch)
    on_tpu = parallel.backend() == "tpu"
    with contextlib.nullcontext() if on_tpu else pltpu.force_tpu_interpret_mode():
        return paged_attention(
            q_SNH,
            k_pages_KNPH,
            v_pages_KNPH,
            jnp.maximum(length_S, 1).astype(jnp.int32),
            table_SM.astype(jnp.int32),
            pages_per_compute_block=block,
        )


def pool_pages_for(rows: int, prompt_len: int, max_new_tokens: int, page_size: int) -> int:
    """Pages of `rows` full-length rows (prompt + completion), each in its own pages: the pool
    that holds the same KV as a fixed batch of `rows` rows."""
    return rows * pages_for(prompt_len + max_new_tokens, page_size)


def min_pool_pages(prompt_len: int, max_new_tokens: int, group: int, page_size: int) -> int:
    """The smallest pool that holds one group at full length (its prompt's pages once, then
    a private page per row for the prompt's last partial page and the completion)."""
    per_row = 1 + pages_for(max_new_tokens, page_size)
    return pages_for(prompt_len, page_size) + group * per_row


def pool_pages(
    tokens: int, rows: int, prompt_len: int, max_new_tokens: int, group: int, decode_rows: int = 0
) -> int:
    """The page pool of a bucket of `rows` rows of `prompt_len`-token prompts: `tokens` in
    pages of PAGE_SIZE, or with 0 the most the rows can hold at once, so that no row is ever
    preempted: every row at full length, or, when at most S = `decode_rows` of them decode at
    once (0: all), S rows at full length in as many groups as can be live (a group is
    admitted whole, so S - G + 1: S - G groups down to one row and a new one), each group's
    prompt pages once; at least one group at full length (min_pool_pages)."""
    pages = tokens // PAGE_SIZE
    if not pages:
        pages = pool_pages_for(rows, prompt_len, max_new_tokens, PAGE_SIZE)
        live = max(group, min(decode_rows or rows, rows) // group * group)
        if live < rows:
            prompt = pages_for(prompt_len, PAGE_SIZE)
            row = 1 + pages_for(max_new_tokens, PAGE_SIZE)
            pages = min(pages, (live - group + 1) * prompt + live * row)
    return max(pages, min_pool_pages(prompt_len, max_new_tokens, group, PAGE_SIZE))
