"""Train a policy with RL from verifiable rewards.

    python -m experiments.train --flagfile=experiments/configs/quickstart.flags
    python -m experiments.train --flagfile=... --algorithm=lite_ppo --clip_high=0.28

Every field of jaxrl4llm.train.config.TrainConfig is a flag (`--helpfull` lists them by
sub-config). `--algorithm` picks a preset (grpo, dr_grpo, reinforce, reinforce_rej,
reinforce_pp, reinforce_pp_baseline, lite_ppo, rloo, raft, raft_pp); every knob of
rl.AlgorithmConfig is also a flag of the same name that overrides the preset. Flags on the
command line override the flagfile. The resolved configuration is written to
WORKDIR/config.json. The console shows a progress bar, one line per step, warnings and
errors; `--verbosity=1` (or 0: INFO only) adds the libraries' log lines.

Exit codes (jaxrl4llm/train/errors.py): 0 finished; 2 a bad flag, data source or workdir
(one line naming it and the fix); 3 stopped on non-finite values; 75 preempted (SIGTERM:
checkpoint saved, rerun the same command to resume); 1 a bug (with its traceback).
"""
from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from jaxrl4llm import cli, parallel
from jaxrl4llm.train import errors
from jaxrl4llm.train.config import TrainConfig

FLAG_NAMES = cli.define_flags(TrainConfig)
for _name in FLAG_NAMES:
    flags.declare_key_flag(_name)   # --help lists them; --helpfull groups them by sub-config
FLAGS = flags.FLAGS


def config_from_flags() -> TrainConfig:
    return cli.config_from_flags(TrainConfig)


def _fail(exc: Exception, code: int) -> int:
    """A user-facing error: one line naming the input and the fix, no traceback."""
    print("Error: " + " ".join(str(exc).split()), file=sys.stderr)
    return code


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments {argv[1:]}: every option is a --flag.")
    cli.quiet_logs()
    try:
        config = config_from_flags()  # each sub-config checks its own values
    except ValueError as exc:
        return _fail(exc, errors.EXIT_USER_ERROR)
    parallel.maybe_initialize_distributed(auto_detect=config.run.distributed)
    import jax
    try:
        config.validate(jax.device_count())  # every flag, before the data or the model load
    except ValueError as exc:
        return _fail(exc, errors.EXIT_USER_ERROR)
    from jaxrl4llm.data import DataError
    from jaxrl4llm.sampling.buckets import PromptTooLongError
    from jaxrl4llm.train import loop  # heavy imports after flag parsing: fast --help
    from jaxrl4llm.train.checkpoint import CheckpointError, NonFiniteStateError
    from jaxrl4llm.train.workdir_lock import WorkdirInUseError
    try:
        summary = loop.run(config)
    except (DataError, PromptTooLongError, WorkdirInUseError, CheckpointError,
            errors.ResumeMismatchError) as exc:
        return _fail(exc, errors.EXIT_USER_ERROR)
    except (errors.TrainingDivergedError, NonFiniteStateError) as exc:
        return _fail(exc, errors.EXIT_DIVERGED)
    if summary["preempted"]:
        print(f"\nPreempted at step {summary['step']}; checkpoint saved in "
              f"{os.path.join(summary['workdir'], 'checkpoints')}; rerun the same command to "
              "resume.")
        return errors.EXIT_PREEMPTED
    logging.info("Done: step %d, outputs in %s", summary["step"], summary["workdir"])
    print(f"\nFinished at step {summary['step']}. Outputs in {summary['workdir']}:")
    for name, path in sorted(summary["outputs"].items()):
        print(f"  {name:8s} {path}")
    print(f"  {'ckpts':8s} {os.path.join(summary['workdir'], 'checkpoints')}")
    last = summary["metrics"]
    rows = [(k, v) for k, v in sorted(last.items()) if k.startswith(("reward/", "response/"))]
    rows += sorted(summary["eval"].items())
    if rows:
        print("\n  metric                          value")
        for key, value in rows:
            print(f"  {key:30s} {value:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
