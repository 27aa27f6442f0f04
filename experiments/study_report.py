"""A study's report from its runs' workdirs: report.json, report.md and curves.png.

Per run (metrics.jsonl, whose records hold `step` and the logged metrics):
  - `final METRIC` / `best METRIC` for every eval metric (`eval/...` but `.../num_prompts`):
    the value at the last eval step, the largest value over the eval steps (step 0 included);
  - `auc PRIMARY`: the area under the primary metric's eval curve (trapezoids over steps)
    divided by the steps it spans: the mean score over training, in the metric's units;
  - `steps PRIMARY>=T`: the first eval step whose primary score is >= the threshold T (runs
    that never reach it are left out of the mean and counted in `reached`);
  - `final KEY` for the training metrics TRAIN_KEYS: the mean of the last `final_window` steps
    that log KEY (one step's batch is small: this is the end of training, less its noise).
Per arm: mean and standard error (sample std, ddof 1, / sqrt(n)) over the finished seeds.
Two arms differ on a quantity (unpaired) when |mean_a - mean_b| > 2 sqrt(se_a^2 + se_b^2);
otherwise the difference is unresolved. Only finished runs (last step = the run's
--num_steps) count; missing and unfinished runs are listed.

Claims are judged seed by seed: the runs of one seed see the same prompts and sampling keys
in every arm, so d_s = a_s - b_s removes what the seed alone decides. Per claim: the mean
paired difference, its 95% bootstrap interval (BOOTSTRAP resamples of the seeds, percentile,
seeded), the verdict from that interval (">": supported when it lies above 0, contradicted
below 0; "~": supported when it lies inside (-margin, margin), contradicted when outside),
the minimum detectable effect with these seeds (a two-sided 5% test with 80% power:
(z_0.975 + z_0.8) sd(d) / sqrt(n)) and the seeds that would resolve the observed difference
(seeds_needed); the unpaired 2-s.e. verdict stays beside it. With few seeds the bootstrap
interval is narrower than the truth (3 seeds have 10 distinct resamples): the minimum
detectable effect says how far to trust it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np

from experiments.study_spec import REPO, SHORT_QUANTITIES, Run, Study
from jaxrl4llm.train import plots
from jaxrl4llm.train.metrics import read_metrics

TRAIN_KEYS = (
    "reward/mean",
    "reward/accuracy",
    "policy/entropy",
    "policy/kl_ref",
    "response/length_mean",
)
PLOT_PANELS = (
    ("reward", "reward/mean"),
    ("eval score", None),
    ("entropy", "policy/entropy"),
    ("KL to reference", "policy/kl_ref"),
    ("response length", "response/length_mean"),
)


def curve(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that log `key` with a value."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    steps, values = zip(*points) if points else ((), ())
    return np.asarray(steps, float), np.asarray(values, float)


def run_status(workdir: str, num_steps: int) -> tuple[str, int]:
    """("finished" | "unfinished" | "missing", last logged step): finished when the metrics
    reach `num_steps` (the spec's, so a spec run longer later resumes its runs)."""
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        return "missing", 0
    last = max((r.get("step", 0) for r in read_metrics(workdir)), default=0)
    return ("finished" if last >= num_steps else "unfinished"), last


def run_summary(
    records: Sequence[dict], primary: str, threshold: float | None, final_window: int
) -> dict[str, float | None]:
    """The per-run quantities named in the module docstring."""
    out: dict[str, float | None] = {}
    eval_keys = sorted(
        {
            k
            for r in records
            for k, v in r.items()
            if k.startswith("eval/") and not k.endswith("/num_prompts") and v is not None
        }
    )
    for key in eval_keys:
        _, values = curve(records, key)
        out[f"final {key}"] = float(values[-1])
        out[f"best {key}"] = float(values.max())
    steps, values = curve(records, primary)
    if len(values):
        span = steps[-1] - steps[0]
        area = float(np.sum((values[1:] + values[:-1]) / 2 * np.diff(steps)))
        out[f"auc {primary}"] = area / span if span > 0 else float(values[0])
    if threshold is not None and len(values):
        hit = np.nonzero(values >= threshold)[0]
        out[f"steps {primary}>={threshold:g}"] = float(steps[hit[0]]) if len(hit) else None
    for key in TRAIN_KEYS:
        _, values = curve([r for r in records if r["step"] > 0], key)
        if len(values):
            out[f"final {key}"] = float(values[-final_window:].mean())
    return out


def mean_se(values: Sequence[float]) -> dict[str, Any]:
    x = np.asarray(values, float)
    n = len(x)
    mean = float(x.mean()) if n else None
    se = float(x.std(ddof=1) / math.sqrt(n)) if n >= 2 else None
    return {"mean": mean, "se": se, "n": n, "values": [float(v) for v in x]}


def resolve_quantity(quantity: str, primary: str, threshold: float | None) -> str:
    """A claim's short quantity ("final", "best", "auc", "steps") -> its report name."""
    if quantity == "steps":
        return f"steps {primary}>={threshold:g}"
    return f"{quantity} {primary}" if quantity in SHORT_QUANTITIES else quantity


def compare(a: dict | None, b: dict | None) -> tuple[str, float | None, float | None]:
    """("a>b" | "a<b" | "unresolved" | "n/a", difference of means, 2 s.e. of the difference)."""
    if not a or not b or a["se"] is None or b["se"] is None:
        return "n/a", None, None
    diff = a["mean"] - b["mean"]
    two_se = 2 * math.sqrt(a["se"] ** 2 + b["se"] ** 2)
    if abs(diff) > two_se:
        return ("a>b" if diff > 0 else "a<b"), diff, two_se
    return "unresolved", diff, two_se


BOOTSTRAP = 10_000
Z_ALPHA = NormalDist().inv_cdf(0.975)  # two-sided 5%
Z_POWER = NormalDist().inv_cdf(0.8)  # 80% power


def bootstrap_ci(d: Sequence[float], seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean of `d` over BOOTSTRAP resamples (seeded)."""
    x = np.asarray(d, float)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (BOOTSTRAP, len(x)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def min_detectable_effect(sd: float, n: int) -> float:
    """The paired difference a two-sided 5% test detects with 80% power from n seeds."""
    return (Z_ALPHA + Z_POWER) * sd / math.sqrt(n)


def seeds_needed(sd: float, effect: float) -> int | None:
    """Paired seeds for a two-sided 5% test to detect `effect` with 80% power (None: no
    effect to detect); at least 2, for a standard deviation."""
    if effect <= 0:
        return None
    if sd == 0:
        return 2
    return max(2, math.ceil(((Z_ALPHA + Z_POWER) * sd / effect) ** 2))


def paired_values(
    rows: Sequence[dict], a: str, b: str, quantity: str
) -> dict[int, tuple[float, float]]:
    """{seed: (a's value, b's value)} over the seeds where both arms finished with a value."""
    by = {
        (r["arm"], r["seed"]): r["summary"].get(quantity) for r in rows if r["status"] == "finished"
    }
    return {
        seed: (by[(a, seed)], by[(b, seed)])
        for (arm, seed) in by
        if arm == a and by.get((b, seed)) is not None and by[(a, seed)] is not None
    }


def paired_claim(pairs: dict[int, tuple[float, float]], expect: str, margin: float | None) -> dict:
    """The paired statistics and verdict of one claim (module docstring)."""
    d = np.array([x - y for x, y in pairs.values()], float)
    n = len(d)
    out: dict[str, Any] = {"seeds": sorted(pairs), "n_pairs": n}
    if n < 2:
        out["verdict"] = "not measured"
        out["why"] = f"needs >= 2 seeds finished in both arms (has {n})"
        return out
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    lo, hi = bootstrap_ci(d)
    mde = min_detectable_effect(sd, n)
    out.update(mean_difference=mean, sd_difference=sd, ci95=[lo, hi], mde=mde)
    if expect == "~":
        out["seeds_needed"] = (
            None
            if abs(mean) >= margin
            else max(2, math.ceil((Z_ALPHA * sd / (margin - abs(mean))) ** 2))
            if sd
            else 2
        )
        if -margin < lo and hi < margin:
            out["verdict"], out["why"] = "supported", f"the 95% interval lies within ±{margin:g}"
        elif hi <= -margin or lo >= margin:
            out["verdict"], out["why"] = (
                "contradicted",
                f"the 95% interval lies outside ±{margin:g}",
            )
        else:
            out["verdict"] = "unresolved"
            out["why"] = f"the 95% interval [{lo:.3g}, {hi:.3g}] crosses ±{margin:g}"
        return out
    out["seeds_needed"] = seeds_needed(sd, abs(mean))
    sign = 1 if expect == ">" else -1
    if lo > 0 or hi < 0:
        agrees = (lo > 0) == (sign > 0)
        out["verdict"] = "supported" if agrees else "contradicted"
        out["why"] = f"the 95% interval [{lo:.3g}, {hi:.3g}] excludes 0"
    else:
        out["verdict"] = "unresolved"
        needed = out["seeds_needed"]
        out["why"] = (
            f"the 95% interval [{lo:.3g}, {hi:.3g}] includes 0: {n} seeds detect a difference "
            f"of {mde:.3g} or more, the observed one is {abs(mean):.3g}"
            + (f" (about {needed} seeds would resolve it)" if needed else "")
        )
    return out


def build_report(study: Study, scale: str, runs: Sequence[Run], command: str = "") -> dict:
    """Everything report.md shows, as JSON: runs' statuses and summaries, arms' statistics,
    significant pairwise differences and the claims' verdicts."""
    s = study.scale(scale)
    primary, threshold = s.primary_metric, s.threshold
    run_rows, per_arm = [], {}
    for run in runs:
        status, last = run_status(run.workdir, run.num_steps)
        row = {
            "arm": run.arm,
            "seed": run.seed,
            "workdir": run.workdir,
            "status": status,
            "last_step": last,
            "num_steps": run.num_steps,
        }
        if status == "finished":
            records = [r for r in read_metrics(run.workdir) if r["step"] <= run.num_steps]
            row["summary"] = run_summary(records, primary, threshold, study.final_window)
            per_arm.setdefault(run.arm, []).append(row["summary"])
        run_rows.append(row)
    arm_names = list(dict.fromkeys(r.arm for r in runs))
    arms = {}
    for name in arm_names:
        summaries = per_arm.get(name, [])
        quantities = sorted({q for sm in summaries for q in sm})
        arms[name] = {
            q: mean_se([sm[q] for sm in summaries if sm.get(q) is not None]) for q in quantities
        }
        for q in quantities:
            if q.startswith("steps "):
                arms[name][q]["reached"] = f"{arms[name][q]['n']}/{len(summaries)}"
        arms[name]["_finished"] = len(summaries)
    headline = [resolve_quantity(q, primary, threshold) for q in ("final", "best", "auc")]
    differences = []
    for q in headline:
        for a, b in itertools.combinations(arm_names, 2):
            verdict, diff, two_se = compare(arms[a].get(q), arms[b].get(q))
            if verdict in ("a>b", "a<b"):
                hi, lo = (a, b) if verdict == "a>b" else (b, a)
                differences.append(
                    {
                        "quantity": q,
                        "higher": hi,
                        "lower": lo,
                        "difference": abs(diff),
                        "two_se": two_se,
                    }
                )
    claims = []
    for c in study.claims:
        q = resolve_quantity(c.quantity, primary, threshold)
        verdict, diff, two_se = compare(arms.get(c.a, {}).get(q), arms.get(c.b, {}).get(q))
        expected = {">": "a>b", "<": "a<b"}.get(c.expect)
        label = {
            "n/a": "not measured (needs >= 2 finished seeds per arm)",
            "unresolved": "unresolved (difference within 2 s.e.)",
        }.get(verdict, "supported" if verdict == expected else "contradicted")
        if c.expect == "~":
            label = "-"  # the 2-s.e. test has no equality form
        paired = paired_claim(paired_values(run_rows, c.a, c.b, q), c.expect, c.margin)
        claims.append(
            {
                "text": c.text,
                "source": c.source,
                "a": c.a,
                "b": c.b,
                "quantity": q,
                "expect": c.expect,
                "margin": c.margin,
                "verdict": paired["verdict"],
                "why": paired["why"],
                "paired": paired,
                "unpaired_verdict": label,
                "difference": diff,
                "two_se": two_se,
            }
        )
    spec = os.path.abspath(study.path)
    if spec.startswith(REPO + os.sep):
        spec = os.path.relpath(spec, REPO)
    return {
        "study": study.name,
        "spec": spec,
        "scale": scale,
        "description": study.description,
        "note": s.note,
        "command": command,
        "primary_metric": primary,
        "threshold": threshold,
        "final_window": study.final_window,
        "runs": run_rows,
        "arms": arms,
        "differences": differences,
        "claims": claims,
    }


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
    primary, threshold = report["primary_metric"], report["threshold"]
    arms = report["arms"]
    lines = [f"# Study `{report['study']}` (scale `{report['scale']}`)", ""]
    if report["description"]:
        lines += [report["description"], ""]
    lines += [f"Spec: `{report['spec']}`." + (f" {report['note']}" if report["note"] else "")]
    if report["command"]:
        lines += ["", f"Collected with `{report['command']}`."]
    lines += [
        "",
        "Mean ± standard error over finished seeds. Training metrics: mean of the "
        f"last {report['final_window']} steps. AUC: mean eval score over training. ",
        "",
    ]
    head = [resolve_quantity(q, primary, threshold) for q in ("final", "best", "auc")]
    if threshold is not None:
        head.append(resolve_quantity("steps", primary, threshold))
    head += [f"final {k}" for k in TRAIN_KEYS]
    lines += ["| arm | seeds | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for name, stats in arms.items():
        lines.append(
            f"| {name} | {stats['_finished']} | "
            + " | ".join(_fmt(stats.get(q)) for q in head)
            + " |"
        )
    others = sorted(
        {q.split(" ", 1)[1] for st in arms.values() for q in st if q.startswith("final eval/")}
        - {primary}
    )
    if others:
        lines += [
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
                    f"{_fmt(stats.get('final ' + k))} / {_fmt(stats.get('best ' + k))}"
                    for k in others
                )
                + " |"
            )
    lines += ["", "## Differences beyond 2 s.e.", ""]
    if report["differences"]:
        lines += [
            f"- {d['quantity']}: **{d['higher']}** > {d['lower']} by "
            f"{d['difference']:.3g} (2 s.e. = {d['two_se']:.3g})"
            for d in report["differences"]
        ]
    else:
        lines.append(
            "None: every pairwise difference of the primary metric's final, best and "
            "AUC is within 2 standard errors (or an arm has < 2 finished seeds)."
        )
    if report["claims"]:
        lines += [
            "",
            "## Claims (fixed in the spec before the runs), paired by seed",
            "",
            "d = a - b per seed; 95% bootstrap interval of its mean; MDE: the difference "
            "these seeds detect (5% two-sided, 80% power); seeds: those that would resolve "
            "the observed difference. Unpaired: the 2-s.e. test on the arms' means.",
            "",
            "| claim | source | test | mean d | 95% CI | MDE | seeds | verdict | unpaired |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in report["claims"]:
            p = c["paired"]
            test = f"{c['a']} {c['expect']} {c['b']}" + (
                f" (±{c['margin']:g})" if c["expect"] == "~" else ""
            )
            if "mean_difference" in p:
                nums = (
                    f"{p['mean_difference']:.3g} (n={p['n_pairs']}) | "
                    f"[{p['ci95'][0]:.3g}, {p['ci95'][1]:.3g}] | {p['mde']:.3g} | "
                    f"{p['seeds_needed'] if p['seeds_needed'] is not None else '-'}"
                )
            else:
                nums = f"- (n={p['n_pairs']}) | - | - | -"
            lines.append(
                f"| {c['text']} | {c['source'] or '-'} | {test} on {c['quantity']} | {nums} | "
                f"**{c['verdict']}** | {c['unpaired_verdict']} |"
            )
        lines += [""] + [
            f"- {c['text']}: **{c['verdict']}**: {c['why']}."
            for c in report["claims"]
            if c["verdict"] != "supported"
        ]
    pending = [r for r in report["runs"] if r["status"] != "finished"]
    lines += ["", "## Runs", ""]
    done = len(report["runs"]) - len(pending)
    lines.append(f"{done} of {len(report['runs'])} runs finished.")
    for r in pending:
        where = (
            f"logged up to step {r['last_step']} of {r['num_steps']}: running, stopped or failed"
            if r["status"] == "unfinished"
            else "not started"
        )
        lines.append(f"- {r['arm']} seed {r['seed']}: {r['status']} ({where})")
    lines += ["", "![curves](curves.png)", ""]
    return "\n".join(lines)


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
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_report(report: dict, root: str) -> dict[str, str]:
    """report.json, report.md and curves.png under `root`; returns their paths."""
    os.makedirs(root, exist_ok=True)
    paths = {name: os.path.join(root, name) for name in ("report.json", "report.md", "curves.png")}
    with open(paths["report.json"], "w") as f:
        json.dump(report, f, indent=2)
    with open(paths["report.md"], "w") as f:
        f.write(render_markdown(report))
    plot_curves(report, paths["curves.png"])
    return paths
