"""Host (CPU) memory: hand freed heap pages back to the OS between phases, read peak RSS.

On the CPU backend every device buffer is host heap memory. glibc keeps much of what the
sampler frees (KV cache, per-layer weight copies, logits chunks) inside its heap instead of
returning it, so the update would start its own peak on top of the rollout's leftovers;
`malloc_trim` gives those pages back. Elsewhere (macOS, musl, accelerators' host side) it is
a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> bool:
    """Returns freed heap pages to the OS; True when it could (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def peak_rss_gib() -> float:
    """This process's peak resident set size so far, GiB (ru_maxrss: KiB on Linux, B on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
