"""`python -m experiments.study` end to end on the toy model: 2 arms x 2 seeds x 3 steps, a
run killed mid-study and resumed, and a report whose numbers are recomputed here with numpy
from the workdirs' metrics.jsonl."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")


def _spec(tmp_path, model_dir, data):
    flags = [
        f"--model={model_dir}",
        f"--data={data}",
        f"--eval_data={data}",
        "--instruction=",
        "--prompts_per_step=4",
        "--group_size=2",
        "--max_new_tokens=2",
        "--max_prompt_tokens=16",
        "--answer_mode=lenient",
        "--num_steps=3",
        "--checkpoint_every=1",
        "--eval_every=1",
        "--eval_prompts=24",
        "--eval_samples=2",
        "--learning_rate=0.05",
        "--log_kl_ref",
        "--mesh=data:1,fsdp:-1,tensor:1",
    ]
    path = tmp_path / "toy_study.toml"
    path.write_text(
        "\n".join(
            [
                'name = "toy"',
                'description = "Two toy arms."',
                'primary_metric = "eval/accuracy"',
                "threshold = 0.0",
                "final_window = 5",
                "[scales.toy]",
                "flags = " + json.dumps(flags),
                "seeds = [0, 1]",
                "[[arms]]",
                'name = "grpo"',
                'flags = ["--algorithm=grpo"]',
                "[[arms]]",
                'name = "reinforce"',
                'flags = ["--algorithm=reinforce"]',
                "[[claims]]",
                'text = "GRPO beats Reinforce."',
                'a = "grpo"',
                'b = "reinforce"',
                'quantity = "final"',
                'expect = ">"',
            ]
        )
    )
    return str(path)


def _study(spec, root, *extra, popen=None):
    """Runs the study CLI; with `popen` (a file to write its stdout to), in the background."""
    argv = [
        sys.executable,
        "-m",
        "experiments.study",
        f"--study={spec}",
        "--scale=toy",
        f"--root={root}",
        *extra,
    ]
    if popen:
        return subprocess.Popen(
            argv,
            cwd=REPO,
            env=ENV,
            stdout=open(popen, "w"),
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    return subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)


def _text(path):
    return path.read_text(errors="replace") if path.exists() else ""


def _processes_naming(text):
    """Live processes whose command line contains `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records, key):
    rows = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return np.array([s for s, _ in rows], float), np.array([v for _, v in rows], float)


def test_print_commands_and_bad_specs(toy_model_dir, copy_task_file, tmp_path):
    spec = _spec(tmp_path, toy_model_dir, copy_task_file)
    result = _study(spec, tmp_path / "root", "--print_commands", "--arms=reinforce")
    assert result.returncode == 0, result.stderr[-3000:]
    commands = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert len(commands) == 2
    for seed, command in enumerate(commands):
        assert command.startswith("python -m experiments.train ")
        assert "--algorithm=reinforce" in command and f"--seed={seed}" in command
        assert f"--workdir={tmp_path / 'root' / 'reinforce' / f'seed_{seed}'}" in command
    assert not (tmp_path / "root").exists()  # nothing ran
    bad = tmp_path / "bad.toml"
    bad.write_text(open(spec).read().replace("--algorithm=reinforce", "--algorithm=nope"))
    result = _study(str(bad), tmp_path / "root", "--print_commands")
    assert result.returncode != 0
    assert "arm reinforce" in result.stderr and "nope" in result.stderr


def test_study_runs_resumes_after_a_kill_and_reports_recomputable_numbers(
    toy_model_dir, copy_task_file, tmp_path
):
    spec = _spec(tmp_path, toy_model_dir, copy_task_file)
    root = tmp_path / "root"
    first = root / "grpo" / "seed_0"
    # Kill the whole study (runner and trainer) once the first run has checkpointed step 1.
    proc = _study(spec, root, popen=tmp_path / "killed.out")
    deadline = time.time() + 600
    while not (first / "checkpoints" / "1").exists():
        assert proc.poll() is None, "the study exited before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # The poll above may see step 1's checkpoint late on a loaded machine: resume from the
    # newest one, as long as the run had not finished when it was killed.
    saved = max(int(p.name) for p in (first / "checkpoints").iterdir() if p.name.isdigit())
    steps = [r["step"] for r in _records(first)]
    assert saved < 3 and steps == list(range(len(steps))) and steps[-1] < 3, (
        f"killed too late to test resuming: {steps}"
    )
    assert not (root / "grpo" / "seed_1").exists()

    # SIGTERM to the runner alone (a scheduler's stop) reaches its run and starts no other.
    proc = _study(spec, root, popen=tmp_path / "stopped.out")
    while _text(first / "train.log").count("\n=== ") < 2:  # the runner started it again
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 0
    assert not _processes_naming(str(root)), "a run outlived its stopped study"
    assert not (root / "grpo" / "seed_1").exists()
    out = (tmp_path / "stopped.out").read_text()
    assert f"grpo/seed_0: training (resuming after step {saved})" in out
    assert "grpo/seed_0: stopped (SIGTERM)" in out

    result = _study(spec, root, "--prune_checkpoints")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"Resumed from step {saved}" in (first / "train.log").read_text()
    # Each run's checkpoints went once it finished (the resumed one's too).
    assert not list(root.glob("*/seed_*/checkpoints"))
    assert len(list(root.glob("*/seed_*/metrics.jsonl"))) == 4
    assert f"Report: {root / 'report.md'}" in result.stdout
    again = _study(spec, root)  # everything finished: nothing runs again
    assert again.returncode == 0 and again.stdout.count("finished earlier") == 4

    report = json.loads((root / "report.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["finished"] * 4
    for arm in ("grpo", "reinforce"):
        runs = [_records(root / arm / f"seed_{s}") for s in (0, 1)]
        for records in runs:  # the resumed run logs each step once
            assert [r["step"] for r in records] == [0, 1, 2, 3]
        stats = report["arms"][arm]

        def check(quantity, per_seed):
            x = np.array(per_seed, float)
            assert stats[quantity]["mean"] == pytest.approx(x.mean(), abs=1e-12)
            assert stats[quantity]["se"] == pytest.approx(np.std(x, ddof=1) / np.sqrt(2), abs=1e-12)

        for key in ("eval/accuracy", "eval/avg@2", "eval/pass@2"):
            check(f"final {key}", [_series(r, key)[1][-1] for r in runs])
            check(f"best {key}", [_series(r, key)[1].max() for r in runs])
        check(
            "auc eval/accuracy",
            [
                np.trapezoid(_series(r, "eval/accuracy")[1], _series(r, "eval/accuracy")[0]) / 3
                for r in runs
            ],
        )
        for key in ("policy/entropy", "policy/kl_ref", "response/length_mean", "reward/mean"):
            check(f"final {key}", [np.mean([x[key] for x in r if x["step"] > 0]) for r in runs])
        # Threshold 0: every run reaches it at its first eval, step 0.
        assert stats["steps eval/accuracy>=0"]["mean"] == 0
        assert stats["steps eval/accuracy>=0"]["reached"] == "2/2"
    claim = report["claims"][0]
    g, r = (
        report["arms"]["grpo"]["final eval/accuracy"],
        report["arms"]["reinforce"]["final eval/accuracy"],
    )
    two_se = 2 * math.sqrt(g["se"] ** 2 + r["se"] ** 2)
    assert claim["two_se"] == pytest.approx(two_se)
    expected = (
        "unresolved (difference within 2 s.e.)"
        if abs(g["mean"] - r["mean"]) <= two_se
        else "supported"
        if g["mean"] > r["mean"]
        else "contradicted"
    )
    # The unpaired 2-s.e. test stays beside the paired verdict (test_study_report checks that).
    assert claim["unpaired_verdict"] == expected
    md = (root / "report.md").read_text()
    assert "| grpo | 2 |" in md and "GRPO beats Reinforce." in md
    assert (root / "curves.png").stat().st_size > 20_000

    # --collect over more seeds than ran: the report marks the missing runs, runs nothing.
    collected = _study(spec, root, "--collect", "--seeds=0,1,2")
    assert collected.returncode == 0, collected.stderr[-3000:]
    report = json.loads((root / "report.json").read_text())
    missing = [(r["arm"], r["seed"]) for r in report["runs"] if r["status"] == "missing"]
    assert missing == [("grpo", 2), ("reinforce", 2)]
    assert not (root / "grpo" / "seed_2").exists()
    assert "4 of 6 runs finished" in (root / "report.md").read_text()
    assert report["arms"]["grpo"]["final eval/accuracy"]["n"] == 2
