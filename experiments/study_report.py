"""A study's report rendered: report.json, report.md and curves.png from the dict that
study_stats.build_report computes (what each quantity is: study_stats.py)."""

from __future__ import annotations

import json
import math

import numpy as np

from experiments.study_stats import MANY_SEEDS, TRAIN_KEYS, curve, resolve_quantity
from jaxrl4llm.config import paths
from jaxrl4llm.train.infra import plots
from jaxrl4llm.train.infra.metrics import read_metrics

PLOT_PANELS = (
    ("reward", "reward/mean"),
    ("eval score", None),
    ("entropy", "policy/entropy"),
    ("KL to reference", "policy/kl_ref"),
    ("response length", "response/length_mean"),
)


def _fmt(stat: dict | None, digits: int = 3) -> str:
    if stat and stat["mean"] is None and "reached" in stat:
        return f"never ({stat['reached']})"
    if not stat or stat["mean"] is None:
        return "-"
    text = f"{stat['mean']:.{digits}g}"
    if stat["se"] is not None:
        text += f" ± {stat['se']:.2g}"
    if "reached" in stat:
        text += f" ({stat['reached']})"
    elif stat["n"] == 1:
        text += " (n=1)"
    return text


def render_markdown(report: dict) -> str:
    lines = _header_lines(report)
    lines += _arms_table_lines(report)
    lines += _other_evals_lines(report["arms"], report["primary_metric"])
    lines += _differences_lines(report["differences"])
    lines += _identical_lines(report.get("identical", []))
    lines += _claims_lines(report["claims"])
    lines += _runs_lines(report["runs"])
    lines += ["", "![curves](curves.png)", ""]
    return "\n".join(lines)


def _header_lines(report: dict) -> list[str]:
    """The title, the study's description, spec and command, and what the tables hold."""
    lines = [f"# Study `{report['study']}` (scale `{report['scale']}`)", ""]
    if report["description"]:
        lines += [report["description"], ""]
    lines += [f"Spec: `{report['spec']}`." + (f" {report['note']}" if report["note"] else "")]
    if report["command"]:
        lines += ["", f"Collected with `{report['command']}`."]
    return lines + [
        "",
        "Mean ± standard error over finished seeds. Training metrics: mean of the "
        f"last {report['final_window']} steps. AUC: mean eval score over training. ",
        "",
    ]


def _arms_table_lines(report: dict) -> list[str]:
    """Per arm: the primary metric's headline quantities and the final training metrics."""
    primary, threshold = report["primary_metric"], report["threshold"]
    head = [resolve_quantity(q, primary, threshold) for q in ("final", "best", "auc")]
    if threshold is not None:
        head.append(resolve_quantity("steps", primary, threshold))
    head += [f"final {k}" for k in TRAIN_KEYS]
    lines = ["| arm | seeds | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for name, stats in report["arms"].items():
        lines.append(
            f"| {name} | {stats['_finished']} | "
            + " | ".join(_fmt(stats.get(q)) for q in head)
            + " |"
        )
    return lines


def _other_evals_lines(arms: dict, primary: str) -> list[str]:
    """Per arm: final / best of the eval metrics other than the primary one."""
    others = sorted(
        {q.split(" ", 1)[1] for st in arms.values() for q in st if q.startswith("final eval/")}
        - {primary}
    )
    if not others:
        return []
    lines = [
        "",
        "Other eval metrics (final / best):",
        "",
        "| arm | " + " | ".join(others) + " |",
        "|---|" + "---|" * len(others),
    ]
    for name, stats in arms.items():
        lines.append(
            f"| {name} | "
            + " | ".join(
                f"{_fmt(stats.get('final ' + k))} / {_fmt(stats.get('best ' + k))}" for k in others
            )
            + " |"
        )
    return lines


def _differences_lines(differences: list[dict]) -> list[str]:
    lines = ["", "## Differences beyond 2 s.e.", ""]
    if not differences:
        return lines + [
            "None: every pairwise difference of the primary metric's final, best and "
            "AUC is within 2 standard errors (or an arm has < 2 finished seeds)."
        ]
    return lines + [
        f"- {d['quantity']}: **{d['higher']}** > {d['lower']} by "
        f"{d['difference']:.3g} (2 s.e. = {d['two_se']:.3g})"
        for d in differences
    ]


def _claims_lines(claims: list[dict]) -> list[str]:
    """The claims' table (paired verdicts, unpaired beside them) and why each claim that is
    not supported is not."""
    if not claims:
        return []
    lines = [
        "",
        "## Claims (fixed in the spec before the runs), paired by seed",
        "",
        "d = a - b per seed; 95% intervals of its mean, percentile bootstrap and "
        "Student's t; the verdict needs both to exclude 0 (with 2 or 3 seeds the "
        "bootstrap interval is about the range of the seeds' differences, which holds "
        "the mean far less than 95% of the time); MDE: the difference these seeds detect "
        "(paired t test, 5% two-sided, 80% power); seeds: those that would resolve the "
        "observed difference. Unpaired: the 2-s.e. test on the arms' means.",
        "",
        "| claim | source | test | mean d | 95% CI bootstrap | 95% CI t | MDE | seeds "
        "| verdict | unpaired |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_claim_row(c) for c in claims]
    return (
        lines
        + [""]
        + [
            f"- {c['text']}: **{c['verdict']}**: {c['why']}."
            for c in claims
            if c["verdict"] != "supported"
        ]
    )


def _claim_row(c: dict) -> str:
    p = c["paired"]
    test = f"{c['a']} {c['expect']} {c['b']}" + (
        f" (±{c['margin']:g})" if c["expect"] == "~" else ""
    )
    if "mean_difference" in p:
        nums = (
            f"{p['mean_difference']:.3g} (n={p['n_pairs']}) | "
            f"[{p['ci95'][0]:.3g}, {p['ci95'][1]:.3g}] | "
            f"[{p['ci95_t'][0]:.3g}, {p['ci95_t'][1]:.3g}] | {p['mde']:.3g} | "
            f"{_seeds_cell(p['seeds_needed'])}"
        )
    else:
        nums = f"- (n={p['n_pairs']}) | - | - | - | -"
    return (
        f"| {c['text']} | {c['source'] or '-'} | {test} on {c['quantity']} | {nums} | "
        f"**{c['verdict']}** | {c['unpaired_verdict']} |"
    )


def _runs_lines(runs: list[dict]) -> list[str]:
    """How many runs finished, what they cost, and where each other one stands."""
    pending = [r for r in runs if r["status"] != "finished"]
    lines = ["", "## Runs", ""]
    done = len(runs) - len(pending)
    lines.append(f"{done} of {len(runs)} runs finished.")
    lines += _cost_lines(runs)
    for r in pending:
        where = (
            f"logged up to step {r['last_step']} of {r['num_steps']}: running, stopped or failed"
            if r["status"] == "unfinished"
            else "not started"
        )
        lines.append(f"- {r['arm']} seed {r['seed']}: {r['status']} ({where})")
    return lines


def _seeds_cell(needed: int | None) -> str:
    if needed is None:
        return "-"
    return f"> {MANY_SEEDS:,}" if needed > MANY_SEEDS else str(needed)


def _identical_lines(identical: list[dict]) -> list[str]:
    """Arms that ran identical steps in some seed: their difference there is 0 by
    construction (the option separating them never acted), not by measurement."""
    if not identical:
        return []
    lines = [
        "",
        "## Arms that ran identical steps",
        "",
        "Same seed, every logged metric but timings equal at every step: the option that "
        "separates the arms never acted on the batches they drew.",
        "",
    ]
    for pair in identical:
        steps = pair["first_divergence"]
        same = [str(s) for s, step in steps.items() if step is None]
        apart = [f"seed {s} from step {step}" for s, step in steps.items() if step is not None]
        lines.append(
            f"- {pair['a']} = {pair['b']} in seed{'s' * (len(same) > 1)} {', '.join(same)}"
            + (f"; they differ in {', '.join(apart)}" if apart else "")
            + "."
        )
    return lines


def _cost_lines(runs: list[dict]) -> list[str]:
    """The runs' summed step time (per arm and in all) and the disk their workdirs use now."""
    costs = [r for r in runs if "cost" in r]
    if not costs:
        return []
    hours = sum(r["cost"]["step_time_s"] for r in costs) / 3600
    disk_gb = sum(r["cost"]["disk_bytes"] for r in costs) / 1e9
    per_arm: dict[str, list[float]] = {}
    for r in costs:
        if r["status"] == "finished":
            per_arm.setdefault(r["arm"], []).append(r["cost"]["step_time_s"] / 60)
    arms = "; ".join(f"{a} {np.mean(m):.1f}" for a, m in per_arm.items())
    return [
        "",
        f"Cost: {hours:.2f} h of training steps over {len(costs)} runs (`time/step_s` summed: "
        "evals after step 0 included; start-up, compilation before the first step and the "
        f"step-0 eval not). Minutes a finished run, per arm: {arms or '-'}. Disk: "
        f"{disk_gb:.2f} GB in the runs' workdirs now (checkpoints included where kept).",
    ]


def plot_curves(report: dict, out: str) -> str:
    """One panel per PLOT_PANELS entry; per arm the mean over finished seeds at the steps
    every seed logs, shaded +- 1 s.e."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm: dict[str, list[list[dict]]] = {}
    for r in report["runs"]:
        by_arm.setdefault(r["arm"], [])
        if r["status"] == "finished":
            by_arm[r["arm"]].append(read_metrics(r["workdir"]))
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, key) in zip(axes.flat, PLOT_PANELS):
        key = key or report["primary_metric"]
        for i, (arm, seeds) in enumerate(by_arm.items()):
            curves = [curve(records, key) for records in seeds]
            curves = [c for c in curves if len(c[0])]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c[0].tolist()) for c in curves)))
            table = np.array([[dict(zip(*c))[s] for s in steps] for c in curves])
            mean = table.mean(0)
            color = colors[i % len(colors)]
            ax.plot(
                steps,
                mean,
                color=color,
                label=f"{arm} (n={len(curves)})",
                marker="o" if len(steps) < 30 else None,
                markersize=3,
            )
            if len(curves) >= 2:
                se = table.std(0, ddof=1) / math.sqrt(len(curves))
                ax.fill_between(steps, mean - se, mean + se, color=color, alpha=0.2)
        plots.finish_axis(ax, f"{title} ({key})", legend_size=7)
    axes.flat[-1].axis("off")
    fig.suptitle(f"{report['study']} ({report['scale']}): mean over seeds, shaded ± 1 s.e.")
    plots.save_figure(fig, out, dpi=100)
    plt.close(fig)
    return out


def write_report(report: dict, root: str) -> dict[str, str]:
    """report.json, report.md and curves.png under `root`; returns their paths."""
    paths.makedirs(root)
    names = ("report.json", "report.md", "curves.png")
    written = {name: paths.join(root, name) for name in names}
    paths.write_text(written["report.json"], json.dumps(report, indent=2))
    paths.write_text(written["report.md"], render_markdown(report))
    plot_curves(report, written["curves.png"])
    return written
