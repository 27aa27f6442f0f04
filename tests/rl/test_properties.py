"""Hypothesis properties: normalization scopes, rejected rows, exact micro-batch combination."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm import rl

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
# A discrete reward set: a group's std is either exactly 0 or far above eps.
REWARD = st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0])


_norm = jax.jit(rl.normalized_advantages, static_argnums=1, static_argnames=("mean", "std", "ddof"))
P = 3  # prompts per batch; fixed so that jit compiles once per (G, scope)


@st.composite
def grouped_rewards(draw):
    G = draw(st.sampled_from([2, 4]))
    r = np.array(draw(st.lists(REWARD, min_size=P * G, max_size=P * G)), np.float32)
    return r, G


@SETTINGS
@given(grouped_rewards(), st.sampled_from([0, 1]))
def test_group_normalized_mean0_std1_per_group(rg, ddof):
    r, G = rg
    if ddof >= G:
        return
    a = np.asarray(_norm(jnp.asarray(r), G, ddof=ddof), np.float64).reshape(-1, G)
    for a_g, r_g in zip(a, r.reshape(-1, G)):
        if np.ptp(r_g) == 0:
            assert np.all(a_g == 0)
        else:
            assert abs(a_g.mean()) < 1e-5
            assert abs(a_g.std(ddof=ddof) - 1.0) < 1e-4


@SETTINGS
@given(grouped_rewards(), st.lists(st.booleans(), min_size=3, max_size=3))
def test_batch_normalized_mean0_std1_over_kept_rows(rg, keep_groups):
    r, G = rg
    keep = np.repeat(np.array(keep_groups), G)
    a = np.asarray(
        _norm(jnp.asarray(r), G, mean="batch", std="batch", keep_B=jnp.asarray(keep)), np.float64
    )
    assert np.all(a[~keep] == 0)
    kept = r[keep]
    if kept.size >= 2 and np.ptp(kept) > 0:
        assert abs(a[keep].mean()) < 1e-5 and abs(a[keep].std(ddof=1) - 1.0) < 1e-4


@SETTINGS
@given(grouped_rewards())
def test_group_mean_batch_std_scales_centered_rewards(rg):
    r, G = rg
    a = np.asarray(_norm(jnp.asarray(r), G, mean="group", std="batch"), np.float64)
    centered = (r.reshape(-1, G) - r.reshape(-1, G).mean(1, keepdims=True)).reshape(-1)
    if np.ptp(r) > 0:
        np.testing.assert_allclose(a, centered / (r.std(ddof=1) + 1e-6), rtol=1e-5, atol=1e-6)
        assert abs(a.mean()) < 1e-5  # group centering implies batch mean 0


B, T = 8, 4  # fixed shapes: every jitted helper compiles once per (config, rows)


@st.composite
def masked_batch(draw):
    lens = np.array(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    mask = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
    keep = np.array(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    logp = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, (B,)).astype(np.float32)
    return dict(mask=mask, keep=keep, logp=logp, old=old, ref=ref, adv=adv)


def _cfg(mode):
    return rl.get_preset("grpo", agg=mode, clip_high=0.28, dual_clip=3.0, kl_coef=0.1)


def _loss_fn(cfg, logp, old, adv, mask, keep, ref, denom):
    """(loss_sum, denominator, metrics, grad of loss_sum / denom w.r.t. logp)."""

    def f(lp):
        s, d, m = rl.policy_loss(cfg, lp, old, adv, mask, keep, ref_logp_BT=ref)
        return s / jnp.maximum(denom, 1.0), (s, d, m)

    g, (s, d, m) = jax.grad(f, has_aux=True)(logp)
    return s, d, m, g


_loss_jit = jax.jit(_loss_fn, static_argnums=0)


def _run(cfg, d, rows=slice(None), denom=1.0, **over):
    d = dict(d, **over)
    a = [jnp.asarray(d[k])[rows] for k in ("logp", "old", "adv", "mask", "keep", "ref")]
    return _loss_jit(cfg, *a, jnp.float32(denom))


@SETTINGS
@given(masked_batch(), st.sampled_from(rl.AGG_MODES), st.sampled_from([2, 4]))
def test_micro_batches_combine_exactly(d, mode, n_micro):
    """Uneven micro-batches too: with n_micro=4 some slices hold only masked or rejected rows."""
    cfg = _cfg(mode)
    s, den, m, _ = _run(cfg, d)
    step = B // n_micro
    parts = [_run(cfg, d, rows=slice(k * step, (k + 1) * step)) for k in range(n_micro)]
    s_mb = sum(float(p[0]) for p in parts)
    den_mb = sum(float(p[1]) for p in parts)
    assert den_mb == pytest.approx(float(den))
    assert float(rl.finalize_loss(s_mb, den_mb)) == pytest.approx(
        float(rl.finalize_loss(s, den)), rel=1e-5, abs=1e-6
    )
    # The documented alternative: the mini-batch denominator, computed once from masks.
    D = rl.loss_denominator(cfg, jnp.asarray(d["mask"]), jnp.asarray(d["keep"]))
    assert float(D) == pytest.approx(float(den))
    # Gradients of loss_sum_k / D summed over micro-batches equal the mini-batch gradient.
    g_full = _run(cfg, d, denom=float(den))[3]
    g_mb = jnp.concatenate(
        [
            _run(cfg, d, rows=slice(k * step, (k + 1) * step), denom=float(D))[3]
            for k in range(n_micro)
        ]
    )
    np.testing.assert_allclose(np.asarray(g_mb), np.asarray(g_full), rtol=1e-5, atol=1e-7)
    # Metrics merged with combine_metrics equal the whole-batch metrics.
    merged = parts[0][2]
    for p in parts[1:]:
        merged = rl.combine_metrics(merged, p[2])
    full, comb = rl.finalize_metrics(m), rl.finalize_metrics(merged)
    assert set(comb) == set(full)
    for k in full:
        np.testing.assert_allclose(float(comb[k]), float(full[k]), rtol=1e-5, atol=1e-6, err_msg=k)


@SETTINGS
@given(masked_batch(), st.sampled_from(rl.AGG_MODES))
def test_rejected_rows_contribute_nothing(d, mode):
    cfg = _cfg(mode)
    keep = d["keep"]
    # Garbage on rejected rows (huge log-ratios and advantages) ...
    s, den, _, g = _run(
        cfg,
        d,
        old=np.where(keep[:, None], d["old"], 50.0).astype(np.float32),
        adv=np.where(keep, d["adv"], 1e4).astype(np.float32),
    )
    # ... gives exactly what those rows give when they are simply absent (mask zeroed, all kept).
    s0, den0, _, g0 = _run(cfg, d, mask=d["mask"] * keep[:, None], keep=np.ones(B, bool))
    assert float(den) == pytest.approx(float(den0))
    assert float(s) == pytest.approx(float(s0), rel=1e-5, abs=1e-6)
    assert float(jnp.abs(g[~keep]).sum()) == 0.0
    np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-5, atol=1e-7)


def test_rejected_rows_equal_dropping_them():
    rng = np.random.default_rng(0)
    d = dict(
        mask=np.ones((B, T), np.float32),
        keep=np.arange(B) % 3 != 0,
        logp=-rng.uniform(0.1, 3, (B, T)).astype(np.float32),
        adv=rng.normal(size=B).astype(np.float32),
    )
    d["old"], d["ref"] = d["logp"] + 0.2, d["logp"] - 0.1
    for mode in rl.AGG_MODES:
        s, den, _, g = _run(_cfg(mode), d)
        idx = np.flatnonzero(d["keep"])
        s1, den1, _, g1 = _run(_cfg(mode), d, rows=idx)
        assert (float(s), float(den)) == pytest.approx((float(s1), float(den1)), rel=1e-6)
        np.testing.assert_allclose(np.asarray(g[idx]), np.asarray(g1), rtol=1e-6)


@SETTINGS
@given(masked_batch(), st.floats(0.0, 0.9), st.floats(0.0, 2.0), st.sampled_from([None, 1.5, 3.0]))
def test_clipped_equals_unclipped_at_ratio_one(d, lo, hi, dual):
    lp = jnp.asarray(d["logp"])
    A = jnp.asarray(d["adv"])
    loss, aux = rl.clipped_surrogate(lp, lp, A, clip_low=lo, clip_high=hi, dual_clip=dual)
    np.testing.assert_allclose(
        np.asarray(loss), np.broadcast_to(-np.asarray(A)[:, None], lp.shape), rtol=1e-6
    )
    assert not bool(
        aux["clipped_low"].any() | aux["clipped_high"].any() | aux["dual_clipped"].any()
    )


_rpp = jax.jit(rl.reinforce_pp_advantages, static_argnames=("group_size", "baseline", "ddof"))


@SETTINGS
@given(masked_batch(), st.sampled_from([0, 1]), st.booleans())
def test_reinforce_pp_whitened_over_valid_tokens(d, ddof, baseline):
    mask, keep = d["mask"], d["keep"]
    r = np.round(d["adv"] * 2) / 2  # a few distinct reward levels
    a = np.asarray(
        _rpp(
            jnp.asarray(r),
            jnp.asarray(mask),
            kl_BT=jnp.asarray(d["ref"]),
            kl_coef=0.05,
            group_size=2,
            baseline=baseline,
            keep_B=jnp.asarray(keep),
            ddof=ddof,
        ),
        np.float64,
    )
    w = (mask > 0) & keep[:, None]
    assert np.all(a[~w] == 0)
    v = a[w]
    if v.size > ddof + 1 and np.ptp(v) > 1e-3:
        assert abs(v.mean()) < 1e-4 and abs(v.std(ddof=ddof) - 1.0) < 1e-3
