"""Training curves of one or more runs, overlaid, in one PNG (matplotlib, headless)."""
from __future__ import annotations

import os
from typing import Sequence

from jaxrl4llm.train.metrics import read_metrics

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("accuracy", ("reward/accuracy", "eval/accuracy")),
    ("entropy", ("policy/entropy",)),
    ("KL to reference", ("policy/kl_ref",)),
    ("response length", ("response/length_mean",)),
    ("clip fraction", ("policy/clip_frac",)),
)


def plot_runs(workdirs: Sequence[str], out: str) -> str:
    """Writes the figure to `out` and returns its path."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    runs = {os.path.basename(os.path.normpath(w)) or w: read_metrics(w) for w in workdirs}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for i, (name, records) in enumerate(runs.items()):
            for key, style in zip(keys, ("-", "--")):
                points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
                if points:
                    steps, values = zip(*points)
                    label = name if len(keys) == 1 else f"{name} ({key.split('/')[0]})"
                    ax.plot(steps, values, style, color=colors[i % len(colors)], label=label,
                            marker="o" if len(points) < 30 else None, markersize=3)
        finish_axis(ax, title, legend_size=8)
    fig.suptitle(", ".join(runs))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def finish_axis(ax, title: str, legend_size: int) -> None:
    """Title, step axis and grid of a curves panel; a legend, or "not logged" when empty."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=legend_size)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes,
                color="gray")
