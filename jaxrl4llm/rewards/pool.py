"""A small process pool for verifiers that must never hang or crash training.

Why not concurrent.futures.ProcessPoolExecutor: a job stuck in C code (a huge sympy integer)
cannot be cancelled there, and its 'spawn'/'forkserver' workers re-import the trainer's
`__main__` (and so JAX) in every worker. Here each worker is a fresh interpreter that imports
only `jaxrl4llm.rewards._worker`, runs one job at a time, and is killed and replaced when its job
passes the per-item wall-clock timeout or the batch deadline, or when it dies.

Jobs are `(function, args)` with a module-level function (pickled by reference). A job's result
is a `JobResult(status, value)`: status "ok" (value = the function's return), "error" (the
function raised; value = the message), "timeout" or "crash" (value says why: which deadline,
or the worker's exit code / signal). `run` never raises for a job.

Deadlines: each job has `item_timeout_s` from the moment a worker starts it, so a slow job
costs one worker while the others keep taking jobs. A whole `run` has a deadline that scales
with its work: `batch_timeout_s` plus each job's allowance (`run(..., costs_s=...)`: the
seconds its work may take, e.g. 0.5 s per test of a program) divided by `num_workers`, so a
large honest batch is never cut on a loaded host (jobs still running at the deadline are
killed, jobs not started are reported as not started).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, NamedTuple, Sequence

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    num_workers: int = 2
    item_timeout_s: float = 5.0  # wall clock for one job, from dispatch to result
    batch_timeout_s: float = 60.0  # wall clock for one `run` call, plus its jobs' allowances
    start_timeout_s: float = 60.0  # a worker that is not ready by then is replaced
    memory_limit_mb: int = 4096  # RLIMIT_AS in the worker; 0 = unlimited
    preload: tuple[str, ...] = ("math_verify",)

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"PoolConfig.num_workers must be >= 1, got {self.num_workers}")
        if self.item_timeout_s <= 0 or self.batch_timeout_s <= 0:
            raise ValueError(
                "PoolConfig.item_timeout_s and batch_timeout_s must be > 0, got "
                f"{self.item_timeout_s} and {self.batch_timeout_s}"
            )


class JobResult(NamedTuple):
    status: str  # "ok" | "error" | "timeout" | "crash"
    value: Any = None


class _Worker:
    def __init__(self, config: PoolConfig):
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [
            sys.executable,
            "-m",
            "jaxrl4llm.rewards._worker",
            str(child_sock.fileno()),
            str(config.memory_limit_mb),
            *config.preload,
        ]
        self.proc = subprocess.Popen(
            cmd, pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL, close_fds=True
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.started = time.monotonic()
        self.ready = False
        self.job: tuple[int, int, float] | None = None  # (job id, item index, dispatch time)

    def exit_description(self) -> str:
        """How the worker ended: its exit code or the signal that killed it."""
        try:
            code = self.proc.wait(timeout=2)  # the socket can close before the exit is reaped
        except subprocess.TimeoutExpired:
            return "closed its connection but did not exit (killed)"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name}" + (
                " (out of memory?)" if -code == signal.SIGKILL else ""
            )
        return f"exited with code {code}"

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.conn.close()

    def shutdown(self) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _shutdown_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.shutdown()
    workers.clear()


class _Batch:
    """The state of one `run` call: each job's pickled payload and result, the jobs not yet
    dispatched, and the batch deadline."""

    def __init__(self, payloads: list[bytes], deadline: float):
        self.payloads = payloads
        self.deadline = deadline
        self.results: list[JobResult | None] = [None] * len(payloads)
        self.pending: deque[int] = deque(range(len(payloads)))


class VerifierPool:
    """Lazily started, reusable worker pool; `close()` it or use it as a context manager."""

    def __init__(self, config: PoolConfig = PoolConfig()):
        self.config = config
        self._workers: list[_Worker] = []
        self._next_job_id = 0
        self._consecutive_start_failures = 0
        self.stats = {"jobs": 0, "timeouts": 0, "crashes": 0, "restarts": 0}
        self._finalizer = weakref.finalize(self, _shutdown_all, self._workers)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        _shutdown_all(self._workers)

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self.config)
        self.stats["restarts"] += 1

    def batch_deadline_s(self, costs_s: Sequence[float] = ()) -> float:
        """Seconds a `run` of jobs with these allowances may take: batch_timeout_s plus
        their sum divided among the workers."""
        return self.config.batch_timeout_s + sum(costs_s) / self.config.num_workers

    def run(
        self, jobs: Sequence[tuple[Callable[..., Any], tuple]], costs_s: Sequence[float] = ()
    ) -> list[JobResult]:
        """Runs every job; returns one JobResult per job, in order. Never raises for a job.
        `costs_s`: each job's allowance, which the batch deadline adds (none: the fixed
        batch_timeout_s)."""
        if not jobs:
            return []
        payloads = [pickle.dumps((fn, tuple(args))) for fn, args in jobs]
        self.stats["jobs"] += len(jobs)
        while len(self._workers) < self.config.num_workers:
            self._workers.append(_Worker(self.config))
        batch = _Batch(payloads, deadline=time.monotonic() + self.batch_deadline_s(costs_s))
        while True:
            now = time.monotonic()
            self._dispatch(batch, now)
            if not batch.pending and all(w.job is None for w in self._workers):
                break
            self._receive_messages(batch, timeout=max(0.0, self._next_wake(batch) - now))
            now = time.monotonic()
            self._replace_overdue_workers(batch, now)
            if self._consecutive_start_failures >= 2 * self.config.num_workers:
                self._fail_unstartable_batch(batch)
                break
            if now >= batch.deadline:
                self._expire_batch(batch)
                break
        return [r if r is not None else JobResult("crash", "lost") for r in batch.results]

    def _finish(self, batch: _Batch, index: int, result: JobResult) -> None:
        batch.results[index] = result
        if result.status == "timeout":
            self.stats["timeouts"] += 1
        elif result.status == "crash":
            self.stats["crashes"] += 1

    def _dispatch(self, batch: _Batch, now: float) -> None:
        """Hands the next pending job to each ready, idle worker."""
        for worker in self._workers:
            if worker.ready and worker.job is None and batch.pending:
                index = batch.pending.popleft()
                self._next_job_id += 1
                try:
                    worker.conn.send((self._next_job_id, batch.payloads[index]))
                    worker.job = (self._next_job_id, index, now)
                except OSError:  # died while idle: retry the job on a fresh worker
                    batch.pending.appendleft(index)
                    self._replace(worker)

    def _next_wake(self, batch: _Batch) -> float:
        """The earliest deadline: the batch's, a running job's, or a starting worker's."""
        wake = [batch.deadline]
        wake += [w.job[2] + self.config.item_timeout_s for w in self._workers if w.job is not None]
        wake += [w.started + self.config.start_timeout_s for w in self._workers if not w.ready]
        return min(wake)

    def _receive_messages(self, batch: _Batch, timeout: float) -> None:
        """Waits up to `timeout` s, then takes one message (or death) from each worker with one."""
        ready = wait([w.conn for w in self._workers], timeout=timeout)
        for conn in ready:
            worker = next(w for w in self._workers if w.conn is conn)
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                self._handle_dead_worker(batch, worker)
                continue
            if message[0] == "ready":
                worker.ready = True
                self._consecutive_start_failures = 0
            elif worker.job is not None and message[0] == worker.job[0]:
                self._finish(batch, worker.job[1], JobResult(message[1], message[2]))
                worker.job = None

    def _handle_dead_worker(self, batch: _Batch, worker: _Worker) -> None:
        """A worker died: its job (if any) crashed; one that never got ready failed to start."""
        if worker.job is not None:
            self._finish(
                batch,
                worker.job[1],
                JobResult("crash", f"verifier worker {worker.exit_description()}"),
            )
        elif not worker.ready:
            self._consecutive_start_failures += 1
        self._replace(worker)

    def _replace_overdue_workers(self, batch: _Batch, now: float) -> None:
        """Replaces workers past their job's item deadline or their start deadline."""
        for worker in list(self._workers):
            if worker.job is not None and now - worker.job[2] >= self.config.item_timeout_s:
                self._finish(
                    batch,
                    worker.job[1],
                    JobResult("timeout", f"item deadline ({self.config.item_timeout_s:g} s)"),
                )
                self._replace(worker)
            elif not worker.ready and now - worker.started >= self.config.start_timeout_s:
                self._consecutive_start_failures += 1
                self._replace(worker)

    def _fail_unstartable_batch(self, batch: _Batch) -> None:
        """Workers cannot start at all (bad environment): fail the jobs, not training."""
        for worker in list(self._workers):
            if worker.job is not None:
                batch.pending.append(worker.job[1])
                self._replace(worker)
        for index in batch.pending:
            self._finish(
                batch,
                index,
                JobResult("crash", "verifier workers failed to start; see their stderr above"),
            )
        self._consecutive_start_failures = 0

    def _expire_batch(self, batch: _Batch) -> None:
        """The batch deadline passed: kills the running jobs, reports the rest as not started."""
        for worker in list(self._workers):
            if worker.job is not None:
                self._finish(batch, worker.job[1], JobResult("timeout", "batch deadline"))
                self._replace(worker)
        for index in batch.pending:
            self._finish(
                batch, index, JobResult("timeout", "not started before the batch deadline")
            )
