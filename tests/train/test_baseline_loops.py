"""The baselines' trainer paths on the toy copy task: DAPO's dynamic sampling keeps every
shape fixed (nothing compiles after the first step) and stops at its cap."""
import jax
import pytest
from jax._src import dispatch

from jaxrl4llm import rl
from jaxrl4llm.train import loop
from jaxrl4llm.train.metrics import read_metrics

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


def test_dynamic_sampling_recompiles_nothing_and_stops_at_the_cap(toy_model_dir, copy_task_file,
                                                                  tmp_path, compiles):
    """A one-step run compiles everything; a second run of 3 steps with the same shapes (the
    jit caches live in the process) then compiles nothing, although its steps sample 1 to 3
    rounds: each step's batch is P x G rows whatever the rounds. A random policy copies the
    digit with p ~ 1/32, so at G = 4 about 1 group in 9 has a correct sample and the cap of 2
    extra rounds is hit."""
    algorithm = rl.get_preset("dapo", max_resample_rounds=2)
    first = _config(toy_model_dir, copy_task_file, tmp_path / "a", algorithm=algorithm, num_steps=1)
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
