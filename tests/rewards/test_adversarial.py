"""Hostile model outputs: every answer extractor and claim parser is linear in the input.

tools/bench_extract.py --check runs each extractor on 1 MiB adversarial strings of every kind
(many opening tags and no closing one, hyphen-joined "names", floods of braces, backslashes,
spaces, ...) in a subprocess under a generous wall-clock bound: linear code finishes all of
them in seconds; the quadratic regexes it replaced took seconds at 64 KiB and never returned
at 1 MiB, so the bound tells linear from quadratic without measuring speed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BOUND_S = 180
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_extractor_is_linear_on_1mib_adversarial_inputs():
    script = os.path.join(ROOT, "tools", "bench_extract.py")
    try:
        proc = subprocess.run(
            [sys.executable, script, "--check"], capture_output=True, text=True, timeout=BOUND_S
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stuck = out.strip().splitlines()[-1] if out.strip() else "(before the first case)"
        pytest.fail(f"not linear: still running after {BOUND_S} s at {stuck!r}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert proc.stdout.strip().endswith("done") and lines.count("start") >= 12 * 21
