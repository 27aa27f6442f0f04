"""Benchmark: sandboxed executions per second, the overhead over bare python, a batch's share.

    python tools/bench_sandbox.py                         # best layer here, 40 runs per figure
    python tools/bench_sandbox.py --isolation=unshare --runs=20 --workers=2 --step_s=30

Figures, each the median of --runs executions (a fresh sandbox per execution, as the code
verifier runs them):
- bare: the same program run by the same interpreter as a plain subprocess, no isolation;
- trivial (`print(1)`) and typical (a stdin/stdout solution: parse 2,000 numbers, sort, prefix
  sums) under the sandbox; the overhead is sandboxed minus bare;
- executions/s with --workers sandboxes at once (threads, each waiting on its subprocess, as
  the reward pool's workers do);
- the time to score a batch of --batch completions of --cases tests each with --workers
  workers, and its share of a step of --step_s seconds (the step's other work overlaps
  nothing here: scoring runs between the rollout and the update).
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrl4llm.config import cli  # noqa: E402
from jaxrl4llm.rewards import sandbox  # noqa: E402

TRIVIAL = "print(1)"
TYPICAL = (
    "import sys\n"
    "def main():\n"
    "    data = sys.stdin.read().split()\n"
    "    n = int(data[0])\n"
    "    values = sorted(int(x) for x in data[1:n + 1])\n"
    "    total, prefix = 0, []\n"
    "    for v in values:\n"
    "        total += v\n"
    "        prefix.append(total)\n"
    "    print(n, prefix[-1], max(prefix) - min(prefix))\n"
    "main()\n"
)
TYPICAL_INPUT = "2000\n" + " ".join(str((i * 7919) % 10007 - 5000) for i in range(2000)) + "\n"


def bare_seconds(source: str, stdin: str, runs: int) -> list[float]:
    """Wall seconds of `runs` plain subprocess executions of `source` (no isolation)."""
    times = []
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as folder:
        program = os.path.join(folder, "main.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run(
                [sandbox.interpreter(), *sandbox.INTERPRETER_ARGS, program],
                input=stdin.encode(),
                capture_output=True,
                check=True,
                cwd=folder,
            )
            times.append(time.perf_counter() - start)
    return times


def sandboxed_seconds(
    source: str, stdin: str, config: sandbox.SandboxConfig, layer: str, runs: int, expected: str
) -> list[float]:
    """Wall seconds of `runs` sandboxed executions, host-side set-up and clean-up included."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        execution = sandbox.run_program(source, stdin, config, layer)
        times.append(time.perf_counter() - start)
        if execution.status != "ok" or not execution.stdout.startswith(expected):
            raise RuntimeError(f"sandboxed run failed: {execution}")
    return times


def parallel_rate(
    source: str, stdin: str, config: sandbox.SandboxConfig, layer: str, runs: int, workers: int
) -> float:
    """Executions per second with `workers` sandboxes running at once."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        start = time.perf_counter()
        list(pool.map(lambda _: sandbox.run_program(source, stdin, config, layer), range(runs)))
        return runs / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--isolation",
        default="auto",
        choices=sandbox.ISOLATION[:-1],
        help="the isolation layer (auto: the best one here)",
    )
    parser.add_argument("--runs", type=int, default=40, help="executions per figure")
    parser.add_argument(
        "--workers", type=int, default=2, help="sandboxes at once (the reward pool's --num_workers)"
    )
    parser.add_argument("--batch", type=int, default=512, help="completions per step")
    parser.add_argument("--cases", type=int, default=3, help="tests per completion")
    parser.add_argument(
        "--step_s", type=float, default=30.0, help="a step's seconds without scoring, for the share"
    )
    args = parser.parse_args(argv)
    config = sandbox.SandboxConfig(isolation=args.isolation)
    layer = sandbox.resolve_isolation(config)
    python = sandbox.interpreter()
    print(
        f"layer {layer}, interpreter {python}, {os.cpu_count()} cpus, "
        f"load {os.getloadavg()[0]:.1f}, {args.runs} runs per figure"
    )
    expected_typical = "2000 "
    bare = {
        name: statistics.median(bare_seconds(src, stdin, args.runs))
        for name, src, stdin in (("trivial", TRIVIAL, ""), ("typical", TYPICAL, TYPICAL_INPUT))
    }
    boxed = {
        "trivial": statistics.median(sandboxed_seconds(TRIVIAL, "", config, layer, args.runs, "1")),
        "typical": statistics.median(
            sandboxed_seconds(TYPICAL, TYPICAL_INPUT, config, layer, args.runs, expected_typical)
        ),
    }
    print(
        f"{'program':<8} {'bare ms':>8} {'sandboxed ms':>13} {'overhead ms':>12} "
        f"{'exec/s (1)':>11} {f'exec/s ({args.workers})':>12}"
    )
    rates = {}
    for name, src, stdin in (("trivial", TRIVIAL, ""), ("typical", TYPICAL, TYPICAL_INPUT)):
        rates[name] = parallel_rate(src, stdin, config, layer, args.runs, args.workers)
        print(
            f"{name:<8} {bare[name] * 1e3:8.1f} {boxed[name] * 1e3:13.1f} "
            f"{(boxed[name] - bare[name]) * 1e3:12.1f} {1 / boxed[name]:11.1f} "
            f"{rates[name]:12.1f}"
        )
    executions = args.batch * args.cases
    scoring_s = executions / rates["typical"]
    print(
        f"scoring {args.batch} completions x {args.cases} tests = {executions} executions "
        f"with {args.workers} workers: {scoring_s:.1f} s, "
        f"{scoring_s / (scoring_s + args.step_s):.0%} of a {args.step_s:g} s step + scoring"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
