"""cgroup v2 memory and process limits for one sandboxed run, where the host delegates them.

rlimits bound each process of a program (RLIMIT_AS) or its uid's processes (RLIMIT_NPROC); a
cgroup bounds their sum: memory.max is the program's memory_mb for all its processes together
(no swap), pids.max its processes. A run gets its own cgroup under a delegated parent:

- $JAXRL4LLM_SANDBOX_CGROUP, a cgroup v2 folder the host prepared for this, owned by the
  trainer's user, with no process of its own and memory and pids enabled for its children
  (`mkdir /sys/fs/cgroup/sandbox; echo +memory +pids > /sys/fs/cgroup/sandbox/../
  cgroup.subtree_control` where not yet, then the same in sandbox/cgroup.subtree_control), or
- this process's own cgroup, when its cgroup.subtree_control already enables memory and pids
  and it is writable (the root cgroup of a host or VM the trainer runs in as root).

Elsewhere (cgroup v1 or hybrid hosts, a container whose cgroup holds its own processes, no
write access) there is none, and the rlimits alone apply. The program's process joins the
run's cgroup before it execs (rewards/sandbox.py, rewards/_sandbox_init.py); after the run every
process left in it is killed and the cgroup removed.
"""

from __future__ import annotations

import errno
import functools
import os
import secrets
import time

ENV = "JAXRL4LLM_SANDBOX_CGROUP"
CONTROLLERS = ("memory", "pids")
REMOVE_S = 1.0  # a run's cgroup is busy while the kernel tears its pid namespace down
EXTRA_PROCESSES = 4  # bwrap's own processes


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def _mount_point() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (/proc/self/mountinfo), if it is."""
    for line in _read("/proc/self/mountinfo").splitlines():
        fields = line.split()
        if " - cgroup2 " in line and len(fields) > 4:
            return fields[4]
    return None


def own_cgroup() -> str | None:
    """This process's cgroup v2 folder, if the host has a cgroup v2 hierarchy."""
    mount = _mount_point()
    for line in _read("/proc/self/cgroup").splitlines():
        if line.startswith("0::") and mount is not None:
            return os.path.normpath(mount + "/" + line[3:].strip())
    return None


def usable(parent: str) -> bool:
    """Whether runs may get memory- and pids-limited child cgroups of `parent`."""
    enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
    return all(c in enabled for c in CONTROLLERS) and os.access(parent, os.W_OK | os.X_OK)


@functools.lru_cache(maxsize=None)
def delegated_parent() -> str | None:
    """The cgroup runs are made under ($JAXRL4LLM_SANDBOX_CGROUP, else our own if it
    delegates memory and pids), or None; resolved once per process."""
    named = os.environ.get(ENV)
    candidate = named if named else own_cgroup()
    return candidate if candidate and usable(candidate) else None


class RunCgroup:
    """One run's cgroup: made with its limits, joined by the program's process (`procs`),
    emptied and removed by `close`."""

    def __init__(self, parent: str, memory_bytes: int, processes: int):
        self.path = os.path.join(parent, f"jaxrl4llm-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self.path)
        try:
            self._write("memory.max", str(memory_bytes))
            self._write("pids.max", str(processes + EXTRA_PROCESSES))
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                self._write("memory.swap.max", "0")
        except OSError:
            self.close()
            raise
        self.procs = os.path.join(self.path, "cgroup.procs")

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w", encoding="utf-8") as f:
            f.write(value)

    def oom_kills(self) -> int:
        """Processes of the run the memory limit killed."""
        for line in _read(os.path.join(self.path, "memory.events")).splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        """Kills what is left in the cgroup and removes it (retrying while it is busy)."""
        try:
            self._write("cgroup.kill", "1")
        except OSError:
            pass
        deadline = time.monotonic() + REMOVE_S
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return
                time.sleep(0.01)


def run_cgroup(memory_bytes: int, processes: int) -> RunCgroup | None:
    """A cgroup for one run under the delegated parent, or None when there is none (or it
    refused this one)."""
    parent = delegated_parent()
    if parent is None:
        return None
    try:
        return RunCgroup(parent, memory_bytes, processes)
    except OSError:
        return None


def join(procs: str) -> None:
    """In the program's process before it execs: move it into the run's cgroup."""
    with open(procs, "w", encoding="utf-8") as f:
        f.write("0")
