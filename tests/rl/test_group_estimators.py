"""OPO, GRPO for pass@k (verl's and the analytical one), GPG's advantage and the optimal
token baseline against numpy transcriptions of verl's core_algos.py and the authors' code
(tests/rl/verl_reference.py), on random groups; rejected rows as rows never sampled; and
through compute_advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl

from tests.rl import verl_reference as ref


def _groups(seed, G=5, P=6, T=6, binary=True):
    rng = np.random.default_rng(seed)
    p_correct = rng.choice([0.0, 0.3, 0.6, 1.0], P)
    correct = (rng.random((P, G)) < p_correct[:, None]).reshape(-1)
    rewards = correct.astype(np.float32) if binary else rng.normal(size=P * G).astype(np.float32)
    lens = rng.integers(1, T + 1, P * G)
    mask = (np.arange(T)[None] < lens[:, None]).astype(np.float32)
    index = np.repeat(np.arange(P), G)
    return rewards, correct, mask, index


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("binary", [True, False])
def test_opo_matches_verl(seed, binary):
    r, _, mask, index = _groups(seed, binary=binary)
    got = rl.opo_advantages(jnp.asarray(r), jnp.asarray(mask.sum(1)), 5)
    want = ref.opo(r.astype(np.float64), mask.sum(1), index)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_verl(seed, norm):
    r, _, _, index = _groups(seed, binary=False)
    got = rl.grpo_passk_advantages(jnp.asarray(r), 5, std_normalize=norm)
    want = ref.grpo_passk(r.astype(np.float64), index, norm=norm)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_grpo_passk_ties_give_zero():
    r = jnp.array([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    got = np.asarray(rl.grpo_passk_advantages(r, 4))
    assert np.all(got[:4] == 0) and got[4] == pytest.approx(1 / (0.5 + 1e-6))
    assert np.all(got[5:] == 0)


@pytest.mark.parametrize("G,k", [(4, 1), (4, 2), (8, 3), (8, 8), (6, 4)])
def test_passk_matches_the_authors_code(G, k):
    _, correct, _, _ = _groups(G + k, G=G)
    got = rl.passk_advantages(jnp.asarray(correct), G, k)
    want = ref.passk_authors(correct.astype(float).reshape(-1, G), k)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_gpg_matches_the_authors_code(seed):
    r, _, _, _ = _groups(seed, binary=seed % 2 == 0)
    got = rl.gpg_advantages(jnp.asarray(r), 5)
    want = ref.gpg_authors(r.astype(np.float64), 5)
    # The authors divide by inverse_alpha + 1e-5; the paper's alpha = B / (B - M) exactly.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("zero_tail", [False, True])
@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baseline_matches_verl(seed, zero_tail, with_is):
    r, _, mask, index = _groups(seed, binary=False)
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.01, 3.0, mask.shape).astype(np.float32)
    sum_sq = rng.uniform(np.exp(logp) ** 2, 1.0).astype(np.float32)
    is_w = rng.uniform(0.5, 1.5, mask.shape).astype(np.float32) if with_is else None
    got, ret = rl.optimal_token_baseline_advantages(
        jnp.asarray(r),
        jnp.asarray(mask),
        jnp.asarray(logp),
        jnp.asarray(sum_sq),
        5,
        is_weights_BT=None if is_w is None else jnp.asarray(is_w),
        zero_tail=zero_tail,
    )
    want, want_ret = ref.otb(
        r.astype(np.float64),
        mask.astype(np.float64),
        logp.astype(np.float64),
        sum_sq.astype(np.float64),
        index,
        zero_tail=zero_tail,
        is_weights=is_w,
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-6)


# ---- rejected rows: as if never sampled (verl sees the remaining rows of each group) ----------


@pytest.mark.parametrize("seed", range(3))
def test_rejected_rows_are_rows_never_sampled(seed):
    r, correct, mask, index = _groups(seed, binary=False)
    keep = np.random.default_rng(seed + 9).random(r.size) < 0.7
    keep[::5] = True  # every group keeps a row
    keep[1::5] = True  # and two
    k = jnp.asarray(keep)
    lens = mask.sum(1)
    cases = {
        "opo": (
            rl.opo_advantages(jnp.asarray(r), jnp.asarray(lens), 5, keep_B=k),
            ref.opo(r[keep].astype(np.float64), lens[keep], index[keep]),
        ),
        "grpo_passk": (
            rl.grpo_passk_advantages(jnp.asarray(r), 5, keep_B=k),
            ref.grpo_passk(r[keep].astype(np.float64), index[keep]),
        ),
    }
    for name, (got, want) in cases.items():
        got = np.asarray(got)
        assert np.all(got[~keep] == 0), name
        np.testing.assert_allclose(got[keep], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_flat_groups_are_exactly_zero_under_jit():
    """A group whose rewards are equal gets exactly 0 from every group baseline."""
    r = jnp.repeat(jnp.array([0.1, 0.7, 1 / 3, 1.0]), 6)
    lens = jnp.asarray(np.random.default_rng(0).integers(1, 9, 24), jnp.float32)
    opo = jax.jit(rl.opo_advantages, static_argnums=2)(r, lens, 6)
    gpg = jax.jit(rl.gpg_advantages, static_argnums=1)(r, 6)
    assert np.all(np.asarray(opo) == 0) and np.all(np.asarray(gpg) == 0)


# ---- through compute_advantages -------------------------------------------------------------


@pytest.mark.parametrize("name", ["opo", "grpo_passk", "gpg"])
def test_presets_dispatch_their_estimator(name):
    r, correct, mask, index = _groups(3, binary=False)
    adv, keep, _ = rl.compute_advantages(
        rl.get_preset(name), jnp.asarray(r), jnp.asarray(correct), jnp.asarray(mask), 5
    )
    want = {
        "opo": lambda: ref.opo(r.astype(np.float64), mask.sum(1), index),
        "grpo_passk": lambda: ref.grpo_passk(r.astype(np.float64), index),
        "gpg": lambda: ref.gpg_authors(r.astype(np.float64), 5),
    }[name]()
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(keep))


def test_passk_and_otb_through_compute_advantages():
    r, correct, mask, _ = _groups(5, G=4)
    cfg = rl.AlgorithmConfig(advantage="passk", passk_k=2)
    adv, _, _ = rl.compute_advantages(
        cfg, jnp.asarray(r), jnp.asarray(correct), jnp.asarray(mask), 4
    )
    want = ref.passk_authors(correct.astype(float).reshape(-1, 4), 2)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-4, atol=1e-4)
    otb = rl.AlgorithmConfig(advantage="otb")
    lp = jnp.full(mask.shape, -1.0)
    with pytest.raises(ValueError, match="needs logp_BT .* and sum_pi_squared_BT"):
        rl.compute_advantages(otb, jnp.asarray(r), jnp.asarray(correct), jnp.asarray(mask), 4)
    adv, _, _ = rl.compute_advantages(
        otb,
        jnp.asarray(r),
        jnp.asarray(correct),
        jnp.asarray(mask),
        4,
        logp_BT=lp,
        sum_pi_squared_BT=jnp.full(mask.shape, 0.5),
    )
    assert adv.shape == mask.shape and np.all(np.asarray(adv)[mask == 0] == 0)


def test_estimator_knobs_are_checked():
    with pytest.raises(ValueError, match="advantage='passk' needs passk_k"):
        rl.AlgorithmConfig(advantage="passk")
    with pytest.raises(ValueError, match="passk_k=2 with advantage='normalized'"):
        rl.AlgorithmConfig(passk_k=2)
    with pytest.raises(ValueError, match="passk_k=8 needs group_size >= 8"):
        rl.validate(rl.AlgorithmConfig(advantage="passk", passk_k=8), 4)
    with pytest.raises(ValueError, match="advantage='opo' needs group_size >= 2"):
        rl.validate(rl.get_preset("opo"), 1)
    with pytest.raises(ValueError, match="otb_zero_tail applies to advantage='otb' only"):
        rl.AlgorithmConfig(otb_zero_tail=True)
    with pytest.raises(ValueError, match="kl_in='reward' needs an advantage that takes token"):
        rl.AlgorithmConfig(advantage="otb", kl_in="reward", kl_estimator="k1", kl_coef=0.1)
