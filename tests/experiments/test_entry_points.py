"""The error contract of every entry point (docs/reliability.md, "Exit codes"), as a user
meets it: a real process given one bad input exits 2 with one line, `Error: ...`, and no
traceback; --debug or JAXRL4LLM_DEBUG=1 brings the traceback back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
ENV.pop("JAXRL4LLM_DEBUG", None)


def _run(argv, env=ENV):
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def _one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["-m", "experiments.train", "--no_such_flag=1"], "no_such_flag"),
        (["-m", "experiments.train", "--flagfile=no/such.flags"], "--flagfile"),
        (["-m", "experiments.train", "--workdir=WORKDIR", "stray"], "'stray'"),
        (["-m", "experiments.train", "--lr_schedule=steep"], "--lr_schedule='steep'"),
        (["-m", "experiments.train", "--format_penalty=-1"], "--format_penalty=-1.0"),
        (["-m", "experiments.train", "--workdir=A_FILE"], "is a file"),
        (["-m", "experiments.train", "--model=MISSING"], "MISSING"),
        (["-m", "experiments.evaluate", "--checkpoint=WORKDIR"], "is not a training workdir"),
        (["-m", "experiments.evaluate", "--eval_prompts=0"], "--eval_prompts=0"),
        (["-m", "experiments.study", "--study=no_such_study"], "--study=no_such_study"),
        (["tools/plot.py", "WORKDIR"], "metrics.jsonl"),
        (["tools/export_hf.py", "WORKDIR", "OUT"], "is not a training workdir"),
        (["tools/plan.py", "--topology=v9-1"], "--topology='v9-1'"),
        (["tools/bench_extract.py", "--bytes=many"], "--bytes"),
        (["tools/bench_forward.py", "--model=huge"], "--model=huge"),
        (["tools/bench_rollout.py", "--dtype=float8"], "--dtype"),
        (["tools/bench_packed_update.py", "--layers=0"], "--layers=0"),
        (["tools/bench_attention.py", "--repeats=0"], "--repeats=0"),
        (["tools/bench_sampler.py", "--modes=beam"], "--modes"),
        (["tools/bench_train.py", "--rounds=0"], "--rounds=0"),
        (["tools/bench_update_memory.py", "stray"], "stray"),
        (["tools/profile_decode.py", "--batch=wide"], "--batch"),
    ],
)
def test_one_bad_input_exits_2_in_one_line(argv, expected, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    paths = {
        "WORKDIR": str(tmp_path),
        "OUT": str(tmp_path / "out"),
        "A_FILE": str(a_file),
        "MISSING": str(tmp_path / "no_model"),
    }
    for word, path in paths.items():
        argv = [a.replace(word, path) for a in argv]
        expected = expected.replace(word, path)
    assert expected in _one_line(_run(argv))


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_above_the_line(how):
    argv = ["-m", "experiments.train", "--format_penalty=-1"]
    env = dict(ENV, JAXRL4LLM_DEBUG="1") if how == "env" else ENV
    result = _run(argv + ["--debug"] if how == "flag" else argv, env)
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "FlagError" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("Error: --format_penalty=-1.0")


def test_export_hf_without_torch_names_the_install_command(tmp_path):
    blocker = tmp_path / "no_torch"
    blocker.mkdir()
    # At start-up: torch marked as not importable (importlib then finds no spec for it).
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(blocker), REPO]))
    line = _one_line(_run(["tools/export_hf.py", str(tmp_path), str(tmp_path / "out")], env))
    assert "pip install torch==2.13.0" in line
