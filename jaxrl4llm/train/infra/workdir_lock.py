"""One run per workdir: WORKDIR/run.lock names the holder (pid, host, start time).

Two runs on one workdir would both train and interleave their metrics and checkpoints. The
lock file appears atomically (written aside, then hard-linked into place, which fails if it
exists), so a reader never sees a half-written holder. A lock whose holder is a dead process
on this host is stale (a killed run): it is taken over with a warning. A holder on another
host cannot be checked from here: the error says how to remove the file by hand.

    with WorkdirLock(workdir):
        ...  # train
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from typing import Any

from absl import logging

from jaxrl4llm.config import paths
from jaxrl4llm.config.errors import UserError

LOCK_NAME = "run.lock"


class WorkdirInUseError(UserError, RuntimeError):
    """Another live run holds the workdir."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _read(path: str) -> dict[str, Any] | None:
    try:
        if not paths.exists(path):
            return None
        holder = json.loads(paths.read_text(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: no pid to check, treated as held
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
        f"(since {holder.get('started', '?')})"
    )


class WorkdirLock:
    """An exclusive, process-level lock on a workdir; a context manager. `enabled=False`
    (e.g. on every host but process 0 of a multi-host run) makes it a no-op."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.workdir = paths.absolute(workdir)
        self.path = paths.join(self.workdir, LOCK_NAME)
        self.enabled = enabled
        self._me = {"pid": os.getpid(), "host": socket.gethostname()}
        self._held = False

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        if not self.enabled or self._held:
            return
        paths.makedirs(self.workdir)
        holder = dict(self._me, started=datetime.datetime.now().isoformat(timespec="seconds"))
        for _ in range(3):  # a stale holder may be taken over, then creation retried
            if self._create(json.dumps(holder)):
                self._held = True
                return
            self._take_over_if_stale()
        raise WorkdirInUseError(
            f"Could not lock {self.workdir}: {self.path} keeps "
            "reappearing; is another run starting there?"
        )

    def _create(self, content: str) -> bool:
        """Creates the lock file holding `content`, atomically; False if it exists."""
        if paths.is_remote(self.path):
            return paths.create_exclusive(self.path, content)
        aside = f"{self.path}.{os.getpid()}.tmp"
        with open(aside, "w") as f:
            f.write(content)
        try:
            os.link(aside, self.path)  # appears complete, or not at all
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links on this file system: exclusive create instead
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(content)
            return True
        finally:
            os.remove(aside)

    def _take_over_if_stale(self) -> None:
        """Moves a dead local holder's lock away (with a warning), else raises."""
        holder = _read(self.path)
        if holder is None:
            return  # released meanwhile: retry
        pid, host = holder.get("pid"), holder.get("host")
        if host != self._me["host"] or not isinstance(pid, int) or _pid_alive(pid):
            raise WorkdirInUseError(
                f"{self.workdir} is in use: {_describe(holder)} holds {self.path}. Wait for "
                "that run to finish (or stop it), or pass another --workdir. If that run is "
                f"gone (e.g. it ran on another host), delete {self.path} and start again."
            )
        stale = f"{self.path}.stale.{os.getpid()}"
        try:
            paths.rename(self.path, stale)
        except FileNotFoundError:
            return  # another run took it over first: retry
        if _read(stale) != holder:  # raced with a run that had just locked: give it back
            paths.rename(stale, self.path)
            raise WorkdirInUseError(
                f"{self.workdir} was just locked by another run: "
                f"{_describe(_read(self.path) or {})}."
            )
        paths.remove(stale)
        logging.warning(
            "Took over the stale lock of %s on %s: that process is no longer running (killed?).",
            _describe(holder),
            self.workdir,
        )

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        holder = _read(self.path)
        if holder and {k: holder.get(k) for k in self._me} == self._me:
            paths.remove(self.path)
