"""Train a policy with RL from verifiable rewards.

    python -m experiments.train --flagfile=experiments/configs/quickstart.flags
    python -m experiments.train --flagfile=... --algorithm=lite_ppo --clip_high=0.28

Every field of jaxrl4llm.train.config.TrainConfig is a flag (`--helpfull` lists them by
sub-config). `--algorithm` picks a preset (cispo, clip_cov, dapo, dr_grpo, gmpo, gpg, grpo,
grpo_passk, gspo, kl_cov, lite_ppo, opo, ppo, raft, raft_pp, reinforce, reinforce_pp,
reinforce_pp_baseline, reinforce_rej, remax, rloo, sapo); every knob of rl.AlgorithmConfig is
also a flag of the same name that overrides the preset. Flags on the command line override the
flagfile. The resolved configuration is written to
WORKDIR/config.json. The console shows a progress bar, one line per step, warnings and
errors; `--verbosity=1` (or 0: INFO only) adds the libraries' log lines.

Every flag is checked before any data or model is read. Exit codes (docs/reliability.md,
"Exit codes"): 0 finished; 2 a bad flag, data source, model, checkpoint or workdir (one line
naming it and the fix; `--debug` adds the traceback); 3 stopped on non-finite values; 75
preempted (SIGTERM: checkpoint saved, rerun the same command to resume); 1 a bug (with its
traceback).
"""

from __future__ import annotations

import os
import sys

from absl import flags, logging

from jaxrl4llm import parallel
from jaxrl4llm.config import cli
from jaxrl4llm.config.errors import one_line
from jaxrl4llm.models import registry
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra import errors

FLAG_NAMES = cli.define_flags(TrainConfig)
for _name in FLAG_NAMES:
    flags.declare_key_flag(_name)  # --help lists them; --helpfull groups them by sub-config
FLAGS = flags.FLAGS


def config_from_flags(flag_values: flags.FlagValues = FLAGS) -> TrainConfig:
    return cli.config_from_flags(TrainConfig, flag_values)


def checked_config(flag_values: flags.FlagValues = FLAGS, check_model: bool = True) -> TrainConfig:
    """The TrainConfig of the parsed flags and, with `check_model`, --model (and
    --critic_model) found, before any data or model is read. Joins a multi-host run first
    (--distributed). Its values are checked once, by train.config.checks.validate, first thing in
    train.loop.run (a FlagError names the flag and the fix)."""
    config = config_from_flags(flag_values)  # each sub-config checks its own values
    parallel.maybe_initialize_distributed(auto_detect=config.run.distributed)
    if check_model:
        registry.check(config.model.name)
        if config.critic.model is not None:
            registry.check(config.critic.model, flag="--critic_model")
    return config


def main(argv):
    del argv  # cli.run refuses positional arguments
    cli.quiet_logs()
    config = checked_config()
    from jaxrl4llm.train import loop  # heavy imports after flag parsing: fast --help
    from jaxrl4llm.train.infra.checkpoint import NonFiniteStateError

    try:
        summary = loop.run(config)  # a UserError (data, workdir, resume, ...) -> exit 2
    except (errors.TrainingDivergedError, NonFiniteStateError) as exc:
        print(one_line(exc), file=sys.stderr)
        return errors.EXIT_DIVERGED
    if summary["preempted"]:
        print(
            f"\nPreempted at step {summary['step']}; checkpoint saved in "
            f"{os.path.join(summary['workdir'], 'checkpoints')}; rerun the same command to "
            "resume."
        )
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
    cli.run(main)
