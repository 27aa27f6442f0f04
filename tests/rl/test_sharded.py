"""Batch-wide statistics under shard_map on 4 CPU devices (tests/conftest.py provides 8):
with axis_name, every estimator, loss and metric equals the unsharded result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl4llm import rl

G, T, N_DEV = 4, 6, 4
B = 8 * G  # 2 groups per device


def _mesh():
    if jax.device_count() < N_DEV:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return Mesh(np.array(jax.devices()[:N_DEV]), ("batch",))


def _rollout(seed=0):
    rng = np.random.default_rng(seed)
    p_correct = rng.choice([0.0, 0.5, 1.0], B // G)
    correct = (rng.random((B // G, G)) < p_correct[:, None]).reshape(-1)
    lens = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
    logp = -rng.uniform(0.05, 3.0, (B, T)).astype(np.float32)
    return dict(
        rewards=(correct + rng.normal(0, 0.3, B)).astype(np.float32),
        correct=correct,
        mask=mask,
        logp=logp,
        ref=(logp + rng.normal(0, 0.2, (B, T))).astype(np.float32),
        values=rng.normal(0, 0.5, (B, T)).astype(np.float32),
        old=(logp + rng.normal(0, 0.3, (B, T))).astype(np.float32),
    )


def _advantages(cfg, d, axis_name=None):
    adv, keep, m = rl.compute_advantages(
        cfg,
        d["rewards"],
        d["correct"],
        d["mask"],
        G,
        logp_BT=d["logp"],
        ref_logp_BT=d["ref"],
        values_BT=d["values"],
        axis_name=axis_name,
    )
    return adv, keep, rl.finalize_metrics(m)


CONFIGS = {
    "lite_ppo": {},  # group mean, batch std
    "grpo": {"mean": "batch", "std": "batch"},
    "reinforce_pp": {},  # whitened over the batch's tokens
    "ppo": {},  # verl's masked_whiten of GAE
    "gpg": {},  # alpha = B / (B - M) over the batch
    "dapo": {},  # rejected groups, group statistics
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_advantages_under_shard_map_equal_the_unsharded(name):
    cfg = rl.get_preset(name, **CONFIGS[name])
    d = {k: jnp.asarray(v) for k, v in _rollout(1).items()}
    adv, keep, metrics = jax.jit(lambda d: _advantages(cfg, d))(d)
    spec = P("batch")
    sharded = jax.jit(
        jax.shard_map(
            lambda d: _advantages(cfg, d, "batch"),
            mesh=_mesh(),
            in_specs=({k: spec for k in d},),
            out_specs=(spec, spec, P()),
        )
    )
    adv_s, keep_s, metrics_s = sharded(d)
    np.testing.assert_allclose(np.asarray(adv_s), np.asarray(adv), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(keep_s), np.asarray(keep))
    for k in metrics:
        assert float(metrics_s[k]) == pytest.approx(float(metrics[k]), rel=1e-5, abs=1e-6), k


def _loss(cfg, d, key, axis_name=None):
    s, den, m = rl.policy_loss(
        cfg,
        d["logp"],
        d["old"],
        d["adv"],
        d["mask"],
        ref_logp_BT=d["ref"],
        key=key,
        axis_name=axis_name,
    )
    if axis_name is not None:
        s, den = jax.lax.psum(s, axis_name), jax.lax.psum(den, axis_name)
    return s, den, rl.finalize_metrics(m)


@pytest.mark.parametrize(
    "name,over",
    [
        ("grpo", {}),
        ("clip_cov", {"clip_cov_ratio": 0.1, "clip_low": 0.2, "clip_high": 0.2}),
        ("kl_cov", {"kl_cov_ratio": 0.1}),
        ("gmpo", {}),
    ],
)
def test_policy_loss_under_shard_map_equals_the_unsharded(name, over):
    cfg = rl.get_preset(name, **over)
    raw = _rollout(2)
    raw["adv"] = (3 * np.random.default_rng(2).normal(size=B)).astype(np.float32)
    d = {k: jnp.asarray(v) for k, v in raw.items()}
    key = jax.random.key(3)
    s, den, metrics = jax.jit(lambda d: _loss(cfg, d, key))(d)
    sharded = jax.jit(
        jax.shard_map(
            lambda d: _loss(cfg, d, key, "batch"),
            mesh=_mesh(),
            in_specs=({k: P("batch") for k in d},),
            out_specs=(P(), P(), P()),
        )
    )
    s_s, den_s, metrics_s = sharded(d)
    assert (float(s_s), float(den_s)) == pytest.approx((float(s), float(den)), rel=1e-5)
    assert set(metrics_s) == set(metrics)
    for k in metrics:
        assert float(metrics_s[k]) == pytest.approx(float(metrics[k]), rel=1e-5, abs=1e-6), k
    if name in ("clip_cov", "kl_cov"):
        assert float(metrics["policy/cov_selected_frac"]) > 0


def test_per_shard_statistics_differ_without_axis_name():
    """The failure axis_name prevents: per-shard batch std (lite_ppo)."""
    cfg = rl.get_preset("lite_ppo")
    d = {k: jnp.asarray(v) for k, v in _rollout(1).items()}
    adv, _, _ = jax.jit(lambda d: _advantages(cfg, d))(d)
    per_shard = jax.jit(
        jax.shard_map(
            lambda d: _advantages(cfg, d)[0],
            mesh=_mesh(),
            in_specs=({k: P("batch") for k in d},),
            out_specs=P("batch"),
        )
    )(d)
    assert float(jnp.abs(per_shard - adv).max()) > 1e-3
