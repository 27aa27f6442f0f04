"""The pure decoder: KV cache == full forward (with and without a sliding window), masking,
remat, bf16, sharded == unsharded."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.models import decoder_layer, kv_cache
from jaxrl4llm.models import transformer as T
from jaxrl4llm.models.config import TINY, RopeScaling

# Qwen-style knobs on, untied, so every parameter kind is exercised.
CFG = dataclasses.replace(
    TINY,
    vocab_size=160,
    intermediate_size=96,
    attention_bias=True,
    qk_norm=True,
    tie_word_embeddings=False,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
    model_type="qwen2",
)
# The same with a sliding window shorter than the test rows (9 tokens); the windowed full
# forward itself is compared with transformers' Mistral in tests/models/test_weights.py.
WINDOWED = dataclasses.replace(CFG, sliding_window=3)


# One compiled forward per input shape (eager dispatch is slow on the shared CI cores).
_fwd = jax.jit(T.forward, static_argnums=1, static_argnames="remat")


@functools.cache
def _params():
    params = T.init_params(CFG, jax.random.key(0))
    # Non-trivial norms and biases, so a mix-up between them shows.
    rng = np.random.default_rng(1)
    return jax.tree.map(
        lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32) if x.ndim <= 3 else x, params
    )


def _batch(B=3, T_=9, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, T_)).astype(np.int32)
    lengths = np.array([T_, T_ - 4, 1][:B])
    mask = np.arange(T_)[None] >= (T_ - lengths)[:, None]  # left padding
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return jnp.asarray(tokens), jnp.asarray(pos, jnp.int32), jnp.asarray(mask)


def test_shapes_axes_and_dtypes():
    params = _params()
    axes = T.param_logical_axes(CFG)
    assert jax.tree.structure(params) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, tuple)
    )
    for x, a in zip(
        jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    ):
        assert x.ndim == len(a)
    assert params["layers"]["q"].shape == (2, 64, 4, 16)
    tokens, pos, mask = _batch()
    logits, cache = _fwd(params, CFG, tokens, pos, mask)
    assert logits.shape == (3, 9, 160) and logits.dtype == jnp.float32 and cache is None
    assert sum(x.size for x in jax.tree.leaves(params)) == CFG.num_params


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["full", "window"])
def test_padding_does_not_leak_and_pads_are_finite(cfg):
    params = _params()
    tokens, pos, mask = _batch()
    logits, _ = _fwd(params, cfg, tokens, pos, mask)
    assert np.isfinite(np.asarray(logits)).all()
    # Changing the ids under the pads leaves the real positions' logits unchanged.
    other = jnp.where(mask, tokens, (tokens + 7) % CFG.vocab_size)
    logits2, _ = _fwd(params, cfg, other, pos, mask)
    np.testing.assert_allclose(
        np.asarray(logits2)[np.asarray(mask)], np.asarray(logits)[np.asarray(mask)], atol=1e-6
    )
    # A row alone equals the same row inside the padded batch (its unpadded length).
    n = int(mask[1].sum())
    alone, _ = _fwd(params, cfg, tokens[1:2, -n:], pos[1:2, -n:], mask[1:2, -n:])
    np.testing.assert_allclose(alone[0], logits[1, -n:], atol=2e-5)


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["full", "window"])
def test_kv_cache_prefill_then_decode_equals_full_forward(cfg):
    params = _params()
    tokens, pos, mask = _batch()
    full, _ = _fwd(params, cfg, tokens, pos, mask)
    step = _fwd
    cache = kv_cache.init_kv_cache(CFG, 3, 16)
    assert len(cache.k_BKHS) == len(cache.v_BKSH) == 2 and not cache.mask_BS.any()
    assert cache.k_BKHS[0].shape == (3, 2, 16, 16) and cache.v_BKSH[0].shape == (3, 2, 16, 16)
    assert cache.max_len == 16
    other = kv_cache.init_kv_cache(CFG, 3, 12)  # keys [B, K, H, S], values [B, K, S, H]
    assert other.k_BKHS[1].shape == (3, 2, 16, 12) and other.v_BKSH[1].shape == (3, 2, 12, 16)
    out, cache = step(params, cfg, tokens[:, :5], pos[:, :5], mask[:, :5], cache, 0)
    outs = [out]
    for t in range(5, 9):  # one token at a time, traced cache_index
        out, cache = step(
            params,
            cfg,
            tokens[:, t : t + 1],
            pos[:, t : t + 1],
            mask[:, t : t + 1],
            cache,
            jnp.int32(t),
        )
        outs.append(out)
    inc = jnp.concatenate(outs, axis=1)
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(inc)[m], np.asarray(full)[m], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(cache.mask_BS[:, :9]), m)
    assert not cache.mask_BS[:, 9:].any()


def test_unstacked_layers_equal_stacked():
    params = _params()
    tokens, pos, mask = _batch()
    ref, _ = _fwd(params, CFG, tokens, pos, mask)
    flat = T.unstack_layers(params)
    assert len(flat["layers"]) == CFG.num_layers and T.unstack_layers(flat) is flat
    np.testing.assert_array_equal(flat["layers"][1]["q"], params["layers"]["q"][1])
    out, _ = _fwd(flat, CFG, tokens, pos, mask)
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[m], np.asarray(ref)[m], atol=2e-5)
    out_c, _ = _fwd(flat, CFG, tokens, pos, mask, kv_cache.init_kv_cache(CFG, 3, 12), 0)
    np.testing.assert_allclose(np.asarray(out_c)[m], np.asarray(ref)[m], atol=2e-5)


def _shared_prefix_rows(G=3, group=2, P=6, T_=5, seed=3):
    """G left-padded prefixes (one fully real, one short) and G*group continuations."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, CFG.vocab_size, (G, P)).astype(np.int32)
    prefix_mask = np.arange(P)[None] >= (P - np.array([P, 2, 4][:G]))[:, None]
    rest = rng.integers(0, CFG.vocab_size, (G * group, T_)).astype(np.int32)
    rest_mask = np.arange(T_)[None] < rng.integers(1, T_ + 1, G * group)[:, None]
    return prefix, prefix_mask, rest, rest_mask


@pytest.mark.parametrize("cfg", [CFG, WINDOWED], ids=["full", "window"])
def test_shared_prefix_equals_the_concatenated_rows(cfg):
    params, group = _params(), 2
    prefix, prefix_mask, rest, rest_mask = _shared_prefix_rows(group=group)
    P = prefix.shape[1]
    tokens = np.concatenate([np.repeat(prefix, group, 0), rest], 1)
    mask = np.concatenate([np.repeat(prefix_mask, group, 0), rest_mask], 1)
    run = jax.jit(T.hidden_states, static_argnums=1, static_argnames="remat")
    full, _ = run(
        params,
        cfg,
        jnp.asarray(tokens),
        T.positions_from_mask(jnp.asarray(mask)),
        jnp.asarray(mask),
    )
    shared = jax.jit(
        T.hidden_states_shared_prefix, static_argnums=1, static_argnames=("group", "remat")
    )
    h_prefix, h_rest = shared(params, cfg, prefix, prefix_mask, rest, rest_mask, group=group)
    full = np.asarray(full)
    for g in range(prefix.shape[0]):  # every row of a block sees the same prefix states
        for r in range(g * group, (g + 1) * group):
            np.testing.assert_allclose(
                np.asarray(h_prefix)[g][prefix_mask[g]], full[r, :P][prefix_mask[g]], atol=2e-5
            )
    np.testing.assert_allclose(np.asarray(h_rest)[rest_mask], full[:, P:][rest_mask], atol=2e-5)

    def loss(p, share):
        if share:
            _, h = T.hidden_states_shared_prefix(
                p, cfg, prefix, prefix_mask, rest, rest_mask, group=group, remat=True
            )
        else:
            h, _ = T.hidden_states(p, cfg, tokens, T.positions_from_mask(mask), mask)
            h = h[:, P:]
        return jnp.sum(jnp.where(rest_mask[..., None], h, 0.0) ** 2)

    grads = jax.jit(jax.grad(loss), static_argnums=1)
    for a, b in zip(jax.tree.leaves(grads(params, False)), jax.tree.leaves(grads(params, True))):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="share prefix"):
        T.hidden_states_shared_prefix(params, CFG, prefix, prefix_mask, rest, rest_mask, group=3)


def test_cache_without_index_is_a_clear_error():
    tokens, pos, mask = _batch()
    with pytest.raises(ValueError, match="cache_index"):
        _fwd(_params(), CFG, tokens, pos, mask, kv_cache.init_kv_cache(CFG, 3, 16))
    with pytest.raises(ValueError, match="longer cache"):
        T.forward(_params(), CFG, tokens, pos, mask, kv_cache.init_kv_cache(CFG, 3, 16), 8)


def test_remat_gives_same_values_and_gradients():
    params = _params()
    tokens, pos, mask = _batch()

    def loss(p, remat):
        logits, _ = _fwd(p, CFG, tokens, pos, mask, remat=remat)
        return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0)[..., 0])

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    l0, g0 = grad(params, False)
    l1, g1 = grad(params, True)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_bfloat16_params_track_float32():
    params = _params()
    tokens, pos, mask = _batch()
    ref, _ = _fwd(params, CFG, tokens, pos, mask)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out, _ = _fwd(bf16, CFG, tokens, pos, mask)
    assert out.dtype == jnp.float32
    m = np.asarray(mask)
    err = np.abs(np.asarray(out) - np.asarray(ref))[m].max()
    assert err < 0.05 * np.abs(np.asarray(ref))[m].max()


def test_llama3_rope_scaling_changes_low_frequencies_only():
    plain = decoder_layer.rope_inv_freq(dataclasses.replace(CFG, rope_scaling=None))
    scaled = decoder_layer.rope_inv_freq(CFG)
    assert scaled[0] == plain[0]  # highest frequency kept
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0, rtol=1e-6)  # lowest divided by factor


def test_sharded_forward_equals_unsharded():
    mesh = parallel.make_mesh("data:1,fsdp:4,tensor:2")
    params = _params()
    tokens, pos, mask = _batch()
    ref, _ = _fwd(params, CFG, tokens, pos, mask)
    sharded = parallel.shard_pytree(params, T.param_logical_axes(CFG), mesh)
    q = sharded["layers"]["q"].sharding.spec
    assert q == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    fwd = _fwd
    out, _ = fwd(sharded, CFG, tokens, pos, mask)
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[m], np.asarray(ref)[m], atol=2e-5)
    # And the cached path: prefill on the mesh equals the plain prefill.
    cache = kv_cache.init_kv_cache(CFG, 3, 12)
    out_c, cache = fwd(sharded, CFG, tokens, pos, mask, cache, 0)
    np.testing.assert_allclose(np.asarray(out_c)[m], np.asarray(ref)[m], atol=2e-5)
