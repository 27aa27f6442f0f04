"""WorkdirLock: one run per workdir; the holder is named; a dead holder's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from jaxrl4llm.train.infra.workdir_lock import LOCK_NAME, WorkdirInUseError, WorkdirLock


def _hold_in_subprocess(workdir):
    """A second process that takes the lock, says so, and waits (killed by the test)."""
    code = textwrap.dedent(f"""
        import sys, time
        from jaxrl4llm.train.infra.workdir_lock import WorkdirLock
        WorkdirLock({str(workdir)!r}).acquire()
        print("locked", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_fails_naming_the_holder_then_takes_over_when_it_dies(tmp_path, caplog):
    holder = _hold_in_subprocess(tmp_path)
    try:
        with pytest.raises(
            WorkdirInUseError, match=rf"pid {holder.pid} on host {socket.gethostname()}"
        ):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # killed: it never releases
        holder.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
    with WorkdirLock(str(tmp_path)):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert f"stale lock of pid {holder.pid}" in caplog.text
    assert not (tmp_path / LOCK_NAME).exists()  # released


def test_a_holder_on_another_host_is_never_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "tpu-vm-7"}))
    with pytest.raises(WorkdirInUseError, match=r"pid 1 on host tpu-vm-7.*delete .*run\.lock"):
        WorkdirLock(str(tmp_path)).acquire()
    assert (tmp_path / LOCK_NAME).exists()


def test_release_leaves_a_lock_it_does_not_hold(tmp_path):
    lock = WorkdirLock(str(tmp_path))
    lock.acquire()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()
    disabled = WorkdirLock(str(tmp_path / "other"), enabled=False)
    with disabled:  # process > 0 of a multi-host run: no lock
        assert not (tmp_path / "other").exists()
