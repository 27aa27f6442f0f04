"""The whole training loop on a toy policy: learning, sharding, resume, reference, bad values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import registry
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.update.state import OptimizerConfig

from tests.train.float_checks import LINEAR_OPT


def _config(model_dir, data, workdir, **overrides):
    base = dict(
        model=model_dir,
        data=data,
        instruction="",
        prompts_per_step=8,
        group_size=4,
        max_prompt_tokens=16,
        max_new_tokens=1,
        algorithm=rl.get_preset("grpo"),
        optimizer=OptimizerConfig(learning_rate=1e-2),
        num_steps=4,
        mesh="data:1,fsdp:1,tensor:1",
        eval_prompts=0,
        checkpoint_every=1000,
        workdir=str(workdir),
        answer_mode="lenient",
        trackers="",
    )
    base.update(overrides)
    return TrainConfig().replace(**base)


def _one_device():
    return jax.devices()[:1]


def _accuracy(workdir):
    """Per step: the accuracy of the policy's samples (with dynamic sampling, over every sample
    drawn: the batch's own is biased towards groups holding a correct sample)."""
    return np.array(
        [r.get("reward/accuracy_sampled", r["reward/accuracy"]) for r in read_metrics(str(workdir))]
    )


@pytest.mark.parametrize("preset", sorted(rl.PRESETS))
def test_every_preset_learns_the_copy_task(preset, toy_model_dir, copy_task_file, tmp_path):
    """A random policy copies the digit with p ~ 1/32; every algorithm must do far better.

    Seeded; measured on the CI machine kind (40 steps, lr 1e-2): final accuracy 0.36 (reinforce,
    the noisiest) to 0.88 (grpo), from 0.02-0.04.
    """
    config = _config(
        toy_model_dir, copy_task_file, tmp_path, algorithm=rl.get_preset(preset), num_steps=40
    )
    loop.run(config, devices=_one_device())
    accuracy = _accuracy(tmp_path)
    start, end = accuracy[:5].mean(), accuracy[-8:].mean()
    assert start < 0.1, f"{preset}: the toy task should start hard, got {start:.2f}"
    assert end > start + 0.25, f"{preset}: accuracy went {start:.2f} -> {end:.2f}"


def test_sharded_run_matches_unsharded(toy_model_dir, copy_task_file, tmp_path):
    """fsdp=4 x tensor=2 on 8 fake devices gives the losses of one device (float32, 1e-4),
    with the rollout and reference pass in two row chunks there. LINEAR_OPT: with Adam's
    default eps a near-zero gradient's rounding, which differs between the layouts, would move
    a weight by +-lr, and the next steps' samples would then differ (see float_checks)."""
    one = _config(
        toy_model_dir, copy_task_file, tmp_path / "one", num_steps=3, optimizer=LINEAR_OPT
    )
    eight = one.replace(
        workdir=str(tmp_path / "eight"), mesh="data:1,fsdp:4,tensor:2", rollout_micro_batch=16
    )
    loop.run(one, devices=_one_device())
    summary = loop.run(eight)
    assert (
        summary["state"].params["embed"].sharding.spec[0] is not None
        or summary["state"].params["embed"].sharding.spec[1] is not None
    )
    a, b = read_metrics(str(tmp_path / "one")), read_metrics(str(tmp_path / "eight"))
    for ra, rb in zip(a, b):
        assert ra["reward/mean"] == rb["reward/mean"]
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], atol=1e-4)
        np.testing.assert_allclose(rb["policy/entropy"], ra["policy/entropy"], atol=1e-4)


@pytest.mark.parametrize(
    "lora",
    [{}, dict(lora_rank=4, lora_dropout=0.1), dict(lora_rank=4, param_dtype="bfloat16")],
    ids=["full", "lora", "lora-bf16-base"],
)
def test_resume_equals_an_uninterrupted_run(lora, toy_model_dir, copy_task_file, tmp_path):
    """LoRA: the checkpoint holds the adapters and their optimizer state (not the base),
    float32 whatever the base's dtype."""
    kwargs = dict(
        num_steps=4,
        checkpoint_every=2,
        algorithm=rl.get_preset("lite_ppo"),
        mini_batch_size=16,
        ppo_epochs=2,
        **lora,
    )
    straight = loop.run(
        _config(toy_model_dir, copy_task_file, tmp_path / "a", **kwargs), devices=_one_device()
    )
    half = _config(toy_model_dir, copy_task_file, tmp_path / "b", **dict(kwargs, num_steps=2))
    loop.run(half, devices=_one_device())
    resumed = loop.run(half.replace(num_steps=4), devices=_one_device())
    assert resumed["step"] == straight["step"] == 4
    if lora:
        assert set(resumed["state"].params) == {"layers"}
        assert all("_lora_" in name for name in resumed["state"].params["layers"])
        floats = [
            x for x in jax.tree.leaves(resumed["state"]) if jnp.issubdtype(x.dtype, jnp.floating)
        ]
        assert {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
    for x, y in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ma, mb = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
    assert [r["step"] for r in mb] == [1, 2, 3, 4]
    for ra, rb in zip(ma, mb):
        for key in ("reward/mean", "policy/loss", "optim/grad_norm", "policy/approx_kl_old"):
            assert ra[key] == rb[key], key


def test_kl_run_keeps_the_reference_frozen(toy_model_dir, copy_task_file, tmp_path):
    config = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path,
        algorithm=rl.get_preset("grpo", kl_coef=0.1),
        num_steps=3,
    )
    summary = loop.run(config, devices=_one_device())
    _, initial, _ = registry.load_model(toy_model_dir, with_tokenizer=False)
    for ref, init, final in zip(
        jax.tree.leaves(summary["ref_params"]),
        jax.tree.leaves(initial),
        jax.tree.leaves(summary["state"].params),
    ):
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(init))
    moved = [
        not np.array_equal(np.asarray(i), np.asarray(f))
        for i, f in zip(jax.tree.leaves(initial), jax.tree.leaves(summary["state"].params))
    ]
    assert any(moved)
    assert read_metrics(str(tmp_path))[-1]["policy/kl_ref"] > 0
    # No KL term: no reference model is loaded at all.
    no_kl = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path / "nokl",
        algorithm=rl.get_preset("dr_grpo"),
        num_steps=1,
    )
    assert loop.run(no_kl, devices=_one_device())["ref_params"] is None


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(mini_batch_size=12), "does not divide the batch of 32 rows"),
        (dict(micro_batch_size=5, mini_batch_size=16), "does not divide the mini-batch of 16"),
        (dict(group_size=1), "group_size"),
        (dict(rollout_micro_batch=6), "--rollout_micro_batch=6 must divide the batch of 32"),
        (dict(mesh="data:1,fsdp:3,tensor:1"), "needs 3 devices but 1 are available"),
        (dict(max_prompt_tokens=4), "longer than --max_prompt_tokens=4"),
    ],
)
def test_bad_values_fail_with_a_clear_message(
    overrides, message, toy_model_dir, copy_task_file, tmp_path
):
    config = _config(toy_model_dir, copy_task_file, tmp_path, **overrides)
    with pytest.raises(ValueError, match=message):
        loop.run(config, devices=_one_device())


def test_a_new_loss_metric_reaches_metrics_jsonl(
    toy_model_dir, copy_task_file, tmp_path, monkeypatch
):
    """A metric named and reduced where it is computed is logged with no other edit; the
    reward mean and accuracy are logged once."""
    policy_loss = rl.policy_loss

    def with_probe(*args, **kwargs):
        loss_sum, denominator, metrics = policy_loss(*args, **kwargs)
        rows = jnp.float32(args[1].shape[0])  # logp_BT: this micro-batch's rows
        return (
            loss_sum,
            denominator,
            dict(
                metrics,
                **{
                    "policy/probe_rows": rl.Metric.sum(rows),
                    "policy/probe_max": rl.Metric.max(rows),
                },
            ),
        )

    monkeypatch.setattr(rl, "policy_loss", with_probe)
    # A knob value no other test uses: train_step is traced afresh, with the probe.
    config = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path,
        num_steps=1,
        mini_batch_size=16,
        micro_batch_size=8,
        algorithm=rl.get_preset("grpo", clip_high=0.2345),
    )
    loop.run(config, devices=_one_device())
    record = read_metrics(str(tmp_path))[-1]
    # 2 mini-batches x 2 micro-batches of 8 rows: summed over all four, max of each.
    assert record["policy/probe_rows"] == 32.0 and record["policy/probe_max"] == 8.0
    assert not {"adv/reward_mean", "adv/accuracy", "adv/frac_truncated"} & set(record)
    assert {"reward/mean", "reward/accuracy", "policy/entropy", "optim/grad_norm"} <= set(record)


def test_length_classes_give_the_same_run(toy_model_dir, copy_task_file, tmp_path):
    """--micro_batch_length_classes changes which padded columns the update computes, not the
    update: the same losses as the plain run, and no more columns. (LINEAR_OPT, so that step
    2 samples from the same policy: see test_sharded_run_matches_unsharded.)"""
    kwargs = dict(num_steps=2, max_new_tokens=40, micro_batch_size=8, optimizer=LINEAR_OPT)
    plain = _config(toy_model_dir, copy_task_file, tmp_path / "plain", **kwargs)
    loop.run(plain, devices=_one_device())
    loop.run(
        plain.replace(workdir=str(tmp_path / "classes"), micro_batch_length_classes=3),
        devices=_one_device(),
    )
    a, b = read_metrics(str(tmp_path / "plain")), read_metrics(str(tmp_path / "classes"))
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert ra["reward/mean"] == rb["reward/mean"]
        assert ra["response/length_mean"] == rb["response/length_mean"]
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rb["optim/grad_norm"], ra["optim/grad_norm"], rtol=1e-4)
        assert rb["response/update_real_frac"] >= ra["response/update_real_frac"] > 0
