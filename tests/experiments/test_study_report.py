"""The study report's statistics on hand-written metrics files (no training), and spec errors."""

import json
import os
import re

import numpy as np
import pytest

from experiments import study_report, study_spec, study_stats

SPEC = """
name = "hand"
primary_metric = "eval/accuracy"
threshold = 0.7
final_window = 2
[scales.x]
flags = ["--num_steps=4"]
seeds = [0, 1]
[[arms]]
name = "a"
flags = ["--algorithm=grpo"]
[[arms]]
name = "b"
flags = ["--algorithm=reinforce"]
x = ["--learning_rate=0.001"]
[[claims]]
text = "a beats b"
a = "a"
b = "b"
quantity = "auc"
expect = ">"
"""


def _write(workdir, rows):
    workdir.mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(step, acc=None, entropy=None):
    row = {"step": step}
    if acc is not None:
        row["eval/accuracy"] = acc
        row["eval/num_prompts"] = 32.0
    if entropy is not None:
        row["policy/entropy"] = entropy
    return row


def test_report_numbers_by_hand(tmp_path):
    spec = tmp_path / "hand.toml"
    spec.write_text(SPEC)
    study = study_spec.load_study(str(spec))
    runs = study_spec.plan(study, "x", str(tmp_path / "root"))
    assert [r.label for r in runs] == ["a/seed_0", "a/seed_1", "b/seed_0", "b/seed_1"]
    assert all(r.num_steps == 4 for r in runs)
    assert runs[2].argv[3:] == (
        "--num_steps=4",
        "--algorithm=reinforce",
        "--learning_rate=0.001",
        "--seed=0",
        f"--workdir={tmp_path / 'root' / 'b' / 'seed_0'}",
    )
    root = tmp_path / "root"
    # a/0: acc 0, .5, 1 at steps 0, 2, 4; entropy 3, 2, 1, 0 at steps 1-4.
    _write(
        root / "a" / "seed_0",
        [
            _run(0, 0.0),
            _run(1, entropy=3.0),
            _run(2, 0.5, 2.0),
            _run(3, entropy=1.0),
            _run(4, 1.0, 0.0),
        ],
    )
    _write(root / "a" / "seed_1", [_run(0, 0.2), _run(2, 0.4, 1.0), _run(4, 0.6, 1.0)])
    _write(root / "b" / "seed_0", [_run(0, 0.1), _run(2, 0.1), _run(4, 0.1)])
    _write(root / "b" / "seed_1", [_run(0, 0.1), _run(2, 0.9)])  # killed after step 2
    report = study_stats.build_report(study, "x", runs)
    assert [r["status"] for r in report["runs"]] == ["finished"] * 3 + ["unfinished"]
    a = report["arms"]["a"]
    assert a["final eval/accuracy"]["mean"] == pytest.approx(0.8)  # (1.0 + 0.6) / 2
    assert a["final eval/accuracy"]["se"] == pytest.approx(0.2)  # |1.0 - 0.6| / 2
    assert a["best eval/accuracy"]["values"] == pytest.approx([1.0, 0.6])
    # Trapezoids over steps 0..4, / 4: (0.5 + 1.5) / 4 = 0.5 and (0.6 + 1.0) / 4 = 0.4.
    assert a["auc eval/accuracy"]["values"] == pytest.approx([0.5, 0.4])
    # First eval step with acc >= 0.7: step 4 for seed 0; seed 1 never (1 of 2 reached).
    assert a["steps eval/accuracy>=0.7"]["values"] == [4.0]
    assert a["steps eval/accuracy>=0.7"]["reached"] == "1/2"
    # Final entropy: mean of the last 2 logged steps: (1 + 0) / 2 and (1 + 1) / 2.
    assert a["final policy/entropy"]["values"] == pytest.approx([0.5, 1.0])
    assert "final eval/num_prompts" not in a
    b = report["arms"]["b"]
    assert b["_finished"] == 1 and b["final eval/accuracy"]["se"] is None
    assert report["claims"][0]["verdict"].startswith("not measured")
    paths = study_report.write_report(report, str(root))
    md = open(paths["report.md"]).read()
    assert "| a | 2 | 0.8 ± 0.2 | 0.8 ± 0.2 | 0.45 ± 0.05 | 4 (1/2) |" in md
    assert "| b | 1 | 0.1 (n=1) | 0.1 (n=1) | 0.1 (n=1) | never (0/1) |" in md
    assert "b seed 1: unfinished (logged up to step 2 of 4: running, stopped or failed)" in md


def test_pairwise_difference_beyond_two_standard_errors():
    a = {"mean": 1.0, "se": 0.1, "n": 3}
    b = {"mean": 0.5, "se": 0.1, "n": 3}
    verdict, diff, two_se = study_stats.compare(a, b)
    assert verdict == "a>b" and diff == pytest.approx(0.5)
    assert two_se == pytest.approx(2 * 0.02**0.5)  # 0.283
    assert study_stats.compare(a, {"mean": 0.8, "se": 0.1, "n": 3})[0] == "unresolved"


def test_spec_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(SPEC.replace('flags = ["--algorithm=grpo"]', 'flags = ["--seed=3"]'))
    with pytest.raises(ValueError, match="sets --seed and --workdir"):
        study_spec.load_study(str(bad))
    bad.write_text(SPEC.replace('a = "a"', 'a = "zzz"'))
    with pytest.raises(ValueError, match="claim 1: a and b must name arms"):
        study_spec.load_study(str(bad))
    bad.write_text(SPEC.replace('x = ["--learning_rate', 'y = ["--learning_rate'))
    with pytest.raises(ValueError, match=r"unknown keys \['y'\]"):
        study_spec.load_study(str(bad))
    with pytest.raises(ValueError, match="not a shipped study.*minimalist_fig4"):
        study_spec.find_spec("no_such_study")
    bad.write_text(SPEC.replace("--learning_rate=0.001", "--learning_rate=fast"))
    study = study_spec.load_study(str(bad))
    with pytest.raises(ValueError, match="arm b at scale x.*learning_rate"):
        study_spec.plan(study, "x", str(tmp_path))


SHIPPED = [
    "minimalist_fig4",
    "raft_vs_grpo",
    "reinforcepp_vs_grpo",
    "tricks_norm",
    "dapo_vs_lite_ppo",
    "policy_losses",
]


def test_every_shipped_spec_is_checked():
    folder = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "studies")
    assert sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".toml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_specs_resolve_at_every_scale(name):
    study = study_spec.load_study(name)
    for scale in study.scales:
        runs = study_spec.plan(study, scale, "/tmp/unused")
        assert len(runs) == len(study.arms) * len(study.scales[scale].seeds)


# ---- paired statistics: against numbers computed by hand -----------------------------------

Z = 1.959964 + 0.841621  # z_0.975 + z_0.8, from a normal table
# Student's t quantiles from a t table: {n seeds: (t_0.975,n-1, t_0.8,n-1)}.
T_TABLE = {2: (12.7062, 1.3764), 3: (4.3027, 1.0607), 4: (3.1824, 0.9785)}


def test_bootstrap_interval_by_hand():
    # Two values: a resample's mean is 0, 0.5 or 1 with probabilities 1/4, 1/2, 1/4, so the
    # 2.5th and 97.5th percentiles of 10,000 resamples are 0 and 1.
    assert study_stats.bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)
    assert study_stats.bootstrap_ci([0.3, 0.3, 0.3]) == pytest.approx((0.3, 0.3))
    # Seeded: the same interval every time.
    d = [0.1, -0.05, 0.2, 0.07]
    assert study_stats.bootstrap_ci(d) == study_stats.bootstrap_ci(d)


def test_t_interval_by_hand():
    # d = 0.05, 0.08: mean 0.065, sd 0.03 / sqrt(2) = 0.021213; half-width 12.7062 x 0.021213
    # / sqrt(2) = 0.19059.
    lo, hi = study_stats.t_interval([0.05, 0.08])
    assert (lo, hi) == pytest.approx((0.065 - 0.19059, 0.065 + 0.19059), abs=1e-4)
    # d = 0.02, 0.021, 0.022: sd 0.001, half-width 4.3027 x 0.001 / sqrt(3) = 0.0024842.
    lo, hi = study_stats.t_interval([0.02, 0.021, 0.022])
    assert (lo, hi) == pytest.approx((0.021 - 0.0024842, 0.021 + 0.0024842), abs=1e-6)


def test_detectable_effect_and_seeds_needed_by_hand():
    for n, (t_alpha, t_power) in T_TABLE.items():
        mde = (t_alpha + t_power) * 0.1 / n**0.5
        assert study_stats.min_detectable_effect(0.1, n) == pytest.approx(mde, rel=1e-4)
    # sd 0.1, effect 0.05: z alone says (2.8016 x 0.1 / 0.05)^2 = 31.4 -> 32 seeds; with t
    # (table: t_0.975,32 = 2.0369, t_0.8,32 = 0.8530 at 33 seeds; 2.0345, 0.8526 at 34):
    # 2.8899 x 0.1 / sqrt(33) = 0.05031 > 0.05, 2.8871 x 0.1 / sqrt(34) = 0.04951 -> 34.
    assert study_stats.seeds_needed(0.1, 0.05) == 34
    assert study_stats.seeds_needed(0.0, 0.05) == 2
    assert study_stats.seeds_needed(0.1, 0.0) is None


def test_paired_verdicts_on_synthetic_results():
    seeds = [0.1, 0.5, 0.9]  # a large seed effect, shared by both arms of a seed
    up = {s: (v + 0.02 + 0.001 * s, v) for s, v in enumerate(seeds)}
    c = study_stats.paired_claim(up, ">", None)
    assert c["verdict"] == "supported" and c["mean_difference"] == pytest.approx(0.021)
    sd = float(np.std([0.02, 0.021, 0.022], ddof=1))
    assert c["sd_difference"] == pytest.approx(sd)
    assert c["mde"] == pytest.approx(sum(T_TABLE[3]) * sd / 3**0.5, rel=1e-4)
    # Unpaired, the same numbers are within 2 s.e. (the seeds' spread swamps 0.02).
    se = float(np.std(seeds, ddof=1)) / 3**0.5
    a = {"mean": float(np.mean(seeds)) + 0.021, "se": se, "n": 3}
    b = {"mean": float(np.mean(seeds)), "se": se, "n": 3}
    assert study_stats.compare(a, b)[0] == "unresolved"
    assert study_stats.paired_claim(up, "<", None)["verdict"] == "contradicted"
    noisy = {0: (0.5, 0.4), 1: (0.4, 0.5), 2: (0.52, 0.5)}
    c = study_stats.paired_claim(noisy, ">", None)
    assert c["verdict"] == "unresolved" and "including 0" in c["why"]
    sd = float(np.std([0.1, -0.1, 0.02], ddof=1))
    n = c["seeds_needed"]
    # The fewest seeds whose detectable effect reaches the observed 0.02 / 3 (the MDE is
    # checked against the t table above), a little above the normal approximation's count.
    mde = study_stats.min_detectable_effect
    assert mde(sd, n) <= 0.02 / 3 < mde(sd, n - 1)
    assert np.ceil((Z * sd / (0.02 / 3)) ** 2) <= n <= 1.01 * (Z * sd / (0.02 / 3)) ** 2 + 3
    assert f"(about {n} seeds would resolve it)" in c["why"]
    assert study_stats.paired_claim({0: (1.0, 0.0)}, ">", None)["verdict"] == "not measured"
    # A mean difference of 1e-4 against an s.d. of 0.1: (Z 0.1 / 1e-4)^2, about 7.8 million.
    near_zero = {0: (0.6001, 0.5), 1: (0.4001, 0.5), 2: (0.5001, 0.5)}
    c = study_stats.paired_claim(near_zero, ">", None)
    d = np.array([x - y for x, y in near_zero.values()])
    # (Z is a table's 6 decimals: equal to a relative 1e-5.)
    assert c["seeds_needed"] == pytest.approx((Z * np.std(d, ddof=1) / d.mean()) ** 2, rel=1e-5)
    assert c["seeds_needed"] > 10_000
    assert "(more than 10,000 seeds would resolve it)" in c["why"]


def test_two_seeds_that_agree_do_not_settle_a_claim():
    # d = 0.05, 0.08: the bootstrap interval is their range [0.05, 0.08], which excludes 0,
    # but the t interval (0.065 ± 0.191, by hand above) does not: unresolved.
    two = {0: (0.50, 0.45), 1: (0.60, 0.52)}
    c = study_stats.paired_claim(two, ">", None)
    assert c["ci95"] == pytest.approx([0.05, 0.08])
    assert c["ci95_t"] == pytest.approx([0.065 - 0.19059, 0.065 + 0.19059], abs=1e-4)
    assert c["verdict"] == "unresolved"


def test_equivalence_claims_use_the_margin():
    close = {0: (0.50, 0.49), 1: (0.40, 0.41), 2: (0.60, 0.60)}
    assert study_stats.paired_claim(close, "~", 0.05)["verdict"] == "supported"
    far = {0: (0.70, 0.49), 1: (0.60, 0.41), 2: (0.80, 0.60)}
    assert study_stats.paired_claim(far, "~", 0.05)["verdict"] == "contradicted"
    wide = {0: (0.60, 0.49), 1: (0.35, 0.41), 2: (0.62, 0.60)}
    c = study_stats.paired_claim(wide, "~", 0.05)
    assert c["verdict"] == "unresolved" and "crosses" in c["why"]


def test_every_shipped_claim_cites_its_source():
    # "Paper (arXiv ID) place": the paper, its arXiv id, then where in it (section, equation,
    # table, figure or named part), e.g. "Minimalist (arXiv 2504.11343) §4.1, on Figure 4".
    cite = re.compile(r"[\w+ -]+ \(arXiv \d{4}\.\d{4,5}(v\d+)?\),? \S.*")
    for name in SHIPPED:
        study = study_spec.load_study(name)
        for item in (*study.claims, *study.arms):
            assert cite.fullmatch(item.source), (name, item)


def _hand_study(tmp_path):
    """SPEC's study, its runs at scale x under tmp_path/root, and that root."""
    spec = tmp_path / "hand.toml"
    spec.write_text(SPEC)
    study = study_spec.load_study(str(spec))
    return study, study_spec.plan(study, "x", str(tmp_path / "root")), tmp_path / "root"


def test_report_counts_step_time_and_disk_by_hand(tmp_path):
    study, runs, root = _hand_study(tmp_path)
    # a/0 finished: steps of 60 + 90 + 30 + 120 s (step 0 has no step time): 5 minutes.
    timed = [
        {**_run(s, 0.5), "time/step_s": t} if t else _run(s, 0.5)
        for s, t in [(0, None), (1, 60.0), (2, 90.0), (3, 30.0), (4, 120.0)]
    ]
    _write(root / "a" / "seed_0", timed)
    (root / "a" / "seed_0" / "checkpoints").mkdir()
    (root / "a" / "seed_0" / "checkpoints" / "blob").write_bytes(b"x" * 1_000_000)
    # b/1 killed after step 2 (600 s): counted in the total, not in the per-arm minutes.
    _write(root / "b" / "seed_1", [_run(0, 0.1), {**_run(2, 0.2), "time/step_s": 600.0}])
    report = study_stats.build_report(study, "x", runs)
    costs = {(r["arm"], r["seed"]): r.get("cost") for r in report["runs"]}
    assert costs[("a", 0)]["step_time_s"] == 300.0
    metrics_bytes = os.path.getsize(root / "a" / "seed_0" / "metrics.jsonl")
    assert costs[("a", 0)]["disk_bytes"] == 1_000_000 + metrics_bytes
    assert costs[("a", 1)] is None and costs[("b", 0)] is None  # never started
    assert costs[("b", 1)]["step_time_s"] == 600.0
    md = study_report.render_markdown(report)
    # 300 + 600 s = 0.25 h over the 2 runs that exist; a finished run of arm a: 5.0 min.
    assert "Cost: 0.25 h of training steps over 2 runs" in md
    assert "Minutes a finished run, per arm: a 5.0." in md
    disk = 1_000_000 + metrics_bytes + os.path.getsize(root / "b" / "seed_1" / "metrics.jsonl")
    assert f"Disk: {disk / 1e9:.2f} GB" in md


def test_report_names_arms_that_ran_identical_steps(tmp_path):
    study, runs, root = _hand_study(tmp_path)
    steps = [_run(0, 0.1), _run(1, entropy=2.0), _run(2, 0.3, 1.5), _run(4, 0.5, 1.0)]
    timed = lambda rows, t: [{**r, "time/step_s": t, "memory/peak_rss_gib": t} for r in rows]  # noqa: E731
    # Seed 0: the same metrics, different timings and memory: identical steps.
    _write(root / "a" / "seed_0", timed(steps, 10.0))
    _write(root / "b" / "seed_0", timed(steps, 99.0))
    # Seed 1: equal until step 2's entropy differs.
    _write(root / "a" / "seed_1", steps)
    _write(root / "b" / "seed_1", steps[:2] + [_run(2, 0.3, 1.25), _run(4, 0.5, 1.0)])
    report = study_stats.build_report(study, "x", runs)
    assert report["identical"] == [{"a": "a", "b": "b", "first_divergence": {0: None, 1: 2}}]
    md = study_report.render_markdown(report)
    assert "- a = b in seed 0; they differ in seed 1 from step 2." in md
    # Different in every seed: no entry.
    _write(root / "a" / "seed_9", steps)
    assert study_stats.first_divergence(steps, steps[:3]) == 4
    assert study_stats.first_divergence(steps, list(reversed(steps))) is None
