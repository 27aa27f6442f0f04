"""Named evaluation sets: the `--eval_sets` grammar and what each item asks for.

    --eval_sets=ITEM[,ITEM...]        ITEM = NAME[=SOURCE][;OPT...]

NAME is a registered benchmark (data/benchmarks.py: its source and default protocol come from
the registry) or, with `=SOURCE` (any --data source without ',' or ';'), any label. OPT:
`greedy`, `avg@K`, `pass@K`, `maj@K` (the sampled metrics share one set of K samples per
prompt, K the largest given), `t=FLOAT` (temperature of the samples), `max_new_tokens=INT`,
`prompts=N` (the first N prompts; default all) and `revision=REV` (the Hub revision of an
hf: source or registered name). Options not given come from the registry entry's protocol,
else from the run (greedy, plus avg/pass/maj@--eval_samples when that is > 1; the run's
temperature and max_new_tokens).

Each set logs `eval/NAME/METRIC` (METRIC: greedy, avg@K, pass@K, maj@K) and every metric
also `eval/mean/METRIC`, the unweighted mean over the sets that report it (the papers' "avg"
column).
"""

from __future__ import annotations

import dataclasses
import re

from jaxrl4llm.config.options import require

KINDS = ("greedy", "avg", "pass", "maj")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_METRIC_RE = re.compile(r"^(avg|pass|maj)@([0-9]+)$")
MEAN = "mean"


@dataclasses.dataclass(frozen=True)
class EvalSet:
    name: str
    source: str
    metrics: tuple[str, ...]  # "greedy", "avg@16", "pass@8", "maj@16", in order
    temperature: float | None = None  # None: the run's --temperature
    max_new_tokens: int | None = None  # None: the run's --max_new_tokens
    prompts: int | None = None  # None: every prompt of the split
    revision: str | None = None

    @property
    def greedy(self) -> bool:
        return "greedy" in self.metrics

    @property
    def samples(self) -> int:
        """K: samples per prompt shared by the sampled metrics (0: greedy only)."""
        return max([metric_k(m) for m in self.metrics if m != "greedy"], default=0)


def metric_k(metric: str) -> int:
    return int(metric.split("@")[1]) if "@" in metric else 1


def _parse_options(text: str, where: str) -> dict:
    """';'-separated OPTs -> {metrics, temperature, max_new_tokens, prompts, revision}."""
    out: dict = {}
    metrics: list[str] = []
    for opt in filter(None, (o.strip() for o in text.split(";"))):
        key, eq, value = opt.partition("=")
        try:
            if opt == "greedy" or _METRIC_RE.match(opt):
                require(opt == "greedy" or metric_k(opt) >= 1, f"{where}: {opt}: K must be >= 1")
                if opt not in metrics:
                    metrics.append(opt)
            elif eq and key == "t":
                out["temperature"] = float(value)
                require(out["temperature"] >= 0, f"{where}: t={value} must be >= 0")
            elif eq and key in ("max_new_tokens", "prompts"):
                out[key] = int(value)
                require(out[key] >= 1, f"{where}: {key}={value} must be >= 1")
            elif eq and key == "revision" and value:
                out["revision"] = value
            else:
                raise ValueError(
                    f"{where}: unknown option {opt!r}; options: greedy, avg@K, "
                    "pass@K, maj@K, t=FLOAT, max_new_tokens=INT, prompts=N, "
                    "revision=REV"
                )
        except ValueError as exc:
            if "unknown option" in str(exc) or "must be" in str(exc):
                raise
            raise ValueError(f"{where}: {opt!r} is not a valid value ({exc})") from None
    if metrics:
        out["metrics"] = tuple(metrics)
    return out


def run_defaults(eval_samples: int) -> dict:
    """The protocol of a set that neither the registry nor the item specifies."""
    if eval_samples > 1:
        k = eval_samples
        return {"metrics": ("greedy", f"avg@{k}", f"pass@{k}", f"maj@{k}")}
    return {"metrics": ("greedy",)}


def parse_eval_sets(text: str | None, eval_samples: int = 1) -> tuple[EvalSet, ...]:
    """The --eval_sets value -> EvalSets (empty for None / ""). Raises ValueError naming the
    item and the fix."""
    from jaxrl4llm.data.benchmarks import BENCHMARKS

    sets: list[EvalSet] = []
    for item in filter(None, (i.strip() for i in (text or "").split(","))):
        head, _, opts = item.partition(";")
        name, eq, source = head.partition("=")
        name, source = name.strip(), source.strip()
        where = f"--eval_sets item {item!r}"
        require(
            _NAME_RE.match(name) and name != MEAN,
            f"{where}: NAME must be letters, digits, '_', '-' or '.' (and not {MEAN!r})",
        )
        require(not eq or source, f"{where}: nothing after '='; write NAME=SOURCE")
        source = source or name
        require(
            eq or name in BENCHMARKS,
            f"{where}: {name!r} is not a registered benchmark (registered: "
            f"{', '.join(sorted(BENCHMARKS))}); give its data: {name}=SOURCE",
        )
        fields = dict(run_defaults(eval_samples))
        if source in BENCHMARKS:
            fields.update(_parse_options(BENCHMARKS[source].protocol, f"registry {source}"))
        fields.update(_parse_options(opts, where))
        sets.append(EvalSet(name=name, source=source, **fields))
    names = [s.name for s in sets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    require(
        not duplicates,
        f"--eval_sets names {', '.join(duplicates)} more than once; give each set its own NAME",
    )
    return tuple(sets)


def add_means(
    results: dict[str, float], sets: tuple[EvalSet, ...], prefix: str = "eval/"
) -> dict[str, float]:
    """`{prefix}mean/METRIC`: the unweighted mean over the sets that report METRIC."""
    by_metric: dict[str, list[float]] = {}
    for s in sets:
        for metric in s.metrics:
            key = f"{prefix}{s.name}/{metric}"
            if key in results:
                by_metric.setdefault(metric, []).append(results[key])
    means = {f"{prefix}{MEAN}/{m}": sum(v) / len(v) for m, v in by_metric.items()}
    return {**results, **means}
