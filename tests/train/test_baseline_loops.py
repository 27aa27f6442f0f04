"""The baselines' trainer paths on the toy copy task: DAPO's dynamic sampling keeps every
shape fixed (nothing compiles after the first step) and stops at its cap."""

import jax
import numpy as np
import pytest
from jax._src import dispatch

from jaxrl4llm.train import loop
from jaxrl4llm.train.infra.metrics import read_metrics

from tests.train.test_loop import _config, _one_device


@pytest.fixture
def compiles():
    """Counts XLA compilations while the test runs (jax.monitoring's backend-compile event)."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            seen.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


def test_dynamic_sampling_recompiles_nothing_and_stops_at_the_cap(
    toy_model_dir, copy_task_file, tmp_path, compiles
):
    """A one-step run compiles everything; a second run of 3 steps with the same shapes (the
    jit caches live in the process) then compiles nothing, although its steps sample 1 to 3
    rounds: each step's batch is P x G rows whatever the rounds. A random policy copies the
    digit with p ~ 1/32, so at G = 4 about 1 group in 9 has a correct sample and the cap of 2
    extra rounds is hit."""
    first = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path / "a",
        algorithm="dapo",
        max_resample_rounds=2,
        num_steps=1,
    )
    loop.run(first, devices=_one_device())
    assert compiles, "the listener saw no compilation: the count below would prove nothing"
    compiles.clear()
    loop.run(first.replace(num_steps=3, workdir=str(tmp_path / "b")), devices=_one_device())
    # Only the train state's creation, which each run compiles before its first step.
    assert [c for c in compiles if c != "jit(create)"] == [], compiles
    records = read_metrics(str(tmp_path / "b"))
    rounds = [r["rollout/rounds"] for r in records]
    assert all(1 <= n <= 3 for n in rounds) and 3 in rounds, rounds
    capped = [r for r in records if r["rollout/rounds"] == 3]
    # Still short after the cap: filled with groups without spread, kept out of the loss.
    assert any(r["rollout/groups_short"] > 0 for r in capped)
    assert all(0 < r["rollout/frac_groups_filtered"] < 1 for r in records)


@pytest.mark.parametrize("preset", ["dapo", "remax"])
def test_resume_with_extra_rounds_or_greedy_rows_equals_an_uninterrupted_run(
    preset, toy_model_dir, copy_task_file, tmp_path
):
    """Dynamic sampling draws extra prompts from the data iterator and ReMax extra greedy rows;
    a run killed and resumed from its checkpoint still reproduces the straight run exactly."""
    kwargs = dict(num_steps=3, checkpoint_every=1, algorithm=preset, max_resample_rounds=2)
    straight = loop.run(
        _config(toy_model_dir, copy_task_file, tmp_path / "a", **kwargs), devices=_one_device()
    )
    half = _config(toy_model_dir, copy_task_file, tmp_path / "b", **dict(kwargs, num_steps=1))
    loop.run(half, devices=_one_device())
    resumed = loop.run(half.replace(num_steps=3), devices=_one_device())
    for x, y in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ma, mb = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
    assert [r["step"] for r in mb] == [1, 2, 3]
    keys = ["reward/mean", "policy/loss", "optim/grad_norm"] + (
        ["rollout/rounds", "reward/accuracy_sampled"] if preset == "dapo" else []
    )
    for ra, rb in zip(ma, mb):
        for key in keys:
            assert ra[key] == rb[key], key
    if preset == "dapo":
        assert max(r["rollout/rounds"] for r in ma) > 1  # the resumed steps drew extra prompts
