"""Training curves of one or more runs, overlaid, in one PNG (matplotlib, headless).

The panels are those a person reads a run by: reward, accuracy (train and held-out),
completion length and entropy always; the KL to the reference, the clip fraction, the
sampler-trainer gap and the tool calls per trajectory only when a run logged them and they
vary (a run without a KL term, or with one update per rollout, whose clip fraction is always
0, would show an empty or flat panel).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl4llm.config import paths
from jaxrl4llm.train.infra.metrics import read_metrics

Panel = tuple[str, tuple[str, ...]]  # (title, metric keys drawn in it: solid, then dashed)
ALWAYS: tuple[Panel, ...] = (
    ("reward", ("reward/mean",)),
    ("accuracy", ("reward/accuracy", "eval/accuracy")),
    ("completion length", ("response/length_mean",)),
    ("entropy", ("policy/entropy",)),
)
WHEN_VARYING: tuple[Panel, ...] = (
    ("KL to reference", ("policy/kl_ref",)),
    ("clip fraction", ("policy/clip_frac",)),
    # mean |trainer logp - sampler logp| per token (rl.correction.mismatch_metrics)
    ("sampler-trainer gap", ("mismatch/logp_abs_diff_mean",)),
    ("tool calls per trajectory", ("tool/calls",)),
)


def _varies(runs: Sequence[Sequence[Mapping[str, Any]]], key: str) -> bool:
    """Whether `key` takes at least two different finite values over all records of all runs."""
    values = {
        r[key]
        for records in runs
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    }
    return len(values) > 1


def choose_panels(runs: Sequence[Sequence[Mapping[str, Any]]]) -> list[Panel]:
    """The panels to draw for these runs' metrics records: ALWAYS, then each WHEN_VARYING
    panel one of whose keys varies."""
    return list(ALWAYS) + [
        panel for panel in WHEN_VARYING if any(_varies(runs, key) for key in panel[1])
    ]


def plot_runs(workdirs: Sequence[str], out: str) -> str:
    """Writes the figure to `out` and returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    runs = {paths.basename(paths.absolute(w)) or w: read_metrics(w) for w in workdirs}
    panels = choose_panels(list(runs.values()))
    cols = 2 if len(panels) <= 4 else 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5 * cols, 4 * rows), constrained_layout=True, squeeze=False
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, panels):
        for i, (name, records) in enumerate(runs.items()):
            for key, style in zip(keys, ("-", "--")):
                points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
                if points:
                    steps, values = zip(*points)
                    label = name if len(keys) == 1 else f"{name} ({key.split('/')[0]})"
                    ax.plot(
                        steps,
                        values,
                        style,
                        color=colors[i % len(colors)],
                        label=label,
                        marker="o" if len(points) < 30 else None,
                        markersize=3,
                    )
        finish_axis(ax, title, legend_size=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")  # the grid's unused cell
    fig.suptitle(", ".join(runs))
    save_figure(fig, out, dpi=100)
    plt.close(fig)
    return out


def save_figure(fig: Any, out: str, **kwargs: Any) -> None:
    """`fig` as a PNG at `out`, a local path or an object-store URL (config/paths.py)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **kwargs)
    paths.write_bytes(out, buffer.getvalue())


def finish_axis(ax: Any, title: str, legend_size: int) -> None:
    """Title, step axis and grid of a curves panel; a legend, or "not logged" when empty."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=legend_size)
    else:
        ax.text(
            0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray"
        )
