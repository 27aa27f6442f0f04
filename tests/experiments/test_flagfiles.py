"""Every shipped flagfile parses to a valid config and to the config the old code gave (but for
issue 14's deliberate changes), and config.json of the old flat layout still loads. The flags
themselves: test_config_flags.py; the papers' settings: test_paper_flagfiles.py."""

import dataclasses
import glob
import json
import os

import pytest
from absl import flags

from jaxrl4llm.config import options
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate

from tests.experiments.flagfile_paths import FLAGFILES, REPO

# Resolved configs of the code before the config tree (commit 7d1c79a): `config_from_flags()`
# of each flagfile (and of two extra argument lists), as its config.json.
OLD = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "old_configs", "*.json")))
# Knobs added since, with the value that reproduces the old code.
ADDED = {
    "k3_clamp": None,
    "rejected_rows": "drop",
    "importance": "token",
    "gamma": 1.0,
    "lam": 0.95,
    "value_clip": 0.2,  # issue 18: PPO's GAE and value clip
    # the sampler-trainer gap's correction, off by default
    "is_correction": None,
    "is_level": "token",
    "is_cap": 2.0,
    "is_lower": 0.5,
    "is_upper": 2.0,
    # issue 51: the knobs of the 2025 losses and estimators (unread by the old objectives)
    "sapo_tau_pos": 1.0,
    "sapo_tau_neg": 1.05,
    "clip_cov_ratio": 2e-4,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 2e-3,
    "kl_cov_coef": 1.0,
    "passk_k": None,
    "otb_zero_tail": False,
}
# Trainer flags added since (once the algorithm's, now the rollout's and the update's).
ADDED_TRAINER = {"log_kl_ref": False, "dynamic_sampling": False, "max_resample_rounds": 10}
# Deliberate changes since, as (old, new) by key of the old config.json ("optimizer.x" for the
# optimizer's). Everywhere: k3 is capped at 10 (issue 14).
CHANGED_EVERYWHERE = {"k3_clamp": (None, 10.0)}
# --tensorboard is a deprecated alias of --trackers now (issue 49): unset unless given.
TENSORBOARD_UNSET = {"tensorboard": (True, None)}
# Issue 14: the Minimalist flagfiles follow the authors' scripts (docs/algorithms.md).
_MINIMALIST = {
    "dual_clip": (None, 3.0),
    "entropy_coef": (0.0, 0.001),
    "optimizer.weight_decay": (0.0, 0.01),
    "mini_batch_size": (512, 1024),
    "num_steps": (500, 444),
    "long_prompts": ("error", "drop"),
    "system_prompt": (
        None,
        "Please reason step by step, and put your final answer within \\boxed{}.",
    ),
    "instruction": (None, "Let's think step by step and output the final answer within \\boxed{}."),
}
# Issue 38: every paper flagfile keeps float32 master weights (with bfloat16 matmuls,
# --compute_dtype, a flag the old code did not have).
_MASTER = {"param_dtype": ("bfloat16", "float32")}
FIXED = {
    # The old parser dropped a knob set to none (`--kl_in=none` kept the preset's "loss"; with
    # --kl_coef=0 nothing used it, so training was the same). The quickstart keeps one
    # checkpoint (each is about 1.4 GB: a laptop's disk).
    "quickstart": {"kl_in": ("loss", None), "keep_checkpoints": (3, 1)},
    "minimalist_qwen25_math_7b_grpo": dict(
        _MINIMALIST, **_MASTER, agg=("seq-mean-token-mean", "token-mean"), kl_coef=(0.04, 0.001)
    ),
    "minimalist_qwen25_math_7b_raft_pp": dict(
        _MINIMALIST,
        **_MASTER,
        kl_in=(None, "loss"),
        kl_coef=(0.0, 0.001),
        rejected_rows=("drop", "zero"),
    ),
    "minimalist_qwen25_math_7b_reinforce_rej": dict(
        _MINIMALIST,
        **_MASTER,
        kl_in=(None, "loss"),
        kl_coef=(0.0, 0.001),
        rejected_rows=("drop", "zero"),
    ),
}
# The paper flagfiles name their data by registry names and gym tasks (issue 16) instead of
# /data/... paths: flag -> (the old value, today's).
_NUMINA = {
    "data": ("parquet:/data/numinamath/{split}.parquet", "numina_math"),
    "prompt_field": ("problem", None),
    "answer_field": ("solution", None),
    "eval_data": (None, "math500"),
}
DATA_BY_NAME = {
    **{f"minimalist_qwen25_math_7b_{a}": _NUMINA for a in ("grpo", "raft_pp", "reinforce_rej")},
    "reinforce_pp_knights_knaves": {
        "data": (
            "synthetic:knights_knaves?min_people=3&max_people=7&n=5000",
            "gym:knights_knaves?n_people=3..7&n=4500",
        ),
        "eval_data": (
            "synthetic:knights_knaves?min_people=8&max_people=8&n=200",
            "gym:knights_knaves?n_people=8&n=100",
        ),
        # Logic-RL's prompt and format reward (issue 14).
        "system_prompt": (None, "@logic_rl"),
        "reward_scale": ("01", "logic_rl"),
        # One sample per puzzle at temperature 1, as Logic-RL evaluates (issue 38).
        "eval_samples": (4, 1),
        **_MASTER,
    },
    "tricks_or_traps_qwen3_8b_lite_ppo": {
        "data": ("parquet:/data/math/{split}.parquet", "dapo_math_17k"),
        "eval_data": (None, "math500"),
        **_MASTER,
    },
}
DATA_BY_NAME["overrides"] = DATA_BY_NAME["tricks_or_traps_qwen3_8b_lite_ppo"]  # its flagfile
# Micro-batches re-planned for the pod (issue 12, docs/scaling.md): flag -> (old, today's).
# Gradient accumulation sums to the same mini-batch gradient, so training is unchanged.
PLANNED = {
    **{
        f"minimalist_qwen25_math_7b_{a}": {"micro_batch_size": (64, 128)}
        for a in ("grpo", "raft_pp", "reinforce_rej")
    },
    "tricks_or_traps_qwen3_8b_lite_ppo": {"micro_batch_size": (16, 64)},
    "overrides": {"micro_batch_size": (16, 64)},
}


def _old(path):
    with open(path) as f:
        fixture = json.load(f)
    return fixture["argv"], fixture["config"]


def test_there_are_flagfiles():
    names = {os.path.basename(f) for f in FLAGFILES}
    assert "quickstart.flags" in names and len(names) >= 19
    # Every flagfile of the old code is still here.
    assert {os.path.basename(f)[: -len(".json")] for f in OLD} - {"defaults", "overrides"} <= {
        n[: -len(".flags")] for n in names
    }


@pytest.mark.parametrize("path", FLAGFILES, ids=os.path.basename)
def test_flagfile_gives_a_valid_config(path, parsed):
    config = parsed(f"--flagfile={path}")
    validate(config, num_devices=8)  # one 8-accelerator host
    assert config.algorithm.name == flags.FLAGS.algorithm


@pytest.mark.parametrize("path", OLD, ids=os.path.basename)
def test_flags_parse_to_the_config_of_the_old_code(path, parsed, monkeypatch):
    """Field by field: each old flat key is today's flag of the same name; the old nested
    algorithm / optimizer dicts are today's sub-configs."""
    monkeypatch.chdir(REPO)
    argv, old = _old(path)
    config = parsed(*argv)
    fixture = os.path.basename(path)[: -len(".json")]
    fixed = {
        **CHANGED_EVERYWHERE,
        **({} if any("tensorboard" in flag for flag in argv) else TENSORBOARD_UNSET),
        **FIXED.get(fixture, {}),
        **DATA_BY_NAME.get(fixture, {}),
        **PLANNED.get(fixture, {}),
    }
    old = dict(ADDED_TRAINER, **old)
    want = {
        "algorithm": dict(ADDED, **old.pop("algorithm")),
        "optimizer": old.pop("optimizer"),
        "": old,
    }
    for key, (before, after) in fixed.items():
        part, _, name = key.rpartition(".")
        part = part or ("algorithm" if name in want["algorithm"] else "")
        assert want[part][name] == before, key
        want[part][name] = after
    got_algorithm = dataclasses.asdict(config.algorithm)
    got_algorithm["binary_reward"] = (
        list(got_algorithm["binary_reward"]) if got_algorithm["binary_reward"] else None
    )
    assert got_algorithm == want["algorithm"]
    assert dataclasses.asdict(config.optimizer) == want["optimizer"]
    flat = options.flatten(config)
    for key, value in old.items():
        assert flat[key] == value, key
    # Spot checks through the tree, by hand.
    assert config.rollout.group_size == old["group_size"]
    assert config.model.name == old["model"] and config.data.source == old["data"]
    assert config.reward.scale == old["reward_scale"]
    assert config.reward.num_workers == old["reward_workers"]
    assert config.reward.max_new_tokens == old["max_new_tokens"]


@pytest.mark.parametrize("path", OLD, ids=os.path.basename)
def test_old_flat_config_json_still_loads(path):
    _, old = _old(path)
    config = TrainConfig.from_json(json.dumps(old))
    assert config.run.num_steps == old["num_steps"]
    assert config.rollout.sampling.temperature == old["temperature"]
    assert config.optimizer.schedule == old["optimizer"]["schedule"]
    assert config.algorithm.kl_in == old["algorithm"]["kl_in"]
    binary = old["algorithm"]["binary_reward"]
    assert config.algorithm.binary_reward == (tuple(binary) if binary else None)
    assert TrainConfig.from_json(config.to_json()) == config
