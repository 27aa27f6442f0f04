"""`python -m experiments.evaluate --checkpoint=WORKDIR` evaluates with the run's own settings
(WORKDIR/config.json, flags given over them), reproduces the run's logged evaluation, and
writes beside the run's files, never over them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from absl import flags

from experiments import evaluate
from jaxrl4llm.config import cli
from jaxrl4llm.config.errors import FlagError, UserError
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra.checkpoint import CheckpointError, checkpoint_step, read_run_config

from tests.compile_cache import with_compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- end to end: a toy run, then its evaluation with no other flag ------------------------


def _eval_metrics(workdir) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of the eval/ metrics the run logged (step 0: before training)."""
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        evals = {k[len("eval/") :]: v for k, v in row.items() if k.startswith("eval/")}
        if evals:
            out[row["step"]] = evals
    return out


def _scores(report: dict) -> dict[str, float]:
    return {k: v for k, v in report["results"].items() if k != "seconds"}


def test_evaluating_a_run_reproduces_its_logged_evaluation(toy_model_dir, copy_task_file, tmp_path):
    flagfile = tmp_path / "toy.flags"
    flagfile.write_text(
        "\n".join(
            [
                f"--model={toy_model_dir}",
                f"--data={copy_task_file}",
                "--instruction=",
                "--prompts_per_step=4",
                "--group_size=4",
                "--max_new_tokens=1",
                "--max_prompt_tokens=16",
                "--answer_mode=lenient",
                "--algorithm=reinforce",
                "--learning_rate=0.05",
                "--num_steps=3",
                "--checkpoint_every=1",
                "--eval_every=3",
                "--eval_prompts=12",
                "--eval_samples=8",
                "--mesh=data:1,fsdp:-1,tensor:1",
            ]
        )
    )
    workdir = tmp_path / "run"
    # The evaluations compile the run's own evaluation programs: loaded from the cache.
    env = with_compile_cache(
        dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            PYTHONPATH=REPO,
            XLA_FLAGS="--xla_force_host_platform_device_count=1",
        )
    )
    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            f"--flagfile={flagfile}",
            f"--workdir={workdir}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    logged = _eval_metrics(workdir)
    assert sorted(logged) == [0, 3]
    run_eval = (workdir / "eval.json").read_bytes()

    # The README's command: the checkpoint and nothing else.
    result = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", f"--checkpoint={workdir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = workdir / "eval" / "3-test.json"
    assert f"wrote {output}" in result.stdout
    report = json.loads(output.read_text())
    # Greedy accuracy and the sampled avg@8 / pass@k / maj@8: the run's own numbers at its
    # last step (same prompts, prompt format, max_new_tokens, answer mode, seed and key).
    assert _scores(report) == logged[3]
    assert report["checkpoint_step"] == 3 and report["model"] == str(workdir)
    assert report["settings"]["max_new_tokens"] == {"value": 1, "from": "run config"}
    assert report["settings"]["answer_mode"] == {"value": "lenient", "from": "run config"}
    row = next(
        line for line in result.stdout.splitlines() if line.strip().startswith("max_new_tokens")
    )
    assert row.split() == ["max_new_tokens", "1", "run", "config"]
    accuracy = next(
        line for line in result.stdout.splitlines() if line.strip().startswith("accuracy")
    )
    assert float(accuracy.split()[1]) == pytest.approx(logged[3]["accuracy"], abs=5e-5)
    assert (workdir / "eval.json").read_bytes() == run_eval  # the run's file untouched

    # The base model with the run's flagfile, from another folder: the run's evaluation
    # before its first step, written under workdirs/eval/ there (no ./eval.json).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", f"--flagfile={flagfile}"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    model = os.path.basename(toy_model_dir)
    output = os.path.join("workdirs", "eval", f"{model}-copy.jsonl-test.json")
    assert f"wrote {output}" in result.stdout
    assert os.listdir(elsewhere) == ["workdirs"]
    assert _scores(json.loads((elsewhere / output).read_text())) == logged[0]


# ---- the settings: the run's, the flags given over them, and where each came from --------


def _workdir(tmp_path, steps=(2, 4), **values):
    """A workdir as the trainer leaves it: config.json and checkpoint step folders."""
    workdir = tmp_path / "run"
    os.makedirs(workdir / "checkpoints")
    for step in steps:
        os.makedirs(workdir / "checkpoints" / str(step))
    os.makedirs(workdir / "checkpoints" / "6.orbax-checkpoint-tmp-1")  # unfinished: not a step
    config = TrainConfig().replace(
        **{
            "model": "some/model",
            "data": "gsm8k",
            "max_new_tokens": 48,
            "answer_mode": "lenient",
            "eval_prompts": 32,
            "seed": 7,
            **values,
        }
    )
    (workdir / "config.json").write_text(config.to_json())
    return str(workdir)


def _opts(**values):
    return evaluate.EvaluateOptions(**values)


def test_a_checkpoint_is_evaluated_with_its_runs_settings_and_the_flags_given_win(tmp_path):
    workdir = _workdir(tmp_path, instruction="@minimalist", temperature=0.7)
    plan = evaluate.plan(_opts(checkpoint=workdir), {"eval_samples": 8, "max_new_tokens": 64})
    config = plan.config
    assert plan.step == 4  # the latest
    assert config.model.name == "some/model" and config.data.source == "gsm8k"
    assert config.data.instruction == "@minimalist"
    assert config.reward.answer_mode == "lenient" and config.run.seed == 7
    assert config.rollout.sampling.temperature == 0.7
    assert config.evaluation.eval_prompts == 32
    assert config.evaluation.eval_samples == 8  # given
    assert config.rollout.max_new_tokens == config.reward.max_new_tokens == 64  # given
    assert plan.origins["eval_samples"] == plan.origins["max_new_tokens"] == "command line"
    assert plan.origins["data"] == plan.origins["seed"] == "run config"
    header = evaluate.settings_header(plan, "test")
    assert os.path.join(workdir, "config.json") in header
    rows = {line.split()[0]: line.split() for line in header.splitlines()[1:]}
    assert set(rows) == set(evaluate.SHOWN)
    assert rows["max_new_tokens"] == ["max_new_tokens", "64", "command", "line"]
    assert rows["instruction"] == ["instruction", "'@minimalist'", "run", "config"]
    assert rows["temperature"] == ["temperature", "0.7", "run", "config"]
    assert plan.held_out_origin == "run config"
    # The run's own held-out data: the file is named by the step and split.
    assert evaluate.output_path(_opts(checkpoint=workdir), plan) == os.path.join(
        workdir, "eval", "4-test.json"
    )


def test_a_checkpoint_step_and_other_data_name_the_output(tmp_path):
    workdir = _workdir(tmp_path, eval_data="math500")
    opts = _opts(checkpoint=workdir, checkpoint_step=2, split="validation")
    # --data given without --eval_data: the given data is the held-out set, not the run's.
    plan = evaluate.plan(opts, {"data": "hf:openai/gsm8k:main"})
    assert plan.step == 2
    assert plan.config.evaluation.eval_data is None and plan.held_out_origin == "command line"
    assert evaluate.output_path(opts, plan) == os.path.join(
        workdir, "eval", "2-gsm8k-main-validation.json"
    )
    sets = "math500;greedy,kk2=gym:knights_knaves?n_people=2;greedy"
    plan = evaluate.plan(_opts(checkpoint=workdir), {"eval_sets": sets, "eval_prompts": 0})
    assert evaluate.output_path(_opts(checkpoint=workdir), plan) == os.path.join(
        workdir, "eval", "4-math500+kk2-test.json"
    )
    assert evaluate.output_path(_opts(checkpoint=workdir, output="x.json"), plan) == "x.json"


def test_a_base_model_is_evaluated_with_the_flags_and_defaults_and_written_under_workdirs():
    plan = evaluate.plan(_opts(), {"max_new_tokens": 32})
    assert plan.step == 0 and plan.checkpoint is None
    assert plan.origins["max_new_tokens"] == "command line"
    assert plan.origins["model"] == plan.origins["data"] == "default"
    assert plan.config == TrainConfig().replace(max_new_tokens=32)
    assert evaluate.output_path(_opts(), plan) == os.path.join(
        "workdirs", "eval", "smollm2-135m-instruct-synthetic-arithmetic-test.json"
    )
    plan = evaluate.plan(_opts(), {"model": "/models/Qwen2.5-0.5B/", "data": "gsm8k"})
    assert evaluate.output_path(_opts(), plan) == os.path.join(
        "workdirs", "eval", "Qwen2.5-0.5B-gsm8k-test.json"
    )


def test_flags_given_on_the_command_line_or_in_a_flagfile_count_as_given(tmp_path):
    values = flags.FlagValues()
    cli.define_flags(TrainConfig, values)
    flagfile = tmp_path / "f.flags"
    flagfile.write_text("--max_new_tokens=128\n--data=gsm8k\n")  # 128 is the default
    values(["prog", f"--flagfile={flagfile}", "--eval_samples=4"])
    assert cli.given_values(TrainConfig, values) == {
        "max_new_tokens": 128,
        "data": "gsm8k",
        "eval_samples": 4,
    }


# ---- user errors: one message naming the input and the fix --------------------------------


def test_missing_workdir_config_or_checkpoint_is_a_checkpoint_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"'.*nope' does not exist: pass the --workdir"):
        evaluate.plan(_opts(checkpoint=missing), {})
    with pytest.raises(CheckpointError, match="has no config.json, so it is not a training"):
        read_run_config(str(tmp_path))
    with pytest.raises(FileNotFoundError):  # what callers that predate CheckpointError catch
        read_run_config(str(tmp_path))
    workdir = _workdir(tmp_path, steps=())
    with pytest.raises(CheckpointError, match="has no checkpoint yet .*evaluate the base model"):
        evaluate.plan(_opts(checkpoint=workdir), {})
    (tmp_path / "run" / "config.json").write_text('{"model": {"name": 3}, "rollout": [')
    with pytest.raises(
        CheckpointError,
        match=r"Cannot read the run's settings from .*config"
        r"\.json \(JSONDecodeError",
    ):
        read_run_config(workdir)


def test_a_step_not_saved_names_the_saved_steps(tmp_path):
    workdir = _workdir(tmp_path)
    assert checkpoint_step(workdir) == 4 and checkpoint_step(workdir, 2) == 2
    with pytest.raises(CheckpointError, match="no checkpoint of step 3: it has steps 2, 4"):
        evaluate.plan(_opts(checkpoint=workdir, checkpoint_step=3), {})


def test_flags_that_contradict_the_checkpoint_are_flag_errors(tmp_path):
    workdir = _workdir(tmp_path)
    with pytest.raises(
        FlagError,
        match="--model=other with --checkpoint=.*trained --model=some/model.*Drop --model",
    ):
        evaluate.plan(_opts(checkpoint=workdir), {"model": "other"})
    assert evaluate.plan(_opts(checkpoint=workdir), {"model": "some/model"}).step == 4
    with pytest.raises(FlagError, match="--checkpoint_step=2 needs --checkpoint=WORKDIR"):
        evaluate.plan(_opts(checkpoint_step=2), {})
    with pytest.raises(
        FlagError,
        match=r"--eval_prompts=0 evaluates nothing \(from the run "
        r"config of .*run\)",
    ):
        evaluate.plan(_opts(checkpoint=_workdir(tmp_path / "b", eval_prompts=0)), {})
    assert issubclass(FlagError, UserError) and issubclass(CheckpointError, UserError)
