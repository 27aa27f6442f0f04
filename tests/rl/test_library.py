"""What a codebase that depends on jaxrl4llm.rl relies on: configs checked when built,
arguments checked for shape and dtype, traced hyperparameters (a schedule compiles once),
float32 inside whatever the inputs' dtype, advantages without gradient, and the registries
through which a user's own loss or estimator runs, in the library and in the trainer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.rl import registry

B, T, G = 8, 5, 4
RNG = np.random.default_rng(0)
LOGP = jnp.asarray(-RNG.uniform(0.1, 2.0, (B, T)), jnp.float32)
OLD = LOGP + jnp.asarray(RNG.normal(0, 0.2, (B, T)), jnp.float32)
ADV = jnp.asarray(RNG.normal(size=B), jnp.float32)
MASK = jnp.asarray(np.arange(T)[None] < RNG.integers(1, T + 1, B)[:, None])
CORRECT = jnp.asarray(RNG.random(B) < 0.5)

# ---- checked when built -------------------------------------------------------------------


@pytest.mark.parametrize(
    "knob,value",
    [
        ("kl_in", "Loss"),
        ("importance", "seq"),
        ("rejected_rows", "zer"),
        ("objective", "NLL"),
        ("advantage", "Normalized"),
        ("agg", "mean"),
        ("is_correction", "TIS"),
    ],
)
def test_typos_fail_when_the_config_is_built(knob, value):
    with pytest.raises(ValueError, match=f"{knob}={value!r}"):
        rl.AlgorithmConfig(**{knob: value})
    with pytest.raises(ValueError, match=f"{knob}={value!r}"):
        rl.get_preset("dapo", **{knob: value})
    with pytest.raises(ValueError, match=f"{knob}={value!r}"):
        dataclasses.replace(rl.get_preset("grpo"), **{knob: value})


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"objective": "cispo", "dual_clip": 3.0}, "dual_clip=3.0 applies to objectives"),
        ({"objective": "sapo", "importance": "sequence"}, "importance='sequence' \\(GSPO\\)"),
        ({"objective": "gmpo", "agg": "token-mean"}, "objective='gmpo' is defined for agg"),
        ({"sapo_tau_neg": 0.0}, "sapo_tau_neg=0.0 must be > 0"),
        ({"clip_cov_lb": 5.0}, "clip_cov_lb=5.0 must be below clip_cov_ub=5.0"),
        ({"kl_cov_ratio": 2.0}, "kl_cov_ratio=2.0 must be in \\(0, 1\\]"),
        ({"kl_coef": 0.1}, "kl_coef=0.1 but kl_in=None"),
    ],
)
def test_conflicting_knobs_fail_naming_the_conflict(overrides, match):
    with pytest.raises(ValueError, match=match):
        rl.AlgorithmConfig(**overrides)


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "gpg"])
def test_new_losses_compose_with_the_existing_tricks(name):
    """KL in the loss or the reward, rejection filters, rejected rows kept at A = 0, the
    overlong filter, an entropy bonus and every IS correction."""
    for over in (
        {"kl_in": "loss", "kl_coef": 0.01},
        {"kl_in": "reward", "kl_estimator": "k1", "kl_coef": 0.01},
        {"reject_all_correct": True, "reject_all_wrong": True, "rejected_rows": "zero"},
        {"overlong_filter": True, "entropy_coef": 0.01},
        *({"is_correction": c} for c in ("tis", "mis", "icepop", "geo_mask")),
    ):
        cfg = rl.validate(rl.get_preset(name, **over), G)
        adv, keep, _ = rl.compute_advantages(
            cfg, ADV, CORRECT, MASK, G, truncated_B=~CORRECT, logp_BT=OLD, ref_logp_BT=LOGP
        )
        s, d, _ = rl.policy_loss(
            cfg,
            LOGP,
            OLD,
            adv,
            MASK,
            keep,
            ref_logp_BT=OLD,
            entropy_BT=jnp.ones((B, T)),
            behaviour_logp_BT=OLD - 0.05,
        )
        assert np.isfinite(float(rl.finalize_loss(s, d))), (name, over)


@pytest.mark.parametrize(
    "knob,flag",
    [
        ("dynamic_sampling", "--dynamic_sampling"),
        ("max_resample_rounds", "--max_resample_rounds"),
        ("log_kl_ref", "--log_kl_ref"),
    ],
)
def test_trainer_knobs_are_not_the_librarys(knob, flag):
    """Knobs only the trainer reads are not in AlgorithmConfig; asked of get_preset, the error
    names the trainer's flag instead of silently doing nothing."""
    assert knob not in {f.name for f in dataclasses.fields(rl.AlgorithmConfig)}
    with pytest.raises(ValueError, match=f"{knob}: the trainer's flags \\({flag},"):
        rl.get_preset("dapo", **{knob: 1})


# ---- arguments --------------------------------------------------------------------------


def test_a_mask_that_would_broadcast_is_refused():
    with pytest.raises(ValueError, match=r"mask_BT has shape \(8, 1\); expected \(8, 5\)"):
        rl.policy_loss(rl.get_preset("grpo", kl_coef=0.0), LOGP, OLD, ADV, MASK[:, :1])
    with pytest.raises(ValueError, match=r"keep_B has shape \(7,\); expected \(8,\)"):
        rl.policy_loss(rl.get_preset("dapo"), LOGP, OLD, ADV, MASK, jnp.ones(7, bool))
    with pytest.raises(ValueError, match=r"ref_logp_BT has shape \(8, 4\)"):
        rl.policy_loss(rl.get_preset("dapo"), LOGP, OLD, ADV, MASK, ref_logp_BT=LOGP[:, :4])
    with pytest.raises(ValueError, match="logp_BT has dtype int32; expected a float dtype"):
        rl.policy_loss(rl.get_preset("dapo"), jnp.zeros((B, T), jnp.int32), None, ADV, MASK)


def test_rollout_arrays_must_match_the_batch():
    cfg = rl.get_preset("grpo")
    with pytest.raises(ValueError, match=r"rewards_B has shape \(6,\); expected \(8,\)"):
        rl.compute_advantages(cfg, ADV[:6], CORRECT, MASK, G)
    with pytest.raises(ValueError, match=r"mask_BT has shape \(8,\); expected rank 2"):
        rl.compute_advantages(cfg, ADV, CORRECT, MASK[:, 0], G)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['logp'\]"):
        rl.compute_advantages_and_returns(cfg, ADV, CORRECT, MASK, G, logp=LOGP)


# ---- traced hyperparameters ----------------------------------------------------------------


def test_a_schedule_of_hyperparameters_compiles_once():
    traces = []

    def loss_value(cfg, logp):
        s, d, _ = rl.policy_loss(
            cfg,
            logp,
            OLD,
            ADV,
            MASK,
            ref_logp_BT=OLD - 0.1,
            entropy_BT=jnp.full((B, T), 0.7),
            behaviour_logp_BT=OLD + 0.3,
        )
        return rl.finalize_loss(s, d)

    @jax.jit
    def loss(cfg, logp):  # cfg traced: its floats are arguments
        traces.append(1)
        return loss_value(cfg, logp)

    static = jax.jit(loss_value, static_argnums=0)  # cfg static: one program per value
    base = rl.get_preset("dapo", kl_in="loss", is_correction="tis")
    values = []
    for i in range(4):
        cfg = dataclasses.replace(
            base,
            kl_coef=0.01 * (i + 1),
            clip_low=0.1 + 0.02 * i,
            clip_high=0.2 + 0.03 * i,
            entropy_coef=0.001 * i,
            is_cap=1.1 + 0.2 * i,
        )
        values.append(float(loss(cfg, LOGP)))
        assert values[-1] == pytest.approx(float(static(cfg, LOGP)), rel=1e-6)
    assert len(traces) == 1 and len(set(values)) == 4
    assert set(rl.algorithm_config.TRACED_FIELDS) >= {
        "kl_coef",
        "clip_low",
        "clip_high",
        "entropy_coef",
        "is_cap",
        "is_lower",
        "is_upper",
        "dual_clip",
    }


# ---- precision and gradients ------------------------------------------------------------


def test_bfloat16_inputs_are_computed_in_float32():
    lp = jnp.full((1, 4), -1.0, jnp.bfloat16)
    ref = jnp.full((1, 4), -0.99, jnp.bfloat16)
    d = float(np.float64(np.asarray(lp[0, 0], np.float32)) - np.asarray(ref[0, 0], np.float32))
    kl = rl.kl_estimate(lp, ref, "k3")
    assert kl.dtype == jnp.float32
    assert float(kl[0, 0]) == pytest.approx(np.exp(-d) + d - 1, rel=1e-3) and float(kl[0, 0]) > 0
    s, den, _ = rl.policy_loss(
        rl.get_preset("grpo"),
        lp,
        lp + jnp.bfloat16(0.01),
        jnp.ones(1),
        jnp.ones((1, 4)),
        ref_logp_BT=ref,
    )
    assert s.dtype == jnp.float32


def test_advantages_carry_no_gradient():
    def f(adv):
        s, d, _ = rl.policy_loss(rl.get_preset("cispo"), LOGP, OLD, adv, MASK)
        return rl.finalize_loss(s, d)

    assert float(jnp.abs(jax.grad(f)(ADV)).max()) == 0.0

    def g(r):
        adv, _, _ = rl.compute_advantages(rl.get_preset("grpo"), r, CORRECT, MASK, G)
        return adv.sum()

    assert float(jnp.abs(jax.grad(g)(ADV)).max()) == 0.0


# ---- registries ----------------------------------------------------------------------------


@pytest.fixture
def custom_names():
    yield
    registry._POLICY_LOSSES.pop("test_reinforce", None)
    registry._ADVANTAGES.pop("test_sign", None)


def test_a_registered_loss_and_estimator_run_through_the_entry_points(custom_names):
    @rl.register_policy_loss("test_reinforce")
    def reinforce(config, x: rl.PolicyInputs):
        return -x.advantages_BT * x.logp_BT, {"negative": x.advantages_BT < 0}

    @rl.register_advantage("test_sign")
    def sign(config, x: rl.AdvantageInputs):
        return jnp.where(x.correct_B, 1.0, -1.0), None

    cfg = rl.AlgorithmConfig(objective="test_reinforce", advantage="test_sign")
    assert "test_reinforce" in rl.algorithms.OBJECTIVES and "test_sign" in rl.algorithms.ADVANTAGES
    adv, keep, _ = rl.compute_advantages(cfg, ADV, CORRECT, MASK, G)
    np.testing.assert_array_equal(np.asarray(adv), np.where(np.asarray(CORRECT), 1.0, -1.0))
    s, d, m = jax.jit(rl.policy_loss, static_argnums=0)(cfg, LOGP, None, adv, MASK, keep)
    mask = np.asarray(MASK, np.float64)
    want = (-np.asarray(adv)[:, None] * np.asarray(LOGP) * mask).sum() / mask.sum()
    assert float(rl.finalize_loss(s, d)) == pytest.approx(want, rel=1e-6)
    assert float(rl.finalize_metrics(m)["policy/negative_frac"]) == pytest.approx(
        float((MASK * (adv < 0)[:, None]).sum() / MASK.sum())
    )
    with pytest.raises(ValueError, match="policy loss 'test_reinforce' is already registered"):
        rl.register_policy_loss("test_reinforce")(lambda c, x: (x.logp_BT, {}))


def test_a_registered_loss_is_a_trainer_flag_choice(custom_names):
    from jaxrl4llm.config import options
    from jaxrl4llm.train.config import TrainConfig

    choices = options.option_map(TrainConfig)["objective"].choices
    assert "test_reinforce" not in choices and "cispo" in choices
    rl.register_policy_loss("test_reinforce")(lambda c, x: (-x.advantages_BT * x.logp_BT, {}))
    assert "test_reinforce" in choices
    config = TrainConfig().replace(algorithm="grpo", objective="test_reinforce")
    assert config.algorithm.objective == "test_reinforce"
    assert options.parse_text(options.option_map(TrainConfig)["objective"], "test_reinforce")


def test_the_trainer_refuses_what_its_rollout_cannot_feed():
    """otb needs the sampler's sum of squared probabilities: the trainer refuses it, naming
    the flag (exit 2 through the CLI's FlagError); the new losses pass its checks."""
    from jaxrl4llm.config.errors import FlagError
    from jaxrl4llm.train.config import TrainConfig
    from jaxrl4llm.train.config.checks import validate

    with pytest.raises(FlagError, match="--advantage=otb needs the sampling policy's"):
        validate(TrainConfig().replace(algorithm="grpo", advantage="otb", kl_coef=0.0), 1)
    for name in ("cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "gpg", "opo", "grpo_passk"):
        validate(TrainConfig().replace(algorithm=name), 1)
