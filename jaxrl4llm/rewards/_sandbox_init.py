"""The sandbox server under `unshare` (the fallback isolation layer; rewards/sandbox.py).

Started once per host thread as `unshare [--user --map-root-user] --mount python -I -S
_sandbox_init.py SPEC`: it runs in a private mount namespace (root there, with every
capability there and none outside), builds a read-only root once (an empty tmpfs with
read-only binds of the system and interpreter folders, four device files, an empty /work
mount point), then serves one run per request line on stdin, answering one line on stdout.

Each run costs two forks, not an `unshare` binary, an interpreter start-up and a root's mounts:
the server forks a keeper, which unshares new mount, network, IPC, UTS and pid namespaces (and,
when the host is not real root, a new user namespace, so the process limit counts this run
only) and forks the program's process, pid 1 of the new pid namespace. That process mounts a
fresh size-limited tmpfs on /work, joins the run's cgroup where the host delegates one
(rewards/cgroups.py), copies the program in, takes the run's stdin, stdout and
stderr files, chroots into the root, sets the rlimits, drops every capability (bounding set,
ambient set, no_new_privs), under real root becomes the run's unused uid, and execs the
interpreter on the program. The keeper kills it at the wall-clock limit; it being pid 1, the
kernel then kills every process it left behind. Nothing of one run (files, processes, sockets,
IPC objects, mounts) is visible to the next. Parent-death signals chain program -> keeper ->
server -> the host thread that started it, so no part outlives the host.

Standard library only, and no json or re (their imports cost more than the run): requests are
marshal-encoded, in hex. A failure of a run's set-up exits with SETUP_FAILED and one line on
the run's stderr, so the host can tell a broken sandbox from a failing program.
"""

import ctypes
import marshal
import os
import resource
import select
import signal
import sys

SETUP_FAILED = 125
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
DEVICES = ("null", "zero", "random", "urandom")
LIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "file_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    def enc(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {source} on {target}",
    )


def _die_with_parent() -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")


def _bind_read_only(path: str, root: str) -> None:
    target = root + path
    if os.path.islink(path):  # merged /usr: /bin -> usr/bin is a link in the new root too
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(path, target, None, MS_BIND)
    # A bind keeps its source's flags; read-only needs a second, remounting call.
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(root: str, read_only: tuple[str, ...]) -> None:
    """Once per server: the read-only root every run chroots into."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in read_only:
        if os.path.lexists(path):
            _bind_read_only(path, root)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "a").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(root + "/work")
    os.symlink("work", root + "/tmp")
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _own_user_namespace() -> None:
    """In the keeper, after unshare(CLONE_NEWUSER): root of the new namespace, mapped to the
    server's root (which is the host user)."""
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def drop_privileges(last_cap: int, uid: int | None) -> None:
    for cap in range(last_cap + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if uid is not None:  # started by real root: become an unused uid (no capabilities left)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def program_process(server: dict, run: dict, last_cap: int) -> None:
    """Pid 1 of the run's namespaces: set up, then exec the program (never returns)."""
    root = server["root"]
    try:
        for fd, (path, mode) in enumerate(
            (
                (run["stdin"], os.O_RDONLY),
                (run["stdout"], os.O_WRONLY | os.O_TRUNC),
                (run["stderr"], os.O_WRONLY | os.O_TRUNC),
            )
        ):
            opened = os.open(path, mode)
            os.dup2(opened, fd)
            os.close(opened)
        os.closerange(3, 1 << 16)
        if run.get("cgroup_procs"):  # the run's cgroup (rewards/cgroups.py): join it first
            with open(run["cgroup_procs"], "w") as f:
                f.write("0")
        _mount(
            "tmpfs",
            root + "/work",
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            f"size={run['work_bytes']},mode=0777",
        )
        with open(run["program"], "rb") as src, open(root + "/work/main.py", "wb") as dst:
            dst.write(src.read())
        os.chdir(root)
        _check(_libc.chroot(b"."), "chroot")
        os.chdir("/work")
        for name, value in run["limits"].items():
            resource.setrlimit(LIMITS[name], (value, value + (1 if name == "cpu_s" else 0)))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # The bounding set is empty, so the exec below gives uid 0 no capabilities at all.
        drop_privileges(last_cap, run.get("uid"))
        _die_with_parent()  # after the uid change, which clears it
        for number in range(1, signal.NSIG):  # the server ignores some; the program must not
            if number not in (signal.SIGKILL, signal.SIGSTOP):
                try:
                    signal.signal(number, signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
        interpreter = server["interpreter"]
        os.execve(
            interpreter,
            [interpreter, *server["interpreter_args"], "/work/main.py"],
            server["environment"],
        )
    except BaseException as exc:  # noqa: BLE001 - any failure here is the sandbox's, not the program's
        try:
            os.write(2, f"sandbox set-up failed: {exc}\n".encode())
        finally:
            os._exit(SETUP_FAILED)


def keeper(server: dict, run: dict, last_cap: int) -> str:
    """Forked per run: new namespaces, the program's process, its wall-clock limit. Returns the
    answer line: "exit CODE", "signal NUMBER" or "timeout"."""
    _die_with_parent()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    _check(_libc.unshare(flags | (CLONE_NEWUSER if server["user_namespace"] else 0)), "unshare")
    if server["user_namespace"]:
        _own_user_namespace()
    pid = os.fork()
    if pid == 0:
        program_process(server, run, last_cap)
    pidfd = os.pidfd_open(pid)
    finished = select.select([pidfd], [], [], run["wall_s"])[0]
    if not finished:
        os.kill(pid, signal.SIGKILL)  # pid 1: the kernel kills the rest of the namespace
    _, status = os.waitpid(pid, 0)
    if not finished:
        return "timeout"
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def serve(server: dict) -> int:
    _die_with_parent()
    if os.getppid() != server["host_pid"]:  # the host died before the signal was set
        return 0
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    try:
        build_root(server["root"], server["read_only"])
        broken = None
    except OSError as exc:
        broken = f"sandbox set-up failed: {exc}\n"
    for line in sys.stdin:
        run = marshal.loads(bytes.fromhex(line))
        if broken is not None:
            with open(run["stderr"], "w") as f:
                f.write(broken)
            answer = f"exit {SETUP_FAILED}"
        else:
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_end)
                try:
                    answer = keeper(server, run, last_cap)
                except BaseException as exc:  # noqa: BLE001 - reported to the host as a set-up failure
                    with open(run["stderr"], "a") as f:
                        f.write(f"sandbox set-up failed: {exc}\n")
                    answer = f"exit {SETUP_FAILED}"
                os.write(write_end, answer.encode())
                os._exit(0)
            os.close(write_end)
            with os.fdopen(read_end, "rb") as f:
                answer = f.read().decode() or f"exit {SETUP_FAILED}"
            os.waitpid(pid, 0)
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve(marshal.loads(bytes.fromhex(sys.argv[1]))))
