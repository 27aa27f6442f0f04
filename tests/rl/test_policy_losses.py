"""CISPO, SAPO, GMPO, Clip-Cov, KL-Cov and GPG against numpy transcriptions of verl's
core_algos.py (tests/rl/verl_reference.py) on random ragged batches, under every aggregation
the loss defines; their gradients from each paper's formula; exact micro-batch and packed
combination; and the IS correction composed as verl composes it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl

from tests.rl import verl_reference as ref

B, T = 12, 7
TOKEN_LEVEL = ("cispo", "sapo", "gpg", "kl_cov", "clip_cov")


def _batch(seed, per_token=False, empty_rows=True, adv_scale=1.0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0 if empty_rows else 1, T + 1, B)
    lens[0] = T
    mask = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
    logp = -rng.uniform(0.05, 3.0, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0.0, 0.3, (B, T))).astype(np.float32)
    shape = (B, T) if per_token else (B,)
    adv = (adv_scale * rng.normal(0.0, 1.0, shape)).astype(np.float32)
    return dict(logp=logp, old=old, adv=adv, mask=mask)


def _adv_BT(d):
    return np.broadcast_to(d["adv"][:, None] if d["adv"].ndim == 1 else d["adv"], (B, T))


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grad(cfg, logp, old, adv, mask, key):
    def f(lp):
        s, den, m = rl.policy_loss(cfg, lp, old, adv, mask, key=key)
        return rl.finalize_loss(s, den), (s, den, m)

    (loss, (s, den, m)), g = jax.value_and_grad(f, has_aux=True)(logp)
    return loss, s, den, m, g


def _run(cfg, d, key=None):
    key = jax.random.key(7) if key is None else key
    args = [jnp.asarray(d[k]) for k in ("logp", "old", "adv", "mask")]
    loss, s, den, m, g = _loss_and_grad(cfg, *args, key)
    return float(loss), float(s), float(den), rl.finalize_metrics(m), np.asarray(g, np.float64)


def _verl_agg(loss_mat, mask, mode):
    """verl's aggregation, with ours for seq-mean-token-sum-norm: verl divides the token
    sums by T alone, the package (Dr. GRPO's eq.) by #sequences x T."""
    value = ref.agg_loss(loss_mat, mask, mode)
    if mode == "seq-mean-token-sum-norm":
        value /= (mask.sum(-1) > 0).sum()
    return value


def _f64(d):
    return {k: np.asarray(v, np.float64) for k, v in d.items()}


# ---- values against verl, every aggregation -----------------------------------------------


@pytest.mark.parametrize("mode", rl.AGG_MODES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_matches_verl(mode, per_token, seed):
    d = _batch(seed, per_token)
    cfg = rl.get_preset("cispo", agg=mode, clip_low=0.2, clip_high=0.28)
    loss, _, _, m, g = _run(cfg, d)
    x = _f64(d)
    pg, clipfrac = ref.cispo(x["old"], x["logp"], _adv_BT(x), x["mask"], 0.2, 0.28)
    assert loss == pytest.approx(_verl_agg(pg, x["mask"], mode), rel=1e-5, abs=1e-6)
    assert m["policy/clip_frac"] == pytest.approx(clipfrac, rel=1e-6)
    if mode == "token-mean":  # the gradient of -sg(w) A log pi is -w A on every token
        w = np.clip(np.exp(x["logp"] - x["old"]), 0.8, 1.28)
        want = -w * _adv_BT(x) * x["mask"] / x["mask"].sum()
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", rl.AGG_MODES)
@pytest.mark.parametrize("per_token", [False, True])
def test_sapo_matches_verl(mode, per_token):
    d = _batch(2, per_token)
    cfg = rl.get_preset("sapo", agg=mode, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    loss, _, _, _, g = _run(cfg, d)
    x = _f64(d)
    adv = _adv_BT(x)
    pg = ref.sapo(x["old"], x["logp"], adv, 1.0, 1.05)
    assert loss == pytest.approx(_verl_agg(pg, x["mask"], mode), rel=1e-5, abs=1e-6)
    if mode == "token-mean":  # d/dlogp of -f(r) A: -A 4 s (1 - s) r, s = sigmoid(tau (r - 1))
        r = np.exp(x["logp"] - x["old"])
        tau = np.where(adv > 0, 1.0, 1.05)
        s = 1 / (1 + np.exp(-tau * (r - 1)))
        want = -adv * 4 * s * (1 - s) * r * x["mask"] / x["mask"].sum()
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", rl.AGG_MODES)
def test_gpg_loss_matches_verl(mode):
    d = _batch(3)
    cfg = rl.AlgorithmConfig(objective="gpg", agg=mode)
    loss, _, _, _, g = _run(cfg, dict(d, old=d["logp"]))
    x = _f64(d)
    pg = ref.gpg_loss(x["logp"], _adv_BT(x))
    assert loss == pytest.approx(_verl_agg(pg, x["mask"], mode), rel=1e-5, abs=1e-6)
    if mode == "token-mean":
        np.testing.assert_allclose(g, -_adv_BT(x) * x["mask"] / x["mask"].sum(), rtol=1e-5)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("seed", [4, 5])
def test_gmpo_matches_verl_geo_mean(per_token, seed):
    d = _batch(seed, per_token, empty_rows=False)
    d["old"] = (d["logp"] + np.random.default_rng(seed).normal(0, 0.6, (B, T))).astype(np.float32)
    cfg = rl.get_preset("gmpo", clip_low=0.4, clip_high=0.3)
    loss, _, _, m, g = _run(cfg, d)
    x = _f64(d)
    adv = _adv_BT(x)
    want, _ = ref.geo_mean(x["old"], x["logp"], adv, x["mask"], 0.4, 0.3)
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-6)
    # The gradient: -A_i exp(mean_t clipped d) / n_i on the tokens not clipped on the
    # pessimistic side of A, divided by #sequences.
    dlt = x["logp"] - x["old"]
    sgn = np.sign(adv)
    kl_min = sgn * np.minimum(sgn * dlt, sgn * np.clip(dlt, -0.4, 0.3))
    n = x["mask"].sum(-1, keepdims=True)
    a_i = (adv * x["mask"]).sum(-1, keepdims=True) / n
    e_i = np.exp((kl_min * x["mask"]).sum(-1, keepdims=True) / n)
    flows = ~(((adv > 0) & (dlt > 0.3)) | ((adv < 0) & (dlt < -0.4))) & (adv != 0)
    np.testing.assert_allclose(g, -a_i * e_i * flows * x["mask"] / n / B, rtol=1e-4, atol=1e-7)
    clipped = dlt != np.clip(dlt, -0.4, 0.3)
    assert m["policy/clip_frac_high"] == pytest.approx(
        ref.masked_mean((clipped & (adv > 0)).astype(float), x["mask"]), rel=1e-6
    )


def test_gmpo_counts_only_rows_with_tokens():
    """verl's torch.mean counts empty rows (loss 0) in the mean; the package's
    seq-mean-token-mean counts the rows with a token, as every other sequence mean."""
    d = _batch(6)
    d["mask"][[3, 5]] = 0.0
    n_empty = int((d["mask"].sum(-1) == 0).sum())
    assert n_empty > 0
    loss = _run(rl.get_preset("gmpo"), d)[0]
    want, _ = ref.geo_mean(
        *(_f64(d)[k] for k in ("old", "logp")), _adv_BT(_f64(d)), d["mask"], 0.4, 0.4
    )
    assert loss == pytest.approx(want * B / (B - n_empty), rel=1e-5)


def test_gmpo_is_defined_for_the_sequence_mean_only():
    with pytest.raises(ValueError, match="objective='gmpo' is defined for agg in"):
        rl.get_preset("gmpo", agg="token-mean")


def _clip_cov_case(seed):
    d = _batch(seed, adv_scale=3.0)
    cfg = rl.get_preset("clip_cov", clip_cov_ratio=0.1, clip_low=0.2, clip_high=0.2)
    return d, cfg


@pytest.mark.parametrize("mode", rl.AGG_MODES)
@pytest.mark.parametrize("seed", [0, 8])
def test_clip_cov_matches_verl(mode, seed):
    d, cfg = _clip_cov_case(seed)
    cfg = dataclasses.replace(cfg, agg=mode)
    key = jax.random.key(seed)
    loss, _, _, m, g = _run(cfg, d, key)
    x = _f64(d)
    u = np.asarray(jax.random.uniform(key, (B, T)))  # clip_cov_draws' draws, unsharded

    def perm_of(cand):  # the candidates by decreasing draw: a uniformly random order
        return np.argsort(-u[cand[:, 0], cand[:, 1]], kind="stable")

    pg, selected = ref.clip_cov(
        x["old"], x["logp"], _adv_BT(x), x["mask"], 0.2, 0.2, 0.1, 1.0, 5.0, perm_of
    )
    assert selected.sum() >= 2
    assert loss == pytest.approx(_verl_agg(pg, x["mask"], mode), rel=1e-5, abs=1e-6)
    assert m["policy/cov_selected_frac"] == pytest.approx(selected.sum() / x["mask"].sum())
    assert np.all(g[selected] == 0.0)  # detached: no gradient


@pytest.mark.parametrize("mode", rl.AGG_MODES)
@pytest.mark.parametrize("per_token", [False, True])
def test_kl_cov_matches_verl(mode, per_token):
    d = _batch(9, per_token)
    x = _f64(d)
    pg = ref.kl_cov(x["old"], x["logp"], _adv_BT(x), x["mask"], 0.1, 0.5)
    loss, _, _, m, _ = _run(rl.get_preset("kl_cov", agg=mode, kl_cov_ratio=0.1, kl_cov_coef=0.5), d)
    assert loss == pytest.approx(_verl_agg(pg, x["mask"], mode), rel=1e-5, abs=1e-6)
    assert m["policy/cov_selected_frac"] == pytest.approx(
        int(0.1 * x["mask"].sum()) / x["mask"].sum()
    )


# ---- the sampler-trainer correction, composed as verl composes it ---------------------------


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo", "kl_cov"])
def test_is_correction_weights_the_policy_term_as_verl(name):
    d = _batch(10, empty_rows=False)
    rng = np.random.default_rng(10)
    behaviour = (d["old"] + rng.normal(0, 0.5, (B, T))).astype(np.float32)
    cfg = rl.get_preset(name, is_correction="tis", is_cap=1.5)
    s, den, _ = rl.policy_loss(
        cfg,
        *(jnp.asarray(d[k]) for k in ("logp", "old", "adv", "mask")),
        behaviour_logp_BT=jnp.asarray(behaviour),
    )
    x = _f64(d)
    w = np.minimum(np.exp(x["old"] - behaviour), 1.5) * x["mask"]  # verl's token TIS
    adv = _adv_BT(x)
    if name == "gmpo":
        want, _ = ref.geo_mean(x["old"], x["logp"], adv, x["mask"], 0.4, 0.4, is_weights=w)
    else:
        pg = {
            "cispo": lambda: ref.cispo(x["old"], x["logp"], adv, x["mask"], 1.0, 0.2)[0],
            "sapo": lambda: ref.sapo(x["old"], x["logp"], adv, 1.0, 1.05),
            "kl_cov": lambda: ref.kl_cov(x["old"], x["logp"], adv, x["mask"], 2e-3, 1.0),
        }[name]()
        want = _verl_agg(pg * w, x["mask"], cfg.agg)
    assert float(rl.finalize_loss(s, den)) == pytest.approx(want, rel=1e-5, abs=1e-6)


# ---- micro-batches and packing ----------------------------------------------------------------


def _slices(n):
    step = B // n
    return [slice(k * step, (k + 1) * step) for k in range(n)]


@pytest.mark.parametrize("name", ["cispo", "sapo", "gpg", "gmpo"])
@pytest.mark.parametrize("n_micro", [2, 3])
def test_micro_batches_combine_exactly(name, n_micro):
    d = _batch(11)
    cfg = rl.get_preset(name) if name != "gpg" else rl.AlgorithmConfig(objective="gpg")
    modes = (cfg.agg,) if name == "gmpo" else rl.AGG_MODES
    for mode in modes:
        c = dataclasses.replace(cfg, agg=mode)
        _, s, den, _, g = _run(c, d)
        parts = [_run(c, {k: v[sl] for k, v in d.items()}) for sl in _slices(n_micro)]
        assert sum(p[2] for p in parts) == den
        assert sum(p[1] for p in parts) == pytest.approx(s, rel=1e-5, abs=1e-6)
        # Each part's gradient of loss_sum_k / D (its own finalize divides by its own
        # denominator: rescale) adds up to the whole batch's.
        g_parts = np.concatenate([p[4] * p[2] / den for p in parts])
        np.testing.assert_allclose(g_parts, g, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo", "kl_cov"])
def test_packed_micro_batch_equals_its_rows(name):
    """The trainer's packed path passes the whole mini-batch with the mask cut to one micro-
    batch's rows: the loss equals that of the rows alone."""
    d = _batch(12)
    cfg = rl.get_preset(name, kl_cov_ratio=0.1) if name == "kl_cov" else rl.get_preset(name)
    rows = np.arange(B) % 3 == 1
    _, s, den, m, _ = _run(cfg, dict(d, mask=d["mask"] * rows[:, None]))
    _, s1, den1, m1, _ = _run(cfg, {k: v[rows] for k, v in d.items()})
    assert (s, den) == pytest.approx((s1, den1), rel=1e-5, abs=1e-6)
    assert m["policy/ratio_max"] == pytest.approx(m1["policy/ratio_max"])


def test_cov_selection_is_per_call():
    """Clip-Cov's and KL-Cov's selection ranks the tokens of one call (verl: of one micro-
    batch); pass the mini-batch in one call (or shard it with axis_name) for the selection
    of the mini-batch."""
    d = _batch(13)
    cfg = rl.get_preset("kl_cov", kl_cov_ratio=0.05)
    _, s, _, m, _ = _run(cfg, d)
    halves = [_run(cfg, {k: v[sl] for k, v in d.items()}) for sl in _slices(2)]
    n = d["mask"].sum()
    n_halves = [d["mask"][sl].sum() for sl in _slices(2)]
    assert m["policy/cov_selected_frac"] * n == int(0.05 * n)
    assert sum(h[3]["policy/cov_selected_frac"] * k for h, k in zip(halves, n_halves)) == sum(
        max(int(0.05 * k), 1) for k in n_halves
    )
