"""A study's statistics from its runs' workdirs: per run, per arm, pairwise and per claim, as the
dict that report.json holds (`build_report`; study_report.py renders it).

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
paired difference, two 95% intervals of it, the percentile bootstrap (BOOTSTRAP resamples of
the seeds, seeded) and Student's t (mean ± t_0.975,n-1 sd(d) / sqrt(n)), and the verdict from
the span of both (">": supported when it lies above 0, contradicted below 0; "~": supported
when it lies inside (-margin, margin), contradicted when outside). Both, because with few
seeds the bootstrap interval is about the range of the seeds' differences, which holds the
true mean with probability 1/2 at 2 seeds and 3/4 at 3, far short of 95%; the t interval
keeps its 95% at any n when the differences are normal, and the bootstrap stands in for it
when they are not and n is large. Beside them: the minimum detectable effect with these seeds
(a paired two-sided 5% t test with 80% power: (t_0.975,n-1 + t_0.8,n-1) sd(d) / sqrt(n)) and
the seeds that would resolve the observed difference (seeds_needed); the unpaired 2-s.e.
verdict stays beside it.
"""

from __future__ import annotations

import itertools
import math
import os
from statistics import NormalDist
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

from experiments.study_spec import REPO, SHORT_QUANTITIES, Claim, Run, Study
from jaxrl4llm.config import paths
from jaxrl4llm.train.infra.metrics import read_metrics

TRAIN_KEYS = (
    "reward/mean",
    "reward/accuracy",
    "policy/entropy",
    "policy/kl_ref",
    "response/length_mean",
)


def curve(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that log `key` with a value."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    steps, values = zip(*points) if points else ((), ())
    return np.asarray(steps, float), np.asarray(values, float)


def run_status(workdir: str, num_steps: int) -> tuple[str, int]:
    """("finished" | "unfinished" | "missing", last logged step): finished when the metrics
    reach `num_steps` (the spec's, so a spec run longer later resumes its runs)."""
    if not paths.exists(paths.join(workdir, "metrics.jsonl")):
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


def run_cost(workdir: str, records: Sequence[dict]) -> dict[str, float]:
    """What a run has cost so far: `step_time_s`, the summed wall time of its logged steps
    (`time/step_s`: an eval at a later step is inside its step's time; start-up, compilation
    before the first step and the step-0 eval are not), and `disk_bytes`, its workdir's
    size now (checkpoints included while they exist)."""
    step_time = sum(float(r.get("time/step_s") or 0.0) for r in records if r.get("step", 0) > 0)
    return {"step_time_s": step_time, "disk_bytes": float(folder_bytes(workdir))}


def folder_bytes(folder: str) -> int:
    """Bytes of the files under `folder` (links not followed; 0 when it does not exist)."""
    if paths.is_remote(folder):
        return paths.size_bytes(folder)
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in names
        if not os.path.islink(os.path.join(root, name))
    )


# Metrics that differ between two runs of the same computation (timing, memory, speed).
UNTRAINED_PREFIXES = ("time/", "memory/", "throughput/")


def first_divergence(records_a: Sequence[dict], records_b: Sequence[dict]) -> int | None:
    """The first step at which two runs logged different metrics (timings, memory and
    throughput aside), None when every step's metrics are equal: arms whose options never
    acted on the batches they saw run identical steps under one seed's prompts and keys."""

    def by_step(records: Sequence[dict]) -> dict[int, dict]:
        return {
            r["step"]: {k: v for k, v in r.items() if not k.startswith(UNTRAINED_PREFIXES)}
            for r in records
        }

    a, b = by_step(records_a), by_step(records_b)
    return next((step for step in sorted(set(a) | set(b)) if a.get(step) != b.get(step)), None)


def identical_arms(records: Mapping[tuple[str, int], Sequence[dict]], arms: Sequence[str]) -> list:
    """Pairs of arms that ran identical steps in at least one seed finished in both: for each,
    {"a", "b", "first_divergence": {seed: step or None (identical throughout)}}."""
    out = []
    for a, b in itertools.combinations(arms, 2):
        seeds = sorted(s for (arm, s) in records if arm == a and (b, s) in records)
        steps = {s: first_divergence(records[(a, s)], records[(b, s)]) for s in seeds}
        if any(step is None for step in steps.values()):
            out.append({"a": a, "b": b, "first_divergence": steps})
    return out


def mark_untestable(claims: list[dict], identical: Sequence[dict]) -> list[dict]:
    """Claims between arms that ran identical steps: when they did in every seed finished in
    both, the claim is "untestable at this scale" (d = 0 by construction: the option that
    separates the arms never acted at this scale); when in some seeds, its `why` names them."""
    for c in claims:
        pair = next((p for p in identical if {p["a"], p["b"]} == {c["a"], c["b"]}), None)
        if pair is None:
            continue
        same = [s for s, step in pair["first_divergence"].items() if step is None]
        seeds = f"seed{'s' * (len(same) > 1)} {', '.join(map(str, same))}"
        if len(same) == len(pair["first_divergence"]):
            c["verdict"] = "untestable at this scale"
            c["why"] = (
                f"{c['a']} and {c['b']} ran identical steps in every seed ({seeds}): the option "
                "that separates them never acted, so their difference is 0 by construction"
            )
        else:
            c["why"] += f"; {c['a']} and {c['b']} ran identical steps in {seeds} (d = 0 there)"
    return claims


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


def bootstrap_ci(
    d: Sequence[float] | np.ndarray, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile interval of the mean of `d` over BOOTSTRAP resamples (seeded)."""
    x = np.asarray(d, float)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (BOOTSTRAP, len(x)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def t_quantile(p: float, n: int) -> float:
    """Student's t quantile at probability p with n - 1 degrees of freedom (n seeds)."""
    return float(scipy_stats.t.ppf(p, n - 1))


def t_interval(d: Sequence[float] | np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """mean(d) ± t_(1+level)/2,n-1 sd(d) / sqrt(n): the paired t test's interval."""
    x = np.asarray(d, float)
    half = t_quantile((1 + level) / 2, len(x)) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return float(x.mean()) - half, float(x.mean()) + half


def min_detectable_effect(sd: float, n: int) -> float:
    """The paired difference a two-sided 5% t test detects with 80% power from n seeds."""
    return (t_quantile(0.975, n) + t_quantile(0.8, n)) * sd / math.sqrt(n)


def seeds_needed(sd: float, effect: float) -> int | None:
    """Paired seeds for a two-sided 5% t test to detect `effect` with 80% power (None: no
    effect to detect): the fewest n >= 2 whose min_detectable_effect is <= effect."""
    if effect <= 0:
        return None
    return _fewest_seeds(lambda n: min_detectable_effect(sd, n), effect, Z_ALPHA + Z_POWER, sd)


def _equivalence_seeds(sd: float, room: float) -> int | None:
    """Seeds whose t interval half-width (t_0.975,n-1 sd / sqrt(n)) fits in `room`, the gap
    between the observed |mean| and the margin (None: no room)."""
    if room <= 0:
        return None
    return _fewest_seeds(lambda n: t_quantile(0.975, n) * sd / math.sqrt(n), room, Z_ALPHA, sd)


def _fewest_seeds(width: Callable[[int], float], target: float, z: float, sd: float) -> int:
    """The fewest n >= 2 with width(n) <= target, where width(n) is a t multiple of
    sd / sqrt(n): the normal approximation (z sd / target)^2 is a lower bound to start from;
    past MANY_SEEDS it is returned as is."""
    if sd == 0:
        return 2
    n = max(2, math.ceil((z * sd / target) ** 2))
    while n <= MANY_SEEDS and width(n) > target:
        n += 1
    return n


# Beyond this many seeds the observed difference is, for a study, indistinguishable from 0.
MANY_SEEDS = 10_000


def seeds_phrase(needed: int) -> str:
    """ "about N seeds", or "more than 10,000 seeds" for a difference near 0."""
    return f"more than {MANY_SEEDS:,} seeds" if needed > MANY_SEEDS else f"about {needed} seeds"


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
    boot, t_ci = bootstrap_ci(d), t_interval(d)
    # The verdict's interval: the span of both (module docstring).
    lo, hi = min(boot[0], t_ci[0]), max(boot[1], t_ci[1])
    mde = min_detectable_effect(sd, n)
    out.update(mean_difference=mean, sd_difference=sd, ci95=list(boot), ci95_t=list(t_ci), mde=mde)
    span = f"the 95% intervals span [{lo:.3g}, {hi:.3g}]"
    if expect == "~":
        assert margin is not None  # study_spec: expect "~" needs a margin
        out["seeds_needed"] = _equivalence_seeds(sd, margin - abs(mean))
        if -margin < lo and hi < margin:
            out["verdict"], out["why"] = "supported", f"{span}, within ±{margin:g}"
        elif hi <= -margin or lo >= margin:
            out["verdict"], out["why"] = "contradicted", f"{span}, outside ±{margin:g}"
        else:
            out["verdict"] = "unresolved"
            out["why"] = f"{span}, which crosses ±{margin:g}"
        return out
    out["seeds_needed"] = seeds_needed(sd, abs(mean))
    sign = 1 if expect == ">" else -1
    if lo > 0 or hi < 0:
        agrees = (lo > 0) == (sign > 0)
        out["verdict"] = "supported" if agrees else "contradicted"
        out["why"] = f"{span}, excluding 0"
    else:
        out["verdict"] = "unresolved"
        needed = out["seeds_needed"]
        out["why"] = (
            f"{span}, including 0: {n} seeds detect a difference "
            f"of {mde:.3g} or more, the observed one is {abs(mean):.3g}"
            + (f" ({seeds_phrase(needed)} would resolve it)" if needed else "")
        )
    return out


def _run_row(
    run: Run, primary: str, threshold: float | None, final_window: int
) -> tuple[dict, list[dict] | None]:
    """One run's report row, and its metrics records when it finished (else None)."""
    status, last = run_status(run.workdir, run.num_steps)
    row = {
        "arm": run.arm,
        "seed": run.seed,
        "workdir": run.workdir,
        "status": status,
        "last_step": last,
        "num_steps": run.num_steps,
    }
    if status == "missing":
        return row, None
    records = [r for r in read_metrics(run.workdir) if r["step"] <= run.num_steps]
    row["cost"] = run_cost(run.workdir, records)
    if status != "finished":
        return row, None
    row["summary"] = run_summary(records, primary, threshold, final_window)
    return row, records


def _arm_stats(summaries: Sequence[dict]) -> dict:
    """An arm's mean and s.e. of every quantity over its finished runs' summaries."""
    quantities = sorted({q for sm in summaries for q in sm})
    stats: dict[str, Any] = {
        q: mean_se([sm[q] for sm in summaries if sm.get(q) is not None]) for q in quantities
    }
    for q in quantities:
        if q.startswith("steps "):
            stats[q]["reached"] = f"{stats[q]['n']}/{len(summaries)}"
    stats["_finished"] = len(summaries)
    return stats


def _differences(arms: dict, headline: Sequence[str]) -> list[dict]:
    """The pairs of arms whose headline quantities differ beyond 2 s.e."""
    differences = []
    for q in headline:
        for a, b in itertools.combinations(arms, 2):
            verdict, diff, two_se = compare(arms[a].get(q), arms[b].get(q))
            if verdict in ("a>b", "a<b"):
                assert diff is not None  # compare() measured it
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
    return differences


UNPAIRED_LABELS = {
    "n/a": "not measured (needs >= 2 finished seeds per arm)",
    "unresolved": "unresolved (difference within 2 s.e.)",
}


def _claim_row(claim: Claim, q: str, arms: dict, run_rows: Sequence[dict]) -> dict:
    """A claim's paired verdict on quantity `q`, with the unpaired 2-s.e. one beside it."""
    verdict, diff, two_se = compare(arms.get(claim.a, {}).get(q), arms.get(claim.b, {}).get(q))
    expected = {">": "a>b", "<": "a<b"}.get(claim.expect)
    label = UNPAIRED_LABELS.get(verdict, "supported" if verdict == expected else "contradicted")
    if claim.expect == "~":
        label = "-"  # the 2-s.e. test has no equality form
    paired = paired_claim(paired_values(run_rows, claim.a, claim.b, q), claim.expect, claim.margin)
    return {
        "text": claim.text,
        "source": claim.source,
        "a": claim.a,
        "b": claim.b,
        "quantity": q,
        "expect": claim.expect,
        "margin": claim.margin,
        "verdict": paired["verdict"],
        "why": paired["why"],
        "paired": paired,
        "unpaired_verdict": label,
        "difference": diff,
        "two_se": two_se,
    }


def build_report(study: Study, scale: str, runs: Sequence[Run], command: str = "") -> dict:
    """Everything report.md shows, as JSON: runs' statuses and summaries, arms' statistics,
    significant pairwise differences and the claims' verdicts."""
    s = study.scale(scale)
    primary, threshold = s.primary_metric, s.threshold
    run_rows: list[dict] = []
    per_arm: dict[str, list[dict]] = {}
    finished_records: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        row, records = _run_row(run, primary, threshold, study.final_window)
        if records is not None:
            finished_records[(run.arm, run.seed)] = records
            per_arm.setdefault(run.arm, []).append(row["summary"])
        run_rows.append(row)
    arm_names = list(dict.fromkeys(r.arm for r in runs))
    arms = {name: _arm_stats(per_arm.get(name, [])) for name in arm_names}
    headline = [resolve_quantity(q, primary, threshold) for q in ("final", "best", "auc")]
    claims = [
        _claim_row(c, resolve_quantity(c.quantity, primary, threshold), arms, run_rows)
        for c in study.claims
    ]
    identical = identical_arms(finished_records, arm_names)
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
        "differences": _differences(arms, headline),
        "identical": identical,
        "claims": mark_untestable(claims, identical),
    }
