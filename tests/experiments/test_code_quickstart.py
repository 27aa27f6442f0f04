"""The code quickstart's flagfile: it parses to a valid config on one CPU device, trains on
the procedural code task with the code reward, and its prompts fit --max_prompt_tokens under
the embedded model's chat template."""

import os

import pytest
from absl import flags

from experiments import train
from jaxrl4llm.data.sources import make_source
from jaxrl4llm.models import registry
from jaxrl4llm.models.tokenizer import Tokenizer
from jaxrl4llm.train.config.checks import validate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGFILE = os.path.join(REPO, "experiments", "configs", "code_quickstart.flags")


@pytest.fixture(scope="module")
def config():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train", f"--flagfile={FLAGFILE}"])
    try:
        yield train.config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()


def test_flagfile_is_a_valid_one_device_config(config):
    validate(config, num_devices=1)
    assert config.data.source.startswith("synthetic:code?")
    assert (config.reward.code_reward, config.reward.unsafe_code_execution) == ("fraction", False)
    # A completion's tests fit the reward job's budget (0.9 x the item deadline).
    cases = int(config.data.source.rsplit("cases=", 1)[1].split("&")[0])
    assert cases * config.reward.code_wall_s <= 0.9 * config.reward.item_timeout_s


def test_every_record_is_a_code_task_and_its_prompt_fits(config):
    path = registry.resolve(config.model.name)
    tokenizer = Tokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    source = make_source(config.data.source, split="train")
    kinds, longest = set(), 0
    for index in range(0, len(source), 97):  # a spread of problems of both kinds
        record = source[index]
        assert record.task == "code"
        kinds.add(record.metadata["kind"])
        longest = max(longest, len(tokenizer.encode_chat(config.data.messages(record))))
    assert kinds == {"linear", "sum"}
    assert longest <= config.rollout.max_prompt_tokens
