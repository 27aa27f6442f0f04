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


@pytest.mark.skipif(not sandbox.layer_works("unshare"), reason="unshare layer not usable here")
def test_unshare_server_is_reused_and_runs_share_nothing():
    """One server serves consecutive runs; each run gets a fresh /work, pid namespace and
    IPC namespace, so nothing one run leaves is visible to the next."""
    config = sandbox.SandboxConfig(isolation="unshare")
    leave = (
        "import os, signal\nopen('/work/left', 'w').write('x')\n"
        "if os.fork() == 0:\n    os.setsid()\n    signal.pause()\nprint(os.getpid())"
    )
    look = (
        "import os\nprint(os.path.exists('/work/left'), os.getpid(), sorted(os.listdir('/work')))"
    )
    first = sandbox.run_program(leave, "", config, "unshare")
    server = sandbox._server()
    second = sandbox.run_program(look, "", config, "unshare")
    assert sandbox._server() is server and server.proc.poll() is None
    assert (first.status, first.stdout) == ("ok", "1\n")
    assert (second.status, second.stdout) == ("ok", "False 1 ['main.py']\n")


@pytest.mark.skipif(sandbox.shutil.which("unshare") is None, reason="no unshare here")
def test_unshare_server_failure_is_a_setup_failure(monkeypatch):
    """A server that cannot start answers nothing: the run is setup_failed, not the program's."""
    monkeypatch.setattr(sandbox, "_INIT", "/nonexistent/_sandbox_init.py")
    monkeypatch.setattr(sandbox, "_servers", sandbox.threading.local())
    execution = sandbox.run_program(
        "print(1)", "", sandbox.SandboxConfig(isolation="unshare"), "unshare"
    )
    assert execution.status == "setup_failed" and "server exited" in execution.stderr
