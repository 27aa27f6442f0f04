"""Hostile programs in the sandbox: each scores 0 through the code verifier, returns within the
wall limit, and leaves the host as it was (no new files outside the sandbox, no processes left,
no secret read, no connection made, this test process alive). Reward hacks (programs that try
to talk the verifier into a pass from inside) are in test_reward_hacks.py.

The programs run concurrently (threads; each execution is a subprocess) once per isolation
layer that works here (bwrap, unshare)."""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import socket
import tempfile
import time

import pytest

from jaxrl4llm.rewards import sandbox
from jaxrl4llm.rewards.code import run_code_tests
from jaxrl4llm.rewards.sandbox_base import SANDBOX_UIDS

WORKING_LAYERS = [layer for layer in sandbox.LAYERS if sandbox.layer_works(layer)]
pytestmark = pytest.mark.skipif(not WORKING_LAYERS, reason="no isolation layer (bwrap, unshare)")

WALL_S = 1.0
SLACK_S = 4.0  # killing, reaping and 2 shared cores
CONFIG = sandbox.SandboxConfig(
    wall_s=WALL_S, cpu_s=1, memory_mb=256, processes=16, file_mb=4, open_files=32, work_mb=8
)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOME = os.path.expanduser("~")
SECRET = "jaxrl4llm-canary-7f3a9c"
MARKER = "987654"  # `sleep MARKER`: a process that must not outlive its sandbox
LISTENER = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
LISTENER.bind(("127.0.0.1", 0))
LISTENER.listen(8)
LISTENER.setblocking(False)
PORT = LISTENER.getsockname()[1]
CANARIES = [
    os.path.join(REPO, "PWNED"),
    os.path.join(HOME, "PWNED"),
    "/tmp/PWNED",
    "/usr/PWNED",
    "/PWNED",
]
WRITE_CANARIES = "\n".join(
    f"try:\n    open({path!r}, 'w').write('x')\nexcept OSError:\n    pass" for path in CANARIES
)

HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
    "        pass",
    "fork_bomb_detached": f"import os\nfor _ in range(64):\n    try:\n        if os.fork() == 0:"
    f"\n            os.setsid()\n            os.execv('/bin/sleep', "
    f"['sleep', '{MARKER}'])\n    except OSError:\n        pass\n"
    "import time\ntime.sleep(100)",
    "daemon_exits_fast": f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:"
    f"\n        os.execv('/bin/sleep', ['sleep', '{MARKER}'])\n"
    "    os._exit(0)\nprint('bye')",
    "busy_loop": "while True:\n    pass",
    "sleep_forever": "import time\ntime.sleep(1000)",
    "ignore_signals_loop": "import signal\nfor s in (signal.SIGTERM, signal.SIGXCPU, "
    "signal.SIGINT, signal.SIGHUP):\n    signal.signal(s, signal.SIG_IGN)\n"
    "while True:\n    pass",
    "memory_bomb_once": "x = bytearray(10 ** 10)\nprint('ok')",
    "memory_bomb_gradual": "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))",
    "write_10gb": "with open('big', 'wb') as f:\n    for _ in range(10 ** 4):\n"
    "        f.write(b'0' * 10 ** 6)",
    "fill_tmpfs": "import os\nfor i in range(10 ** 5):\n    with open(f'/tmp/f{i}', 'wb') as f:\n"
    "        f.write(b'0' * 60000)",
    "huge_stdout": "while True:\n    print('x' * 10000)",
    "huge_stderr": "import sys\nwhile True:\n    sys.stderr.write('y' * 10000)",
    "read_ssh_keys": f"import glob\nfor p in glob.glob('{HOME}/.ssh/*') + glob.glob('/root/.ssh/*')"
    f" + glob.glob('/home/*/.ssh/*'):\n    print(open(p).read())",
    "read_repository": f"print(open({os.path.join(REPO, 'pytest.ini')!r}).read())",
    "list_host_folders": f"import os\nfor p in ({REPO!r}, {HOME!r}, '/home', '/etc', '/proc', "
    "'/sys', '/work/..', '/var'):\n    try:\n        print(p, os.listdir(p))"
    "\n    except OSError:\n        pass",
    "write_canaries": WRITE_CANARIES,
    "delete_files": f"import os, shutil\nfor p in ({os.path.join(REPO, 'pytest.ini')!r}, "
    f"'/usr/bin/python3', '/bin/sh'):\n    try:\n        os.remove(p)\n"
    "    except OSError:\n        pass\nshutil.rmtree('/usr', ignore_errors=True)",
    "overwrite_interpreter": "import sys\nopen(sys.executable, 'wb').write(b'')",
    "connect_local_port": f"import socket\nsocket.create_connection(('127.0.0.1', {PORT}), "
    "timeout=0.5).sendall(b'leak')",
    "udp_send": f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'leak',"
    f" ('127.0.0.1', {PORT}))",
    "connect_internet": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=0.5)",
    "kill_parent": "import os, signal\nos.kill(os.getppid() or 1, signal.SIGKILL)\n"
    "import time\ntime.sleep(100)",
    "kill_host_pid": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
    "kill_everything": "import os, signal\nos.kill(-1, signal.SIGKILL)\n"
    "os.killpg(0, signal.SIGKILL)\nimport time\ntime.sleep(100)",
    "ctypes_segfault": "import ctypes\nctypes.string_at(0)",
    "deep_recursion": "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1)\n"
    "f(0)",
    "zombie_children": "import os, time\nfor _ in range(8):\n    try:\n"
    "        if os.fork() == 0:\n            os._exit(0)\n"
    "    except OSError:\n        pass\ntime.sleep(100)",
    "thread_bomb": "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, "
    "args=(100,)).start()",
    "open_files_bomb": "files = []\nwhile True:\n    files.append(open('/dev/null'))",
    "environment_exfiltration": "import os\nprint(dict(os.environ))\n"
    "print(open('/proc/self/environ').read())",
    "escape_chroot": "import os\nos.mkdir('x')\nos.chroot('x')\nos.chdir('../../../..')\n"
    "print(os.listdir('.'))",
    "new_user_namespace": "import ctypes\nlibc = ctypes.CDLL(None)\nassert libc.unshare(0x10000000)"
    " == 0\nprint('escaped')",
    "mount_host": "import ctypes\nlibc = ctypes.CDLL(None)\nassert libc.mount(b'/', b'/work', None,"
    " 4096, None) == 0\nprint('mounted')",
    "setuid_root": "import os\nos.setuid(0)\nos.setgid(0)\nopen('/usr/PWNED', 'w')",
    "exit_zero_early": "import sys\nsys.exit(0)",
}
# What each must not print (beyond failing its test): a secret, a host listing.
MUST_NOT_PRINT = {
    "read_repository": "addopts",
    "environment_exfiltration": SECRET,
    "list_host_folders": "pytest.ini",
    "escape_chroot": "usr",
    "new_user_namespace": "escaped",
    "mount_host": "mounted",
}
TESTS = json.dumps({"style": "stdio", "cases": [{"input": "", "output": "expected answer"}]})


def _sandbox_processes() -> list[str]:
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "/work/main.py" in cmdline or f"sleep {MARKER}" in cmdline:
            found.append(cmdline)
    return found


def _run(name: str, layer: str) -> dict:
    source = HOSTILE[name]
    start = time.monotonic()
    reason, score, detail = run_code_tests(source, TESTS, "all_pass", CONFIG, layer, 30.0)
    scored_s = time.monotonic() - start
    execution = sandbox.run_program(source, "", CONFIG, layer)
    return {
        "reason": reason,
        "score": score,
        "detail": detail,
        "scored_s": scored_s,
        "execution": execution,
    }


@pytest.fixture(scope="module", params=WORKING_LAYERS)
def results(request):
    os.environ["JAXRL4LLM_SECRET"] = SECRET
    run_dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "jaxrl4llm-sandbox-*")))
    home, repo = set(os.listdir(HOME)), set(os.listdir(REPO))
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            found = dict(zip(HOSTILE, pool.map(_run, HOSTILE, [request.param] * len(HOSTILE))))
    finally:
        del os.environ["JAXRL4LLM_SECRET"]
    time.sleep(0.5)  # the kernel tears pid namespaces down asynchronously
    connections = []
    try:
        while True:
            connections.append(LISTENER.accept())
    except BlockingIOError:
        pass
    host = {
        "processes": _sandbox_processes(),
        "connections": connections,
        "new_home": set(os.listdir(HOME)) - home,
        "new_repo": set(os.listdir(REPO)) - repo,
        "new_run_dirs": set(glob.glob(os.path.join(tempfile.gettempdir(), "jaxrl4llm-sandbox-*")))
        - run_dirs,
    }
    return found, host


def test_there_are_at_least_30_hostile_programs():
    assert len(HOSTILE) >= 30


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_scores_zero_within_the_wall_limit(results, name):
    found = results[0][name]
    assert (found["reason"], found["score"]) == ("wrong", 0.0), found["detail"]
    assert found["scored_s"] < WALL_S + SLACK_S
    assert found["execution"].seconds < WALL_S + SLACK_S
    assert len(found["execution"].stdout) <= CONFIG.file_mb << 20
    if name in MUST_NOT_PRINT:
        assert MUST_NOT_PRINT[name] not in found["execution"].stdout


def test_host_is_unchanged(results):
    host = results[1]
    assert host["processes"] == []
    assert host["connections"] == []
    assert host["new_home"] == set() and host["new_repo"] == set()
    assert host["new_run_dirs"] == set()
    assert not any(os.path.exists(path) for path in CANARIES)
    assert os.path.exists(os.path.join(REPO, "pytest.ini"))


@pytest.mark.parametrize("layer", WORKING_LAYERS)
def test_runaway_programs_hit_their_limit_not_the_host(layer):
    """The limits, not luck, stop them: the status says which one did."""
    found = {
        name: sandbox.run_program(HOSTILE[name], "", CONFIG, layer)
        for name in ("busy_loop", "memory_bomb_once", "write_10gb", "fork_bomb")
    }
    assert found["busy_loop"].status in ("timeout", "signal")
    assert "MemoryError" in found["memory_bomb_once"].stderr
    assert found["write_10gb"].status in ("signal", "exit")  # SIGXFSZ / EFBIG
    assert found["fork_bomb"].status == "timeout"


@pytest.mark.parametrize("layer", WORKING_LAYERS)
def test_the_process_limit_holds(layer):
    """A bounded fork counter (200 tries) stays within the limit under every layer: under real
    root too, where the program runs as an unused uid (uid 0 is exempt from RLIMIT_NPROC)."""
    counter = (
        "import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
        "            time.sleep(2)\n            os._exit(0)\n        n += 1\n"
        "except OSError:\n    pass\nprint(n, os.getuid())"
    )
    execution = sandbox.run_program(counter, "", CONFIG, layer)
    assert execution.status == "ok", execution.stderr
    forks, uid = map(int, execution.stdout.split())
    assert forks <= CONFIG.processes
    if os.geteuid() == 0:
        assert uid >= SANDBOX_UIDS[0]
