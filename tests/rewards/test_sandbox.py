"""The sandbox: it refuses to run without an isolation layer unless told it is unsafe, finds
its layers' binaries once by absolute path, runs bwrap's program as an unused uid under root,
and gives each run a cgroup where the host delegates one."""

from __future__ import annotations

import os

import pytest

from jaxrl4llm.config.errors import DependencyError
from jaxrl4llm.rewards import cgroups, sandbox, sandbox_base, sandbox_unshare


def test_refuses_without_an_isolation_layer(monkeypatch):
    monkeypatch.setattr(sandbox, "binary", lambda name: None)
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
    server = sandbox_unshare._server()
    second = sandbox.run_program(look, "", config, "unshare")
    assert sandbox_unshare._server() is server and server.proc.poll() is None
    assert (first.status, first.stdout) == ("ok", "1\n")
    assert (second.status, second.stdout) == ("ok", "False 1 ['main.py']\n")


@pytest.mark.skipif(sandbox.binary("unshare") is None, reason="no unshare here")
def test_unshare_server_failure_is_a_setup_failure(monkeypatch):
    """A server that cannot start answers nothing: the run is setup_failed, not the program's."""
    monkeypatch.setattr(sandbox_unshare, "_INIT", "/nonexistent/_sandbox_init.py")
    monkeypatch.setattr(sandbox_unshare, "_servers", sandbox_unshare.threading.local())
    execution = sandbox.run_program(
        "print(1)", "", sandbox.SandboxConfig(isolation="unshare"), "unshare"
    )
    assert execution.status == "setup_failed" and "server exited" in execution.stderr


def test_a_layer_binary_is_resolved_once_to_an_absolute_path(monkeypatch, tmp_path):
    """A bwrap on the trainer's PATH but not on the sandbox's (/usr/local/bin:/usr/bin:/bin)
    is found, and bwrap's command line names it by its absolute path."""
    real = sandbox.binary("bwrap")
    if real is None:
        pytest.skip("bwrap is not installed here")
    (tmp_path / "bwrap").symlink_to(real)
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox_base.binary.cache_clear()
    try:
        assert sandbox_base.binary("bwrap") == str(tmp_path / "bwrap")
        argv = sandbox._bwrap_argv(sandbox.SandboxConfig(isolation="bwrap"), 3, None)
        assert argv[0] == str(tmp_path / "bwrap")
        monkeypatch.setenv("PATH", "/nonexistent")
        assert sandbox_base.binary("bwrap") == str(tmp_path / "bwrap")  # resolved once
    finally:
        sandbox_base.binary.cache_clear()


def test_an_installed_layer_that_fails_is_named_not_skipped(monkeypatch):
    monkeypatch.setattr(sandbox, "binary", lambda name: f"/opt/{name}")
    monkeypatch.setattr(sandbox, "layer_problem", lambda layer: f"/opt/{layer} failed (exit 1)")
    with pytest.raises(DependencyError, match="/opt/bwrap failed"):
        sandbox.resolve_isolation(sandbox.SandboxConfig(isolation="bwrap"))


@pytest.mark.skipif(not sandbox.layer_works("bwrap"), reason="bwrap is not installed or usable")
def test_bwrap_runs_the_program_as_an_unused_uid_under_root():
    execution = sandbox.run_program(
        "import os, ctypes\nprint(os.getuid(), os.getcwd(), ctypes.CDLL(None).unshare(0x10000000))",
        "",
        sandbox.SandboxConfig(isolation="bwrap"),
        "bwrap",
    )
    uid, cwd, unshared = execution.stdout.split()
    assert (cwd, unshared) == ("/work", "-1")  # no new user namespace from inside
    if os.geteuid() == 0:
        assert int(uid) >= sandbox_base.SANDBOX_UIDS[0]


def _fake_cgroup(tmp_path, controllers="memory pids"):
    parent = tmp_path / "sandbox"
    parent.mkdir()
    (parent / "cgroup.subtree_control").write_text(controllers + "\n")
    return parent


def test_a_run_cgroup_under_a_delegated_parent_gets_the_limits(monkeypatch, tmp_path):
    parent = _fake_cgroup(tmp_path)
    monkeypatch.setenv(cgroups.ENV, str(parent))
    cgroups.delegated_parent.cache_clear()
    try:
        assert cgroups.delegated_parent() == str(parent)
        run = cgroups.run_cgroup(256 << 20, 16)
        assert run is not None and os.path.dirname(run.path) == str(parent)
        limits = {name: open(os.path.join(run.path, name)).read() for name in os.listdir(run.path)}
        assert limits == {"memory.max": str(256 << 20), "pids.max": "20"}
        assert run.procs == os.path.join(run.path, "cgroup.procs") and run.oom_kills() == 0
    finally:
        cgroups.delegated_parent.cache_clear()


def test_no_cgroup_without_delegated_memory_and_pids(monkeypatch, tmp_path):
    monkeypatch.setenv(cgroups.ENV, str(_fake_cgroup(tmp_path, "cpu io")))
    cgroups.delegated_parent.cache_clear()
    try:
        assert cgroups.delegated_parent() is None and cgroups.run_cgroup(1 << 20, 4) is None
    finally:
        cgroups.delegated_parent.cache_clear()


@pytest.mark.skipif(cgroups.delegated_parent() is None, reason="no delegated cgroup v2 here")
def test_a_delegated_cgroup_bounds_the_sum_of_the_processes():
    """Where the host delegates cgroup v2 memory and pids: 8 processes of 48 MB each pass each
    process's address-space limit but not the run's 128 MB together."""
    config = sandbox.SandboxConfig(memory_mb=128, processes=16, wall_s=5, cpu_s=5)
    hog = (
        "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n"
        "        x = bytearray(48 << 20)\n        time.sleep(3)\n        os._exit(0)\n"
        "print(sum(os.waitstatus_to_exitcode(os.wait()[1]) != 0 for _ in range(8)))"
    )
    execution = sandbox.run_program(hog, "", config)
    assert execution.status != "ok" or int(execution.stdout) > 0
