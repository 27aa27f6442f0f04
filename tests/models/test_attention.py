"""Attention implementations against a float64 numpy softmax: chunked online softmax (forward
and its custom backward), the Pallas splash kernel (interpret mode on CPU), the
dot_product_attention call, padding masks, GQA, offsets, sliding windows, sharded under a
mesh."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.models import attention as A
from jaxrl4llm.models import masks
from jaxrl4llm.models import transformer as T
from jaxrl4llm.models.config import TINY

B, N, K, H = 3, 4, 2, 16


def _inputs(Tq, S, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Tq, N, H)).astype(np.float32)
    k = rng.standard_normal((B, K, H, S)).astype(np.float32)
    v = rng.standard_normal((B, K, S, H)).astype(np.float32)
    # Left padding of 0, 4 and S-2 slots; row 1 also has two masked slots in the middle.
    valid = np.arange(S)[None] >= np.array([0, 4, S - 2])[:, None]
    valid[1, 6:8] = False
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(valid))


def _numpy_attention(q, k, v, valid, offset, window=None):
    """softmax(q k^T / sqrt(H)) v per head in float64; query t sees valid keys s <= t+offset,
    and with a window W only the W slots t+offset-W < s <= t+offset."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    Tq, S = q.shape[1], k.shape[3]
    distance = np.arange(Tq)[:, None] + offset - np.arange(S)[None, :]
    causal = (distance >= 0) & (distance < (S + Tq + offset if window is None else window))
    visible = np.asarray(valid)[:, None, :] & causal[None]
    out = np.zeros((B, Tq, N, H))
    for n in range(N):
        kv = n // (N // K)
        s = np.einsum("bth,bhs->bts", q[:, :, n], k[:, kv]) / np.sqrt(H)
        s = np.where(visible, s, -np.inf)
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(-1, keepdims=True))
            p = p / p.sum(-1, keepdims=True)
        out[:, :, n] = np.einsum("bts,bsh->bth", p, v[:, kv])
    # Rows that see no key at all are pads: their value is unused, so it is not compared.
    return out.reshape(B, Tq, N * H), visible.any(-1)


CASES = [(9, 9, 0), (5, 13, 8), (7, 12, 3)]  # self-attention, shared prefix of 8, a cache
WINDOWS = [None, 3]  # full causal, a sliding window of 3 slots
_run = jax.jit(A.attention, static_argnames=("offset", "config", "sharding", "window"))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("Tq,S,offset", CASES)
def test_chunked_forward_equals_the_softmax(Tq, S, offset, window):
    q, k, v, valid = _inputs(Tq, S)
    expected, seen = _numpy_attention(q, k, v, valid, offset, window)
    for blocks in ((4, 4), (3, 5), (64, 64)):  # several blocks, ragged, one block
        config = A.AttentionConfig("chunked", *blocks)
        out = _run(q, k, v, valid, offset=offset, config=config, window=window)
        np.testing.assert_allclose(np.asarray(out)[seen], expected[seen], atol=1e-5)
        assert np.isfinite(np.asarray(out)).all()
    ref = A.attention(q, k, v, valid, offset, A.AttentionConfig("reference"), window=window)
    np.testing.assert_allclose(np.asarray(ref)[seen], expected[seen], atol=1e-5)


def test_window_keeps_the_query_and_the_slots_before_it():
    """Query slot p sees p - W < s <= p (transformers: kv_idx > q_idx - sliding_window), and
    a window at least as long as the keys masks nothing."""
    valid = jnp.ones((1, 6), bool)
    visible = np.asarray(masks.visible_mask(valid, 3, 3, window=2))[0]
    assert visible.tolist() == [
        [False, False, True, True, False, False],
        [False, False, False, True, True, False],
        [False, False, False, False, True, True],
    ]
    np.testing.assert_array_equal(
        masks.visible_mask(valid, 3, 3, window=6), masks.visible_mask(valid, 3, 3)
    )


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("Tq,S,offset", CASES[1:])
def test_chunked_gradients_equal_the_reference(Tq, S, offset, window):
    q, k, v, valid = _inputs(Tq, S, seed=1)
    seen = np.asarray(masks.visible_mask(valid, Tq, offset, window).any(-1))
    w = jnp.asarray(np.random.default_rng(2).standard_normal((B, Tq, N * H)), jnp.float32)

    def loss(q, k, v, impl):
        out = A.attention(q, k, v, valid, offset, A.AttentionConfig(impl, 4, 3), window=window)
        return jnp.sum(jnp.where(seen[..., None], out * w, 0.0))  # pads carry no gradient

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    for a, b in zip(grad(q, k, v, "reference"), grad(q, k, v, "chunked")):
        assert float(jnp.abs(a).max()) > 0.1
        np.testing.assert_allclose(b, a, atol=1e-5)


def test_chunked_bfloat16_tracks_float32():
    q, k, v, valid = _inputs(6, 11, seed=3)
    ref = A.attention(q, k, v, valid, 5, A.AttentionConfig("reference"))
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = A.attention(*bf, valid, 5, A.AttentionConfig("chunked", 4, 4))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=0.05)


def test_auto_picks_the_reference_for_decode_and_short_contexts():
    config = A.AttentionConfig()
    assert config.resolve(1, 100_000, 128, jnp.bfloat16) == "reference"  # decode step
    assert config.resolve(64, 200, 64, jnp.float32) == "reference"
    assert config.resolve(4096, 4096, 64, jnp.float32) == "chunked"  # CPU, long
    with pytest.raises(ValueError, match="impl"):
        A.AttentionConfig("flash3")


@pytest.mark.parametrize("window", [None, 20])
def test_splash_kernel_equals_the_softmax_in_interpret_mode(window):
    """The TPU kernel's own code, run by the Pallas interpreter on CPU: layout, GQA, segment
    ids for padding, the causal offset of a shared prefix, block padding, the sliding window
    and gradients."""
    Tq, S, offset = 100, 160, 60
    q, k, v, valid = _inputs(Tq, S, seed=4)
    expected, seen = _numpy_attention(q, k, v, valid, offset, window)
    config = A.AttentionConfig("splash", 128, 128)
    out = _run(q, k, v, valid, offset=offset, config=config, window=window)
    np.testing.assert_allclose(np.asarray(out)[seen], expected[seen], atol=1e-5)

    def loss(q, k, v, config):
        out = A.attention(q, k, v, valid, offset, config, window=window)
        return jnp.sum(jnp.where(seen[..., None], out, 0.0) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    for a, b in zip(grad(q, k, v, A.AttentionConfig("reference")), grad(q, k, v, config)):
        np.testing.assert_allclose(b, a, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("window", WINDOWS)
def test_dot_product_attention_call_on_a_mesh_equals_the_softmax(window):
    """The cuDNN path's call (layout, mask, scale, shard_map over rows and kv heads) with
    XLA's implementation, which runs on CPU."""
    Tq, S, offset = 7, 12, 3
    q, k, v, valid = _inputs(Tq, S, seed=5)
    expected, seen = _numpy_attention(q, k, v, valid, offset, window)
    mesh = parallel.make_mesh("data:1,fsdp:4,tensor:2")
    sharding = parallel.ActivationSharding(mesh)
    q4 = jnp.concatenate([q, q[:1]])  # 4 rows: split over fsdp=4
    args = [jnp.concatenate([x, x[:1]]) for x in (k, v, valid)]
    for s in (None, sharding):
        out = _run(
            q4, *args, offset=offset, config=A.AttentionConfig("xla"), sharding=s, window=window
        )
        np.testing.assert_allclose(np.asarray(out)[:B][seen], expected[seen], atol=1e-5)


CFG = dataclasses.replace(
    TINY,
    vocab_size=96,
    attention_bias=True,
    qk_norm=True,
    tie_word_embeddings=False,
    model_type="qwen2",
)


@pytest.mark.parametrize("window", [None, 4])
def test_model_paths_with_chunked_attention_equal_the_reference(window):
    """hidden_states_shared_prefix with 3-slot blocks (values and gradients) equals the
    full-score-matrix attention (its prefix pass is the plain self-attention path)."""
    cfg = dataclasses.replace(CFG, sliding_window=window)
    params = T.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(6)
    G, group, P, Tc = 2, 2, 7, 6
    prefix = jnp.asarray(rng.integers(0, CFG.vocab_size, (G, P)), jnp.int32)
    prefix_mask = jnp.asarray(np.arange(P)[None] >= np.array([0, 3])[:, None])
    rest = jnp.asarray(rng.integers(0, CFG.vocab_size, (G * group, Tc)), jnp.int32)
    rest_mask = jnp.asarray(np.arange(Tc)[None] < np.array([6, 2, 4, 1])[:, None])
    chunked = A.AttentionConfig("chunked", 3, 3, 0)
    reference = A.AttentionConfig("reference")

    def loss(p, attention):
        hp, hc = T.hidden_states_shared_prefix(
            p, cfg, prefix, prefix_mask, rest, rest_mask, group=group, attention=attention
        )
        return jnp.sum(jnp.where(rest_mask[..., None], hc, 0.0) ** 2) + jnp.sum(
            jnp.where(prefix_mask[..., None], hp, 0.0) ** 2
        )

    run = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (l_ref, g_ref), (l_chunk, g_chunk) = run(params, reference), run(params, chunked)
    np.testing.assert_allclose(l_chunk, l_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_chunk)):
        # The loss is ~1e3, its gradients ~1e1: compare on the scale of each leaf.
        assert float(jnp.abs(b - a).max()) <= 2e-5 * float(jnp.abs(a).max())
