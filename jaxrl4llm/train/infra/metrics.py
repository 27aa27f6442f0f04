"""Metric sinks: an append-only JSONL file, the trackers (TensorBoard, W&B, MLflow: see
trackers.py), and a console line.

Metrics arrive named as they are logged, each with its reduction (rl.metrics.Metric);
`to_host_scalars` turns them into the plain `{name: float}` dicts every writer takes. Only
process 0 writes, so a multi-host run produces one log.
"""

from __future__ import annotations

import importlib.util
import json
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from absl import logging

from jaxrl4llm.config import paths
from jaxrl4llm.config.errors import UserError
from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.train.infra import trackers as trackers_lib

# The metrics the console line shows, in order, with their short labels.
CONSOLE_KEYS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("reward/accuracy", "acc"),
    ("eval/accuracy", "eval_acc"),
    ("policy/entropy", "ent"),
    ("policy/kl_ref", "kl"),
    ("policy/clip_frac", "clip"),
    ("response/length_mean", "len"),
    ("optim/grad_norm", "gnorm"),
    ("time/step_s", "s"),
)


def to_host_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """{name: rl.Metric or array} -> {name: float} (one transfer for the whole dict).

    A Metric that counted nothing (`Metric.is_empty`: e.g. the entropy of an update whose
    every row was rejected, as in RAFT's first steps) is left out rather than logged as 0,
    so curves and final averages do not take its stand-in value for a measurement."""
    host = jax.device_get(dict(metrics))
    return {
        k: float(np.asarray(v.value if isinstance(v, Metric) else v))
        for k, v in host.items()
        if not (isinstance(v, Metric) and bool(np.asarray(v.is_empty)))
    }


def combine_over_hosts(metrics: Mapping[str, Metric]) -> dict[str, Metric]:
    """Each host's metrics of its own rows -> the whole batch's, by each metric's reduction
    (identical on every host)."""
    if jax.process_count() == 1:
        return dict(metrics)
    from jax.experimental import multihost_utils

    keys = sorted(metrics)
    parts = np.asarray(
        multihost_utils.process_allgather(
            np.array([[float(metrics[k].total), float(metrics[k].count)] for k in keys], np.float64)
        )
    )
    out = {}
    for i, k in enumerate(keys):
        merged = Metric(parts[0, i, 0], parts[0, i, 1], metrics[k].reduce)
        for host in parts[1:]:
            merged = merged.merge(Metric(host[i, 0], host[i, 1], metrics[k].reduce))
        out[k] = merged
    return out


class MetricsWriter:
    """Appends one JSON object per step to `workdir/metrics.jsonl` and mirrors it to the
    trackers (train/infra/trackers.py: TensorBoard by default, W&B, MLflow), with `hparams` (the
    run's flags) as their hyper-parameters."""

    def __init__(
        self,
        workdir: str,
        trackers: Sequence[str] = ("tensorboard",),
        hparams: Mapping[str, Any] | None = None,
    ):
        self.path = paths.join(workdir, "metrics.jsonl")
        self._is_writer = jax.process_index() == 0
        self._trackers: list[trackers_lib.Tracker] = []
        if self._is_writer:
            paths.makedirs(workdir)
            names = tuple(trackers)
            if "tensorboard" in names and importlib.util.find_spec("tensorboardX") is None:
                # optional at run time; JSONL is the source of truth
                logging.warning("tensorboardX is not installed: writing metrics.jsonl only.")
                names = tuple(n for n in names if n != "tensorboard")
            self._trackers = trackers_lib.open_trackers(workdir, names, hparams or {})

    def truncate_after(self, step: int) -> None:
        """Drops the records a restarted run writes again: those with step > `step` (the
        restored checkpoint), or every record when `step` is 0 (a fresh start redoes its
        step-0 eval). Torn lines (a kill or full disk mid-write) go too, with a warning."""
        if not self._is_writer or not paths.exists(self.path):
            return
        kept = [r for r in _parse_records(self.path) if step > 0 and r.get("step", 0) <= step]
        paths.write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self._is_writer:
            return
        record: dict[str, float | None] = {"step": int(step)}
        record.update(
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in sorted(metrics.items())
            }
        )
        paths.append_text(self.path, json.dumps(record) + "\n")
        finite = {
            k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)
        }
        for tracker in self._trackers:
            tracker.write(step, finite)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def _parse_records(path: str) -> list[dict[str, Any]]:
    """The JSON object lines of a metrics file; torn or garbled lines are skipped, warned."""
    records = []
    for line_no, line in enumerate(paths.read_text(path).splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            logging.warning(
                "%s:%d: not a JSON record (a write cut short by a kill or a "
                "full disk?); skipped: %.80r",
                path,
                line_no,
                line,
            )
            continue
        records.append(record)
    return records


class MetricsNotFoundError(UserError, FileNotFoundError):
    """A folder without metrics.jsonl where a training workdir was expected."""


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All records of `workdir/metrics.jsonl`, in file order (torn lines skipped, warned)."""
    path = paths.join(workdir, "metrics.jsonl")
    if not paths.exists(path):
        raise MetricsNotFoundError(
            f"No metrics at {path}: is {workdir!r} a training workdir? "
            "Pass training workdirs (each holds metrics.jsonl)."
        )
    return _parse_records(path)


def console_line(step: int, num_steps: int, metrics: Mapping[str, float]) -> str:
    """A one-line, fixed-order summary of a step: `step 3/20 | reward 0.41 | acc 0.38 | ...`."""
    parts = [f"step {step}/{num_steps}"]
    for key, label in CONSOLE_KEYS:
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {metrics[key]:.4g}")
    parts += [f"{label} {value:.4g}" for label, value in _eval_set_scores(metrics)]
    return " | ".join(parts)


def _eval_set_scores(metrics: Mapping[str, float]) -> list[tuple[str, float]]:
    """Each --eval_sets set's average score, `eval/NAME/avg@k` -> ("NAME avg@k", value), in
    name order; the mean over sets (`eval/mean/...`) only when there are several sets."""
    scores = []
    for key in sorted(metrics):
        parts = key.split("/")
        if (
            len(parts) == 3
            and parts[0] == "eval"
            and parts[2].startswith("avg@")
            and metrics[key] is not None
        ):
            scores.append((parts[1], f"{parts[1]} {parts[2]}", metrics[key]))
    sets = {name for name, _, _ in scores if name != "mean"}
    return [(label, value) for name, label, value in scores if name != "mean" or len(sets) > 1]
