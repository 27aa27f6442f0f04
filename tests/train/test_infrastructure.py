"""Metrics writer, checkpoint round trip, optimizer schedule, preemption flag."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl4llm.train.infra import checkpoint, metrics
from jaxrl4llm.train.update import state


def test_metrics_jsonl_tensorboard_and_resume_truncation(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path))
    for step in range(1, 5):
        writer.write(step, {"reward/mean": step / 10, "bad": float("nan")})
    writer.close()
    records = metrics.read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["reward/mean"] == pytest.approx(0.3)
    assert records[0]["bad"] is None  # NaN is not valid JSON
    assert os.listdir(tmp_path / "tensorboard")
    writer = metrics.MetricsWriter(str(tmp_path), trackers=())
    writer.truncate_after(2)
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 2]


def test_metrics_that_counted_nothing_are_not_logged():
    """An update whose every row is rejected (RAFT with no correct sample) has no tokens to
    average: its entropy, clip fraction and ratio extremes are absent, not 0 / inf; what it
    did measure (the rejected fraction, 1) stays."""
    from jaxrl4llm import rl
    from jaxrl4llm.rl.losses import token_metrics

    B, T = 4, 6
    zeros_BT = jnp.zeros((B, T))
    part = token_metrics(
        zeros_BT,
        jnp.zeros((B,), bool),
        ratio_BT=jnp.ones((B, T)),
        log_ratio_BT=zeros_BT,
        entropy_BT=jnp.full((B, T), 2.0),
        pg_loss_BT=zeros_BT,
    )
    host = metrics.to_host_scalars({**part, "time/step_s": jnp.float32(3.0)})
    assert host == {"policy/frac_rejected": 1.0, "time/step_s": 3.0}
    # Merged with a part that kept 2 tokens of entropy 1.0 and 3.0, the mean is theirs alone.
    w_BT = jnp.zeros((B, T)).at[0, :2].set(1.0)
    kept = token_metrics(
        w_BT,
        jnp.array([True, False, False, False]),
        ratio_BT=jnp.full((B, T), 1.5),
        log_ratio_BT=zeros_BT,
        entropy_BT=jnp.zeros((B, T)).at[0, :2].set(jnp.array([1.0, 3.0])),
    )
    host = metrics.to_host_scalars(rl.combine_metrics(part, kept))
    assert host["policy/entropy"] == pytest.approx(2.0)
    assert host["policy/ratio_min"] == host["policy/ratio_max"] == pytest.approx(1.5)
    assert host["policy/frac_rejected"] == pytest.approx(7 / 8)


def test_console_line_is_ordered_and_short():
    line = metrics.console_line(3, 10, {"reward/accuracy": 0.5, "reward/mean": 0.25, "x": 1.0})
    assert line == "step 3/10 | reward 0.25 | acc 0.5"


def test_console_line_shows_each_eval_set_and_the_mean_only_over_several():
    one = {"eval/add1/avg@4": 0.5, "eval/add1/pass@4": 1.0, "eval/mean/avg@4": 0.5}
    assert metrics.console_line(6, 12, one) == "step 6/12 | add1 avg@4 0.5"
    two = {
        "eval/gsm8k/avg@1": 0.25,
        "eval/add1/avg@4": 0.75,
        "eval/mean/avg@1": 0.5,
        "eval/add1/num_prompts": 32.0,
    }
    assert (
        metrics.console_line(6, 12, two)
        == "step 6/12 | add1 avg@4 0.75 | gsm8k avg@1 0.25 | mean avg@1 0.5"
    )


def test_learning_rate_schedule_warmup_then_cosine():
    cfg = state.OptimizerConfig(
        learning_rate=1e-3, warmup_steps=4, schedule="cosine", decay_steps=10
    )
    sched = state.learning_rate_schedule(cfg)
    assert float(sched(0)) == pytest.approx(2.5e-4)
    assert float(sched(4)) == pytest.approx(1e-3)
    assert float(sched(14)) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="lr_schedule"):
        state.OptimizerConfig(schedule="exp").validate()


def test_grad_clipping_rescales_to_max_norm():
    def updates(max_grad_norm, grad):
        # eps=1 makes Adam's update depend on the gradient's scale, so clipping is visible.
        opt = state.make_optimizer(
            state.OptimizerConfig(learning_rate=1.0, eps=1.0, max_grad_norm=max_grad_norm)
        )
        params = {"w": jnp.zeros(3)}
        return opt.update({"w": grad}, opt.init(params), params)[0]["w"]

    grad = jnp.array([30.0, 40.0, 0.0])  # norm 50
    np.testing.assert_allclose(updates(1.0, grad), updates(0.0, grad / 50.0), rtol=1e-6)
    assert not np.allclose(updates(1.0, grad), updates(0.0, grad))


def test_checkpoint_round_trip_keeps_last_k(tmp_path):
    opt = optax.adam(1e-2)
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    ts = state.TrainState.create(params, opt, seed=7)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=2, keep=2)
    for step in (2, 4, 6):
        ts = ts.replace(step=jnp.int32(step), params={"w": ts.params["w"] + 1})
        ckpt.save(step, ts, {"epoch": 1, "index": step})
    assert ckpt.latest_step() == 6
    assert sorted(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit()) == [4, 6]
    restored, data_state = ckpt.restore(checkpoint.abstract_like(ts))
    np.testing.assert_array_equal(restored.params["w"], ts.params["w"])
    np.testing.assert_array_equal(restored.rng, ts.rng)
    assert int(restored.step) == 6 and data_state == {"epoch": 1, "index": 6}
    assert jax.random.key_data(restored.key()).tolist() == jax.random.key_data(ts.key()).tolist()
    ckpt.close()


def test_sigterm_sets_the_preemption_flag():
    flag = checkpoint.PreemptionFlag()
    try:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested
    finally:
        flag.restore_handler()
