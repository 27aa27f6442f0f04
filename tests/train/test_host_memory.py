"""Host memory helpers, each checked in a fresh process against the kernel's own accounts:
peak RSS equals /proc's high-water mark and grows by an allocation's size; trimming hands
freed heap pages back (resident memory falls) and keeps live data."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and relies on glibc's malloc_trim"
)

PROBE = r"""
import json
import numpy as np
from jaxrl4llm.train.infra import host_memory

def proc_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

out = {"peak0": host_memory.peak_rss_gib(), "hwm0": proc_kib("VmHWM") / 2**20}
block = np.ones(128 * 2**20, np.float32)          # 512 MiB, written, so resident
out.update(peak1=host_memory.peak_rss_gib(), hwm1=proc_kib("VmHWM") / 2**20)
del block
# ~200 MiB of heap objects; the last one stays and pins the heap's top, so free() alone
# cannot give the rest back: only malloc_trim can.
blocks = [bytearray(4000) for _ in range(50_000)]
kept = blocks.pop()
kept[:4] = b"live"
del blocks
out["rss_before"] = proc_kib("VmRSS") / 2**10
out["trimmed"] = host_memory.release_free_memory()
out["rss_after"] = proc_kib("VmRSS") / 2**10
out["kept_intact"] = bytes(kept[:4]) == b"live" and len(kept) == 4000
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe():
    # Through a small intermediate process: a child's peak RSS starts at what its parent held
    # when it forked (the kernel carries it across exec), so the probe must fork from a
    # process that holds little, not from this test process.
    relay = (
        "import subprocess, sys; "
        "sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]]).returncode)"
    )
    run = subprocess.run(
        [sys.executable, "-c", relay, PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_peak_rss_is_the_kernels_high_water_mark_in_gib(probe):
    # /proc/self/status VmHWM (KiB) counts what ru_maxrss counts; a unit slip (KiB read as
    # MiB, bytes as KiB) is off by 1024x.
    assert abs(probe["peak1"] - probe["hwm1"]) < 0.02, probe


def test_peak_rss_grows_by_a_large_allocation(probe):
    assert probe["peak1"] - probe["hwm0"] > 0.45  # the 0.5 GiB block


def test_trim_returns_freed_heap_pages_and_keeps_live_data(probe):
    assert probe["trimmed"]
    freed_mib = probe["rss_before"] - probe["rss_after"]
    assert freed_mib > 100, probe  # ~190 MiB of freed objects; without the trim: ~0
    assert probe["kept_intact"]
