"""The sampler-trainer gap on a toy model: its float32 bound, and a run that logs it and
corrects by it (--is_correction)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import TINY
from jaxrl4llm.sampling import sampler
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.update.logprobs import Sequences, completion_logprobs
from jaxrl4llm.train.update.state import OptimizerConfig

# float32 sampler and float32 trainer: the KV-cache decode and the teacher-forced forward
# differ by summation order only (measured on this model: max |diff| 2.4e-6 nats).
F32_BOUND = 1e-5
CONFIG = dataclasses.replace(TINY, tie_word_embeddings=False)


def _gap(sampler_config, trainer_config, seed=0):
    """|trainer logp - sampler logp| on every sampled token, at temperature 1."""
    params = transformer.init_params(CONFIG, jax.random.key(seed))
    params["unembed"] = params["unembed"] * 15.0  # logits over several nats
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, CONFIG.vocab_size, size=n).tolist() for n in [4, 9, 2, 6]]
    out = sampler.generate(
        params,
        sampler_config,
        prompts,
        SamplingConfig(temperature=1.0),
        16,
        jax.random.key(seed),
        n=2,
        stop_ids=(),
    )
    seqs = Sequences(out.prompt_tokens_BP, out.prompt_mask_BP, out.tokens_BT, out.mask_BT)
    logp, _ = completion_logprobs(params, trainer_config, seqs, 1.0)
    return np.abs(np.asarray(logp) - np.asarray(out.logprobs_BT))[np.asarray(out.mask_BT)]


def test_float32_sampler_and_trainer_agree_to_the_bound():
    gap = _gap(CONFIG, CONFIG)
    assert gap.size == 8 * 16 and gap.max() < F32_BOUND


def test_a_bfloat16_sampler_is_further_off_than_the_bound():
    """The measure can fail: a bfloat16 sampler against the float32 trainer is off by far more."""
    gap = _gap(dataclasses.replace(CONFIG, compute_dtype="bfloat16"), CONFIG)
    assert gap.max() > 100 * F32_BOUND


def _config(model_dir, data, workdir, **overrides):
    base = dict(
        model=model_dir,
        data=data,
        instruction="",
        prompts_per_step=4,
        group_size=4,
        max_prompt_tokens=16,
        max_new_tokens=2,
        optimizer=OptimizerConfig(1e-2),
        num_steps=2,
        mesh="data:1,fsdp:1,tensor:1",
        eval_prompts=0,
        checkpoint_every=1000,
        workdir=str(workdir),
        answer_mode="lenient",
        trackers="",
        algorithm=rl.AlgorithmConfig(name="grpo"),
    )
    return TrainConfig().replace(**dict(base, **overrides))


def test_a_run_logs_the_gap_and_the_corrected_fractions(toy_model_dir, copy_task_file, tmp_path):
    config = _config(
        toy_model_dir, copy_task_file, tmp_path, is_correction="icepop", mini_batch_size=8
    )  # two updates per rollout: pi_old is recomputed
    loop.run(config, devices=jax.devices()[:1])
    records = read_metrics(str(tmp_path))
    assert len(records) == 2
    for r in records:
        assert 0 <= r["mismatch/logp_abs_diff_mean"] <= r["mismatch/logp_abs_diff_max"]
        assert r["mismatch/logp_abs_diff_max"] < F32_BOUND
        # float32 on both sides: no ratio leaves [0.5, 2], so nothing is masked.
        assert r["mismatch/ratio_outside_frac"] == 0.0
        assert r["is/corrected_token_frac"] == 0.0 and r["is/corrected_seq_frac"] == 0.0
        assert r["is/weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_correction_with_the_samplers_pi_old_is_refused(toy_model_dir, copy_task_file, tmp_path):
    config = _config(
        toy_model_dir,
        copy_task_file,
        tmp_path,
        is_correction="tis",
        mini_batch_size=8,
        recompute_old_logprobs=False,
    )
    with pytest.raises(ValueError, match="--is_correction=tis reweights"):
        validate(config, num_devices=1)
    assert not config.replace(is_correction=None).keeps_behaviour_logprobs
