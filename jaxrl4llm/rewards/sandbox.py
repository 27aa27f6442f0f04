"""Run one untrusted Python program: no network, no view of the user's files, bounded resources.

    config = SandboxConfig(wall_s=2.0)
    execution = run_program("print(input()[::-1])", "abc\\n", config)
    execution.status, execution.stdout   # ("ok", "cba\\n")

Isolation layers, best first (`isolation="auto"` takes the first that works here):

- "bwrap" (bubblewrap): new user, mount, network, IPC, UTS, pid and cgroup namespaces; a root
  of read-only binds of the system and interpreter folders, a private tmpfs /work, no /proc;
  every capability dropped; dies with its parent.
- "unshare" (util-linux `unshare` + rewards/_sandbox_init.py): a server per host thread,
  started once in a private mount namespace, holds the new root (built once); each run is two
  forks of it into new mount, network, IPC, UTS and pid namespaces (and a new user namespace,
  or under real root an unused uid of its own), a fresh /work, chroot, every capability
  dropped and no_new_privs. Lost against bwrap: the cgroup namespace and bwrap's audited
  set-up code.
- "none" (only with `unsafe=True`, the `--unsafe_code_execution` flag): the program runs as
  the user, in a fresh temporary directory, with the rlimits and a process-group kill only. It
  can read every file the user can, reach the network, and a child that leaves the process
  group (setsid) outlives the timeout.

Every layer sets the rlimits (CPU seconds, address space, processes, file size, open files, no
core files), cleans the environment, and kills the program at the wall-clock limit (its process
group; under unshare the server's keeper kills pid 1 of the run's pid namespace). In the
namespaced layers the program (or bwrap) is pid 1 of its pid namespace: when it exits or is
killed, the kernel kills every process it started, however it detached. Processes are counted
per user namespace (or per unused uid), so the limit bounds this program, not the user's others.
Output goes to files whose size the file-size limit caps (a huge print ends the program).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import marshal
import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, NamedTuple

from jaxrl4llm.config.errors import DependencyError

LAYERS = ("bwrap", "unshare")
ISOLATION = ("auto", *LAYERS, "none")
SETUP_FAILED = 125  # _sandbox_init's exit code when the namespaces or mounts could not be made
_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
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
SERVER_SLACK_S = 5.0  # past the wall limit, an unshare server that has not answered is stuck


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


def _probe(argv: list[str]) -> bool:
    try:
        return (
            subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=20,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.lru_cache(maxsize=None)
def layer_works(layer: str) -> bool:
    """Whether `layer` runs a trivial program here (cached per process)."""
    try:
        return (
            run_program("print(6 * 7)", "", SandboxConfig(isolation=layer), layer=layer).stdout
            == "42\n"
        )
    except OSError:
        return False


def available_layer() -> str | None:
    """The best isolation layer installed and permitted here, else None."""
    for layer in LAYERS:
        if shutil.which(layer) and layer_works(layer):
            return layer
    return None


def resolve_isolation(config: SandboxConfig) -> str:
    """The layer `config` runs under; raises DependencyError when none is available and
    `unsafe` is off."""
    if config.isolation == "none":
        return "none"
    if config.isolation != "auto":
        if shutil.which(config.isolation) and layer_works(config.isolation):
            return config.isolation
        found = None
    else:
        found = available_layer()
    if found is not None:
        return found
    if config.unsafe and config.isolation == "auto":
        return "none"
    wanted = "bwrap or unshare" if config.isolation == "auto" else config.isolation
    raise DependencyError(
        f"code rewards need an isolation layer to run model-written programs and {wanted} "
        "does not work here: install bubblewrap (apt install bubblewrap) or allow unprivileged "
        "user namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces "
        "> 0); or pass --unsafe_code_execution to run them as your user with only resource "
        "limits (they can then read your files and reach the network)"
    )


def _bwrap_argv(config: SandboxConfig, program: str) -> list[str]:
    argv = [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--clearenv",
    ]
    for name, value in ENVIRONMENT.items():
        argv += ["--setenv", name, value]
    for path in read_only_folders():
        argv += (
            ["--symlink", os.readlink(path), path]
            if os.path.islink(path)
            else ["--ro-bind", path, path]
        )
    argv += [
        "--dev",
        "/dev",
        "--size",
        str(config.work_mb << 20),
        "--tmpfs",
        "/work",
        "--ro-bind",
        program,
        "/work/main.py",
        "--symlink",
        "work",
        "/tmp",
        "--chdir",
        "/work",
        "--remount-ro",
        "/",
        "--",
        interpreter(),
        *INTERPRETER_ARGS,
        "/work/main.py",
    ]
    return argv


class _Server:
    """One `_sandbox_init.py` server (the unshare layer): started once, one run per request."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="jaxrl4llm-sandboxroot-")
        spec = {
            "root": self.root,
            "read_only": read_only_folders(),
            "host_pid": os.getpid(),
            "user_namespace": os.geteuid() != 0,
            "interpreter": interpreter(),
            "interpreter_args": INTERPRETER_ARGS,
            "environment": ENVIRONMENT,
        }
        user = ["--user", "--map-root-user"] if spec["user_namespace"] else []
        self.proc = subprocess.Popen(
            [
                "unshare",
                *user,
                "--mount",
                interpreter(),
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
            env=dict(ENVIRONMENT),
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
        _kill_group(self.proc.pid)
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


def _run_unshare(config: SandboxConfig, run_dir: str) -> tuple[str, int | None]:
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
    if os.geteuid() == 0:
        # uid 0 is exempt from RLIMIT_NPROC, in a user namespace too: the program becomes an
        # unused uid of its own, so the limit counts this sandbox's processes only.
        run["uid"] = SANDBOX_UIDS[0] + secrets.randbelow(SANDBOX_UIDS[1])
    server = _server()
    answer = server.run(run, config.wall_s)
    if not answer:  # a dead or stuck server: its group goes, the next run starts another
        _drop_server(server)
        if answer == "":
            with open(run["stderr"], "a", encoding="utf-8") as f:
                f.write(
                    "sandbox set-up failed: the unshare server exited (unshare --mount refused?)\n"
                )
        return ("timeout", None) if answer is None else ("setup_failed", SETUP_FAILED)
    if answer == "timeout":
        return "timeout", None
    kind, number = answer.split()
    if kind == "signal":
        return "signal", -int(number)
    code = int(number)
    return ("ok" if code == 0 else "setup_failed" if code == SETUP_FAILED else "exit"), code


def _set_limits(limits: dict[str, int], extra_processes: int) -> None:
    """In the child before exec (bwrap, none): the rlimits the program inherits."""
    rlimits = {
        "cpu_s": resource.RLIMIT_CPU,
        "memory_bytes": resource.RLIMIT_AS,
        "processes": resource.RLIMIT_NPROC,
        "file_bytes": resource.RLIMIT_FSIZE,
        "open_files": resource.RLIMIT_NOFILE,
    }
    for name, value in limits.items():
        value += extra_processes if name == "processes" else 0
        resource.setrlimit(rlimits[name], (value, value + (1 if name == "cpu_s" else 0)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run_child(config: SandboxConfig, run_dir: str, layer: str) -> tuple[str, int | None]:
    """(status, returncode) of the program in run_dir as a child of this process (bwrap, none)."""
    program, work = os.path.join(run_dir, "main.py"), os.path.join(run_dir, "work")
    os.mkdir(work)
    if layer == "bwrap":
        argv = _bwrap_argv(config, program)
        preexec = functools.partial(_set_limits, config.limits, 4)  # bwrap's own processes
    else:
        argv = [interpreter(), *INTERPRETER_ARGS, program]
        preexec = functools.partial(_set_limits, config.limits, 0)
    env = dict(ENVIRONMENT, HOME=work) if layer == "none" else dict(ENVIRONMENT)
    with (
        open(os.path.join(run_dir, "stdin"), "rb") as stdin_file,
        open(os.path.join(run_dir, "stdout"), "wb") as out,
        open(os.path.join(run_dir, "stderr"), "wb") as err,
    ):
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=out,
            stderr=err,
            cwd=work,
            env=env,
            start_new_session=True,
            preexec_fn=preexec,
            close_fds=True,
        )
        try:
            returncode = _wait(proc, config.wall_s)
        finally:
            _kill_group(proc.pid)  # whatever is left of the group, on every path
            proc.wait()
    if returncode is None:
        return "timeout", None
    return ("ok" if returncode == 0 else "signal" if returncode < 0 else "exit"), returncode


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """The exit code, None past timeout_s. A pidfd wakes at the exit; Popen.wait(timeout)
    polls with sleeps of up to 50 ms, which costs short runs more than their run time."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
    try:
        if not select.select([pidfd], [], [], timeout_s)[0]:
            return None
        return proc.wait()
    finally:
        os.close(pidfd)


def run_program(
    source: str, stdin: str, config: SandboxConfig, layer: str | None = None
) -> Execution:
    """Runs `source` (Python) with `stdin` under `config`'s isolation and limits; returns its
    status, exit code, output (each capped at file_mb) and wall seconds. Raises
    DependencyError when no isolation layer is available and `config.unsafe` is off; never
    raises for what the program does."""
    layer = layer or resolve_isolation(config)
    run_dir = tempfile.mkdtemp(prefix="jaxrl4llm-sandbox-")
    try:
        program = os.path.join(run_dir, "main.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        with open(os.path.join(run_dir, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        start = time.monotonic()
        if layer == "unshare":
            status, returncode = _run_unshare(config, run_dir)
        else:
            status, returncode = _run_child(config, run_dir, layer)
        seconds = time.monotonic() - start
        limit = config.file_mb << 20
        return Execution(
            status,
            returncode,
            _read(os.path.join(run_dir, "stdout"), limit),
            _read(os.path.join(run_dir, "stderr"), limit),
            seconds,
            layer,
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
