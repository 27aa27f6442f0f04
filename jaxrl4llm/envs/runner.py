"""Environment calls in the reward worker pool, without blocking the caller.

`reset_job` and `step_job` run inside a pool worker (rewards/pool.py): the environment object
travels there pickled, runs the call and comes back with its new state, and what it returned
is checked and cleaned there, before it crosses back: an observation that is not text is an
error, bytes and text that is not valid UTF-8 (lone surrogates) become U+FFFD, control
characters other than tab and newline too, and a huge one is cut to `max_chars`. A call that
never returns is the pool's "timeout", one that kills its worker a "crash".

`EnvRunner` runs those jobs for the trainer: `submit` hands a job to one of `num_workers`
threads and returns at once; each thread owns a one-worker VerifierPool, so a job that hangs
holds one thread and one worker until its deadline while the others keep working.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from jaxrl4llm.envs.base import Environment, StepResult
from jaxrl4llm.rewards.pool import JobResult, PoolConfig, VerifierPool

STATUSES = ("ok", "error", "timeout")
# C0 controls but tab, newline and carriage return; DEL; C1 controls; lone surrogates (text
# that is not UTF-8, as `bytes.decode(errors="surrogateescape")` makes).
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_BYTES_PER_CHAR = 4  # the most UTF-8 bytes one character takes


def clean_text(value: Any, max_chars: int) -> str | None:
    """`value` as safe text of at most `max_chars` characters (plus a note saying how much
    was cut); None stays None. Raises TypeError when it is neither text nor bytes."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        total, unit, read = len(value), "bytes", max_chars * _BYTES_PER_CHAR
        text = bytes(value[:read]).decode("utf-8", errors="replace")
    elif isinstance(value, str):
        total, unit, read = len(value), "characters", max_chars
        text = value[:read]
    else:
        raise TypeError(f"an observation must be text (str) or None, got {type(value).__name__}")
    text = _UNSAFE.sub("\ufffd", text)
    if len(text) > max_chars or total > read:
        text = text[:max_chars] + f"\n[... cut: {total} {unit} in all]"
    return text


def reset_job(env: Environment, record: Any, max_chars: int) -> tuple[Environment, str | None]:
    """In a pool worker: `env.reset(record)`; returns the environment and its cleaned text."""
    return env, clean_text(env.reset(record), max_chars)


def step_job(env: Environment, turn_text: str, max_chars: int) -> tuple[Environment, StepResult]:
    """In a pool worker: `env.step(turn_text)`, checked and cleaned."""
    result = env.step(turn_text)
    if not isinstance(result, StepResult):
        raise TypeError(f"step returned {type(result).__name__}, not a StepResult")
    if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
        raise TypeError(f"step's reward must be a number, got {type(result.reward).__name__}")
    if not math.isfinite(result.reward):
        raise ValueError(f"step's reward must be finite, got {result.reward}")
    if result.status not in STATUSES:
        raise ValueError(f"step's status must be one of {STATUSES}, got {result.status!r}")
    return env, StepResult(
        observation=clean_text(result.observation, max_chars),
        reward=float(result.reward),
        done=bool(result.done),
        tool_call=bool(result.tool_call),
        status=result.status,
    )


Done = Callable[[JobResult, float], None]  # (the job's result, its seconds)


class EnvRunner:
    """Runs environment jobs in `config.num_workers` pool workers; `close()` it."""

    def __init__(self, config: PoolConfig):
        # One job per run: its deadline is the item's (the batch's leaves room for a start).
        self.pool_config = dataclasses.replace(
            config,
            num_workers=1,
            batch_timeout_s=config.item_timeout_s + config.start_timeout_s,
        )
        self._executor = ThreadPoolExecutor(config.num_workers, thread_name_prefix="env")
        self._local = threading.local()
        self._pools: list[VerifierPool] = []
        self._lock = threading.Lock()

    @property
    def item_timeout_s(self) -> float:
        return self.pool_config.item_timeout_s

    def _pool(self) -> VerifierPool:
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = VerifierPool(self.pool_config)
            with self._lock:
                self._pools.append(pool)
        return pool

    def _run(self, fn: Callable[..., Any], args: tuple) -> tuple[JobResult, float]:
        start = time.monotonic()
        try:
            result = self._pool().run([(fn, args)])[0]
        except Exception as exc:  # noqa: BLE001 - e.g. an environment that cannot be pickled
            result = JobResult("error", f"could not send the job to a worker: {exc}"[:500])
        return result, time.monotonic() - start

    def submit(self, fn: Callable[..., Any], args: tuple, done: Done) -> None:
        """Runs `fn(*args)` in a worker; `done(result, seconds)` is called from a runner
        thread when it ends. Never blocks."""
        self._executor.submit(lambda: done(*self._run(fn, args)))

    def run(self, jobs: Sequence[tuple[Callable[..., Any], tuple]]) -> list[JobResult]:
        """Runs `jobs` in parallel; blocks until each has ended (or missed its deadline)."""
        futures = [self._executor.submit(self._run, fn, args) for fn, args in jobs]
        return [future.result()[0] for future in futures]

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for pool in self._pools:
                pool.close()
            self._pools.clear()

    def __enter__(self) -> EnvRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
