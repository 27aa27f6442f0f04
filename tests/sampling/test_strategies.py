"""Sampling strategies: distributions, truncation sets (vs transformers' warpers), logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl4llm.sampling import strategies
from jaxrl4llm.sampling.strategies import GREEDY, SamplingConfig

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")


def _keys(n: int, seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed), n)


def _hf_allowed(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """Tokens left finite by transformers' temperature -> top-k -> top-p warpers."""
    scores = torch.from_numpy(logits.astype(np.float32)) / config.temperature
    if config.top_k:
        scores = logits_process.TopKLogitsWarper(config.top_k)(None, scores)
    if config.top_p < 1.0:
        scores = logits_process.TopPLogitsWarper(config.top_p)(None, scores)
    return torch.isfinite(scores).numpy()


def test_config_is_hashable_and_validated():
    assert hash(SamplingConfig(0.7, 5, 0.9)) == hash(SamplingConfig(0.7, 5, 0.9))
    assert GREEDY.is_greedy and GREEDY.effective_temperature == 1.0
    assert SamplingConfig.greedy() == GREEDY
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingConfig(**bad)


def test_greedy_is_argmax_with_temperature_one_logprobs():
    logits = jax.random.normal(jax.random.key(1), (16, 50)) * 3
    tokens, logprobs = strategies.sample(logits, _keys(16), GREEDY)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    ref = jax.nn.log_softmax(logits)[np.arange(16), tokens]
    np.testing.assert_allclose(logprobs, ref, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_empirical_distribution_matches_softmax_over_temperature(temperature):
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5], np.float32)
    draws = 20000
    tokens, _ = jax.jit(strategies.sample, static_argnums=2)(
        jnp.broadcast_to(logits, (draws, logits.size)),
        _keys(draws, seed=3),
        SamplingConfig(temperature),
    )
    counts = np.bincount(np.asarray(tokens), minlength=logits.size)

    def p_value(t):
        z = np.exp((logits - logits.max()).astype(np.float64) / t)
        expected = z / z.sum() * draws
        return stats.chisquare(counts, expected).pvalue

    assert p_value(temperature) > 1e-3
    # The same test rejects a 20% wrong temperature: it has the power to catch the bug.
    assert p_value(temperature * 1.2) < 1e-6
    assert p_value(temperature / 1.2) < 1e-6


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(1.0, top_k=5),
        SamplingConfig(0.7, top_p=0.8),
        SamplingConfig(1.0, top_p=0.95),
        SamplingConfig(1.3, top_k=20, top_p=0.6),
    ],
)
def test_truncation_set_matches_transformers_warpers(config):
    rng = np.random.default_rng(0)
    peaked = rng.normal(size=(24, 300)) * 4.0  # nucleus within the top-64 fast path
    flat = rng.normal(size=(8, 300)) * 0.05  # nucleus of ~hundreds: exact bisection
    logits = np.concatenate([peaked, flat]).astype(np.float32)
    ours = np.asarray(strategies.allowed_tokens(jnp.asarray(logits), config))
    np.testing.assert_array_equal(ours, _hf_allowed(logits, config))
    if config.top_p < 1.0 and not config.top_k:
        assert ours[24:].sum(axis=1).min() > strategies.TOP_P_CANDIDATES  # slow path exercised


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(1.0, top_k=3),
        SamplingConfig(1.0, top_p=0.5),
        SamplingConfig(0.5, top_k=10, top_p=0.7),
    ],
)
def test_samples_stay_in_the_truncated_set_and_logprobs_are_untruncated(config):
    rows, vocab = 4096, 40
    logits = jax.random.normal(jax.random.key(5), (8, vocab)) * 2.0
    logits_RV = jnp.tile(logits, (rows // 8, 1))
    tokens, logprobs = jax.jit(strategies.sample, static_argnums=2)(logits_RV, _keys(rows), config)
    allowed = np.asarray(strategies.allowed_tokens(logits_RV, config))
    assert allowed[np.arange(rows), np.asarray(tokens)].all()
    assert (~allowed).any(axis=1).all()  # the test is not vacuous: something was excluded
    # Every allowed token of row 0 is drawn at some point (the truncation is not too strict).
    row0 = np.asarray(tokens)[::8]
    assert set(row0.tolist()) == set(np.flatnonzero(allowed[0]).tolist())
    ref = jax.nn.log_softmax(logits_RV / config.temperature)[np.arange(rows), tokens]
    np.testing.assert_allclose(logprobs, ref, atol=1e-5)


def test_excluded_tokens_never_drawn_even_at_the_cdf_edges():
    # Masses at both ends of the vocabulary are zero after top-k; u close to 0 or 1 must not
    # leak onto them.
    logits = jnp.array([[-50.0, 3.0, 2.0, -50.0]])
    config = SamplingConfig(1.0, top_k=2)
    tokens, _ = strategies.sample(jnp.tile(logits, (2000, 1)), _keys(2000, 9), config)
    assert set(np.asarray(tokens).tolist()) == {1, 2}
