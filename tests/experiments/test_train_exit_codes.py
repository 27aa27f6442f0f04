"""How `python -m experiments.train` ends: exit codes and one-line user errors
(jaxrl4llm/train/infra/errors.py), on the toy model."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxrl4llm.train.infra import errors
from jaxrl4llm.train.infra.metrics import read_metrics

from tests.compile_cache import with_compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The toy runs here compile the same programs: all but the first load them from the cache.
ENV = with_compile_cache(
    dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
    )
)


def _args(model, data, workdir, *extra):
    return [
        sys.executable,
        "-m",
        "experiments.train",
        f"--model={model}",
        f"--data={data}",
        "--instruction=",
        "--prompts_per_step=4",
        "--group_size=2",
        "--max_new_tokens=1",
        "--max_prompt_tokens=16",
        "--answer_mode=lenient",
        "--eval_prompts=0",
        "--trackers=",
        f"--workdir={workdir}",
        *extra,
    ]


def _run(*args, **kwargs):
    return subprocess.run(
        _args(*args, **kwargs), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )


def _one_line_error(result, code):
    """The process failed with `code` and printed one line (beside the progress bar), no
    traceback."""
    assert result.returncode == code, result.stderr[-3000:]
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not line.startswith("train:")
    ]
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--learning_rate=nan", "--learning_rate=nan is not a finite number"),
        ("--learning_rate=inf", "--learning_rate=inf is not a finite number"),
        ("--format_penalty=nan", "--format_penalty=nan is not a finite number"),
        ("--keep_checkpoints=0", "--keep_checkpoints=0 must be >= 1"),
        ("--checkpoint_every=0", "--checkpoint_every=0 must be >= 1"),
        ("--temperature=-1", "--temperature=-1.0 must be >= 0"),
        ("--top_p=0", "--top_p=0.0 must be in (0, 1]"),
        ("--reward_workers=0", "--reward_workers=0"),
        ("--max_nonfinite_steps=0", "--max_nonfinite_steps must be >= 1"),
        ("--data=MISSING", "no file matches"),
        ("--data=MALFORMED", "bad.jsonl:2: malformed JSON"),
    ],
)
def test_a_bad_flag_or_data_fails_in_one_line_before_the_model_loads(flag, expected, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "copy 1", "answer": "1"}\n{"prompt": "copy 2", "answer": \n')
    data = {"--data=MISSING": str(tmp_path / "missing.jsonl"), "--data=MALFORMED": str(bad)}.get(
        flag, str(bad)
    )
    extra = [] if flag.startswith("--data=") else [flag]
    # A model folder the flag check accepts but that cannot load: had it been loaded first,
    # its error would show instead.
    model = tmp_path / "unloadable_model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    result = _run(model, data, tmp_path / "run", *extra)
    line = _one_line_error(result, errors.EXIT_USER_ERROR)
    assert expected in line
    for internal in ("max_to_keep", "num_workers", "max_prompt_len", "SamplingConfig"):
        assert internal not in line
    assert not (tmp_path / "run" / "config.json").exists()  # nothing written


def test_prompts_over_max_prompt_tokens_name_the_flags(toy_model_dir, copy_task_file, tmp_path):
    line = _one_line_error(
        _run(
            toy_model_dir,
            copy_task_file,
            tmp_path / "run",
            "--max_prompt_tokens=2",
            "--num_steps=1",
        ),
        errors.EXIT_USER_ERROR,
    )
    assert "longer than --max_prompt_tokens=2" in line and "--long_prompts=drop" in line


def test_resume_refuses_another_model_or_algorithm_and_logs_allowed_changes(
    toy_model_dir, copy_task_file, tmp_path
):
    workdir = tmp_path / "run"
    first = _run(toy_model_dir, copy_task_file, workdir, "--num_steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    saved = (workdir / "config.json").read_text()
    other_model = tmp_path / "other_model"
    os.symlink(toy_model_dir, other_model)  # same shape: it would resume on the old weights
    line = _one_line_error(
        _run(other_model, copy_task_file, workdir, "--num_steps=2", "--algorithm=rloo"),
        errors.EXIT_USER_ERROR,
    )
    assert f"--model: '{toy_model_dir}' saved, '{other_model}' now" in line
    assert "--algorithm: 'grpo' saved, 'rloo' now" in line
    assert "new --workdir" in line
    assert line.index("--model") < line.index("--algorithm")
    assert (workdir / "config.json").read_text() == saved  # refused before any write
    assert [r["step"] for r in read_metrics(str(workdir))] == [1]
    # Resumable changes (length, cadence, learning rate) resume, each logged.
    resumed = _run(
        toy_model_dir,
        copy_task_file,
        workdir,
        "--num_steps=2",
        "--learning_rate=3e-6",
        "--checkpoint_every=5",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "with --num_steps changed: 1 -> 2" in resumed.stderr
    assert "with --learning_rate changed: 1e-06 -> 3e-06" in resumed.stderr
    assert "Resumed from step 1" in resumed.stdout + resumed.stderr
    assert json.loads((workdir / "config.json").read_text())["run"]["num_steps"] == 2


def test_a_run_ending_with_non_finite_parameters_exits_non_zero(
    toy_model_dir, copy_task_file, tmp_path
):
    import jax.numpy as jnp

    from jaxrl4llm.models import registry, weights

    config, params, tokenizer = registry.load_model(toy_model_dir)
    params["final_norm"] = params["final_norm"].at[0].set(jnp.nan)  # a broken model file
    broken = tmp_path / "broken"
    weights.export_hf(params, config, str(broken), tokenizer=tokenizer.hf_tokenizer)
    result = _run(
        broken, copy_task_file, tmp_path / "run", "--num_steps=3", "--max_nonfinite_steps=2"
    )
    line = _one_line_error(result, errors.EXIT_DIVERGED)
    assert "Stopped at step 2: every update of the last 2 steps" in line
    assert not (tmp_path / "run" / "checkpoints" / "2").exists()


def test_sigterm_saves_and_exits_with_the_preempted_code(toy_model_dir, copy_task_file, tmp_path):
    workdir = tmp_path / "run"
    process = subprocess.Popen(
        _args(
            toy_model_dir, copy_task_file, workdir, "--num_steps=1000", "--checkpoint_every=1000"
        ),
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    deadline = time.time() + 300
    for line in process.stdout:  # wait for the first trained step
        seen.append(line)
        if "step 1/1000" in line or time.time() > deadline:
            break
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=300)
    output = "".join(seen) + out
    assert process.returncode == errors.EXIT_PREEMPTED, output[-3000:]
    assert "Preempted at step" in output and "rerun the same command to resume" in output
    assert "Finished" not in output
    steps = [int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()]
    assert len(steps) == 1 and steps[0] >= 1  # the step it stopped at, saved
