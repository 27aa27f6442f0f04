"""`python -m experiments.train` end to end at toy size, through the absl entry point."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.compile_cache import with_compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args):
    env = with_compile_cache(
        dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    )
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _train_one_step(model_dir, data, workdir, *extra):
    """One toy training step through the CLI; returns the workdir and the process result."""
    result = _run(
        [
            f"--model={model_dir}",
            f"--data={data}",
            "--instruction=",
            "--prompts_per_step=4",
            "--group_size=2",
            "--max_new_tokens=1",
            "--max_prompt_tokens=16",
            "--answer_mode=lenient",
            "--num_steps=1",
            "--eval_prompts=0",
            f"--workdir={workdir}",
            *extra,
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


def _library_log_lines(text):
    """absl-formatted INFO lines ("I1123 02:28:33.27 ... checkpoint_manager.py:...")."""
    return re.findall(r"^I\d{4} \d\d:\d\d:\d\d.*$", text, re.M)


def test_train_cli_runs_two_steps_and_leaves_outputs(toy_model_dir, copy_task_file, tmp_path):
    flagfile = tmp_path / "toy.flags"
    flagfile.write_text(
        "\n".join(
            [
                f"--model={toy_model_dir}",
                f"--data={copy_task_file}",
                f"--eval_data={copy_task_file}",
                "--instruction=",
                "--prompts_per_step=4",
                "--group_size=2",
                "--max_new_tokens=1",
                "--max_prompt_tokens=16",
                "--answer_mode=lenient",
                "--num_steps=5",
                "--checkpoint_every=1",
                "--eval_prompts=4",
                "--eval_samples=2",
                "--learning_rate=0.01",
                "--mesh=data:1,fsdp:-1,tensor:1",
            ]
        )
    )
    workdir = tmp_path / "run"
    # Command-line flags override the flagfile (--num_steps=2 wins over 5).
    result = _run(
        [
            f"--flagfile={flagfile}",
            f"--workdir={workdir}",
            "--num_steps=2",
            "--algorithm=lite_ppo",
            "--clip_high=0.28",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((workdir / "config.json").read_text())
    assert config["run"]["num_steps"] == 2
    assert config["algorithm"]["name"] == "lite_ppo"
    assert config["algorithm"]["clip_high"] == 0.28 and config["algorithm"]["std"] == "batch"
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert sorted(os.listdir(workdir / "checkpoints"))[:2] == ["1", "2"]
    assert "Finished at step 2" in result.stdout
    assert (workdir / "curves.png").stat().st_size > 10_000
    assert json.loads((workdir / "eval.json").read_text())["eval/accuracy"] >= 0
    assert "eval/accuracy" in result.stdout and "eval/pass@2" in result.stdout
    assert "step 2/2 | reward" in result.stdout + result.stderr
    # A quiet console: the progress bar and one line per step, no library INFO logs.
    assert _library_log_lines(result.stderr) == []
    assert "CheckpointManagerOptions" not in result.stderr


def test_train_cli_rejects_unknown_flags_and_bad_knobs(tmp_path):
    result = _run(["--no_such_flag=1"])
    assert result.returncode != 0
    assert "no_such_flag" in result.stderr
    result = _run(["--clip_high=wide", f"--workdir={tmp_path}"])
    assert result.returncode != 0
    assert "--clip_high='wide' is not a valid" in result.stderr


def test_the_train_docstring_names_every_preset():
    from experiments import train
    from jaxrl4llm import rl

    named = set(
        re.findall(r"[a-z_]+", train.__doc__.split("picks a preset (", 1)[1].split(")", 1)[0])
    )
    assert named == set(rl.PRESETS)


def test_evaluate_cli_on_a_trained_checkpoint(toy_model_dir, copy_task_file, tmp_path):
    workdir, trained = _train_one_step(
        toy_model_dir, copy_task_file, tmp_path / "run", "--verbosity=0"
    )
    assert _library_log_lines(trained.stderr)  # --verbosity brings the library logs back
    env = with_compile_cache(dict(os.environ, JAX_PLATFORMS="cpu"))
    out = tmp_path / "eval.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.evaluate",
            f"--checkpoint={workdir}",
            f"--data={copy_task_file}",
            "--instruction=",
            "--eval_prompts=10",
            "--eval_samples=4",
            "--max_new_tokens=1",
            "--answer_mode=lenient",
            f"--output={out}",
            "--mesh=data:1,fsdp:-1,tensor:1",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["model"] == str(workdir)
    assert results["num_prompts"] == 10
    assert 0 <= results["avg@4"] <= results["pass@4"] <= 1
    assert results["pass@1"] == pytest.approx(results["avg@4"])
    assert "maj@4" in results and "accuracy" in results
    assert "pass@4" in result.stdout
    # --eval_prompts means the same as in training: 0 evaluates nothing (refused here).
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.evaluate",
            f"--checkpoint={workdir}",
            f"--data={copy_task_file}",
            "--eval_prompts=0",
            f"--output={out}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0 and "--eval_prompts=0 evaluates nothing" in result.stderr


def test_export_hf_writes_a_folder_transformers_loads(toy_model_dir, copy_task_file, tmp_path):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jaxrl4llm.models import registry, transformer
    from jaxrl4llm.train.trained import load_trained_policy

    workdir, _ = _train_one_step(
        toy_model_dir,
        copy_task_file,
        tmp_path / "run",
        "--learning_rate=0.05",
        "--algorithm=reinforce",
    )
    out = tmp_path / "hf"
    result = subprocess.run(
        [sys.executable, "tools/export_hf.py", str(workdir), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, config, trained, _ = load_trained_policy(str(workdir))
    _, initial, _ = registry.load_model(toy_model_dir, with_tokenizer=False)
    # Reinforce with {-1, 1} rewards always has a gradient: the checkpoint is not the init.
    assert not np.allclose(np.asarray(trained["embed"]), np.asarray(initial["embed"]))
    torch_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = np.array([[2, 4, 8, 12, 3]])
    with torch.no_grad():
        expected = torch_model(torch.tensor(tokens)).logits.numpy()
    logits, _ = transformer.forward(
        trained, config, tokens, np.arange(5)[None], np.ones((1, 5), bool)
    )
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4)
