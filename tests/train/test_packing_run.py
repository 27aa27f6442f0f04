"""--micro_batch_tokens in the training loop on the toy policy: the packed update trains as
the padded one does, and a run with random completion lengths compiles few update programs."""

import jax
import numpy as np

from jaxrl4llm import rl
from jaxrl4llm.train import loop
from jaxrl4llm.train.infra.metrics import read_metrics

from tests.train.float_checks import LINEAR_OPT
from tests.train.test_loop import _config as loop_config


def _config(model_dir, data, workdir, **overrides):
    """test_loop's toy run with completions of 1 to 40 tokens."""
    return loop_config(
        model_dir, data, workdir, max_new_tokens=40, optimizer=LINEAR_OPT, **overrides
    )


def _count_compilations(fun_name):
    """A list that grows by one at each backend compilation of a function named fun_name."""
    compiled = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and kwargs.get("fun_name") == (
            fun_name
        ):
            compiled.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return compiled


def test_packed_run_equals_the_padded_run(toy_model_dir, copy_task_file, tmp_path):
    """Two steps with and without packing: the same samples, losses and gradient norms
    (LINEAR_OPT: step 2 samples from the same policy, see test_loop), and the packed update
    computes a larger share of real tokens."""
    plain = _config(toy_model_dir, copy_task_file, tmp_path / "plain", num_steps=2)
    loop.run(plain, devices=jax.devices()[:1])
    loop.run(
        plain.replace(workdir=str(tmp_path / "packed"), micro_batch_tokens=256),
        devices=jax.devices()[:1],
    )
    a, b = read_metrics(str(tmp_path / "plain")), read_metrics(str(tmp_path / "packed"))
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert ra["response/length_mean"] == rb["response/length_mean"]
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rb["optim/grad_norm"], ra["optim/grad_norm"], rtol=1e-4)
        assert rb["response/update_real_frac"] > ra["response/update_real_frac"]
        # The packed plan modelled fewer FLOPs than the padded update: it ran packed.
        assert rb["response/update_packed"] == 1 and rb["response/update_flops_ratio"] < 1
        assert "response/update_packed" not in ra
        # GRPO's reference pass ran on the packed rows too.
        assert rb["response/logprob_real_frac"] > ra["response/logprob_real_frac"]


def test_random_lengths_compile_a_handful_of_update_programs(
    toy_model_dir, copy_task_file, tmp_path
):
    """20 steps whose completions (the toy policy's: random, 1 to 40 tokens) differ every
    step: the update and the packed reference pass compile once per row-length bucket they
    meet, not once per step."""
    compiled = _count_compilations("jit(train_step)")
    reference_passes = _count_compilations("jit(logprobs_jit)")  # packed, GRPO's KL
    config = _config(toy_model_dir, copy_task_file, tmp_path, num_steps=20, micro_batch_tokens=2048)
    loop.run(config, devices=jax.devices()[:1])
    records = read_metrics(str(tmp_path))
    assert len(records) == 20
    # The lengths were random: the batch's token count differed from step to step.
    assert len({r["response/length_mean"] for r in records}) >= 15
    assert 1 <= len(compiled) <= 4, f"{len(compiled)} update programs compiled"
    # The packed reference pass: one program per (row length, completion bucket) met.
    assert 1 <= len(reference_passes) <= 4, f"{len(reference_passes)} reference programs"


def test_packed_ppo_step_equals_the_padded_step(toy_model_dir, copy_task_file, tmp_path):
    """PPO, two epochs: the reference, old-logprob and value passes all run on packed rows;
    the step's policy and critic losses and gradient norms are the padded step's."""
    plain = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path / "plain",
        num_steps=1,
        algorithm=rl.get_preset("ppo"),
        ppo_epochs=2,
        critic_warmup_steps=0,
    )
    loop.run(plain, devices=jax.devices()[:1])
    loop.run(
        plain.replace(workdir=str(tmp_path / "packed"), micro_batch_tokens=256),
        devices=jax.devices()[:1],
    )
    (a,), (b,) = read_metrics(str(tmp_path / "plain")), read_metrics(str(tmp_path / "packed"))
    assert a["response/length_mean"] == b["response/length_mean"]
    for key in ("policy/loss", "critic/loss", "optim/grad_norm", "critic/grad_norm"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert b["response/logprob_real_frac"] > a["response/logprob_real_frac"]
