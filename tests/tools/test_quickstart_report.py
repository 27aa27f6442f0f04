"""tools/quickstart_report.py on two synthetic workdirs: each figure, by hand, and its range."""

from __future__ import annotations

import json
import os

from tools import quickstart_report

T0 = 1_700_000_000.0


def _workdir(path, records, wall_s, checkpoint_bytes, eval_json=None):
    path.mkdir()
    (path / "config.json").write_text("{}")
    with open(path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.utime(path / "config.json", (T0, T0))
    os.utime(path / "metrics.jsonl", (T0 + wall_s - 30, T0 + wall_s - 30))
    if eval_json is not None:
        (path / "eval.json").write_text(json.dumps(eval_json))
        os.utime(path / "eval.json", (T0 + wall_s, T0 + wall_s))
    (path / "checkpoints" / "4").mkdir(parents=True)
    with open(path / "checkpoints" / "4" / "blob", "wb") as f:
        f.truncate(checkpoint_bytes)  # its size, without writing the bytes
    return str(path)


def _train(step, reward, length, step_s, **more):
    return {
        "step": step,
        "reward/mean": reward,
        "response/length_mean": length,
        "time/step_s": step_s,
        **more,
    }


def _run_a(tmp_path):
    # Eval at 0 and 2 in metrics.jsonl; the last step's eval only in eval.json.
    records = [
        {"step": 0, "eval/accuracy": 0.25},
        _train(1, 0.25, 50.0, 10.0, **{"memory/peak_rss_gib": 2.0}),
        _train(2, 0.5, 40.0, 20.0, **{"memory/peak_rss_gib": 2.5, "eval/accuracy": 0.75}),
        _train(3, 0.75, 20.0, 30.0, **{"memory/peak_rss_gib": 2.4}),
        _train(4, 1.0, 10.0, 40.0, **{"memory/peak_rss_gib": 2.6}),
    ]
    return _workdir(
        tmp_path / "a",
        records,
        wall_s=630,
        checkpoint_bytes=30_000_000,
        eval_json={"eval/accuracy": 0.75},
    )


def _run_b(tmp_path):
    # No RSS logged, no eval.json; its max (100%) comes at the last step.
    records = [
        {"step": 0, "eval/accuracy": 0.5},
        _train(1, 0.5, 60.0, 12.0),
        _train(2, 0.25, 30.0, 18.0, **{"eval/accuracy": 0.5}),
        _train(3, 0.5, 30.0, 15.0),
        _train(4, 0.75, 14.0, 15.0, **{"eval/accuracy": 1.0}),
    ]
    # Without eval.json its end is metrics.jsonl, written at 480 s: 8.0 min.
    return _workdir(tmp_path / "b", records, wall_s=480 + 30, checkpoint_bytes=50_000_000)


def test_one_workdir(tmp_path):
    run = quickstart_report.figures(_run_a(tmp_path))
    assert abs(run["wall_min"] - 10.5) < 1e-9  # 630 s from config.json to eval.json
    assert run["steps"] == 4
    assert run["step_s"] == 25.0  # (10 + 20 + 30 + 40) / 4
    assert (run["reward_first"], run["reward_last"]) == (0.25, 1.0)
    assert run["accuracy"] == {0: 0.25, 2: 0.75, 4: 0.75}
    assert (run["best_accuracy"], run["first_step_at_best"]) == (0.75, 2)
    assert (run["length_first"], run["length_last"]) == (50.0, 10.0)
    assert run["peak_rss_gib"] == 2.6
    assert 0.030 < run["disk_gb"] < 0.0301  # the 30 MB blob and three small files
    assert quickstart_report.report([run]) == [
        "runs: 1",
        "wall time: 10.5 min",
        "steps: 4",
        "time per step: 25.0 s (mean of time/step_s)",
        "train reward (reward/mean): 0.25 at the first step -> 1.00 at the last",
        "greedy eval accuracy (eval/accuracy): step 0: 25.0%; step 2: 75.0%; step 4: 75.0%",
        "max eval accuracy: 75.0%, first reached at step 2",
        "completion length (tokens): 50 at the first step -> 10 at the last",
        "peak RSS: 2.60 GiB",
        "workdir disk: 0.03 GB",
    ]


def test_several_workdirs_give_ranges(tmp_path, capsys):
    assert quickstart_report.main([_run_a(tmp_path), _run_b(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "runs: 2",
        "wall time: 8.0-10.5 min",
        "steps: 4",
        "time per step: 15.0-25.0 s (mean of time/step_s)",
        "train reward (reward/mean): 0.25-0.50 at the first step -> 0.75-1.00 at the last",
        (
            "greedy eval accuracy (eval/accuracy): step 0: 25.0%-50.0%; step 2: 50.0%-75.0%; "
            "step 4: 75.0%-100.0%"
        ),
        "max eval accuracy: 75.0%-100.0%, first reached at step 2-4",
        "completion length (tokens): 50-60 at the first step -> 10-14 at the last",
        "peak RSS: 2.60 GiB (1 of 2 runs)",
        "workdir disk: 0.03-0.05 GB",
    ]


def test_a_folder_without_metrics_is_exit_2(tmp_path, capsys):
    from jaxrl4llm.config import cli

    assert cli.exit_code(quickstart_report.main, [str(tmp_path)]) == 2  # as cli.run maps it
    assert "metrics.jsonl" in capsys.readouterr().err


def test_a_run_with_an_environment_adds_its_tool_figures(tmp_path):
    tools = [
        # (calls, turns, observation share, decode s, tools s, wait s) per step
        (0.5, 1.5, 0.10, 30.0, 2.0, 0.5),
        (0.75, 1.75, 0.15, 40.0, 3.0, 1.5),
        (1.0, 2.0, 0.20, 20.0, 4.0, 1.0),
    ]
    records = [{"step": 0, "eval/accuracy": 0.5}] + [
        _train(
            i + 1,
            0.25 * (i + 1),
            30.0,
            60.0,
            **{
                "tool/calls": calls,
                "turns/mean": turns,
                "tool/observation_token_share": share,
                "time/decode_s": decode,
                "time/tools_s": tools_s,
                "time/tool_wait_s": wait,
            },
        )
        for i, (calls, turns, share, decode, tools_s, wait) in enumerate(tools)
    ]
    run = quickstart_report.figures(_workdir(tmp_path / "t", records, 600, 1000))
    lines = quickstart_report.report([run])
    assert lines[-4:] == [
        "tool calls per trajectory (tool/calls): 0.50 at the first step -> 1.00 at the last",
        "model turns per trajectory (turns/mean): 1.50 at the first step -> 2.00 at the last",
        "observation token share (tool/observation_token_share): 10.0% at the first step -> "
        "20.0% at the last",
        # means over the 3 steps: (30 + 40 + 20) / 3, (2 + 3 + 4) / 3, (0.5 + 1.5 + 1) / 3
        "time per step in decode: 30.0 s, in the tools: 3.0 s (overlapping decode), waiting for "
        "tools: 1.0 s",
    ]
    assert lines[4] == "train reward (reward/mean): 0.25 at the first step -> 0.75 at the last"
