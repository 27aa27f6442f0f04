"""Verifier worker process: runs one job at a time for `VerifierPool`.

Started as `python -m jaxrl4llm.rewards._worker FD MEMORY_MB [PRELOAD ...]` by the pool; FD is
one end of a socketpair. It runs in its own main thread, so math-verify's SIGALRM timeouts work
here; the pool still keeps a wall-clock guard (a C-level hang ignores signals) and kills us.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import sys
from multiprocessing.connection import Connection


def _limit_memory(megabytes: int) -> None:
    # A runaway sympy expression should fail with MemoryError here, not swap the host.
    if megabytes <= 0:
        return
    try:
        import resource

        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass


def _run_job(payload: bytes) -> tuple[str, object]:
    try:
        fn, args = pickle.loads(payload)
        return "ok", fn(*args)
    except MemoryError:
        return "error", "MemoryError"
    except Exception as exc:  # noqa: BLE001 - untrusted input: any failure is a result
        return "error", f"{type(exc).__name__}: {exc}"[:500]


def main(argv: list[str]) -> int:
    fd, memory_mb, preload = int(argv[1]), int(argv[2]), argv[3:]
    conn = Connection(fd)
    # math-verify logs every timeout / parse failure; the pool counts them instead.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    for name in preload:
        importlib.import_module(name)
    _limit_memory(memory_mb)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 0
        if message is None:  # orderly shutdown
            return 0
        job_id, payload = message
        status, value = _run_job(payload)
        try:
            conn.send((job_id, status, value))
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            conn.send((job_id, "error", f"unpicklable result: {exc}"[:500]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
