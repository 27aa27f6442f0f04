"""curves.png's panels follow what a run logged: KL and clip fraction only when logged and
varying; reward, accuracy, completion length and entropy always."""

from __future__ import annotations

import json

from jaxrl4llm.train.infra import plots

ALWAYS = ["reward", "accuracy", "completion length", "entropy"]


def _records(**columns):
    """Three steps' records with the given per-step values (None: not in that record)."""
    records = []
    for i in range(3):
        record = {
            "step": i + 1,
            "reward/mean": 0.25 * i,
            "policy/entropy": 1.0 - 0.1 * i,
            "response/length_mean": 50.0 - 10 * i,
        }
        record.update({k: v[i] for k, v in columns.items() if v[i] is not None})
        records.append(record)
    return records


def _titles(*runs):
    return [title for title, _ in plots.choose_panels(runs)]


def test_a_run_without_kl_and_with_a_constant_clip_fraction_has_the_four_panels():
    assert _titles(_records(**{"policy/clip_frac": [0.0, 0.0, 0.0]})) == ALWAYS


def test_a_varying_clip_fraction_gets_its_panel():
    assert _titles(_records(**{"policy/clip_frac": [0.0, 0.05, 0.0]})) == ALWAYS + ["clip fraction"]


def test_a_varying_kl_gets_its_panel_and_a_constant_one_does_not():
    assert _titles(_records(**{"policy/kl_ref": [0.0, 0.01, 0.03]})) == ALWAYS + ["KL to reference"]
    assert _titles(_records(**{"policy/kl_ref": [0.0, 0.0, 0.0]})) == ALWAYS


def test_a_varying_sampler_trainer_gap_gets_its_panel():
    assert _titles(_records(**{"mismatch/logp_abs_diff_mean": [1e-7, 3e-7, 2e-7]})) == ALWAYS + [
        "sampler-trainer gap"
    ]


def test_a_varying_tool_call_rate_gets_its_panel_and_a_single_turn_run_none():
    assert _titles(_records(**{"tool/calls": [0.5, 0.75, 1.0]})) == ALWAYS + [
        "tool calls per trajectory"
    ]
    assert _titles(_records(**{"tool/calls": [0.0, 0.0, 0.0]})) == ALWAYS


def test_missing_and_non_finite_values_do_not_count_as_variation():
    # One logged value (the others absent or NaN read back as None / nan) is constant.
    assert _titles(_records(**{"policy/kl_ref": [0.02, None, float("nan")]})) == ALWAYS


def test_two_runs_each_constant_at_different_levels_vary_together():
    a = _records(**{"policy/clip_frac": [0.0, 0.0, 0.0]})
    b = _records(**{"policy/clip_frac": [0.1, 0.1, 0.1]})
    assert _titles(a, b) == ALWAYS + ["clip fraction"]


def test_the_figure_is_drawn_with_the_chosen_panels(tmp_path):
    records = _records(**{"policy/clip_frac": [0.0, 0.0, 0.0], "policy/kl_ref": [0.0, 0.01, 0.02]})
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    out = plots.plot_runs([str(tmp_path)], str(tmp_path / "curves.png"))
    import matplotlib.image

    height, width = matplotlib.image.imread(out).shape[:2]
    # 5 panels: a 2 x 3 grid of 5 x 4 inch cells at 100 dpi.
    assert (width, height) == (1500, 800)
