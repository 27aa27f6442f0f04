"""The sandbox refuses to run without an isolation layer unless told it is unsafe."""
from __future__ import annotations

import pytest

from jaxrl4llm.config.errors import DependencyError
from jaxrl4llm.rewards import sandbox


def test_refuses_without_an_isolation_layer(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(DependencyError, match="--unsafe_code_execution"):
        sandbox.resolve_isolation(sandbox.SandboxConfig())
    with pytest.raises(DependencyError, match="bubblewrap"):
        sandbox.run_program("print(1)", "", sandbox.SandboxConfig())
    unsafe = sandbox.SandboxConfig(unsafe=True)
    assert sandbox.resolve_isolation(unsafe) == "none"
    assert sandbox.run_program("print(6 * 7)", "", unsafe).stdout == "42\n"


def test_isolation_none_needs_the_unsafe_flag():
    with pytest.raises(ValueError, match="--unsafe_code_execution"):
        sandbox.SandboxConfig(isolation="none")


def test_unsafe_layer_still_kills_at_the_wall_limit():
    config = sandbox.SandboxConfig(isolation="none", unsafe=True, wall_s=0.5)
    execution = sandbox.run_program("while True:\n    pass", "", config)
    assert execution.status == "timeout" and execution.seconds < 3
