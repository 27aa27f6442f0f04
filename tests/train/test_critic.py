"""PPO's critic in the trainer: values against transformers, layout, HF export and reload,
warm-up, exact resume, flags."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl4llm import parallel, rl
from jaxrl4llm.models import registry
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.update import critic
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences
from jaxrl4llm.train.update.state import create_state

from tests.train.float_checks import LINEAR_OPT, assert_trees_close, param_step
from tests.train.test_loop import _config, _one_device


def _critic_with_head(toy_model_dir, seed=1):
    model_config, params, tokenizer = registry.load_model(toy_model_dir)
    params_critic = critic.from_policy(params)
    head = jax.random.normal(jax.random.key(seed), params_critic[critic.HEAD].shape)
    return model_config, params, dict(params_critic, **{critic.HEAD: head}), tokenizer


def _seqs():
    """Two rows: a left-padded prompt of 3 real tokens, completions of 3 and 2 real tokens."""
    prompt = jnp.array([[0, 7, 13], [7, 13, 14]], jnp.int32)
    prompt_mask = jnp.array([[False, True, True], [True, True, True]])
    completion = jnp.array([[15, 16, 3], [17, 3, 0]], jnp.int32)
    completion_mask = jnp.array([[True, True, True], [True, True, False]])
    return Sequences(prompt, prompt_mask, completion, completion_mask)


def test_values_match_transformers_token_classification_of_the_export(toy_model_dir, tmp_path):
    """critic.export writes a folder transformers loads as LlamaForTokenClassification
    (num_labels 1); its logits at the columns before each completion token are our values.
    --critic_model reads it back bit for bit (the toy policy is untied: no lm_head there)."""
    from transformers import AutoModelForTokenClassification

    model_config, _, params_critic, tokenizer = _critic_with_head(toy_model_dir)
    folder = tmp_path / "critic"
    critic.export(params_critic, model_config, folder, tokenizer)
    seqs = _seqs()
    values = np.asarray(critic.completion_values(params_critic, model_config, seqs))

    hf = AutoModelForTokenClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    for i in range(2):
        real = np.asarray(seqs.prompt_mask_BP[i])
        tokens = np.r_[
            np.asarray(seqs.prompt_tokens_BP[i])[real], np.asarray(seqs.completion_tokens_BT[i])
        ]
        with torch.no_grad():
            logits = hf(torch.tensor(tokens[None])).logits[0, :, 0].numpy()
        n = int(real.sum())
        # V(s_t) is read at the position before completion token t.
        want = logits[n - 1 : n - 1 + 3]
        m = np.asarray(seqs.completion_mask_BT[i])
        np.testing.assert_allclose(values[i][m], want[m], rtol=1e-4, atol=1e-4)

    reloaded = critic.load(str(folder), model_config)
    assert "unembed" not in reloaded["backbone"]
    for a, b in zip(jax.tree.leaves(params_critic), jax.tree.leaves(reloaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_critic_model_of_another_shape_is_refused(toy_model_dir, tmp_path):
    from tests.conftest import build_toy_model

    model_config, _, _, _ = _critic_with_head(toy_model_dir)
    other = dataclasses.replace(model_config, hidden_size=16)
    with pytest.raises(ValueError, match="--critic_model=.*hidden_size=32 .policy: 16"):
        critic.load(build_toy_model(tmp_path / "m"), other)


def test_critic_is_laid_out_like_the_policy_on_a_mesh(toy_model_dir):
    mesh = parallel.make_mesh("data:1,fsdp:4,tensor:2", jax.devices())
    _, params, _ = registry.load_model(toy_model_dir, mesh=mesh)
    params_critic = critic.from_policy(params)
    for name in ("embed", "final_norm"):
        assert params_critic["backbone"][name].sharding == params[name].sharding
    for a, b in zip(
        jax.tree.leaves(params_critic["backbone"]["layers"]), jax.tree.leaves(params["layers"])
    ):
        assert a.sharding == b.sharding
    assert params_critic[critic.HEAD].sharding == params["final_norm"].sharding
    assert np.all(np.asarray(params_critic[critic.HEAD]) == 0)  # V = 0 at step 0


def test_sharded_critic_step_matches_one_device(toy_model_dir):
    """One critic update (2 micro-batches) on fsdp=4 x tensor=2 gives one device's loss,
    metrics and update, and keeps the critic laid out like the policy. The update is Adam's
    with a step proportional to the gradient (LINEAR_OPT): with the default eps, a near-zero
    gradient's rounding, which differs between layouts and hosts, would be a +-lr step. (A
    loop-level comparison is not robust here for the same reason: at step 0 the returns are
    float noise.)"""
    rng = np.random.default_rng(0)
    B, T = 8, 3
    seqs = Sequences(
        jnp.asarray(rng.integers(4, 20, (B, 4)), jnp.int32),
        jnp.ones((B, 4), bool),
        jnp.asarray(rng.integers(4, 20, (B, T)), jnp.int32),
        jnp.asarray(np.arange(T)[None] < rng.integers(1, T + 1, (B, 1))),
    )
    returns = jnp.asarray(rng.normal(size=(B, T)), jnp.float32) * seqs.completion_mask_BT
    results = []
    for mesh in (None, parallel.make_mesh("data:1,fsdp:4,tensor:2", jax.devices())):
        model_config, params, _ = registry.load_model(toy_model_dir, mesh=mesh)
        params_critic = critic.from_policy(params)
        params_critic[critic.HEAD] = params_critic[critic.HEAD] + 0.3
        sharding = None if mesh is None else parallel.ActivationSharding(mesh)
        old_values = critic.values_jit(params_critic, model_config, seqs, sharding=sharding)
        batch = UpdateBatch(
            seqs=seqs,
            advantages=jnp.zeros((B, T)),
            keep_B=jnp.ones(B, bool),
            old_logp_BT=None,
            ref_logp_BT=None,
            old_values_BT=old_values,
            returns_BT=returns,
        )
        before = jax.device_get(params_critic)  # critic_step donates the state
        state = create_state(params_critic, LINEAR_OPT, 0)
        new, metrics = critic.critic_step(
            state,
            batch,
            model_config=model_config,
            algorithm=rl.get_preset("ppo"),
            optimizer=LINEAR_OPT,
            num_micro=2,
            sharding=sharding,
        )
        results.append((param_step(before, new.params), rl.finalize_metrics(metrics)))
        if mesh is not None:
            for a, b in zip(
                jax.tree.leaves(new.params["backbone"]),
                jax.tree.leaves({k: v for k, v in params.items() if k != "unembed"}),
            ):
                assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    (one, m1), (eight, m8) = results
    assert m1["critic/loss"] > 0.1  # returns ~ N(0, 1) against values ~ 0.3 h . 1
    for key in ("critic/loss", "critic/grad_norm", "critic/values_mean", "critic/clip_frac"):
        np.testing.assert_allclose(m8[key], m1[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # Rounding moves the step by ~1e-7 of its largest element; a wrong value mask or a
    # micro-batch counted twice moves it by a sizeable fraction.
    assert_trees_close(eight, one, rel=1e-4)


def test_critic_learning_rate_defaults_to_ten_times_the_policys():
    base = TrainConfig().optimizer
    assert critic.optimizer_config(base, None).learning_rate == pytest.approx(
        10 * base.learning_rate
    )
    assert critic.optimizer_config(base, 3e-6).learning_rate == 3e-6


@pytest.mark.parametrize(
    "flags", [{"critic_warmup_steps": 2}, {"critic_learning_rate": 1e-5}, {"critic_model": "x"}]
)
def test_critic_flags_without_a_critic_are_refused(flags):
    with pytest.raises(ValueError, match="trains no critic"):
        validate(TrainConfig().replace(algorithm="grpo", **flags), 1)


def test_warmup_updates_only_the_critic_and_resume_is_exact(
    toy_model_dir, copy_task_file, tmp_path
):
    """--critic_warmup_steps=2: after 2 steps the policy is the loaded model and the critic
    has moved; a run killed after step 2 and resumed reproduces a straight 4-step run bit for
    bit (policy, critic and optimizer states, metrics)."""
    kwargs = dict(
        algorithm=rl.get_preset("ppo"),
        critic_warmup_steps=2,
        checkpoint_every=1,
        mini_batch_size=16,
        ppo_epochs=2,
    )
    half = _config(toy_model_dir, copy_task_file, tmp_path / "b", num_steps=2, **kwargs)
    first = loop.run(half, devices=_one_device())
    _, loaded, _ = registry.load_model(toy_model_dir)
    for a, b in zip(jax.tree.leaves(first["state"].params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(first["critic_state"].params[critic.HEAD]) != 0)
    warm = read_metrics(str(tmp_path / "b"))
    assert all("policy/loss" not in r and r["critic/loss"] >= 0 for r in warm)

    straight = loop.run(
        _config(toy_model_dir, copy_task_file, tmp_path / "a", num_steps=4, **kwargs),
        devices=_one_device(),
    )
    resumed = loop.run(half.replace(num_steps=4), devices=_one_device())
    for key in ("state", "critic_state"):
        for x, y in zip(jax.tree.leaves(straight[key]), jax.tree.leaves(resumed[key])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ma, mb = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
    assert [r["step"] for r in mb] == [1, 2, 3, 4]
    for ra, rb in zip(ma, mb):
        for key in ("reward/mean", "critic/loss", "critic/grad_norm", "critic/values_mean"):
            assert ra[key] == rb[key], key
    assert ma[-1]["policy/loss"] == mb[-1]["policy/loss"]

    # tools/export_hf.py writes the critic beside the policy; both reload as trained.
    from tools import export_hf

    out = tmp_path / "exported"
    assert export_hf.main([str(tmp_path / "a"), str(out)]) == 0
    _, policy_params, _ = registry.load_model(str(out))
    for x, y in zip(jax.tree.leaves(straight["state"].params), jax.tree.leaves(policy_params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    model_config = registry.load_model(str(out), with_tokenizer=False)[0]
    reloaded = critic.load(str(tmp_path / "exported-critic"), model_config)
    for x, y in zip(jax.tree.leaves(straight["critic_state"].params), jax.tree.leaves(reloaded)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(resumed["critic_state"].step) == 4

    # --critic_model starts a run from that critic: its first values are not the zero head's.
    fresh = loop.run(
        _config(
            toy_model_dir,
            copy_task_file,
            tmp_path / "c",
            num_steps=1,
            algorithm=rl.get_preset("ppo"),
            critic_model=str(tmp_path / "exported-critic"),
        ),
        devices=_one_device(),
    )
    assert read_metrics(str(tmp_path / "c"))[0]["critic/values_mean"] != 0
    assert fresh["critic_state"] is not None
