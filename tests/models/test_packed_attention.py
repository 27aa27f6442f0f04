"""Packed rows: several sequences in one row with segment ids and positions restarting per
sequence give each sequence's hidden states (and gradients) as if it ran alone, in every
attention implementation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.models import attention as A
from jaxrl4llm.models import kv_cache, masks
from jaxrl4llm.models import transformer as T
from jaxrl4llm.models.config import TINY

CFG = dataclasses.replace(
    TINY,
    vocab_size=96,
    attention_bias=True,
    qk_norm=True,
    tie_word_embeddings=False,
    model_type="qwen2",
)
# Row 0 holds three sequences and 2 slots of padding, row 1 one sequence and 7 of padding.
ROWS = [[5, 3, 6], [9]]
L = 16
# The splash kernel runs in the Pallas interpreter on CPU (minutes): one case of it.
IMPLS = [
    (A.AttentionConfig("reference"), None),
    (A.AttentionConfig("chunked", 4, 4, 0, packed_block=4), None),
    (A.AttentionConfig("chunked", 4, 4, 0, packed_block=3), 4),
    (A.AttentionConfig("chunked", 4, 4, 0, packed_block=4, skip_blocks=False), None),
    (A.AttentionConfig("xla"), 4),
    (A.AttentionConfig("splash", 128, 128), 4),
]


def _sequences():
    rng = np.random.default_rng(0)
    return [[rng.integers(2, CFG.vocab_size, n) for n in row] for row in ROWS]


def _packed(seqs):
    tokens, positions, segments = (np.zeros((len(ROWS), L), np.int32) for _ in range(3))
    for r, row in enumerate(seqs):
        start = 0
        for i, s in enumerate(row):
            tokens[r, start : start + len(s)] = s
            positions[r, start : start + len(s)] = np.arange(len(s))
            segments[r, start : start + len(s)] = i + 1
            start += len(s)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)


@pytest.mark.parametrize("attention,window", IMPLS, ids=lambda x: str(getattr(x, "impl", x)))
def test_packed_rows_equal_each_sequence_alone(attention, window):
    cfg = dataclasses.replace(CFG, sliding_window=window)
    params = T.init_params(cfg, jax.random.key(0))
    seqs = _sequences()
    tokens, positions, segments = _packed(seqs)
    weights = jnp.asarray(
        np.random.default_rng(1).normal(size=(len(ROWS), L, cfg.hidden_size)), jnp.float32
    )

    def packed_loss(p):
        h, _ = T.hidden_states(
            p, cfg, tokens, positions, segments > 0, attention=attention, segment_ids_BT=segments
        )
        return jnp.sum(jnp.where(segments[..., None] > 0, h * weights, 0.0)), h

    (loss, h), grads = jax.jit(jax.value_and_grad(packed_loss, has_aux=True))(params)

    def alone_loss(p):
        # Each sequence as its own unpadded row, the plain (bool mask) reference path.
        total, hs = 0.0, []
        for r, row in enumerate(seqs):
            start = 0
            for s in row:
                ids = jnp.asarray(s, jnp.int32)[None]
                h1, _ = T.hidden_states(
                    p, cfg, ids, jnp.arange(len(s))[None], jnp.ones_like(ids, bool)
                )
                total += jnp.sum(h1[0] * weights[r, start : start + len(s)])
                hs.append(h1[0])
                start += len(s)
        return total, hs

    (loss_alone, hs_alone), grads_alone = jax.jit(jax.value_and_grad(alone_loss, has_aux=True))(
        params
    )
    seg = np.asarray(segments)
    got = [np.asarray(h)[r][seg[r] == i + 1] for r, row in enumerate(ROWS) for i in range(len(row))]
    for a, b in zip(got, hs_alone):
        np.testing.assert_allclose(a, np.asarray(b), atol=2e-5)
    np.testing.assert_allclose(float(loss), float(loss_alone), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_alone)):
        assert float(jnp.abs(a - b).max()) <= 2e-5 * max(float(jnp.abs(b).max()), 1e-6)


def test_segments_keep_queries_to_their_own_sequence():
    """The mask by hand: row [1 1 2 2 2 0], self-attention."""
    seg = jnp.asarray([[1, 1, 2, 2, 2, 0]], jnp.int32)
    visible = np.asarray(masks.visible_mask(seg, 6, 0))[0].astype(int)
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 0],
        ]
    )
    np.testing.assert_array_equal(visible, expected)


def test_block_visibility_by_hand():
    """Blocks of 4 over a row of three 4-slot segments: alone, each query block sees only its
    own key block; as a prefix and two members, the second member's block also sees the
    prefix's and never the first member's."""
    seg = np.repeat(np.array([[1, 2, 3]], np.int32), 4, axis=1)
    alone = np.stack([seg, seg], axis=-1)
    shared = np.stack([seg, np.ones_like(seg)], axis=-1)
    for xp in (np, jnp):
        visibility = functools.partial(masks.row_block_visibility, xp.asarray(seg), xp=xp)
        table = visibility(xp.asarray(alone), 0, 4, 4, None)
        np.testing.assert_array_equal(np.asarray(table)[0], np.eye(3, dtype=bool))
        table = visibility(xp.asarray(shared), 0, 4, 4, None)
        np.testing.assert_array_equal(
            np.asarray(table)[0], np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
        )


def test_block_visibility_keeps_a_prefix_seen_by_queries_outside_any_segment():
    """Queries 4-7 have no segment of their own (0) but prefix segment 1: they see keys 0-3,
    so their block needs key block 0 (masks.visible_mask's rule)."""
    seg = np.array([[1, 1, 1, 1, 0, 0, 0, 0]], np.int32)
    ids = np.stack([seg, np.ones_like(seg)], axis=-1)
    assert np.asarray(masks.visible_mask(jnp.asarray(seg), 8, 0, None, jnp.ones((1, 8))))[
        0, 4:, :4
    ].all()
    table = masks.row_block_visibility(seg, ids, 0, 4, 4, None, xp=np)
    np.testing.assert_array_equal(table[0], np.array([[1, 0], [1, 0]], bool))


def test_window_counts_positions_on_a_shared_prompt_by_hand():
    """A prefix of 3 (positions 0-2) and two members of 2 (positions 3-4 each), window 3:
    the second member's first query (slot 5, position 3) sees prefix positions 1-2, four
    and three slots back; by slots it would see none of them."""
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 3]], jnp.int32)
    pre = jnp.asarray([[1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 3, 4, 3, 4]], jnp.int32)
    visible = np.asarray(masks.visible_mask(seg, 7, 0, 3, pre, pos))[0].astype(int)
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1, 0, 0],
            [0, 1, 1, 0, 0, 1, 0],
            [0, 0, 1, 0, 0, 1, 1],
        ]
    )
    np.testing.assert_array_equal(visible, expected)
    # Blocks of 2: query block 2 (slots 4-5) needs key block 0 (slot 1, position 1) and
    # block 3 (slot 6) key block 1 (slot 2); by slots neither would be computed.
    ids = np.stack([np.asarray(seg), np.asarray(pre)], axis=-1)
    table = masks.row_block_visibility(np.asarray(seg), ids, 0, 2, 2, 3, xp=np, positions_BS=pos)
    assert table[0, 2, 0] and table[0, 3, 1]
    by_slots = masks.row_block_visibility(np.asarray(seg), ids, 0, 2, 2, 3, xp=np)
    assert not by_slots[0, 2, 0]
    with pytest.raises(ValueError, match="pass positions_BS"):
        q = jnp.ones((1, 7, 2, 4))
        k, v = jnp.ones((1, 1, 4, 7)), jnp.ones((1, 1, 7, 4))
        A.attention(q, k, v, seg, 0, A.AttentionConfig("reference"), window=3, query_prefix_BT=pre)


def _random_packed_row(rng, L):
    """One packed row as the packer lays it out: units of an optional prefix segment and
    member segments (seeing the prefix, their positions continuing the prefix's), then
    padding. Returns (segments, prefixes, positions)."""
    seg, pre, pos = (np.zeros(L + 40, np.int32) for _ in range(3))
    col, s = 0, 0
    while col < L - 2:
        shared, first = 0, 0
        if rng.random() < 0.5:
            n = int(rng.integers(1, 6))
            s += 1
            seg[col : col + n], pre[col : col + n], shared = s, s, s
            pos[col : col + n], first = np.arange(n), n
            col += n
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(1, 9))
            s += 1
            seg[col : col + n], pre[col : col + n] = s, shared or s
            pos[col : col + n] = first + np.arange(n)
            col += n
    return seg[:L], pre[:L], pos[:L]


@pytest.mark.parametrize("bq,bk,window", [(4, 4, None), (3, 5, None), (4, 4, 6), (8, 2, 3)])
def test_block_visibility_never_skips_a_visible_pair(bq, bk, window):
    """Against the explicit mask (visible_mask) on random packed rows: every block pair that
    holds a visible (query, key) pair is marked, and numpy and jax.numpy agree; the window
    counting slots (rows without prefixes) or positions (any row)."""
    rng = np.random.default_rng(bq * 10 + bk)
    L = 29
    for i in range(20):
        seg, pre, pos = (np.stack(x) for x in zip(*(_random_packed_row(rng, L) for _ in range(3))))
        if i % 2:  # by slots: the rows' own segments only, no prefixes
            pre, pos = seg, None
        mask = np.asarray(
            masks.visible_mask(
                jnp.asarray(seg), L, 0, window, jnp.asarray(pre), None if pos is None else pos
            )
        )
        if window is not None and pos is not None:  # by hand: p_s > p_t - W where visible
            assert (pos[:, None, :] > pos[:, :, None] - window)[mask].all()
        padded = np.zeros((3, -(-L // bq) * bq, -(-L // bk) * bk), bool)
        padded[:, :L, :L] = mask
        needed = padded.reshape(3, -(-L // bq), bq, -(-L // bk), bk).any(axis=(2, 4))
        ids = np.stack([seg, pre], axis=-1)
        table = masks.row_block_visibility(seg, ids, 0, bq, bk, window, xp=np, positions_BS=pos)
        assert not (needed & ~table).any()
        assert table.sum() < table.size  # the causal half at least is skipped
        on_device = masks.row_block_visibility(
            jnp.asarray(seg),
            jnp.asarray(ids),
            0,
            bq,
            bk,
            window,
            positions_BS=None if pos is None else jnp.asarray(pos),
        )
        np.testing.assert_array_equal(np.asarray(on_device), table)


def test_segment_ids_refuse_a_kv_cache():
    params = T.init_params(CFG, jax.random.key(0))
    ids = jnp.ones((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids_BT"):
        T.hidden_states(
            params, CFG, ids, ids, ids > 0, kv_cache.init_kv_cache(CFG, 1, 4), 0, segment_ids_BT=ids
        )
