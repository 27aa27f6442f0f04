"""tools/bench_sampler.py times the sides in turns, so that a slow spell of a shared machine
hits every side alike, and keeps each side's best time."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools import bench_sampler  # noqa: E402


def test_sides_are_timed_in_turns_and_the_best_time_is_kept():
    calls = []
    times = {"ours": iter([3.0, 1.0]), "torch": iter([2.0, 5.0])}

    def side(name):
        def run(n):
            calls.append((name, n))
            return next(times[name]), f"{name} output {len(calls)}"

        return run

    best = bench_sampler.best_interleaved(
        {"ours": (side("ours"), 64), "torch": (side("torch"), 64)}, repeats=2
    )
    assert calls == [("ours", 64), ("torch", 64), ("ours", 64), ("torch", 64)]
    assert best == {"ours": (1.0, "ours output 3"), "torch": (2.0, "torch output 4")}
