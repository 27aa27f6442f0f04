"""The estimate a study prints before it starts, and its refusal when the disk is too small:
a 2-arm x 2-seed spec on the toy model, with shutil.disk_usage replaced."""

from __future__ import annotations

import collections
import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest

from experiments import study, study_estimate
from experiments.study_spec import load_study, plan
from jaxrl4llm.models import registry
from jaxrl4llm.train.infra import checkpoint
from jaxrl4llm.train.update import state

Usage = collections.namedtuple("Usage", "total used free")
STEPS, EVERY, KEEP = 5, 2, 2  # saves at 2, 4 and 5: 2 kept, 3 on disk during a save


@pytest.fixture
def spec(tmp_path, toy_model_dir):
    flags = [
        f"--model={toy_model_dir}",
        "--data=synthetic:arithmetic?digits=1",
        "--prompts_per_step=4",
        "--group_size=2",
        "--max_prompt_tokens=16",
        "--max_new_tokens=8",
        f"--num_steps={STEPS}",
        f"--checkpoint_every={EVERY}",
        f"--keep_checkpoints={KEEP}",
        "--mesh=data:1,fsdp:-1,tensor:1",
    ]
    path = tmp_path / "toy.toml"
    path.write_text(
        "\n".join(
            [
                'name = "toy"',
                'primary_metric = "eval/accuracy"',
                "[scales.toy]",
                "flags = " + json.dumps(flags),
                "seeds = [0, 1]",
                "[[arms]]",
                'name = "a"',
                'flags = ["--algorithm=grpo"]',
                "[[arms]]",
                'name = "b"',
                'flags = ["--algorithm=reinforce"]',
            ]
        )
    )
    return load_study(str(path))


@pytest.fixture
def toy_params(toy_model_dir):
    """The toy model's parameter count, from its loaded weights."""
    _, params, _ = registry.load_model(toy_model_dir, with_tokenizer=False)
    return sum(x.size for x in jax.tree.leaves(params))


def _free(monkeypatch, free_bytes):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * free_bytes, 0, free_bytes))


def test_a_checkpoint_is_params_and_two_moments_on_disk(tmp_path):
    # The estimate against a real save: a 1M-float32 state -> at most 12 MB.
    # Orbax compresses, so the values are random like trained weights and moments (the
    # zero moments of a fresh state would take no room).
    rng = np.random.default_rng(0)
    fresh = state.TrainState.create(
        {"w": np.ones((1000, 1000), np.float32)}, optax.adamw(1e-3), seed=0
    )
    trained = fresh.replace(
        params={"w": rng.normal(size=(1000, 1000)).astype(np.float32)},
        opt_state=jax.tree.map(
            lambda x: rng.normal(size=x.shape).astype(x.dtype) if x.size > 1 else x, fresh.opt_state
        ),
    )
    ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=1)
    ckpt.save(1, trained, {"i": 0})
    ckpt.close()
    on_disk = sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmp_path / "1") for f in fs
    )
    from jaxrl4llm.train.config import TrainConfig

    estimate = study_estimate.checkpoint_bytes(TrainConfig(), 1_000_000)
    assert estimate == 12_000_000
    # An upper bound: orbax's zstd saves a few per cent on random float32 (not on zeros).
    assert 0.85 * estimate < on_disk <= estimate


def test_the_estimate_counts_runs_time_and_disk(spec, toy_params, tmp_path, monkeypatch):
    root = tmp_path / "root"
    runs = plan(spec, "toy", str(root))
    ckpt = 12 * toy_params  # float32 params + 2 moments
    # No run logged yet: the CPU rate per parameter-token, 16 rows x (16 + 8) tokens.
    per_step = study_estimate.CPU_SECONDS_PER_PARAM_TOKEN * toy_params * 8 * 24
    # 4 runs keep 2 each, and one more during the last save.
    need = (4 * KEEP + 1) * ckpt
    _free(monkeypatch, need + 1)
    lines = study_estimate.summary("toy", "toy", runs, str(root), prune=False).splitlines()
    seconds = 4 * STEPS * per_step
    assert lines[0] == (
        f"toy (toy): 4 runs, 4 to train (0 finished), {4 * STEPS} steps; about "
        f"{seconds / 60:.0f} min (2-core CPU rate per parameter-token, no run "
        "logged yet)."
    )
    assert lines[1] == (
        f"Disk: each run keeps up to 2 checkpoint(s) of {ckpt / 1e9:.2f} GB "
        f"({toy_params / 1e6:.1f}M params: params + 2 Adam moments); "
        f"{need / 1e9:.1f} GB needed, {(need + 1) / 1e9:.1f} GB free in {root}."
    )


def test_logged_step_times_and_existing_checkpoints_are_used(
    spec, toy_params, tmp_path, monkeypatch
):
    root = tmp_path / "root"
    runs = plan(spec, "toy", str(root))
    # a/seed_0 was stopped after step 2 (20 s and 40 s), with one checkpoint of 1000 bytes.
    first = runs[0]
    os.makedirs(os.path.join(first.workdir, "checkpoints", "2"))
    with open(os.path.join(first.workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "time/step_s": 20.0}) + "\n")
        f.write(json.dumps({"step": 2, "time/step_s": 40.0}) + "\n")
    with open(os.path.join(first.workdir, "checkpoints", "2", "blob"), "wb") as f:
        f.write(b"x" * 1000)
    ckpt = 12 * toy_params
    _free(monkeypatch, 10**12)
    estimates = [
        study_estimate.estimate_run(r, study_estimate.resolve_config(r.argv[3:], "r")) for r in runs
    ]
    assert [e.steps_left for e in estimates] == [3, 5, 5, 5]
    assert study_estimate.disk_needed(estimates, prune=False) == (4 * KEEP + 1) * ckpt - 1000
    assert study_estimate.disk_needed(estimates, prune=True) == (KEEP + 1) * ckpt
    first_line = study_estimate.summary("toy", "toy", runs, str(root), False).splitlines()[0]
    # 30 s per step (both arms: b has no run of its own yet) x 18 steps = 9 min.
    assert first_line == (
        "toy (toy): 4 runs, 4 to train (0 finished), 18 steps; about 9 min "
        "(mean time/step_s of 2 logged steps)."
    )


def test_a_disk_too_small_is_refused_with_the_fixes(spec, toy_params, tmp_path, monkeypatch):
    runs = plan(spec, "toy", str(tmp_path / "root"))
    ckpt = 12 * toy_params
    _free(monkeypatch, 4 * ckpt)  # below 9 checkpoints, above the 3 that pruning needs
    with pytest.raises(study_estimate.InsufficientDiskError) as e:
        study_estimate.summary("toy", "toy", runs, str(tmp_path / "root"), prune=False)
    message = str(e.value)
    assert f"{4 * ckpt / 1e9:.1f} GB free, {9 * ckpt / 1e9:.1f} GB needed" in message
    assert (
        f"--prune_checkpoints (deletes each finished run's checkpoints: "
        f"{3 * ckpt / 1e9:.1f} GB needed)" in message
    )
    assert "--keep_checkpoints=1" in message and "another --root" in message
    # With pruning it fits.
    assert "GB needed (with --prune_checkpoints)" in study_estimate.summary(
        "toy", "toy", runs, str(tmp_path / "root"), prune=True
    )


def test_the_study_command_exits_2_before_any_run(spec, tmp_path, monkeypatch, capsys):
    _free(monkeypatch, 1000)
    monkeypatch.setattr(study, "run_all", lambda *a, **k: pytest.fail("a run started"))
    from absl import flags

    flags.FLAGS(["study", f"--study={spec.path}", "--scale=toy", f"--root={tmp_path / 'r'}"])
    try:
        from jaxrl4llm.config import cli

        assert cli.exit_code(study.main, ["study"]) == 2  # the entry point's error contract
    finally:
        flags.FLAGS.unparse_flags()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("Error: Not enough disk for study toy")


def test_a_process_given_some_arms_uses_the_other_arms_step_times(spec, toy_params, tmp_path):
    root = tmp_path / "root"
    runs = plan(spec, "toy", str(root))
    # a/seed_0 logged 10 s and 50 s; the process below is given arm b only.
    first = runs[0]
    os.makedirs(first.workdir)
    with open(os.path.join(first.workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "time/step_s": 10.0}) + "\n")
        f.write(json.dumps({"step": 2, "time/step_s": 50.0}) + "\n")
    only_b = [r for r in runs if r.arm == "b"]
    config = study_estimate.resolve_config(only_b[0].argv[3:], "r")
    per_step, source = study_estimate.seconds_per_step(only_b[0], config, toy_params, only_b)
    assert (per_step, source) == (30.0, "mean time/step_s of 2 logged steps")
