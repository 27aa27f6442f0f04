"""Ahead-of-time plan of one training step on a simulated topology: does every program fit?

    python tools/plan.py --flagfile=experiments/configs/minimalist_qwen25_math_7b_grpo.flags \
        --topology=v5p-64
    python tools/plan.py --flagfile=... --topology=8xh100 --mesh=data:1,fsdp:8,tensor:1

Builds the flagfile's model architecture from its name (models/architectures.py
ARCHITECTURES, or a local folder's config.json; no weights are read or allocated), fakes the
topology's devices on the CPU (--xla_force_host_platform_device_count), and compiles every
program of one step with abstract (jax.ShapeDtypeStruct) inputs carrying the run's shardings:

  create    TrainState.create with the optimizer state laid out like the params
  rollout   the sampler over all rows (prefill + decode, in --rollout_micro_batch row chunks)
  logprobs  the reference / old-policy teacher-forced pass (same program for both)
  update    one optimizer update on a mini-batch (micro-batch accumulation)
  critic values, critic update
            PPO's value model (--algorithm=ppo): its pass over the rollout, its update on
            each mini-batch; its state stays resident beside every other program

With --lora_rank=R (and --lora_targets) the state is the adapters and their Adam moments, the
frozen base stays beside it as an argument of every program, and the reference is the base
itself (no copy): the title line gives the adapters' parameter count.

Per program and device it prints the compiled memory (arguments, temporaries, outputs, the
state that stays resident beside it), whether that fits the chip with 10% headroom, the hand
estimate (jaxrl4llm/planner/estimate.py, formulas written out there), the collective bytes per call
read from the HLO (jaxrl4llm/planner/hlo.py, loops counted) and a roofline time: matmul
FLOPs / peak, collective link bytes / interconnect bandwidth, HBM bytes / HBM bandwidth.
Exit status 1 when some program does not fit: the last line names them ("DOES NOT FIT
8xh100 (budget 72.0 GB per device): rollout 77.1 GB").

For the rollout it also prints the weights' gathers read from the HLO right after SPMD
partitioning: once per step before the decode loops (what the sampler does), against once per
prefill and decode step (where the partitioner puts them when the weights enter the loop in
their storage layout), with the rollout time of each; and any collective a decode step
repeats on unchanged values (none). For a mixture of experts it prints the experts' layout
(read from the params' shardings) and the expert exchange's all-gather and reduce-scatter
bytes (models/moe.py EXCHANGE_SCOPE, read from each program's HLO) per call and per step.
With a completion length profile
(--completion_mean, --completion_p99) it prints the rollout's expected slot utilisation with
a fixed batch and with continuous batching (planner/slots.py: the model is written there),
and the page pool section (planner/pool.py): in the flagfile's KV per device and in the KV
the chip leaves the compiled rollout, the rows a fixed batch and fixed slots hold at full
length, the rows the page pool admits in steady state, the pool's pages and GB, and each
one's decode steps and roofline rollout time. Without a profile it prints that section for
the worst case, every completion at --max_new_tokens.

The simulated devices are CPUs: the compiler is XLA's CPU backend, whose fusion and buffer
decisions differ from the TPU / GPU compilers (and which cannot compile the splash / cuDNN
attention kernels: attention is the chunked online softmax here, a close upper bound).
--target_kernels (TPU topologies) also exports every program for the TPU with jax.export,
the Pallas kernels the run calls there lowered to Mosaic (jaxrl4llm/planner/target.py), and
prints each program's kernels; exit status 1 when one does not lower ("DOES NOT LOWER for
tpu: update").
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl4llm.planner.topology import topology  # noqa: E402  (no jax import)


def _argv_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


if __name__ == "__main__":  # fake the devices before jax starts
    _topo = _argv_value(sys.argv, "topology")
    try:
        _devices = topology(_topo).num_devices if _topo else 0
    except ValueError:
        _devices = 0  # main() reports the bad --topology
    if _devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_devices}"
        ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from absl import flags  # noqa: E402

from experiments import train  # noqa: E402  (defines the training flags)
from jaxrl4llm.config import cli  # noqa: E402
from jaxrl4llm.config.options import require  # noqa: E402
from jaxrl4llm.planner import programs, slots, target  # noqa: E402
from jaxrl4llm.planner.report import (  # noqa: E402
    not_fitting_line,
    over_budget,
    print_plan,
    print_pool,
    print_slot_use,
)
from jaxrl4llm.train.config.checks import validate  # noqa: E402

flags.DEFINE_string("topology", None, "v5p-N, v5e-N, Kxh100 or Kxh200 (e.g. v5p-64).")
flags.DEFINE_string(
    "architecture",
    None,
    "Override the model architecture (a key of "
    "models/architectures.py ARCHITECTURES); default: from --model's name.",
)
flags.DEFINE_bool("markdown", False, "Print the table as Markdown (docs/scaling.md).")
flags.DEFINE_bool(
    "target_kernels",
    False,
    "Also export every program for the topology's platform (TPU; jax.export): the Pallas "
    "splash and paged attention kernels the run calls there, which the CPU compile replaces, "
    "lowered to Mosaic on the run's shapes and mesh; prints each program's kernels (exit 1, "
    "last line DOES NOT LOWER, when one fails).",
)
flags.DEFINE_float(
    "completion_mean",
    None,
    "Mean completion length in tokens: with --completion_p99, prints the rollout's slot "
    "utilisation and the page pool's rows, memory and rollout time against fixed slots and a "
    "fixed batch. Unset: no slot section, and the page pool section assumes the worst "
    "case, every completion at --max_new_tokens (mean = p99 = max_new_tokens).",
)
flags.DEFINE_float(
    "completion_p99",
    None,
    "99th percentile of the completion length in tokens (see --completion_mean).",
)


def main(argv):
    del argv  # cli.run refuses positional arguments
    FLAGS = flags.FLAGS
    require(FLAGS.topology, "--topology is required (e.g. --topology=v5p-64).")
    with cli.flag_errors():
        topo = topology(FLAGS.topology)
        if FLAGS.target_kernels:
            target.check_topology(topo)
    require(
        jax.device_count() >= topo.num_devices,
        f"--topology={FLAGS.topology}: {topo.num_devices} devices needed, "
        f"{jax.device_count()} available: XLA_FLAGS already fixes another device count.",
    )
    profile = (FLAGS.completion_mean, FLAGS.completion_p99)
    require(
        (FLAGS.completion_mean is None) == (FLAGS.completion_p99 is None),
        "--completion_mean and --completion_p99 go together: pass both or neither.",
    )
    if None not in profile:
        with cli.flag_errors():
            slots.fit_lognormal(*profile)
    config = train.config_from_flags().with_init_adapter()  # LoRA settings of --init_adapter
    one_host = config.one_host_only
    require(
        topo.num_hosts == 1 or not one_host,
        f"--topology={FLAGS.topology} spans {topo.num_hosts} hosts, but "
        f"{', '.join(one_host)} pick rows on the host and run on one host only: plan for "
        "one host (e.g. --topology=8xh200) or drop them.",
    )
    # The run's own checks of its config, at the topology's devices and hosts.
    validate(config, topo.num_devices, num_hosts=topo.num_hosts)
    model_config = programs.architecture(FLAGS.architecture or config.model.name)
    # As the run does at start: prompt + completion must fit the model's context.
    config.validate_context(
        model_config.max_position_embeddings, FLAGS.architecture or config.model.name
    )
    devices = jax.devices()[: topo.num_devices]
    result = programs.plan(config, model_config, topo, devices)
    print_plan(result, markdown=FLAGS.markdown)
    mean, p99 = FLAGS.completion_mean, FLAGS.completion_p99
    if mean is not None and p99 is not None:
        print_slot_use(result, mean, p99)
    else:  # the page pool's section for the worst case: every row at its cap
        mean = p99 = config.rollout.max_new_tokens
    print_pool(result, mean, p99, markdown=FLAGS.markdown)
    ends = [not_fitting_line(result)] if over_budget(result) else []
    if FLAGS.target_kernels:
        lowered = target.target_kernels(config, model_config, topo, devices)
        target.print_target(lowered, topo)
        ends += [line for line in [target.not_lowering_line(lowered, topo)] if line]
    for line in ends:  # the last lines name what does not fit or lower; exit status 1
        print(line)
    return 1 if ends else 0


if __name__ == "__main__":
    cli.run(main)
