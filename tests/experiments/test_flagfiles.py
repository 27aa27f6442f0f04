"""Every shipped flagfile parses into a valid TrainConfig (the paper setups and the quickstart)."""
import glob
import os

import pytest
from absl import flags

from experiments import train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGFILES = sorted(glob.glob(os.path.join(REPO, "experiments", "configs", "*.flags")))


@pytest.fixture
def parsed():
    def parse(*argv):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["train", *argv])
        return train.config_from_flags()
    yield parse
    flags.FLAGS.unparse_flags()


def test_there_are_flagfiles():
    names = {os.path.basename(f) for f in FLAGFILES}
    assert "quickstart.flags" in names and len(names) >= 6


@pytest.mark.parametrize("path", FLAGFILES, ids=os.path.basename)
def test_flagfile_gives_a_valid_config(path, parsed):
    config = parsed(f"--flagfile={path}")
    config.validate(num_devices=8)  # one 8-accelerator host
    assert config.algorithm.name == flags.FLAGS.algorithm


def test_paper_hyperparameters(parsed):
    c = parsed(f"--flagfile={REPO}/experiments/configs/reinforce_pp_knights_knaves.flags")
    assert (c.prompts_per_step, c.group_size, c.optimizer.learning_rate) == (32, 8, 5e-7)
    assert (c.algorithm.kl_coef, c.algorithm.kl_in, c.algorithm.clip_low) == (0.001, "reward", 0.2)
    c = parsed(f"--flagfile={REPO}/experiments/configs/minimalist_qwen25_math_7b_raft_pp.flags")
    assert (c.prompts_per_step, c.group_size, c.mini_batch) == (1024, 4, 512)
    assert c.algorithm.name == "raft_pp" and c.max_prompt_tokens + c.max_new_tokens == 4096


def test_command_line_overrides_the_flagfile(parsed):
    c = parsed(f"--flagfile={REPO}/experiments/configs/tricks_or_traps_qwen3_8b_lite_ppo.flags",
               "--clip_high=0.28", "--agg=seq-mean-token-mean", "--binary_reward=-1,1")
    assert c.algorithm.clip_high == 0.28 and c.algorithm.agg == "seq-mean-token-mean"
    assert c.algorithm.std == "batch"  # the preset's value stays where not overridden
    assert c.algorithm.binary_reward == (-1.0, 1.0)
