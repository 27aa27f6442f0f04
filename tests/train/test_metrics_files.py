"""metrics.jsonl survives a torn last line (kill / disk full mid-write); TensorBoard is flushed
with every JSONL record; restarting truncates to the restored step (everything at 0)."""

from __future__ import annotations

import glob
import json
import os
import struct

from jaxrl4llm.train.infra import metrics, plots

TORN = '{"step": 3, "reward/me'


def _write_records(workdir, steps, torn=True):
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "reward/mean": step / 10}) + "\n")
        if torn:
            f.write(TORN)  # no newline: the process died mid-write


def _steps(workdir):
    return [r["step"] for r in metrics.read_metrics(str(workdir))]


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    _write_records(tmp_path, [1, 2])
    assert _steps(tmp_path) == [1, 2]
    assert "metrics.jsonl:3" in caplog.text and "skipped" in caplog.text


def test_truncate_after_drops_torn_lines_and_later_steps(tmp_path, caplog):
    _write_records(tmp_path, [1, 2, 3, 4])
    writer = metrics.MetricsWriter(str(tmp_path), trackers=())
    writer.truncate_after(2)
    writer.write(3, {"reward/mean": 0.5})  # appended on a clean line, not glued to the torn one
    writer.close()
    assert _steps(tmp_path) == [1, 2, 3]
    assert "metrics.jsonl:5" in caplog.text
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)


def test_truncate_to_step_0_starts_over(tmp_path):
    # A run killed before its first checkpoint restarts at 0: its old steps (and its step-0
    # eval, written again) must go, or the log reads 0, 1, 2, 0, 1, 2, 3.
    _write_records(tmp_path, [0, 1, 2], torn=False)
    writer = metrics.MetricsWriter(str(tmp_path), trackers=())
    writer.truncate_after(0)
    for step in (0, 1, 2, 3):
        writer.write(step, {"reward/mean": 0.0})
    writer.close()
    assert _steps(tmp_path) == [0, 1, 2, 3]


def test_the_end_of_run_plot_survives_a_torn_line(tmp_path):
    _write_records(tmp_path, [1, 2, 3])
    out = plots.plot_runs([str(tmp_path)], str(tmp_path / "curves.png"))
    assert os.path.getsize(out) > 1000


def _event_tags(directory):
    """Scalar tags in the TensorBoard event files (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2

    tags = []
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        data = open(path, "rb").read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            tags += [(v.tag, event.step) for v in event.summary.value]
            pos += 12 + length + 4
    return tags


def test_tensorboard_is_flushed_with_every_record(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path))
    writer.write(1, {"reward/mean": 0.25})
    writer.write(2, {"reward/mean": 0.5})
    # No flush / close: a kill now must not lose what metrics.jsonl already has.
    assert _event_tags(tmp_path / "tensorboard") == [("reward/mean", 1), ("reward/mean", 2)]
    writer.close()


def test_tools_plot_survives_a_torn_line(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _write_records(tmp_path, [1, 2])
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "tools", "plot.py"),
            str(tmp_path),
            "--out",
            str(tmp_path / "p.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "metrics.jsonl:3" in proc.stderr and (tmp_path / "p.png").exists()
