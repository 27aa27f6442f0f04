"""Flags come from the config tree: a flagfile's values and the command line's overrides, the
presets' knobs, config.json round-trips the tree, every option has help, and a new field is a
new flag."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from absl import flags

from jaxrl4llm.config import cli, options
from jaxrl4llm.sampling.config import DynamicSampling
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate

from tests.experiments.flagfile_paths import REPO


def test_config_json_round_trips_the_tree(parsed):
    config = parsed(
        f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_lite_ppo.flags",
        "--binary_reward=-1,1",
        "--overlong_buffer=64",
        "--top_k=5",
    )
    data = json.loads(config.to_json())
    assert data["rollout"]["sampling"]["top_k"] == 5
    assert data["algorithm"]["binary_reward"] == [-1.0, 1.0]
    assert data["reward"]["max_new_tokens"] == 8192  # follows --max_new_tokens
    assert TrainConfig.from_json(config.to_json()) == config


def test_command_line_overrides_the_flagfile(parsed):
    c = parsed(
        f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_lite_ppo.flags",
        "--clip_high=0.28",
        "--agg=seq-mean-token-mean",
        "--binary_reward=-1,1",
    )
    assert c.algorithm.clip_high == 0.28 and c.algorithm.agg == "seq-mean-token-mean"
    assert c.algorithm.std == "batch"  # the preset's value stays where not overridden
    assert c.algorithm.binary_reward == (-1.0, 1.0)


def test_preset_knobs_override_only_when_given(parsed):
    c = parsed("--algorithm=reinforce_pp")
    assert (c.algorithm.kl_in, c.algorithm.kl_estimator, c.algorithm.kl_coef) == (
        "reward",
        "k1",
        0.01,
    )
    c = parsed("--algorithm=grpo", "--kl_in=none", "--kl_coef=0", "--noreject_all_wrong")
    assert c.algorithm.kl_in is None and c.algorithm.kl_coef == 0.0 and not c.needs_reference
    # The KL as a metric only: the reference is loaded, the loss has no KL term.
    c = parsed("--algorithm=raft_pp", "--log_kl_ref")
    assert c.needs_reference and c.algorithm.kl_in is None and c.update.log_kl_ref
    c = parsed("--algorithm=reinforce_rej", "--rejected_rows=drop", "--k3_clamp=none")
    assert (c.algorithm.rejected_rows, c.algorithm.k3_clamp) == ("drop", None)
    with pytest.raises(flags.IllegalFlagValueError, match="choose one of drop|zero"):
        parsed("--rejected_rows=keep")
    c = parsed("--algorithm=reinforce_rej", "--reject_all_wrong=false")
    assert (c.algorithm.reject_all_correct, c.algorithm.reject_all_wrong) == (True, False)


def test_the_dapo_preset_turns_on_the_rollouts_dynamic_sampling(parsed):
    """Dynamic sampling is a rollout flag (the loss library does not read it), yet
    --algorithm=dapo sets it as the preset's other knobs: on unless overridden, and off for
    every other preset."""
    assert parsed("--algorithm=dapo").rollout.dynamic == DynamicSampling(True, 10)
    c = parsed("--algorithm=dapo", "--nodynamic_sampling", "--max_resample_rounds=3")
    assert c.rollout.dynamic == DynamicSampling(False, 3)
    assert parsed("--algorithm=grpo").rollout.dynamic == DynamicSampling(False, 10)
    assert parsed("--algorithm=grpo", "--dynamic_sampling").rollout.dynamic.dynamic_sampling
    # A config written when the knobs were the algorithm's resumes with them.
    data = json.loads(parsed("--algorithm=dapo").to_json())
    data["algorithm"].update(data["rollout"].pop("dynamic"), log_kl_ref=True)
    del data["update"]["log_kl_ref"]
    old = TrainConfig.from_json(json.dumps(data))
    assert old.rollout.dynamic.dynamic_sampling and old.update.log_kl_ref
    with pytest.raises(ValueError, match="--max_resample_rounds=-1 must be"):
        parsed("--max_resample_rounds=-1")
    with pytest.raises(ValueError, match="--dynamic_sampling .* needs --group_size >= 2, got 1"):
        validate(parsed("--algorithm=dapo", "--group_size=1", "--noreject_all_wrong"), 1)


def test_reward_and_optimizer_options_are_flags(parsed):
    c = parsed(
        "--overlong_penalty=0.5",
        "--countdown_use_all",
        "--item_timeout_s=2.5",
        "--batch_timeout_s=30",
        "--reward_scale=pm1",
        "--reward_workers=3",
        "--max_new_tokens=99",
        "--lr_schedule=cosine",
        "--adam_b2=0.95",
        "--adam_eps=1e-5",
        "--eps=1e-4",
        "--nodistributed",
    )
    r = c.reward
    assert (r.overlong_penalty, r.countdown_use_all, r.item_timeout_s, r.batch_timeout_s) == (
        0.5,
        True,
        2.5,
        30.0,
    )
    assert (r.scale, r.num_workers, r.max_new_tokens) == ("pm1", 3, 99)
    assert (c.optimizer.schedule, c.optimizer.b2, c.optimizer.eps) == ("cosine", 0.95, 1e-5)
    assert c.algorithm.eps == 1e-4  # --eps is the advantage's; Adam's is --adam_eps
    with pytest.raises(flags.IllegalFlagValueError, match="choose one of constant"):
        parsed("--lr_schedule=exp")
    with pytest.raises(flags.IllegalFlagValueError, match="'wide' is not a valid float"):
        parsed("--clip_high=wide")


def test_every_option_has_help_and_a_unique_flag():
    for o in options.options(TrainConfig):
        assert o.help != f"{o.group_class}.{o.path[-1]}", f"--{o.name} has no docstring line"
        assert flags.FLAGS[o.name].help.startswith(o.help)


def test_a_new_field_is_a_new_flag():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        """A sub-config.

        knob: How much.
        mode: Which way.
        """

        knob: int = 3
        mode: str = "a"

    @dataclasses.dataclass(frozen=True)
    class Root:
        inner: Inner = options.group(
            Inner, flags={"knob": "inner_knob"}, choices={"mode": ("a", "b")}
        )

    values = flags.FlagValues()
    cli.define_flags(Root, values)
    values(["prog", "--inner_knob=5", "--mode=b"])
    assert cli.config_from_flags(Root, values) == Root(Inner(knob=5, mode="b"))
    assert values["inner_knob"].help == "How much."
    assert values.find_module_defining_flag("mode") == "inner (Inner)"
    with pytest.raises(flags.IllegalFlagValueError):
        values(["prog", "--mode=c"])


def test_helpfull_groups_flags_by_sub_config():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--helpfull"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    sections = {}
    for block in result.stdout.split("\n\n"):
        head, _, body = block.strip().partition(":\n")
        sections[head] = body
    assert "--group_size" in sections["rollout (RolloutConfig)"]
    assert "--temperature" in sections["rollout.sampling (SamplingConfig)"]
    assert "--lr_schedule" in sections["optimizer (OptimizerConfig)"]
    assert "--overlong_penalty" in sections["reward (RewardConfig)"]
    assert "--clip_high" in sections["algorithm (AlgorithmConfig)"]
    assert "--model" in sections["model (ModelOptions)"]
