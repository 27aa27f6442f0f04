"""The routers' training signals against transformers' load_balancing_loss_func and numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.models import routing_stats

torch = pytest.importorskip("torch")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

L, B, T, E, K = 3, 2, 5, 6, 2
_RNG = np.random.default_rng(0)
LOGITS = (2.0 * _RNG.standard_normal((L, B, T, E))).astype(np.float32)
MASK = np.arange(T)[None] >= np.array([0, 3])[:, None]  # row 1 left-padded by 3


def _softmax(x):
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("mask", [None, MASK])
def test_load_balancing_loss_equals_transformers(mask):
    gate_logits = tuple(torch.tensor(layer.reshape(B * T, E)) for layer in LOGITS)
    attention_mask = None if mask is None else torch.tensor(mask.astype(np.int64))
    want = qwen3_moe.load_balancing_loss_func(gate_logits, E, K, attention_mask)
    got = routing_stats.load_balancing_loss(
        jnp.asarray(LOGITS), K, None if mask is None else jnp.asarray(mask)
    )
    np.testing.assert_allclose(got, float(want), rtol=1e-5)


def test_load_balancing_loss_counts_the_given_experts_and_is_k_when_balanced():
    """Uniform router probabilities with each expert picked equally often: k."""
    experts = np.arange(L * B * T * K).reshape(L, B, T, K) % E
    loss = routing_stats.load_balancing_loss(
        jnp.zeros((L, B, T, E)), K, experts_LBTK=jnp.asarray(experts)
    )
    np.testing.assert_allclose(loss, K, rtol=1e-6)


def test_router_z_loss_is_the_mean_squared_logsumexp_over_real_tokens():
    z = np.log(np.exp(LOGITS.astype(np.float64)).sum(-1))
    want = (z**2 * MASK).sum() / (L * MASK.sum())
    got = routing_stats.router_z_loss(jnp.asarray(LOGITS), jnp.asarray(MASK))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_expert_load_counts_real_tokens_per_expert():
    experts = np.argsort(-_softmax(LOGITS), -1)[..., :K]
    counts = np.zeros((L, E))
    for layer, b, t, k in np.ndindex(L, B, T, K):
        counts[layer, experts[layer, b, t, k]] += MASK[b, t]
    load = routing_stats.expert_load(jnp.asarray(experts), E, jnp.asarray(MASK))
    assert float(load.max_tokens) == counts.max()
    np.testing.assert_allclose(load.mean_tokens, MASK.sum() * K / E, rtol=1e-6)


def test_routing_flip_fraction_compares_sets_over_real_tokens():
    a = np.argsort(-_softmax(LOGITS), -1)[..., :K]
    b = a[..., ::-1].copy()  # the same sets in another order: no flip
    b[0, 0, 1, 0] = E  # an expert outside either set
    b[2, 1, 0, 1] = E  # a padding token of row 1: not counted
    b[1, 1, 4, 0] = E
    got = routing_stats.routing_flip_fraction(jnp.asarray(a), jnp.asarray(b), jnp.asarray(MASK))
    np.testing.assert_allclose(got, 2 / (L * MASK.sum()), rtol=1e-6)
    assert float(routing_stats.routing_flip_fraction(jnp.asarray(a), jnp.asarray(a))) == 0.0
