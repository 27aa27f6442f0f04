"""The sandbox's first process under `unshare` (the fallback isolation layer; rewards/sandbox.py).

Run as `unshare --user --map-root-user --net --mount --ipc --uts --pid --kill-child \
python -I -S _sandbox_init.py SPEC_JSON`: it is pid 1 of new user, mount, network, IPC, UTS and
pid namespaces, root inside them with every capability there and none outside. Started by real
root, it gets no user namespace (the kernel exempts uid 0 from the process limit): it builds the
root as root, then becomes the spec's unused uid, which has no capabilities and whose
processes the limit counts. It builds a new
root from an empty tmpfs (read-only binds of the system and interpreter folders, four device
files, a size-limited tmpfs as the private working directory /work, the program copied in),
chroots into it, sets the rlimits, drops every capability (bounding set, ambient set,
no_new_privs) and execs the interpreter on the program, which so stays pid 1: when it exits,
the kernel kills every process it left behind.

Standard library only (it runs with -I -S): imported by nothing, run by path. A failure of the
set-up exits with SETUP_FAILED and one line on stderr, so the host can tell a broken sandbox
from a failing program.
"""
import ctypes
import json
import os
import resource
import sys

SETUP_FAILED = 125
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
DEVICES = ("null", "zero", "random", "urandom")
LIMITS = {"cpu_s": resource.RLIMIT_CPU, "memory_bytes": resource.RLIMIT_AS,
          "processes": resource.RLIMIT_NPROC, "file_bytes": resource.RLIMIT_FSIZE,
          "open_files": resource.RLIMIT_NOFILE}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    def enc(text):
        return text.encode() if text is not None else None
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} on {target}")


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


def build_root(spec: dict) -> None:
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in spec["read_only"]:
        if os.path.lexists(path):
            _bind_read_only(path, root)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "a").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(root + "/work")
    _mount("tmpfs", root + "/work", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['work_bytes']},mode=0777")
    os.symlink("work", root + "/tmp")
    with open(spec["program"], "rb") as src, open(root + "/work/main.py", "wb") as dst:
        dst.write(src.read())
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    _check(_libc.chroot(b"."), "chroot")
    os.chdir("/work")


def drop_privileges(last_cap: int, uid: int | None) -> None:
    for cap in range(last_cap + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if uid is not None:  # started by real root: become an unused uid (no capabilities left)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
        build_root(spec)
        for name, value in spec["limits"].items():
            resource.setrlimit(LIMITS[name], (value, value + (1 if name == "cpu_s" else 0)))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # The bounding set is empty, so the exec below gives uid 0 no capabilities at all.
        drop_privileges(last_cap, spec.get("uid"))
    except (OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"sandbox set-up failed: {exc}\n")
        return SETUP_FAILED
    interpreter = spec["interpreter"]
    os.execve(interpreter, [interpreter, *spec["interpreter_args"], "/work/main.py"],
              spec["environment"])
    return SETUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
