"""The platform programs are traced for: the process's own (jax.default_backend()), or,
inside `lowering_for(name)`, one whose programs this process exports but cannot run (the
planner lowers the TPU and GPU kernels on a CPU host: planner/target.py).

Trace-time choices that depend on the platform (the attention kernel, the paged decode
attention, the KV cache dtype, the compacted sampler's smallest level) read `backend()`,
never jax.default_backend() itself, so an exported program is the one that platform runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("target", default=None)

# jax.export's platform names of jax's backends.
EXPORT_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def backend() -> str:
    """cpu, gpu or tpu: the platform traces are for."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def lowering_for(name: str) -> Iterator[None]:
    """Traces inside it choose as on backend `name` (cpu, gpu, tpu). JAX caches traces by
    function and arguments, not by this choice, so its caches are cleared on the way in and
    out: no trace made for one platform is reused for the other."""
    if name not in EXPORT_PLATFORMS:
        raise ValueError(f"backend {name!r}: choose one of {sorted(EXPORT_PLATFORMS)}.")
    jax.clear_caches()
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)
        jax.clear_caches()
