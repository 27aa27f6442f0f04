"""What every sandbox layer shares (rewards/sandbox.py): the limits of one execution, its
result, the environment and interpreter the program gets, and the binaries the layers run.

The layers' binaries (bwrap, unshare) are resolved once, on the trainer's PATH, to absolute
paths: the sandbox's own PATH (ENVIRONMENT) never decides whether a layer is found.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shutil
import signal
import sys
from typing import NamedTuple

LAYERS = ("bwrap", "unshare")
ISOLATION = ("auto", *LAYERS, "none")
SETUP_FAILED = 125  # _sandbox_init's exit code when the namespaces or mounts could not be made
# Folders the program may read (those that exist): the system's, and the interpreter's prefix.
SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}
SANDBOX_UIDS = (1_500_000_000, 100_000_000)  # first, count: unused uids for a root host
INTERPRETER_ARGS = ("-I", "-S", "-B")  # isolated: no user site, no PYTHON* variables, no .pyc


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one execution (flag-friendly scalars).

    isolation: "auto" (bwrap, else unshare), "bwrap", "unshare", or "none" (needs unsafe).
    unsafe: Allow isolation "none" (and "auto" falling back to it): no namespaces at all.
    wall_s: Wall-clock seconds before the process group is killed.
    cpu_s: CPU seconds (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later).
    memory_mb: Address space (RLIMIT_AS) in MB.
    processes: Processes and threads (RLIMIT_NPROC, counted in the sandbox's user namespace).
    file_mb: Largest file the program may write, stdout and stderr included (RLIMIT_FSIZE).
    open_files: Open file descriptors (RLIMIT_NOFILE).
    work_mb: Size of the private /work tmpfs (the namespaced layers).
    """

    isolation: str = "auto"
    unsafe: bool = False
    wall_s: float = 2.0
    cpu_s: int = 2
    memory_mb: int = 512
    processes: int = 32
    file_mb: int = 8
    open_files: int = 64
    work_mb: int = 16

    def __post_init__(self):
        if self.isolation not in ISOLATION:
            raise ValueError(
                f"unknown sandbox isolation {self.isolation!r}; valid: {', '.join(ISOLATION)}"
            )
        if self.isolation == "none" and not self.unsafe:
            raise ValueError(
                "sandbox isolation 'none' runs model-written programs with the "
                "user's rights; pass --unsafe_code_execution to allow it"
            )
        for name in (
            "wall_s",
            "cpu_s",
            "memory_mb",
            "processes",
            "file_mb",
            "open_files",
            "work_mb",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)}")

    @property
    def limits(self) -> dict[str, int]:
        return {
            "cpu_s": int(self.cpu_s),
            "memory_bytes": self.memory_mb << 20,
            "processes": self.processes,
            "file_bytes": self.file_mb << 20,
            "open_files": self.open_files,
        }


class Execution(NamedTuple):
    status: str  # "ok" (exit 0) | "exit" (non-zero) | "signal" | "timeout" | "setup_failed"
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    layer: str


def interpreter() -> str:
    """The real interpreter binary (a venv's python is a link to it)."""
    return os.path.realpath(sys.executable)


def read_only_folders() -> tuple[str, ...]:
    prefix = os.path.realpath(sys.base_prefix)
    extra = () if prefix.startswith("/usr/") or prefix == "/usr" else (prefix,)
    return tuple(p for p in (*SYSTEM_FOLDERS, *extra) if os.path.lexists(p))


@functools.lru_cache(maxsize=None)
def binary(name: str) -> str | None:
    """The absolute path of a layer's binary on this process's PATH (then the sandbox's),
    resolved once; None when it is not installed."""
    found = shutil.which(name) or shutil.which(name, path=ENVIRONMENT["PATH"])
    return os.path.abspath(found) if found else None


def unused_uid() -> int | None:
    """Under real root, a random unused uid for one run (uid 0 is exempt from RLIMIT_NPROC,
    in a user namespace too); None otherwise (the run keeps the user's uid)."""
    return SANDBOX_UIDS[0] + secrets.randbelow(SANDBOX_UIDS[1]) if os.geteuid() == 0 else None


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
