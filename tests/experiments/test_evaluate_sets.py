"""`python -m experiments.evaluate --eval_sets=...` on the embedded model, fixture data only
(a hub cache written here, HF_HUB_OFFLINE=1; a reasoning-gym task)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.data.hub_fixtures import MATH500, readme, write_repo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_evaluate_cli_scores_named_sets_and_prints_the_table(tmp_path):
    pytest.importorskip("reasoning_gym")
    cache = tmp_path / "hub"
    write_repo(
        str(cache),
        "HuggingFaceH4/MATH-500",
        {
            "README.md": readme([{"name": "default", "files": {"test": "test.jsonl"}}]),
            "test.jsonl": MATH500,
        },
    )
    out = tmp_path / "eval.json"
    sets = (
        "math500;greedy;avg@2;pass@2;maj@2;prompts=2,"
        "kk2=gym:knights_knaves?n_people=2&n=2;greedy;max_new_tokens=6,"
        "kk3=gym:knights_knaves?n_people=3&n=2;greedy;max_new_tokens=6"
    )
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        HF_HUB_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.evaluate",
            "--model=smollm2-135m-instruct",
            f"--eval_sets={sets}",
            "--eval_prompts=0",
            "--max_new_tokens=4",
            "--max_prompt_tokens=512",
            f"--output={out}",
            "--mesh=data:1,fsdp:-1,tensor:1",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert results["math500/num_prompts"] == 2 and results["kk3/num_prompts"] == 2
    for key in (
        "math500/greedy",
        "math500/avg@2",
        "math500/pass@2",
        "math500/maj@2",
        "kk2/greedy",
        "kk3/greedy",
    ):
        assert 0.0 <= results[key] <= 1.0, key
    assert results["mean/greedy"] == pytest.approx(
        (results["math500/greedy"] + results["kk2/greedy"] + results["kk3/greedy"]) / 3
    )
    assert report["eval_sets"]["kk2"]["max_new_tokens"] == 6
    assert report["eval_sets"]["math500"]["source"] == "math500"
    assert "data" not in report and "accuracy" not in results  # --eval_prompts=0: sets only
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["set"])
    assert header.split() == ["set", "greedy", "avg@2", "maj@2", "pass@2", "prompts"]
    rows = {
        line.split()[0]: line.split()
        for line in lines[lines.index(header) + 1 :]
        if line.strip() and not line.startswith("wrote")
    }
    assert set(rows) == {"math500", "kk2", "kk3", "mean"}
    assert rows["kk2"][2:5] == ["-", "-", "-"]  # kk2 reports greedy only
