"""Which backend builds a launch's plan: `make_plan` dispatches on --backend to the local and
SLURM builders (launch_plans.py) and the tpu-vm and GKE ones (launch_tpu_vm.py,
launch_gke.py), which build on launch_plans' shared pieces (so this module, not
launch_plans, imports them: no import cycle)."""

from __future__ import annotations

from typing import Sequence

from experiments import launch_gke, launch_plans, launch_tpu_vm


def make_plan(
    opts: launch_plans.LaunchOptions,
    train_args: Sequence[str],
    module: str = launch_plans.TRAIN_MODULE,
) -> launch_plans.Plan:
    """The plan of `opts.backend` for the training arguments `train_args`. `module` replaces
    experiments.train (tests run stand-ins). Raises ValueError naming the flag at fault."""
    if opts.backend not in launch_plans.BACKENDS:
        raise ValueError(
            f"--backend={opts.backend}: choose one of {', '.join(launch_plans.BACKENDS)}."
        )
    counts = {
        "num_hosts": (opts.num_hosts, 1),
        "num_slices": (opts.num_slices, 1),
        "max_restarts": (opts.max_restarts, 0),
        "grace_period_s": (opts.grace_period_s, 0),
        "poll_s": (opts.poll_s, 0),
    }
    for flag, (value, least) in counts.items():
        if value < least:
            raise ValueError(f"--{flag}={value} must be >= {least}.")
    workdir = launch_plans.workdir_of(train_args)
    builders = {
        "local": launch_plans.local_plan,
        "tpu-vm": launch_tpu_vm.plan,
        "gke": launch_gke.plan,
        "slurm": launch_plans.slurm_plan,
    }
    return builders[opts.backend](opts, list(train_args), workdir, module)
