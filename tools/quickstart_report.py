"""The quickstart's figures (the ones README.md quotes) from finished training workdirs.

    python tools/quickstart_report.py /work/qs/seed0 /work/qs/seed1 /work/qs/seed2

Per workdir it reads metrics.jsonl (and eval.json, config.json's time stamp, the files'
sizes); with several workdirs (e.g. one per --seed) each figure is printed as the range
min-max over them, a single value when they agree. The figures:

- wall time: from config.json's modification time (written when the run starts, before the
  model loads) to the latest of metrics.jsonl, eval.json and curves.png (written at its
  end); it misses only the Python and JAX start-up before the config is written;
- steps, and the mean of time/step_s (a step's rollout, update and any eval);
- the training reward (reward/mean) at the first and the last step;
- greedy held-out accuracy (eval/accuracy) at step 0 (the untrained model) and at each
  eval step, then the first step at which it reaches its maximum;
- the mean completion length (response/length_mean) at the first and the last step;
- the peak resident memory (memory/peak_rss_gib) when logged;
- the disk the workdir uses (all its files: checkpoints, metrics, TensorBoard events);
- with an environment (--env; only when tool/calls is logged): tool calls and model turns per
  trajectory and the observation token share at the first and the last step, and the mean
  per step of the time in the compiled decode programs, in the tools' own steps (overlapping
  decode) and waiting for tools with no row decoding.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.study_stats import folder_bytes  # noqa: E402
from jaxrl4llm.config import cli
from jaxrl4llm.train.infra.metrics import read_metrics  # noqa: E402

_END_FILES = ("metrics.jsonl", "eval.json", "curves.png")


def _column(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record that logged `key`, in file order."""
    return [(r["step"], r[key]) for r in records if r.get(key) is not None]


# (figure, metric) logged every step: the first and the last value are reported.
FIRST_LAST = {
    "reward": "reward/mean",
    "length": "response/length_mean",
    "calls": "tool/calls",
    "turns": "turns/mean",
    "observation_share": "tool/observation_token_share",
}
# (figure, metric): the mean over steps is reported.
MEANS = {
    "step_s": "time/step_s",
    "decode_s": "time/decode_s",
    "tools_s": "time/tools_s",
    "tool_wait_s": "time/tool_wait_s",
}


def figures(workdir: str) -> dict[str, Any]:
    """One workdir's figures; a figure the run did not log is None."""
    records = read_metrics(workdir)
    out: dict[str, Any] = {}
    for name, key in FIRST_LAST.items():
        column = _column(records, key)
        out[f"{name}_first"] = column[0][1] if column else None
        out[f"{name}_last"] = column[-1][1] if column else None
    for name, key in MEANS.items():
        values = [v for _, v in _column(records, key)]
        out[name] = sum(values) / len(values) if values else None
    rss = [v for _, v in _column(records, "memory/peak_rss_gib")]
    accuracy = dict(_column(records, "eval/accuracy"))  # a step's last value wins
    eval_path = os.path.join(workdir, "eval.json")
    if os.path.exists(eval_path):  # the end-of-run eval (also the last step's record)
        with open(eval_path) as f:
            final = json.load(f).get("eval/accuracy")
        if final is not None and records:
            accuracy.setdefault(max(r["step"] for r in records), final)
    best = max(accuracy.values()) if accuracy else None
    ends = [
        os.path.getmtime(os.path.join(workdir, n))
        for n in _END_FILES
        if os.path.exists(os.path.join(workdir, n))
    ]
    start = os.path.join(workdir, "config.json")
    return {
        **out,
        "wall_min": (max(ends) - os.path.getmtime(start)) / 60
        if ends and os.path.exists(start)
        else None,
        "steps": max((r["step"] for r in records), default=0),
        "accuracy": dict(sorted(accuracy.items())),
        "best_accuracy": best,
        "first_step_at_best": min(s for s, v in accuracy.items() if v == best)
        if accuracy
        else None,
        "peak_rss_gib": max(rss) if rss else None,
        "disk_gb": folder_bytes(workdir) / 1e9,
    }


def span(values: Sequence[float | None], fmt: str, unit: str = "") -> str:
    """`fmt` of the value, or of min-max when the values differ, then `unit`; "not logged"
    when none is known, and "(n of N runs)" when only some runs logged it."""
    known = [v for v in values if v is not None]
    if not known:
        return "not logged"
    low, high = format(min(known), fmt), format(max(known), fmt)
    text = (low if low == high else f"{low}-{high}") + unit
    return text if len(known) == len(values) else f"{text} ({len(known)} of {len(values)} runs)"


def first_to_last(runs: Sequence[dict[str, Any]], name: str, fmt: str) -> str:
    """'A at the first step -> B at the last' of figure `name` (ranges over several runs)."""
    first = span([run[f"{name}_first"] for run in runs], fmt)
    last = span([run[f"{name}_last"] for run in runs], fmt)
    return f"{first} at the first step -> {last} at the last"


def report(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The figures of one or more workdirs as lines of text (ranges over several)."""

    def each(key: str) -> list[Any]:
        return [run[key] for run in runs]

    eval_steps = sorted({s for run in runs for s in run["accuracy"]})
    accuracy = (
        "; ".join(
            f"step {s}: {span([r['accuracy'].get(s) for r in runs], '.1%')}" for s in eval_steps
        )
        or "not logged"
    )
    return [
        f"runs: {len(runs)}",
        f"wall time: {span(each('wall_min'), '.1f', ' min')}",
        f"steps: {span(each('steps'), 'd')}",
        f"time per step: {span(each('step_s'), '.1f', ' s')} (mean of time/step_s)",
        f"train reward (reward/mean): {first_to_last(runs, 'reward', '.2f')}",
        f"greedy eval accuracy (eval/accuracy): {accuracy}",
        (
            f"max eval accuracy: {span(each('best_accuracy'), '.1%')}, first reached at step "
            f"{span(each('first_step_at_best'), 'd')}"
        ),
        f"completion length (tokens): {first_to_last(runs, 'length', '.0f')}",
        f"peak RSS: {span(each('peak_rss_gib'), '.2f', ' GiB')}",
        f"workdir disk: {span(each('disk_gb'), '.2f', ' GB')}",
    ] + (tool_lines(runs) if any(run["calls_first"] is not None for run in runs) else [])


def tool_lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The environment's figures (a run with --env)."""

    def mean(name: str) -> str:
        return span([run[name] for run in runs], ".1f", " s")

    return [
        f"tool calls per trajectory (tool/calls): {first_to_last(runs, 'calls', '.2f')}",
        f"model turns per trajectory (turns/mean): {first_to_last(runs, 'turns', '.2f')}",
        (
            "observation token share (tool/observation_token_share): "
            f"{first_to_last(runs, 'observation_share', '.1%')}"
        ),
        (
            f"time per step in decode: {mean('decode_s')}, in the tools: {mean('tools_s')} "
            f"(overlapping decode), waiting for tools: {mean('tool_wait_s')}"
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "workdirs",
        nargs="+",
        help="finished training workdirs (with metrics.jsonl), e.g. one per --seed",
    )
    args = parser.parse_args(argv)
    runs = [figures(w) for w in args.workdirs]  # a folder without metrics.jsonl: a UserError
    print("\n".join(report(runs)))
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
