"""Host memory helpers: peak RSS reads in GiB and grows with a big allocation; trim is safe."""
import sys

import numpy as np

from jaxrl4llm.train import host_memory


def test_peak_rss_counts_a_large_allocation_and_trim_keeps_data():
    block = np.ones(64 * 2**20, np.float32)  # 256 MiB, touched, so resident
    assert block.nbytes / 2**30 <= host_memory.peak_rss_gib() < 64  # GiB, not KiB or bytes
    trimmed = host_memory.release_free_memory()
    assert trimmed == sys.platform.startswith("linux")  # glibc here; a no-op elsewhere
    assert float(block.sum()) == block.size  # live memory untouched
