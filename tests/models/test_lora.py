"""LoRA adapters (models/lora.py): step 0 equals the base, the adapter path equals the merged
weights and an independent numpy computation, and the flags' checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.models import lora, transformer
from jaxrl4llm.models.config import ModelConfig

CFG = ModelConfig(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    tie_word_embeddings=False,
    max_position_embeddings=64,
    attention_bias=True,
)
ALL = lora.LoraConfig(rank=3, alpha=6.0)


def _batch(B=2, T=7, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    mask = jnp.ones((B, T), bool).at[0, :2].set(False)
    return tokens, transformer.positions_from_mask(mask), mask


def _logits(params):
    return np.asarray(transformer.forward(params, CFG, *_batch())[0])


def _random_b(adapters, seed=1):
    """Adapters with B random too (fresh ones have B = 0, so they change nothing)."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    )


@pytest.fixture(scope="module")
def base():
    return transformer.init_params(CFG, jax.random.key(0))


def test_fresh_adapters_leave_the_logits_identical(base):
    adapters = lora.init_adapters(CFG, ALL, jax.random.key(1))
    assert all(float(jnp.abs(adapters["layers"][f"{t}_lora_a"]).max()) > 0 for t in lora.TARGETS)
    np.testing.assert_array_equal(_logits(lora.combine(base, adapters, ALL)), _logits(base))


def test_fresh_adapters_are_float32_and_leave_a_bfloat16_base_identical():
    """A bfloat16 base: the adapters stay float32 (master weights), the passes compute with
    them in bfloat16 (cast_for_compute), and step 0's logits are the base's bit for bit."""
    base = transformer.init_params(CFG, jax.random.key(0), dtype=jnp.bfloat16)
    adapters = lora.init_adapters(CFG, ALL, jax.random.key(1))
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    params = transformer.cast_for_compute(lora.combine(base, adapters, ALL), CFG)
    assert {params["layers"][f"{t}_lora_{m}"].dtype for t in lora.TARGETS for m in "ab"} == {
        jnp.dtype(jnp.bfloat16)
    }
    np.testing.assert_array_equal(_logits(params), _logits(base))


def test_adapter_path_equals_merged_weights(base):
    adapters = _random_b(lora.init_adapters(CFG, ALL, jax.random.key(1)))
    unmerged = _logits(lora.combine(base, adapters, ALL))
    merged = _logits(lora.merge(base, adapters, ALL))
    assert np.abs(unmerged - _logits(base)).max() > 1e-2  # the adapters do change the model
    np.testing.assert_allclose(unmerged, merged, atol=1e-5, rtol=1e-5)


def test_merge_is_w_plus_scaled_a_b_in_numpy(base):
    """The merged q and o weights, computed by hand from the HF-layout matrices."""
    adapters = _random_b(lora.init_adapters(CFG, ALL, jax.random.key(1)))
    merged = lora.merge(base, adapters, ALL)["layers"]
    a = np.asarray(adapters["layers"]["q_lora_a"][1])  # [D, r]
    b = np.asarray(adapters["layers"]["q_lora_b"][1])  # [r, N*H]
    w = np.asarray(base["layers"]["q"][1]).reshape(16, 16)  # [D, N*H]
    np.testing.assert_allclose(
        np.asarray(merged["q"][1]).reshape(16, 16), w + (6.0 / 3) * a @ b, atol=1e-6
    )
    a = np.asarray(adapters["layers"]["o_lora_a"][0])  # [N*H, r]
    b = np.asarray(adapters["layers"]["o_lora_b"][0])  # [r, D]
    w = np.asarray(base["layers"]["o"][0]).reshape(16, 16)
    np.testing.assert_allclose(
        np.asarray(merged["o"][0]).reshape(16, 16), w + 2.0 * a @ b, atol=1e-6
    )


def test_merge_onto_a_bfloat16_base_sums_in_float32():
    """W + scale * A B from the float32 adapters, rounded once to the weight's bfloat16."""
    base = transformer.init_params(CFG, jax.random.key(0), dtype=jnp.bfloat16)
    adapters = _random_b(lora.init_adapters(CFG, ALL, jax.random.key(1)))
    merged = lora.merge(base, adapters, ALL)["layers"]["up"]
    assert merged.dtype == jnp.bfloat16
    a, b = np.asarray(adapters["layers"]["up_lora_a"]), np.asarray(adapters["layers"]["up_lora_b"])
    w = np.asarray(base["layers"]["up"], np.float32)  # [L, D, F]
    expected = (w + 2.0 * np.einsum("lir,lro->lio", a, b)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(merged), expected)


def test_a_subset_of_targets_adapts_only_those(base):
    qv = lora.LoraConfig(rank=2, alpha=2.0, targets=("q", "v"))
    adapters = lora.init_adapters(CFG, qv, jax.random.key(1))
    assert sorted(adapters["layers"]) == ["q_lora_a", "q_lora_b", "v_lora_a", "v_lora_b"]
    assert adapters["layers"]["v_lora_a"].shape == (2, 16, 2)
    assert adapters["layers"]["v_lora_b"].shape == (2, 2, 8)  # K * H
    adapters = _random_b(adapters)
    merged = lora.merge(base, adapters, qv)
    for name in ("k", "o", "gate", "up", "down"):
        np.testing.assert_array_equal(merged["layers"][name], base["layers"][name])
    np.testing.assert_allclose(
        _logits(lora.combine(base, adapters, qv)), _logits(merged), atol=1e-5, rtol=1e-5
    )


def test_dropout_drops_the_adapter_input_only(base):
    drop = lora.LoraConfig(rank=3, alpha=6.0, dropout=0.5)
    adapters = _random_b(lora.init_adapters(CFG, drop, jax.random.key(1)))
    plain = _logits(lora.combine(base, adapters, drop))
    dropped = _logits(lora.combine(base, adapters, drop, dropout_key=jax.random.key(5)))
    again = _logits(lora.combine(base, adapters, drop, dropout_key=jax.random.key(5)))
    assert np.abs(plain - dropped).max() > 1e-3
    np.testing.assert_array_equal(dropped, again)
    # With B = 0 the adapters contribute nothing, dropped or not.
    fresh = lora.init_adapters(CFG, drop, jax.random.key(1))
    np.testing.assert_array_equal(
        _logits(lora.combine(base, fresh, drop, dropout_key=jax.random.key(5))), _logits(base)
    )


def test_bfloat16_compute_keeps_the_dropout_key():
    cfg = ModelConfig(**{**CFG.__dict__, "compute_dtype": "bfloat16"})
    drop = lora.LoraConfig(rank=3, alpha=6.0, dropout=0.5)
    base = transformer.init_params(cfg, jax.random.key(0))
    params = lora.combine(
        base, lora.init_adapters(cfg, drop, jax.random.key(1)), drop, dropout_key=jax.random.key(5)
    )
    cast = transformer.cast_for_compute(params, cfg)["layers"]
    assert cast[lora.DROPOUT_KEY].dtype == jnp.uint32
    assert cast["q_lora_a"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "config, message",
    [
        (lora.LoraConfig(rank=-1), "--lora_rank=-1"),
        (lora.LoraConfig(rank=4, targets=("q", "x")), "--lora_targets=q,x"),
        (lora.LoraConfig(rank=4, targets=("q", "q")), "--lora_targets=q,q"),
        (lora.LoraConfig(rank=4, alpha=0.0), "--lora_alpha=0.0"),
        (lora.LoraConfig(rank=4, dropout=1.0), "--lora_dropout=1.0"),
    ],
)
def test_bad_flags_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()
