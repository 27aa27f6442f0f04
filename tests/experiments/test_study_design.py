"""The design check (experiments/study_design.py): identical arms refused, constant factors and
flags without effect reported; and Figure 4's arm 6 (both filters, group std, no mean) by hand."""

import os

import numpy as np
import pytest

from experiments import study_design, study_spec
from jaxrl4llm.rl import algorithms, presets

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "studies")


def _check(spec: str, scale: str = "cpu"):
    study = study_spec.load_study(spec)
    return study_design.check_design(study_spec.plan(study, scale, "/tmp/unused"), study.path)


def test_the_old_tricks_norm_reward_arms_are_refused():
    with pytest.raises(study_design.DegenerateDesignError) as e:
        _check(os.path.join(FIXTURES, "degenerate_tricks_norm.toml"))
    text = str(e.value)
    assert "group_std_01 = group_std_pm1" in text and "batch_std_01 = batch_std_pm1" in text
    # Without a std the {-1,1} advantages are twice the {0,1} ones: not the same arm.
    assert "no_std_01 = no_std_pm1" not in text


def test_the_old_mean_zero_std_arm_is_grpo_again():
    with pytest.raises(study_design.DegenerateDesignError, match=r"\(mean_zero_std = grpo\)"):
        _check(os.path.join(FIXTURES, "degenerate_mean_zero_std.toml"))


def _spec(tmp_path, arms: dict[str, list[str]]) -> str:
    lines = [
        'name = "t"',
        'primary_metric = "eval/easy/avg@4"',
        "[scales.cpu]",
        'flags = ["--flagfile=experiments/studies/cpu_minimalist.flags"]',
        "seeds = [0, 1]",
    ]
    for name, flags in arms.items():
        lines += [
            "[[arms]]",
            f'name = "{name}"',
            "cpu = [" + ", ".join(f'"{f}"' for f in flags) + "]",
        ]
    path = tmp_path / "t.toml"
    path.write_text("\n".join(lines))
    return str(path)


def test_a_constant_factor_and_a_flag_without_effect_are_reported(tmp_path):
    spec = _spec(
        tmp_path,
        {
            "dr_01": ["--algorithm=dr_grpo", "--agg=token-mean", "--binary_reward=0,1"],
            "dr_pm1": ["--algorithm=dr_grpo", "--agg=token-mean", "--binary_reward=-1,1"],
            # GRPO rejects no group, so where its rows go changes nothing.
            "grpo": ["--algorithm=grpo", "--rejected_rows=zero"],
        },
    )
    check = _check(spec)
    assert check.identical == []
    assert [(a, b) for a, b, _ in check.proportional] == [("dr_01", "dr_pm1")]
    assert check.proportional[0][2] == pytest.approx(0.5, rel=1e-5)
    assert ("grpo", "--rejected_rows=zero") in check.no_effect
    # --agg is the base flagfile's value already; --binary_reward is not.
    assert ("dr_01", "--agg=token-mean") in check.no_effect
    assert ("dr_pm1", "--binary_reward=-1,1") not in check.no_effect
    assert any("factor 0.5" in w for w in check.warnings())


@pytest.mark.parametrize(
    "name",
    [
        "minimalist_fig4",
        "raft_vs_grpo",
        "tricks_norm",
        "dapo_vs_lite_ppo",
        "reinforcepp_vs_grpo",
        "policy_losses",
    ],
)
def test_shipped_cpu_designs_pass_without_warnings(name):
    check = _check(name)
    assert check.identical == [] and check.no_effect == [], check.warnings()


def test_figure_4_arm_6_divides_by_the_group_std_without_the_mean():
    config = presets.get_preset("reinforce_rej", std="group")
    correct = np.array(
        [1, 1, 0, 0] + [1, 0, 0, 0] + [1, 1, 1, 1] + [0, 0, 0, 0], bool
    )  # mixed, mixed, all-correct, all-wrong
    mask = np.ones((16, 3), np.float32)
    adv, keep, _ = algorithms.compute_advantages(
        config, correct.astype(np.float32), correct, mask, 4
    )
    # Group 1: r = +1 +1 -1 -1, std (ddof 1) = sqrt(4 / 3): A = r / (sqrt(4/3) + 1e-6).
    s1 = (4 / 3) ** 0.5 + 1e-6
    # Group 2: r = +1 -1 -1 -1, mean -0.5, squares 2.25 + 3 x 0.25 = 3, / 3 = 1: std 1.
    s2 = 1.0 + 1e-6
    expected = [1 / s1, 1 / s1, -1 / s1, -1 / s1, 1 / s2, -1 / s2, -1 / s2, -1 / s2] + [0.0] * 8
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-6)
    # The removed groups stay in the loss with A = 0 (the authors' denominator).
    assert np.asarray(keep).all()
