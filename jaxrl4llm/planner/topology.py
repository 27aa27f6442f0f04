"""The chips and topologies the planner simulates: per-device memory, peak FLOP/s, HBM and
interconnect bandwidth (sources beside each number). No jax import: tools/plan.py reads the
device count from here before jax starts."""

from __future__ import annotations

import dataclasses
import re

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-device numbers. link_bw: one device's interconnect bandwidth in one direction
    (half the bidirectional figure), which a ring collective over the mesh axis can use."""

    name: str
    hbm_bytes: float
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bw: float  # bytes/s
    link_bw: float  # bytes/s, one direction


CHIPS = {
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB HBM2e at 2765 GB/s, ICI 1200 GB/s
    # bidirectional per chip; two TensorCores per chip, one JAX device (v5p-N has N/2 chips).
    "v5p": Chip("TPU v5p", 95 * GB, 459e12, 2765 * GB, 600 * GB),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 400 GB/s
    # bidirectional per chip; one TensorCore per chip (v5e-N has N chips).
    "v5e": Chip("TPU v5e", 16 * GB, 197e12, 819 * GB, 200 * GB),
    # nvidia.com H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense bf16, NVLink 4
    # 900 GB/s bidirectional per GPU (one node of 8; across nodes InfiniBand is ~10x slower).
    "h100": Chip("NVIDIA H100 SXM", 80 * GB, 989e12, 3350 * GB, 450 * GB),
    # nvidia.com H200 datasheet: 141 GB HBM3e at 4.8 TB/s, same compute and NVLink as H100.
    "h200": Chip("NVIDIA H200 SXM", 141 * GB, 989e12, 4800 * GB, 450 * GB),
}
HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    chip: Chip
    num_devices: int
    num_hosts: int = 1  # processes of a run: flags that run on one host only need 1

    @property
    def backend(self) -> str:
        """The jax backend a run on it compiles for: cpu (the cpu-N test devices), tpu, gpu."""
        if self.name.lower().startswith("cpu"):
            return "cpu"
        return "gpu" if "xh" in self.name.lower() else "tpu"


def topology(name: str) -> Topology:
    """v5p-N (N TensorCores = N/2 chips), v5e-N (N chips), Kxh100 / Kxh200 (K <= 8 GPUs of
    one NVLink node), cpu-N (N fake devices with v5p chips' numbers: tests, one host)."""
    m = re.fullmatch(r"(v5p|v5e|cpu)-(\d+)|(\d+)x(h100|h200)", name.lower())
    if not m:
        raise ValueError(
            f"--topology={name!r}: use v5p-N, v5e-N, Kxh100 or Kxh200 "
            "(e.g. v5p-64, v5e-256, 8xh100)."
        )
    if m.group(3):
        count, chip = int(m.group(3)), CHIPS[m.group(4)]
        if count > 8:
            raise ValueError(f"--topology={name}: one NVLink node holds at most 8 GPUs.")
    elif m.group(1) == "v5p":
        count, chip = int(m.group(2)) // 2, CHIPS["v5p"]
    else:
        count, chip = int(m.group(2)), CHIPS["v5p" if m.group(1) == "cpu" else "v5e"]
    if count < 1:
        raise ValueError(f"--topology={name} has no devices.")
    # cloud.google.com/tpu/docs/v5p and /v5e: a v5p host holds 4 chips; a v5e host 8 chips
    # up to v5e-8, 4 in larger slices. A GPU node and the CPU test devices are one host.
    hosts = 1
    if m.group(1) == "v5p" or (m.group(1) == "v5e" and count > 8):
        hosts = -(-count // 4)
    return Topology(name, chip, count, hosts)
