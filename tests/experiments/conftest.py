"""Fixtures shared by the tests of tests/experiments/."""

import pytest
from absl import flags

from experiments import train


@pytest.fixture
def parsed():
    def parse(*argv):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["train", *argv])
        return train.config_from_flags()

    yield parse
    flags.FLAGS.unparse_flags()
