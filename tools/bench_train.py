"""Benchmark one GRPO training step on SmolLM2-135M-Instruct (CPU or accelerator), against TRL.

    python tools/bench_train.py                       # float32 and bfloat16, 8 x 4 x 128 tokens
    python tools/bench_train.py --dtypes float32 --prompts=4 --new_tokens=32   # quicker
    python tools/bench_train.py --dtypes float32 float32:bfloat16   # f32 vs bf16 compute

One step = rollout (sampler, forced length: stop tokens ignored) -> rewards -> reference
logprobs (only with --kl_coef > 0: GRPO's KL term; off by default, as TRL's beta = 0) -> one
jitted update with per-layer remat (--no_remat to keep all activations: about 17 GiB peak RSS
instead of a few). Each dtype runs in its own process so its peak RSS is its own; a warm-up
step compiles everything first, then `--repeats` timed steps.
When `trl` is installed (the `bench` extra; --no_trl skips it), TRL's GRPOTrainer runs the same
work in its own process after ours, per dtype (`--rounds N`: ours, TRL, ours, TRL, ... each
side's fastest step kept; tools/bench_trl.py: same weights, prompts,
reward, group, forced token count, one optimizer step over the same rows, torch given XLA's
thread count); the last table is ours / TRL per dtype (target <= 0.75). On a loaded machine
pass --omp_wait_policy=PASSIVE: torch's spinning OpenMP workers otherwise slow it several-fold.
The ratio depends on the host's vector instructions (torch's MKL and oneDNN kernels gain more
from AVX-512 than XLA's): the first line names the CPU and its extensions, and
`--cpu_isa=AVX2` caps both sides at AVX2 to reproduce an AVX2-only host's comparison.
Prints seconds per stage, tokens/s and peak RSS, and the compute floor: the step's matmul
FLOPs (`step_tflop`) at the best matmul rate measured in the same process (`matmul_gflops`:
1024^3 matmuls in the compute dtype, probed before and after the steps),
i.e. the fastest this step could run on this machine (`floor_s`; `floor_share` = floor_s /
step_s). The reference and update passes run each prompt once per group (--no_share_prompts
runs it once per row, as before). `--micro_batch_tokens=N` also runs our step with the update
on packed micro-batches of N tokens (train/update/packing.py: a group's prompt once per row, rows
chosen by modelled FLOPs) in each round, between our padded step and TRL's, and reports both
ratios to TRL and the packed update's modelled FLOPs / the padded update's
(`update_flops_packed`; the trainer itself packs only below 1). `--lora_rank=R` also runs our
step with rank-R LoRA adapters on the frozen base (`--lora_targets`, all seven projections by
default) in each round, in its own process, and prints full fine-tuning against LoRA: step
time, update time and peak RSS, and the LoRA / full ratios.
This script parses the flags and runs the rounds; our step is tools/bench_train_ours.py, the
tables tools/bench_train_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrl4llm.config import cli
from tools import bench_train_ours, bench_train_report

LORA = "lora/"  # a side's prefix: our step with --lora_rank adapters (run_child)

# --cpu_isa: the widest vector instructions each library may use, by the library's own
# switch. torch's elementwise kernels (ATen), its oneDNN and MKL kernels, and XLA's generated
# code each read their own; a cap reproduces a smaller host's comparison on a bigger one.
ISA_CAPS = {
    "AVX2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "xla": "AVX2",
    },
    "AVX512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "xla": "AVX512",
    },
}


def isa_env(isa: str | None, environ: dict[str, str]) -> dict[str, str]:
    """`environ` with every library's vector ISA capped at `isa` (None: unchanged)."""
    if isa is None:
        return dict(environ)
    caps = dict(ISA_CAPS[isa])
    xla_isa = caps.pop("xla")
    xla_flags = " ".join(
        [f for f in environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_cpu_max_isa")]
        + [f"--xla_cpu_max_isa={xla_isa}"]
    )
    return {**environ, **caps, "XLA_FLAGS": xla_flags}


def cpu_description(cpuinfo: str | None = None) -> str:
    """The host's CPU model and the vector extensions that decide torch's and XLA's kernels
    (the ratio to TRL differs between AVX2-only and AVX-512 hosts of one machine kind)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return "cpu unknown"
    fields = dict(
        (k.strip(), v.strip())
        for k, _, v in (line.partition(":") for line in cpuinfo.splitlines())
        if k.strip() in ("model name", "flags")
    )
    flags = set(fields.get("flags", "").split())
    shown = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    have = [f for f in shown if f in flags] or ["no avx2"]
    return f"{fields.get('model name', 'cpu unknown')} ({', '.join(have)})"


def lora_targets(value: str) -> list[str]:
    """--lora_targets: "all" or comma-separated projections -> their names."""
    from jaxrl4llm.models.lora import TARGETS

    names = list(TARGETS) if value == "all" else [t for t in value.split(",") if t]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: give all or some of {','.join(TARGETS)}")
    return names


def dtype_list(values: list[str]) -> list[str]:
    """`--dtypes float32 bfloat16` and `--dtypes=float32,bfloat16` -> ["float32", "bfloat16"]."""
    return [d for v in values for d in v.split(",") if d]


def child_flags(args: argparse.Namespace) -> list[str]:
    """Every option but --dtypes / --child, spelled out for a child process."""
    flags = [
        f"--{k}={v}"
        for k, v in vars(args).items()
        if k
        not in (
            "dtypes",
            "child",
            "remat",
            "share_prompts",
            "trl",
            "rounds",
            "debug",
            "lora_child",
            "lora_targets",
        )
        and v is not None
    ]
    return (
        flags
        + ([] if args.remat else ["--no_remat"])
        + ([] if args.share_prompts else ["--no_share_prompts"])
        + ["--debug"] * args.debug
        + [f"--lora_targets={','.join(args.lora_targets)}"]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        help="space- or comma-separated PARAM[:COMPUTE] dtypes, e.g. float32 "
        "float32:bfloat16 (float32 master weights, bfloat16 compute)",
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run ours and TRL in turns this many times per dtype (each a fresh "
        "process pair) and keep each side's fastest step: the machine's "
        "slow minutes then hit both sides alike",
    )
    parser.add_argument(
        "--kl_coef",
        type=float,
        default=0.0,
        help="GRPO's KL coefficient (0.04 in the paper): > 0 adds the reference "
        "pass; 0 (default) matches TRL's default beta = 0",
    )
    parser.add_argument(
        "--no_remat",
        dest="remat",
        action="store_false",
        help="keep every layer's activations (much more memory)",
    )
    parser.add_argument(
        "--no_share_prompts",
        dest="share_prompts",
        action="store_false",
        help="run every row's prompt (not once per group) in the reference and update passes",
    )
    parser.add_argument(
        "--no_trl",
        dest="trl",
        action="store_false",
        help="do not time TRL's GRPOTrainer even if trl is installed",
    )
    parser.add_argument(
        "--omp_wait_policy",
        choices=("PASSIVE", "ACTIVE"),
        default=None,
        help="OMP_WAIT_POLICY for the child processes (default: torch's own). "
        "On a loaded machine torch's spinning OpenMP workers slow it "
        "several-fold; PASSIVE keeps its thread count but lets them sleep",
    )
    parser.add_argument(
        "--cpu_isa",
        choices=tuple(ISA_CAPS),
        default=None,
        help="cap both sides' vector instructions (torch's ATen, oneDNN and MKL kernels, "
        "XLA's generated code) at this ISA, e.g. AVX2 on an AVX-512 host to reproduce an "
        "AVX2-only host's comparison (default: the host's own)",
    )
    parser.add_argument(
        "--micro_batch_tokens",
        type=int,
        default=0,
        help="also run our step with the update on packed micro-batches of this many "
        "tokens (0: only the padded update)",
    )
    parser.add_argument(
        "--lora_rank",
        type=int,
        default=0,
        help="also run our step with LoRA adapters of this rank on the frozen base, in "
        "its own process, and compare it with full fine-tuning (0: off)",
    )
    parser.add_argument(
        "--lora_targets",
        type=lora_targets,
        default="all",
        help="projections the LoRA run adapts: all, or some of q,k,v,o,gate,up,down",
    )
    parser.add_argument("--lora_child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hf_dir", default=None, help=argparse.SUPPRESS)
    return parser


def run_child(args: argparse.Namespace, child: str) -> dict | None:
    """Runs this script as `--child=CHILD` (its own process: its own peak RSS); a CHILD of
    LORA + dtype runs our step with --lora_rank adapters (`--child=dtype --lora_child`)."""
    lora = child.startswith(LORA)
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={child.removeprefix(LORA)}"]
    cmd += child_flags(args) + ["--lora_child"] * lora
    env = isa_env(args.cpu_isa, dict(os.environ))
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        print(
            f"--child={child} failed (exit {out.returncode}):\n{out.stderr[-4000:]}",
            file=sys.stderr,
        )
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def fastest(results: list[dict | None]) -> dict | None:
    """The result with the shortest step of one side's rounds (None if any round failed),
    with `rounds` = how many were run and `step_s_rounds` = every round's step."""
    done = [r for r in results if r is not None]
    if not results or len(done) < len(results):
        return None
    best = min(done, key=lambda r: r["step_s"])
    return {**best, "rounds": len(done), "step_s_rounds": [r["step_s"] for r in done]}


def load_average() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_rounds(args: argparse.Namespace, dtype: str, with_trl: bool) -> dict | None:
    """Each side's fastest of --rounds rounds in turns (ours, ours packed with
    --micro_batch_tokens, TRL), so the sides see about the same load; None if a run failed."""
    sides = {"ours": dtype}
    if args.lora_rank:
        sides["lora"] = LORA + dtype
    if args.micro_batch_tokens:
        sides["packed"] = bench_train_ours.PACKED + dtype
    if with_trl:
        sides["trl"] = f"trl/{dtype}"
    rounds: dict[str, list] = {side: [] for side in sides}
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"{dtype}: round {i + 1} of {args.rounds} ({load_average()})", flush=True)
        for side, child in sides.items():
            rounds[side].append(run_child(args, child))
            if rounds[side][-1] is None:
                return None
    return {side: fastest(results) for side, results in rounds.items()}


def child_result(args: argparse.Namespace) -> dict:
    """What the child process `--child=CHILD` measured (run_child reads it): the exported
    model's folder, TRL's step (`trl/DTYPE`) or ours."""
    from tools import bench_trl

    if args.child == "export":
        bench_trl.export_model(args.model, args.hf_dir)
        return {"hf_dir": args.hf_dir}
    if args.child.startswith("trl/"):
        return bench_trl.run_trl(args, args.child[len("trl/") :], args.hf_dir)
    return bench_train_ours.run_ours(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds={args.rounds} --repeats={args.repeats}: both must be >= 1.")
    if args.child:
        print("RESULT " + json.dumps(child_result(args)), flush=True)
        return 0
    from tools import bench_trl

    with_trl = args.trl and bench_trl.trl_available()
    if args.trl and not with_trl:
        print(bench_trl.TRL_MISSING)
    print(f"cpu: {cpu_description()}; vector ISA cap: {args.cpu_isa or 'none'}")
    print(f"before: {load_average()}", flush=True)
    ours, packed, theirs, lora = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_train_hf_") as hf_dir:
        args.hf_dir = hf_dir
        if with_trl and run_child(args, "export") is None:
            return 1
        for dtype in dtype_list(args.dtypes):
            best = run_rounds(args, dtype, with_trl)
            if best is None:
                return 1
            ours.append(best["ours"])
            if "packed" in best:
                packed.append(best["packed"])
            if "lora" in best:
                lora.append(best["lora"])
            if with_trl:
                theirs.append(best["trl"])
    print(f"after: {load_average()}")
    bench_train_report.print_report(args, ours, lora, packed, theirs)
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
