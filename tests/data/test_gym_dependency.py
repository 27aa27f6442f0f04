"""A gym: source without the reasoning-gym extra installed."""

from __future__ import annotations

import sys

import pytest

from jaxrl4llm.config.errors import DependencyError
from jaxrl4llm.data import make_source


def test_a_gym_source_without_its_extra_is_a_dependency_error(monkeypatch):
    """reasoning-gym not installed: one user error naming the install command."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails
    with pytest.raises(DependencyError, match=r"pip install -e '\.\[gym\]'"):
        make_source("gym:basic_arithmetic", split="train")
