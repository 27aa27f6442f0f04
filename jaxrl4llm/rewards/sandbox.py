"""Run one untrusted Python program: no network, no view of the user's files, bounded resources.

    config = SandboxConfig(wall_s=2.0)
    execution = run_program("print(input()[::-1])", "abc\\n", config)
    execution.status, execution.stdout   # ("ok", "cba\\n")

Isolation layers, best first (`isolation="auto"` takes the first that works here):

- "bwrap" (bubblewrap): new user, mount, network, IPC, UTS, pid and cgroup namespaces; a root
  of read-only binds of the system and interpreter folders, a private tmpfs /work, no /proc;
  every capability dropped; dies with its parent. Under real root bwrap itself runs as an
  unused uid of its own (uid 0 is exempt from RLIMIT_NPROC, in a user namespace too).
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
Where the host delegates cgroup v2 memory and pids controllers (rewards/cgroups.py), each run
also gets a cgroup of its own that bounds the memory and processes of all its processes
together. The layers' binaries are resolved once to absolute paths (sandbox_base.binary).
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import select
import shutil
import subprocess
import tempfile
import time

from absl import logging

from jaxrl4llm.config.errors import DependencyError
from jaxrl4llm.rewards import cgroups
from jaxrl4llm.rewards.sandbox_base import (
    ENVIRONMENT,
    INTERPRETER_ARGS,
    ISOLATION,
    LAYERS,
    SETUP_FAILED,
    SYSTEM_FOLDERS,
    Execution,
    SandboxConfig,
    binary,
    interpreter,
    kill_group,
    read_only_folders,
    unused_uid,
)
from jaxrl4llm.rewards.sandbox_unshare import close_servers, run_unshare

__all__ = [
    "ISOLATION",
    "INTERPRETER_ARGS",
    "LAYERS",
    "SETUP_FAILED",
    "Execution",
    "SandboxConfig",
    "available_layer",
    "close_servers",
    "interpreter",
    "layer_works",
    "resolve_isolation",
    "run_program",
]

LAYER_PROCESSES = {"bwrap": 2}  # a layer's own processes in a run's cgroup: bwrap and its pid 1
USER_BWRAP_PROCESSES = 4  # what a user's bwrap adds to RLIMIT_NPROC for its own processes
BOX = "/box"  # under root, the program's root inside bwrap's
ROOT_CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_SYS_CHROOT")  # kept for chroot alone
ROOT_BINARIES = ("chroot", "env")  # coreutils, run inside the sandbox
_LAYER_LOG_ONCE: set[str] = set()


@functools.lru_cache(maxsize=None)
def layer_problem(layer: str) -> str | None:
    """Why `layer` cannot run a trivial program here, None when it can (cached per process)."""
    path = binary(layer)
    if path is None:
        return f"{layer} is not installed (not on PATH)"
    if layer == "bwrap" and unused_uid() is not None:
        missing = [name for name in ROOT_BINARIES if binary(name) is None]
        if missing or "--perms" not in _bwrap_options():
            return f"under root bwrap needs --perms (bwrap 0.5+) and {', '.join(ROOT_BINARIES)}"
    try:
        execution = run_program("print(6 * 7)", "", SandboxConfig(isolation=layer), layer=layer)
    except OSError as exc:
        return f"{path} could not start: {exc}"
    if execution.stdout == "42\n":
        return None
    said = execution.stderr.strip().splitlines()
    return f"{path} failed ({execution.status} {execution.returncode})" + (
        f": {said[-1][:200]}" if said else ""
    )


def layer_works(layer: str) -> bool:
    """Whether `layer` runs a trivial program here (cached per process)."""
    return binary(layer) is not None and layer_problem(layer) is None


def available_layer() -> str | None:
    """The best isolation layer installed and permitted here, else None. A layer that is
    installed but fails is logged (once), never skipped silently."""
    for layer in LAYERS:
        if binary(layer) is None:
            continue
        problem = layer_problem(layer)
        if problem is None:
            return layer
        if layer not in _LAYER_LOG_ONCE:
            _LAYER_LOG_ONCE.add(layer)
            logging.warning("Code sandbox: %s is installed but does not work: %s", layer, problem)
    return None


def resolve_isolation(config: SandboxConfig) -> str:
    """The layer `config` runs under; raises DependencyError when none is available and
    `unsafe` is off."""
    if config.isolation == "none":
        return "none"
    if config.isolation != "auto":
        found = config.isolation if layer_works(config.isolation) else None
        why = f" ({layer_problem(config.isolation)})" if binary(config.isolation) else ""
    else:
        found, why = available_layer(), ""
    if found is not None:
        return found
    if config.unsafe and config.isolation == "auto":
        return "none"
    wanted = "bwrap or unshare" if config.isolation == "auto" else config.isolation
    raise DependencyError(
        f"code rewards need an isolation layer to run model-written programs and {wanted} "
        f"does not work here{why}: install bubblewrap (apt install bubblewrap) or allow "
        "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
        "user.max_user_namespaces > 0); or pass --unsafe_code_execution to run them as your "
        "user with only resource limits (they can then read your files and reach the network)"
    )


@functools.lru_cache(maxsize=None)
def _bwrap_options() -> str:
    """bwrap's --help (which options this version has)."""
    try:
        found = subprocess.run(
            [binary("bwrap") or "bwrap", "--help"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return found.stdout + found.stderr


def _bwrap_argv(config: SandboxConfig, program_fd: int, uid: int | None) -> list[str]:
    """bwrap's command line; the program is copied in from `program_fd`. Run by a user
    (`uid` None): a user namespace (no further one inside where this bwrap can forbid it),
    the program runs as that user. Run by real root: no user namespace (it would map the
    program to uid 0, which RLIMIT_NPROC exempts); the sandbox is built under BOX and
    coreutils' chroot enters it as `uid` (from a chroot the kernel refuses new user
    namespaces), keeping no capability, and env starts the program in /work."""
    top = BOX if uid is not None else ""
    argv = [binary("bwrap") or "bwrap", "--die-with-parent", "--new-session"]
    argv += ["--cap-drop", "ALL", "--clearenv"]
    if uid is None:
        argv += ["--unshare-all", "--unshare-user"]
        argv += ["--disable-userns"] if "--disable-userns" in _bwrap_options() else []
    else:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
        argv += ["--unshare-cgroup-try", "--perms", "0755", "--dir", BOX]
        argv += [a for cap in ROOT_CAPABILITIES for a in ("--cap-add", cap)]
    for name, value in ENVIRONMENT.items():
        argv += ["--setenv", name, value]
    for path in read_only_folders():
        argv += _bwrap_folder(path, top)
    argv += ["--dev", f"{top}/dev", "--size", str(config.work_mb << 20)]
    argv += ["--perms", "0777"] if uid is not None else []
    argv += ["--tmpfs", f"{top}/work", "--file", str(program_fd), f"{top}/work/main.py"]
    argv += ["--symlink", "work", f"{top}/tmp", "--chdir", f"{top}/work", "--remount-ro", "/"]
    if uid is not None:
        argv += ["--", binary("chroot") or "chroot", f"--userspec=+{uid}:+{uid}"]
        argv += [f"--groups=+{uid}", BOX, binary("env") or "env", "-C", "/work"]
    return argv + ["--", interpreter(), *INTERPRETER_ARGS, "/work/main.py"]


def _bwrap_folder(path: str, top: str) -> list[str]:
    """Binds a read-only folder at `top` + path. Under BOX: its parents made traversable
    (bwrap copies a source parent's mode: /root would be 0700), and a system folder also
    linked at bwrap's own root, where chroot and env run."""
    argv: list[str] = []
    if top:
        parents = [p for p in _parents(path) if not os.path.islink(p)]
        argv += [a for p in parents for a in ("--perms", "0755", "--dir", top + p)]
        if path in SYSTEM_FOLDERS:
            argv += ["--symlink", top.lstrip("/") + path, path]
    if os.path.islink(path):
        return argv + ["--symlink", os.readlink(path), top + path]
    return argv + ["--ro-bind", path, top + path]


def _parents(path: str) -> list[str]:
    """/a/b/c -> [/a, /a/b]."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


RLIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "file_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}


def _enter_sandbox(limits: dict[str, int], extra_processes: int, cgroup_procs: str | None) -> None:
    """In the child before exec (bwrap, none): the rlimits the program inherits, its cgroup."""
    for name, value in limits.items():
        value += extra_processes if name == "processes" else 0
        resource.setrlimit(RLIMITS[name], (value, value + (1 if name == "cpu_s" else 0)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cgroup_procs is not None:
        cgroups.join(cgroup_procs)


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _run_child(
    config: SandboxConfig, run_dir: str, layer: str, cgroup_procs: str | None
) -> tuple[str, int | None]:
    """(status, returncode) of the program in run_dir as a child of this process (bwrap, none)."""
    program, work = os.path.join(run_dir, "main.py"), os.path.join(run_dir, "work")
    os.mkdir(work)
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(open(os.path.join(run_dir, name), mode))
            for name, mode in (
                ("main.py", "rb"),
                ("stdin", "rb"),
                ("stdout", "wb"),
                ("stderr", "wb"),
            )
        ]
        uid = unused_uid() if layer == "bwrap" else None
        argv, extra = [interpreter(), *INTERPRETER_ARGS, program], 0
        fds: tuple[int, ...] = ()
        if layer == "bwrap":
            argv, fds = _bwrap_argv(config, files[0].fileno(), uid), (files[0].fileno(),)
            # A user's bwrap: its own processes count with the program's (root's do not).
            extra = USER_BWRAP_PROCESSES if uid is None else 0
        proc = subprocess.Popen(
            argv,
            stdin=files[1],
            stdout=files[2],
            stderr=files[3],
            cwd=work,
            env=dict(ENVIRONMENT, HOME=work) if layer == "none" else dict(ENVIRONMENT),
            start_new_session=True,
            preexec_fn=functools.partial(_enter_sandbox, config.limits, extra, cgroup_procs),
            close_fds=True,
            pass_fds=fds,
        )
        try:
            returncode = _wait(proc, config.wall_s)
        finally:
            kill_group(proc.pid)  # whatever is left of the group, on every path
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
        cgroup = cgroups.run_cgroup(
            config.memory_mb << 20, config.processes + LAYER_PROCESSES.get(layer, 0)
        )
        procs = cgroup.procs if cgroup is not None else None
        start = time.monotonic()
        try:
            if layer == "unshare":
                status, returncode = run_unshare(config, run_dir, procs)
            else:
                status, returncode = _run_child(config, run_dir, layer, procs)
        finally:
            if cgroup is not None:
                cgroup.close()
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
