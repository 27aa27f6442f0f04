"""A persistent JAX compilation cache for the trainer processes the tests start.

The end-to-end tests start `python -m experiments.train` (and evaluate, export) several times
on the toy model with the same flags: a straight run, a killed one, its resume. Each process
compiled the same programs again (a toy run: ~23 s cold, ~12 s from the cache). A cache hit
loads the executable XLA compiled for the same program, so what the tests check does not
change. One folder per test process (pytest-xdist worker): its processes run one at a time,
so no two write one entry at once. Deleted when the test process exits.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

_DIR: list[str] = []


def with_compile_cache(env: dict[str, str]) -> dict[str, str]:
    """`env` plus this test process's JAX compilation cache (every program cached: the toy
    programs compile in well under JAX's default 1 s threshold)."""
    if not _DIR:
        _DIR.append(tempfile.mkdtemp(prefix="jaxrl4llm-test-jax-cache-"))
        atexit.register(shutil.rmtree, _DIR[0], True)
    return dict(
        env,
        JAX_COMPILATION_CACHE_DIR=_DIR[0],
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
