"""The unshare layer's host side (rewards/sandbox.py): one `_sandbox_init.py` server per host
thread, started once in a private mount namespace, asked for one run per request line.

The server and what each run gets are described in rewards/_sandbox_init.py; here the host
starts it (the `unshare` binary resolved once to an absolute path), sends it a run, waits for
its answer at most the wall limit plus SERVER_SLACK_S, and replaces a server that died or hung.
Every server this process started is stopped at exit.
"""

from __future__ import annotations

import atexit
import marshal
import os
import select
import shutil
import subprocess
import tempfile
import threading
from typing import Any

from jaxrl4llm.rewards import sandbox_base as base

_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
SERVER_SLACK_S = 5.0  # past the wall limit, an unshare server that has not answered is stuck


class _Server:
    """One `_sandbox_init.py` server (the unshare layer): started once, one run per request."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="jaxrl4llm-sandboxroot-")
        spec = {
            "root": self.root,
            "read_only": base.read_only_folders(),
            "host_pid": os.getpid(),
            "user_namespace": os.geteuid() != 0,
            "interpreter": base.interpreter(),
            "interpreter_args": base.INTERPRETER_ARGS,
            "environment": base.ENVIRONMENT,
        }
        user = ["--user", "--map-root-user"] if spec["user_namespace"] else []
        self.proc = subprocess.Popen(
            [
                base.binary("unshare") or "unshare",
                *user,
                "--mount",
                base.interpreter(),
                "-I",
                "-S",
                "-B",
                _INIT,
                marshal.dumps(spec).hex(),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env=dict(base.ENVIRONMENT),
            start_new_session=True,
            close_fds=True,
        )
        self.owner = os.getpid()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.requests, self.answers = self.proc.stdin, self.proc.stdout

    def run(self, run: dict, wall_s: float) -> str | None:
        """The server's answer for one run: "" when it has died (it could not start), None
        when it overran the wall limit."""
        try:
            self.requests.write(marshal.dumps(run).hex().encode() + b"\n")
            self.requests.flush()
        except OSError:
            return ""
        ready = select.select([self.answers], [], [], wall_s + SERVER_SLACK_S)[0]
        return self.answers.readline().decode().strip() if ready else None

    def close(self) -> None:
        base.kill_group(self.proc.pid)
        self.proc.wait()
        for pipe in (self.requests, self.answers):
            try:
                pipe.close()
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


_servers = threading.local()
_all_servers: list[_Server] = []
_servers_lock = threading.Lock()


def _server() -> _Server:
    """This thread's server, started at its first run (and again after a failure or a fork)."""
    server = getattr(_servers, "server", None)
    if server is None or server.owner != os.getpid() or server.proc.poll() is not None:
        if server is not None and server.owner == os.getpid():
            _drop_server(server)
        server = _servers.server = _Server()
        with _servers_lock:
            _all_servers.append(server)
    return server


def _drop_server(server: _Server) -> None:
    server.close()
    with _servers_lock:
        if server in _all_servers:
            _all_servers.remove(server)
    if getattr(_servers, "server", None) is server:
        _servers.server = None


@atexit.register
def close_servers() -> None:
    """Stops every server this process started (their read-only roots go with them)."""
    with _servers_lock:
        servers = [s for s in _all_servers if s.owner == os.getpid()]
    for server in servers:
        _drop_server(server)


def run_unshare(
    config: base.SandboxConfig, run_dir: str, cgroup_procs: str | None = None
) -> tuple[str, int | None]:
    """(status, returncode) of the program in run_dir under the unshare layer's server."""
    run: dict[str, Any] = {
        "program": os.path.join(run_dir, "main.py"),
        **{name: os.path.join(run_dir, name) for name in ("stdin", "stdout", "stderr")},
        "work_bytes": config.work_mb << 20,
        "limits": config.limits,
        "wall_s": float(config.wall_s),
    }
    for name in ("stdout", "stderr"):  # the server opens them, creating nothing on the host
        open(run[name], "wb").close()
    uid = base.unused_uid()
    if uid is not None:
        # uid 0 is exempt from RLIMIT_NPROC, in a user namespace too: the program becomes an
        # unused uid of its own, so the limit counts this sandbox's processes only.
        run["uid"] = uid
    if cgroup_procs is not None:  # the program's process joins the run's cgroup first
        run["cgroup_procs"] = cgroup_procs
    server = _server()
    answer = server.run(run, config.wall_s)
    if not answer:  # a dead or stuck server: its group goes, the next run starts another
        _drop_server(server)
        if answer == "":
            with open(run["stderr"], "a", encoding="utf-8") as f:
                f.write(
                    "sandbox set-up failed: the unshare server exited (unshare --mount refused?)\n"
                )
        return ("timeout", None) if answer is None else ("setup_failed", base.SETUP_FAILED)
    if answer == "timeout":
        return "timeout", None
    kind, number = answer.split()
    if kind == "signal":
        return "signal", -int(number)
    code = int(number)
    return ("ok" if code == 0 else "setup_failed" if code == base.SETUP_FAILED else "exit"), code
