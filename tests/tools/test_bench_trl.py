"""tools/bench_trl.py: TRL's GRPOConfig built from the bench's arguments does the work of our
step: the same rows per optimizer step, one fresh rollout per step, forced lengths, the same
KL switch and precision. Skipped when trl (the optional `bench` extra) is absent."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("trl")
from trl import GRPOConfig  # noqa: E402

TOOLS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"
)
sys.path.insert(0, TOOLS)
import bench_train  # noqa: E402
import bench_trl  # noqa: E402


def trl_config(tmp_path, flags, dtype):
    args = bench_train.build_parser().parse_args(flags)
    return GRPOConfig(
        **bench_trl.trl_config_kwargs(
            prompts=args.prompts,
            group=args.group,
            new_tokens=args.new_tokens,
            dtype=dtype,
            remat=args.remat,
            kl_coef=args.kl_coef,
            steps=1 + args.repeats,
            output_dir=str(tmp_path),
            use_cpu=True,
        )
    )


def test_rows_per_step_match_ours(tmp_path):
    config = trl_config(
        tmp_path, ["--prompts=3", "--group=4", "--new_tokens=16", "--repeats=2"], "float32"
    )
    # Our step: 3 prompts x 4 samples = 12 rows, one micro-batch, one optimizer step.
    assert config.world_size == 1
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 12
    assert config.gradient_accumulation_steps == 1
    # TRL's rollout: generation_batch_size rows (derived by GRPOConfig), 4 per prompt, and a
    # fresh one for every optimizer step (no reuse of old completions).
    assert config.generation_batch_size == 12
    assert config.generation_batch_size // config.num_generations == 3
    assert config.steps_per_generation * config.num_iterations == 1
    assert config.max_steps == 3  # warm-up + 2 timed steps
    # Forced length: at most and at least 16 new tokens.
    assert config.max_completion_length == 16
    assert config.generation_kwargs["min_new_tokens"] == 16
    assert config.beta == 0.0  # KL off, as ours by default
    assert config.gradient_checkpointing is True  # ours remats by default
    assert config.bf16 is False and config.fp16 is False
    assert config.shuffle_dataset is False  # prompts in our order


def test_precision_remat_and_kl_follow_the_flags(tmp_path):
    config = trl_config(
        tmp_path, ["--prompts=2", "--group=2", "--no_remat", "--kl_coef=0.04"], "float32:bfloat16"
    )
    assert config.bf16 is True  # bf16 compute over float32 weights
    assert config.gradient_checkpointing is False
    assert config.beta == 0.04
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 4


def test_step_records_are_the_bench_prompts():
    source = list(range(5))
    assert bench_trl.step_records(source, 0, 3) == [0, 1, 2]
    assert bench_trl.step_records(source, 1, 3) == [3, 4, 0]  # wraps around the source
