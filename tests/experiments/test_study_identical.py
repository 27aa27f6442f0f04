"""A claim between arms that ran identical steps at run time is untestable at that scale (the
report's hand-written study of test_study_report.py; no training)."""

from experiments import study_report, study_stats

from tests.experiments.test_study_report import _hand_study, _run, _write

STEPS = [_run(0, 0.1), _run(1, entropy=2.0), _run(2, 0.3, 1.5), _run(4, 0.5, 1.0)]


def test_a_claim_between_arms_identical_in_every_seed_is_untestable(tmp_path):
    study, runs, root = _hand_study(tmp_path)
    for arm in ("a", "b"):
        for seed in (0, 1):
            _write(root / arm / f"seed_{seed}", STEPS)
    report = study_stats.build_report(study, "x", runs)
    (claim,) = report["claims"]
    assert claim["verdict"] == "untestable at this scale"
    assert "ran identical steps in every seed (seeds 0, 1)" in claim["why"]
    md = study_report.render_markdown(report)
    assert "**untestable at this scale**" in md
    assert "- a = b in seeds 0, 1." in md


def test_a_claim_between_arms_identical_in_some_seeds_names_them(tmp_path):
    study, runs, root = _hand_study(tmp_path)
    _write(root / "a" / "seed_0", STEPS)
    _write(root / "b" / "seed_0", STEPS)
    _write(root / "a" / "seed_1", STEPS)
    _write(root / "b" / "seed_1", STEPS[:2] + [_run(2, 0.2, 1.25), _run(4, 0.4, 1.0)])
    (claim,) = study_stats.build_report(study, "x", runs)["claims"]
    assert claim["verdict"] != "untestable at this scale"
    assert claim["why"].endswith("; a and b ran identical steps in seed 0 (d = 0 there)")
