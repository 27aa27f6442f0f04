"""Ahead-of-time plan of one training step on a simulated topology: does every program fit?

    python tools/plan.py --flagfile=experiments/configs/minimalist_qwen25_math_7b_grpo.flags \
        --topology=v5p-64
    python tools/plan.py --flagfile=... --topology=8xh100 --mesh=data:1,fsdp:8,tensor:1

Builds the flagfile's model architecture from its name (models/config.py ARCHITECTURES, or a
local folder's config.json; no weights are read or allocated), fakes the topology's devices
on the CPU (--xla_force_host_platform_device_count), and compiles every program of one step
with abstract (jax.ShapeDtypeStruct) inputs carrying the run's shardings:

  create    TrainState.create with the optimizer state laid out like the params
  rollout   the sampler over all rows (prefill + decode, in --rollout_micro_batch row chunks)
  logprobs  the reference / old-policy teacher-forced pass (same program for both)
  update    one optimizer update on a mini-batch (micro-batch accumulation)

Per program and device it prints the compiled memory (arguments, temporaries, outputs, the
state that stays resident beside it), whether that fits the chip with 10% headroom, the hand
estimate (tools/plan_estimate.py, formulas written out there), the collective bytes per call
read from the HLO (jaxrl4llm/hlo_analysis.py, loops counted) and a roofline time: matmul
FLOPs / peak, collective link bytes / interconnect bandwidth, HBM bytes / HBM bandwidth.

For the rollout it also prints the weights' gathers read from the HLO right after SPMD
partitioning: once per step before the decode loops (what the sampler does), against once per
prefill and decode step (where the partitioner puts them when the weights enter the loop in
their storage layout), with the rollout time of each; and any collective a decode step
repeats on unchanged values (none). With a completion length profile
(--completion_mean, --completion_p99) it prints the rollout's expected slot utilisation with
a fixed batch and with continuous batching (tools/plan_slots.py: the model is written there).

The simulated devices are CPUs: the compiler is XLA's CPU backend, whose fusion and buffer
decisions differ from the TPU / GPU compilers (and which cannot compile the splash / cuDNN
attention kernels: attention is the chunked online softmax here, a close upper bound).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-device numbers. link_bw: one device's interconnect bandwidth in one direction
    (half the bidirectional figure), which a ring collective over the mesh axis can use."""

    name: str
    hbm_bytes: float
    peak_flops: float      # dense bf16 FLOP/s
    hbm_bw: float          # bytes/s
    link_bw: float         # bytes/s, one direction


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


def topology(name: str) -> Topology:
    """v5p-N (N TensorCores = N/2 chips), v5e-N (N chips), Kxh100 / Kxh200 (K <= 8 GPUs of
    one NVLink node), cpu-N (N fake devices with v5p chips' numbers: tests)."""
    m = re.fullmatch(r"(v5p|v5e|cpu)-(\d+)|(\d+)x(h100|h200)", name.lower())
    if not m:
        raise ValueError(f"--topology={name!r}: use v5p-N, v5e-N, Kxh100 or Kxh200 "
                         "(e.g. v5p-64, v5e-256, 8xh100).")
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
    return Topology(name, chip, count)


def _argv_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


if __name__ == "__main__":   # fake the devices before jax starts
    _topo = _argv_value(sys.argv, "topology")
    try:
        _devices = topology(_topo).num_devices if _topo else 0
    except ValueError:
        _devices = 0   # main() reports the bad --topology
    if _devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={_devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from absl import flags  # noqa: E402

from experiments import train  # noqa: E402  (defines the training flags)
from jaxrl4llm.config import cli  # noqa: E402
from jaxrl4llm.config.options import require  # noqa: E402

import plan_programs  # noqa: E402
import plan_slots  # noqa: E402

flags.DEFINE_string("topology", None, "v5p-N, v5e-N, Kxh100 or Kxh200 (e.g. v5p-64).")
flags.DEFINE_string("architecture", None, "Override the model architecture (a key of "
                    "models/config.py ARCHITECTURES); default: from --model's name.")
flags.DEFINE_bool("markdown", False, "Print the table as Markdown (docs/scaling.md).")
flags.DEFINE_float("completion_mean", None, "Mean completion length in tokens: with "
                   "--completion_p99, prints the rollout's slot utilisation.")
flags.DEFINE_float("completion_p99", None, "99th percentile of the completion length in "
                   "tokens (see --completion_mean).")


_SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
          "collective-permute": "CP"}


def _fmt_gb(x: float) -> str:
    return f"{x / GB:.1f}"


def print_plan(result: plan_programs.Plan, markdown: bool = False) -> None:
    topo, rows = result.topology, result.rows
    budget = topo.chip.hbm_bytes * (1 - HEADROOM)
    head = ["program", "calls", "args GB", "temp GB", "out GB", "resident GB", "total GB",
            "estimate GB", "fits", "collectives GB/call", "s/call (compute/comm/hbm)"]
    lines = []
    for r in rows:
        coll = " ".join(f"{_SHORT[k]} {v / GB:.1f}" for k, v in sorted(r.collectives.items())
                        if k != "link" and v >= 0.05 * GB) or "-"
        times = f"{r.seconds:.2f} ({r.t_compute:.2f}/{r.t_comm:.2f}/{r.t_hbm:.2f})"
        lines.append([r.program, str(r.calls), _fmt_gb(r.args), _fmt_gb(r.temp),
                      _fmt_gb(r.output), _fmt_gb(r.resident), _fmt_gb(r.total),
                      _fmt_gb(r.estimate), "yes" if r.total <= budget else "NO", coll, times])
    print(f"\n{result.title}\n{topo.num_devices} x {topo.chip.name} ({_fmt_gb(topo.chip.hbm_bytes)}"
          f" GB, budget {_fmt_gb(budget)} GB with {HEADROOM:.0%} headroom), mesh {result.mesh}\n")
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    step = sum(r.seconds * r.calls for r in rows)
    print(f"\nroofline step time: {step:.1f} s; update collectives "
          f"{result.update_vs_textbook:.2f}x textbook FSDP; "
          + ("every program fits" if all(r.total <= budget for r in rows)
             else "SOME PROGRAM DOES NOT FIT"))
    print_weight_gathers(result)


def print_weight_gathers(result: plan_programs.Plan) -> None:
    r = result.rollout
    once, comm_once = result.rollout_seconds(per_token=False)
    per_token, comm_per_token = result.rollout_seconds(per_token=True)
    print(f"rollout weight gathers (HLO after SPMD partitioning): {_fmt_gb(r.weight_gathers)} GB"
          f" per device per step, once before the decode loops: rollout {once:.2f} s "
          f"(comm {comm_once:.2f} s); once per token ({r.weight_uses} prefill + decode steps "
          f"of {r.rows // r.slots} chunk(s), {_fmt_gb(r.weight_gathers * r.weight_uses)} GB): "
          f"rollout {per_token:.2f} s (comm {comm_per_token:.2f} s)")
    print("decode loop: no collective on unchanged values" if not r.in_loop else
          f"LOOPS REPEAT {_fmt_gb(r.in_loop)} GB of collectives on unchanged values per "
          "iteration (counted in every prefill and decode step above: an upper bound)")


def print_slot_use(result: plan_programs.Plan, mean: float, p99: float) -> None:
    r = result.rollout
    use = plan_slots.slot_use(mean, p99, r.max_new_tokens, r.rows, r.slots)
    print(f"completion lengths lognormal (mean {mean:g}, p99 {p99:g} tokens, cut at "
          f"{r.max_new_tokens}: mean {use.mean_tokens:.0f}); {r.rows} rows in {r.slots} slots: "
          f"slot utilisation {use.fixed_utilisation:.2f} with a fixed batch "
          f"({use.fixed_steps:.0f} decode steps), {use.continuous_utilisation:.2f} with "
          f"continuous batching ({use.continuous_steps:.0f} decode steps; "
          f"{r.rows // r.slots * r.max_new_tokens} at the length limit)")


def main(argv):
    del argv   # cli.run refuses positional arguments
    FLAGS = flags.FLAGS
    require(FLAGS.topology, "--topology is required (e.g. --topology=v5p-64).")
    with cli.flag_errors():
        topo = topology(FLAGS.topology)
    require(jax.device_count() >= topo.num_devices,
            f"--topology={FLAGS.topology}: {topo.num_devices} devices needed, "
            f"{jax.device_count()} available: XLA_FLAGS already fixes another device count.")
    profile = (FLAGS.completion_mean, FLAGS.completion_p99)
    require((FLAGS.completion_mean is None) == (FLAGS.completion_p99 is None),
            "--completion_mean and --completion_p99 go together: pass both or neither.")
    if None not in profile:
        with cli.flag_errors():
            plan_slots.fit_lognormal(*profile)
    config = train.config_from_flags()
    model_config = plan_programs.architecture(FLAGS.architecture or config.model.name)
    result = plan_programs.plan(config, model_config, topo, jax.devices()[:topo.num_devices])
    print_plan(result, markdown=FLAGS.markdown)
    if None not in profile:
        print_slot_use(result, *profile)


if __name__ == "__main__":
    cli.run(main)
