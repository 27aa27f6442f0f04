"""Closed-form values of the per-token losses, KL estimators, entropy and aggregation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.rl import losses

surrogate = jax.jit(rl.clipped_surrogate, static_argnames=("clip_low", "clip_high", "dual_clip"))
agg = jax.jit(rl.aggregate, static_argnums=(3, 4))
kl = jax.jit(rl.kl_estimate, static_argnums=2)
entropy = jax.jit(rl.entropy_from_logits)


def _np(x):
    return np.asarray(x, np.float64)


def _surrogate(ratio, adv, **kw):
    ratio = jnp.asarray(ratio, jnp.float32)
    old = jnp.zeros_like(ratio)
    return surrogate(jnp.log(ratio), old, jnp.asarray(adv, jnp.float32), **kw)


def test_clipped_surrogate_symmetric_clip():
    loss, aux = _surrogate(
        [[1.5, 1.1, 0.5, 0.9]], [[1.0, 1.0, -1.0, -1.0]], clip_low=0.2, clip_high=0.2
    )
    # A>0, rho=1.5: max(-1.5, -1.2) = -1.2 (clipped high); rho=1.1: -1.1;
    # A<0, rho=0.5: max(0.5, 0.8) = 0.8 (clipped low); rho=0.9: max(0.9, 0.9) = 0.9.
    np.testing.assert_allclose(_np(loss), [[-1.2, -1.1, 0.8, 0.9]], rtol=1e-6)
    np.testing.assert_array_equal(aux["clipped_high"], [[1, 0, 0, 0]])
    np.testing.assert_array_equal(aux["clipped_low"], [[0, 0, 1, 0]])


def test_clip_higher_and_pessimistic_side():
    loss, aux = _surrogate([[1.25, 1.25, 1.5]], [[1.0, -1.0, -1.0]], clip_low=0.2, clip_high=0.28)
    # rho=1.25 < 1.28: not clipped for A>0; A<0 with rho>1 takes the unclipped (larger) loss.
    np.testing.assert_allclose(_np(loss), [[-1.25, 1.25, 1.5]], rtol=1e-6)
    assert not bool(aux["clipped_high"].any()) and not bool(aux["clipped_low"].any())


def test_dual_clip_bounds_negative_advantage_loss():
    loss, aux = _surrogate([[5.0, 5.0, 2.0]], [[-1.0, 1.0, -0.5]], dual_clip=3.0)
    # A=-1, rho=5: max(5, 1.2) = 5 -> min(5, 3) = 3; A>0 untouched; A=-.5, rho=2: 1.0 < 1.5 kept.
    np.testing.assert_allclose(_np(loss), [[3.0, -1.2, 1.0]], rtol=1e-6)
    np.testing.assert_array_equal(aux["dual_clipped"], [[1, 0, 0]])


def test_advantage_broadcast_B_and_BT_agree():
    logp = jnp.log(jnp.array([[1.3, 0.7], [1.0, 1.6]]))
    a_B = jnp.array([1.0, -2.0])
    l1, _ = rl.clipped_surrogate(logp, jnp.zeros_like(logp), a_B)
    l2, _ = rl.clipped_surrogate(logp, jnp.zeros_like(logp), jnp.broadcast_to(a_B[:, None], (2, 2)))
    np.testing.assert_allclose(_np(l1), _np(l2))
    with pytest.raises(ValueError, match="advantages have shape"):
        rl.clipped_surrogate(logp, logp, jnp.ones(3))


def test_log_ratio_clamp():
    logp = jnp.array([[30.0, -30.0]])
    np.testing.assert_allclose(_np(rl.log_ratio(logp, jnp.zeros_like(logp))), [[20.0, -20.0]])
    loss, aux = rl.clipped_surrogate(logp, jnp.zeros_like(logp), jnp.array([-1.0]))
    assert np.isfinite(_np(loss)).all()
    np.testing.assert_allclose(_np(aux["ratio"]), [[np.exp(20.0), np.exp(-20.0)]], rtol=1e-5)


def test_kl_estimators_closed_form():
    logp, ref = jnp.array([[0.5, -0.3]]), jnp.zeros((1, 2))
    d = np.array([0.5, -0.3])
    np.testing.assert_allclose(_np(kl(logp, ref, "k1")), [d], rtol=1e-6)
    np.testing.assert_allclose(_np(kl(logp, ref, "k2")), [d**2 / 2], rtol=1e-6)
    np.testing.assert_allclose(_np(kl(logp, ref, "k3")), [np.exp(-d) + d - 1], rtol=1e-5)
    assert float(kl(ref, ref, "k3").sum()) == 0.0
    with pytest.raises(ValueError, match="kl_estimator='k4'"):
        kl(logp, ref, "k4")


def test_entropy_from_logits():
    np.testing.assert_allclose(_np(entropy(jnp.zeros((1, 1, 4)))), [[np.log(4)]], rtol=1e-6)
    # -inf logits (masked vocabulary) must give a finite entropy, not NaN.
    h = entropy(jnp.array([[[0.0, 0.0, -jnp.inf]]]))
    np.testing.assert_allclose(_np(h), [[np.log(2)]], rtol=1e-6)
    x = np.random.default_rng(0).normal(size=(2, 3, 7)) * 5
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(_np(entropy(jnp.asarray(x))), -(p * np.log(p)).sum(-1), rtol=1e-4)
    # Large logits do not overflow.
    assert np.isfinite(_np(entropy(jnp.array([[[1e4, 0.0, -1e4]]])))).all()


def test_nll_loss():
    np.testing.assert_allclose(_np(rl.nll_loss(jnp.array([[-0.5, -2.0]]))), [[0.5, 2.0]])


L = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = jnp.array([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    "mode,num,den",
    [
        ("token-mean", 18.0, 5.0),
        ("seq-mean-token-mean", 1.5 + 5.0, 2.0),
        ("seq-mean-token-sum", 18.0, 2.0),
        ("seq-mean-token-sum-norm", 18.0, 6.0),
    ],
)
def test_aggregation_modes(mode, num, den):
    s, d = agg(L, M, None, mode, None)
    assert (float(s), float(d)) == pytest.approx((num, den))
    assert float(losses.loss_denominator(M, None, mode)) == pytest.approx(den)


@pytest.mark.parametrize(
    "mode,value",
    [
        ("token-mean", 1.5),
        ("seq-mean-token-mean", 1.5),
        ("seq-mean-token-sum", 3.0),
        ("seq-mean-token-sum-norm", 1.0),
    ],
)
def test_aggregation_rejected_row_leaves_numerator_and_denominator(mode, value):
    big = L.at[1].set(1e6)  # garbage on the rejected row
    s, d = agg(big, M, jnp.array([True, False]), mode, None)
    assert float(rl.finalize_loss(s, d)) == pytest.approx(value)


def test_sum_norm_uses_max_tokens_constant():
    s, d = agg(L, M, None, "seq-mean-token-sum-norm", 10)
    assert (float(s), float(d)) == pytest.approx((18.0, 20.0))


def test_all_rejected_gives_zero_not_nan():
    s, d = agg(L, M, jnp.array([False, False]), "seq-mean-token-mean", None)
    assert float(d) == 0.0 and float(rl.finalize_loss(s, d)) == 0.0
    with pytest.raises(ValueError, match="agg mode"):
        rl.aggregate(L, M, None, "mean")


def test_metrics_combine_and_finalize():
    Metric = rl.Metric
    a = {
        "x": Metric.mean(2.0, 4.0),
        "lo": Metric.min(0.9),
        "hi": Metric.max(1.1),
        "n": Metric.sum(3.0),
        "only_a": Metric.mean(5.0),
    }
    b = {
        "x": Metric.mean(6.0, 4.0),
        "lo": Metric.min(0.8),
        "hi": Metric.max(1.05),
        "n": Metric.sum(4.0),
    }
    m = rl.finalize_metrics(rl.combine_metrics(a, b))
    # mean: (2 + 6) / (4 + 4) tokens
    assert (
        m["x"] == pytest.approx(1.0)
        and m["lo"] == pytest.approx(0.8)
        and m["hi"] == pytest.approx(1.1)
    )
    assert m["n"] == pytest.approx(7.0) and m["only_a"] == pytest.approx(5.0)
    uneven = rl.finalize_metrics(
        rl.combine_metrics({"x": Metric.mean(1.0, 1.0)}, {"x": Metric.mean(6.0, 3.0)})
    )
    assert uneven["x"] == pytest.approx(7 / 4)  # token-weighted, not (1 + 2) / 2
    assert rl.finalize_metrics({"e": Metric.mean(0.0, 0.0)})["e"] == 0.0  # nothing counted
    assert bool(Metric.mean(0.0, 0.0).is_empty) and not bool(Metric.mean(0.0, 2.0).is_empty)
    assert bool(Metric.min(jnp.inf).is_empty) and bool(Metric.max(-jnp.inf).is_empty)
    assert not bool(Metric.min(0.5).is_empty) and not bool(Metric.sum(0.0).is_empty)
    with pytest.raises(ValueError, match="Cannot merge"):
        rl.combine_metrics({"x": Metric.min(1.0)}, {"x": Metric.max(1.0)})
    # Under jit and as a scan carry: the identities merge as no-ops.
    ident = rl.metrics.identity_metrics(jax.tree.map(jnp.asarray, b))
    merged = jax.jit(rl.combine_metrics)(ident, jax.tree.map(jnp.asarray, b))
    assert {k: float(v) for k, v in rl.finalize_metrics(merged).items()} == pytest.approx(
        {"x": 1.5, "lo": 0.8, "hi": 1.05, "n": 4.0}
    )


def test_losses_jit():
    f = jax.jit(rl.aggregate, static_argnums=(3, 4))
    s, d = f(L, M, jnp.array([True, True]), "seq-mean-token-mean", None)
    assert (float(s), float(d)) == pytest.approx((6.5, 2.0))
    g = jax.jit(rl.clipped_surrogate, static_argnames=("clip_low", "clip_high", "dual_clip"))
    loss, _ = g(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.array([1.0, -1.0]), dual_clip=3.0)
    np.testing.assert_allclose(_np(loss), [[-1.0] * 3, [1.0] * 3])
    h = jax.jit(rl.entropy_from_logits)
    assert h(jnp.zeros((2, 3, 5))).shape == (2, 3)
