"""Run a study: a comparison of arms (presets + flag overrides) x seeds, with its report.

    python -m experiments.study --study=minimalist_fig4 --scale=cpu --root=/work/study_runs/fig4
    python -m experiments.study --study=minimalist_fig4 --scale=paper --print_commands
    python -m experiments.study --study=minimalist_fig4 --scale=cpu --root=... --collect

A study spec (experiments/studies/NAME.toml, or --study=PATH; experiments/study_spec.py
gives the format) names a base flagfile per scale, the arms and the seeds. Each arm x seed
is an ordinary `python -m experiments.train` run in ROOT/ARM/seed_S, one after another; a
finished run is skipped, an unfinished one (killed, preempted) resumes from its checkpoint.
Each run's console output goes to its workdir's train.log. At the end (and with --collect,
from whatever runs exist) it writes ROOT/report.md, report.json and curves.png
(experiments/study_stats.py says what they hold). --print_commands prints one command per
run, for a cluster scheduler, and runs nothing. Before anything runs (or prints), the design
is checked (experiments/study_design.py): arms that are the same arm are refused.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import tempfile
import time

from absl import flags
from tqdm.auto import tqdm

from experiments import study_design, study_estimate, study_report, study_stats
from experiments.study_spec import REPO, Run, load_study, plan, select
from jaxrl4llm.config import cli, paths
from jaxrl4llm.config.options import require
from jaxrl4llm.train.infra.errors import EXIT_PREEMPTED

_STUDY = flags.DEFINE_string(
    "study",
    None,
    "A shipped study's name (experiments/studies/) or the path of a study spec (.toml).",
)
_SCALE = flags.DEFINE_string(
    "scale",
    "cpu",
    "Which of the spec's scales to run (its [scales.NAME] table): e.g. cpu or paper.",
)
_ROOT = flags.DEFINE_string(
    "root",
    None,
    "Folder of the runs' workdirs and the report (default: workdirs/studies/STUDY/SCALE).",
)
_ARMS = flags.DEFINE_string("arms", "", "Comma-separated subset of the arms (default: all).")
_SEEDS = flags.DEFINE_string("seeds", "", "Comma-separated seeds, instead of the scale's.")
_PRINT = flags.DEFINE_boolean(
    "print_commands", False, "Print one training command per run and run nothing."
)
_COLLECT = flags.DEFINE_boolean(
    "collect", False, "Only build the report from the existing workdirs."
)
_CACHE = flags.DEFINE_string(
    "compilation_cache",
    None,
    "JAX's persistent compilation cache "
    "for the runs (default ROOT/jax_cache, or workdirs/studies/jax_cache on this "
    "machine's disk for an object-store ROOT; '' for none): the runs of a "
    "study compile the same programs, so all but the first skip most "
    "of their compile time (a toy run: 97 s -> 25 s).",
)
_KEEP_GOING = flags.DEFINE_boolean(
    "keep_going",
    True,
    "After a failed run, go on with the next ones (the study then exits with status 1).",
)
_PRUNE = flags.DEFINE_boolean(
    "prune_checkpoints",
    False,
    "Delete a run's checkpoints once it "
    "has finished (the report reads only metrics.jsonl; unfinished "
    "runs keep theirs to resume). A cpu-scale run of SmolLM2-135M "
    "keeps 2.8 GB of checkpoints: 59 GB for minimalist_fig4's 21 runs.",
)


_STOPPED: list[int] = []  # the SIGTERMs received while a run trained


def train(run: Run, cache_dir: str) -> tuple[int, str]:
    """Runs (or resumes) one training run; its console output is appended to train.log
    (with an object-store workdir, written locally and appended there when the run ends).
    Returns (exit code, the local log's path)."""
    paths.makedirs(run.workdir)
    remote_log = paths.join(run.workdir, "train.log") if paths.is_remote(run.workdir) else None
    log_path = (
        os.path.join(tempfile.mkdtemp(prefix="study-log-"), "train.log")
        if remote_log
        else os.path.join(run.workdir, "train.log")
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"  # train.log follows the run live
    if cache_dir:  # the user's own JAX_* settings win
        env.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    started: list[subprocess.Popen] = []

    def stop(signum, frame):
        # `kill RUNNER`: the run checkpoints and exits (the trainer's preemption path), and
        # no further run starts; a rerun resumes it.
        _STOPPED.append(signum)
        for proc in started:
            proc.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with open(log_path, "a") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {run.shell()}\n")
            log.flush()
            started.append(
                subprocess.Popen(run.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
            if _STOPPED:  # a SIGTERM before the run existed
                started[0].send_signal(signal.SIGTERM)
            code = started[0].wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if remote_log:
            with open(log_path, errors="replace") as f:
                paths.append_text(remote_log, f.read())
    return code, log_path


def _tail(path: str, lines: int = 15) -> str:
    """The last non-empty lines of a log (progress bars' carriage returns as new lines)."""
    with open(path, errors="replace") as f:
        text = f.read().replace("\r", "\n")
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def run_all(runs: list[Run], keep_going: bool, cache_dir: str, prune: bool = False) -> list[str]:
    """Trains every run not yet finished, in order, with a progress bar over runs; returns
    the labels of the runs that failed. `prune`: a run's checkpoints are deleted once it
    has finished."""
    failed = []
    bar = tqdm(total=len(runs), desc="study", unit="run", dynamic_ncols=True)
    for run in runs:
        status, last = study_stats.run_status(run.workdir, run.num_steps)
        if status == "finished":
            bar.write(f"{run.label}: finished earlier (step {last}), skipped")
            bar.update(1)
            continue
        resume = f" (resuming after step {last})" if status == "unfinished" else ""
        bar.set_postfix_str(run.label)
        bar.write(f"{run.label}: training{resume}, log {run.workdir}/train.log")
        t0 = time.time()
        code, log_path = train(run, cache_dir)
        status, last = study_stats.run_status(run.workdir, run.num_steps)
        minutes = (time.time() - t0) / 60
        if _STOPPED or code == EXIT_PREEMPTED:  # the runner's SIGTERM, or the run's own
            bar.write(
                f"{run.label}: stopped (SIGTERM) at step {last}/{run.num_steps} after "
                f"{minutes:.1f} min; the next runs did not start. Rerun to resume."
            )
            break
        if code == 0 and status == "finished":
            bar.write(f"{run.label}: finished (step {last}) in {minutes:.1f} min")
            if prune:
                paths.remove(paths.join(run.workdir, "checkpoints"))
        else:
            failed.append(run.label)
            bar.write(
                f"{run.label}: FAILED (exit {code}, step {last}/{run.num_steps}) after "
                f"{minutes:.1f} min; the end of {log_path}:\n{_tail(log_path)}"
            )
            if not keep_going:
                break
        bar.update(1)
    bar.close()
    return failed


def announce(name: str, scale: str, runs: list[Run], root: str, prune: bool) -> None:
    """Prints the runs, the estimated time and disk (experiments/study_estimate.py); an
    InsufficientDiskError (a UserError: exit 2, one line) when the disk cannot hold the
    checkpoints."""
    print(study_estimate.summary(name, scale, runs, root, prune), flush=True)


def main(argv):
    del argv  # cli.run refuses positional arguments
    require(_STUDY.value, "Give --study=NAME (experiments/studies/NAME.toml) or a path.")
    assert _STUDY.value is not None  # required just above
    with cli.flag_errors():  # a bad spec, arm, seed or scale: one line naming it
        study = load_study(_STUDY.value)
        arms, seeds = select(study, _ARMS.value, _SEEDS.value, _SCALE.value)
        root = paths.absolute(
            _ROOT.value or os.path.join("workdirs", "studies", study.name, _SCALE.value)
        )
        runs = plan(study, _SCALE.value, root, arms, seeds)
    if not _COLLECT.value:  # refuses arms that are the same arm, before any run
        for line in study_design.check_design(runs, study.path).warnings():
            print(f"design: {line}", flush=True)
    if _PRINT.value:
        print(
            f"# {study.name} ({_SCALE.value}): {len(runs)} runs ({len(arms)} arms x seeds "
            f"{', '.join(map(str, seeds))}), paired by seed: the runs of one seed share its "
            f"prompts and sampling keys in every arm. Run each from {REPO}; then collect "
            "the report with --collect --root=ROOT."
        )
        for run in runs:
            print(run.shell())
        return 0
    if not _COLLECT.value:
        announce(study.name, _SCALE.value, runs, root, _PRUNE.value)
    # An object-store root keeps the compilation cache on this machine's disk.
    cache_root = os.path.join("workdirs", "studies") if paths.is_remote(root) else root
    cache = os.path.join(cache_root, "jax_cache") if _CACHE.value is None else _CACHE.value
    failed = [] if _COLLECT.value else run_all(runs, _KEEP_GOING.value, cache, _PRUNE.value)
    collect = [
        "python",
        "-m",
        "experiments.study",
        f"--study={_STUDY.value}",
        f"--scale={_SCALE.value}",
        f"--root={root}",
        "--collect",
    ]
    collect += [f"--arms={_ARMS.value}"] * bool(_ARMS.value)
    collect += [f"--seeds={_SEEDS.value}"] * bool(_SEEDS.value)
    report = study_stats.build_report(
        study, _SCALE.value, runs, " ".join(shlex.quote(c) for c in collect)
    )
    written = study_report.write_report(report, root)
    finished = sum(r["status"] == "finished" for r in report["runs"])
    print(
        f"\n{finished}/{len(runs)} runs finished. Report: {written['report.md']} "
        f"(also report.json, curves.png)"
    )
    if failed:
        print(f"Failed runs: {', '.join(failed)} (their train.log says why; rerun to resume)")
        return 1
    return 0


if __name__ == "__main__":
    cli.run(main)
