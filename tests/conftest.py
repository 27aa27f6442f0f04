"""Test harness: CPU only, 8 fake devices, deterministic seeds.

XLA_FLAGS must be set before jax is imported anywhere, which is why this happens at
import time of the conftest (pytest imports it before any test module).
"""
import os
import random

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic_seeds():
    random.seed(0)
    np.random.seed(0)
    yield
