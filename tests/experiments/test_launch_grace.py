"""--grace_period_s: the seconds a preempted host has between SIGTERM and SIGKILL reach the
platform (GKE's terminationGracePeriodSeconds, SLURM's --signal) and the trainer, which warns
when a step and its checkpoint save take longer."""

import logging
import re

import pytest
import yaml

from experiments import launch_plans
from experiments.launch_backends import make_plan
from experiments.launch_plans import GRACE_ENV, LaunchOptions
from jaxrl4llm.train import loop

ARGS = ["--workdir=gs://bucket/run"]
BACKENDS = {
    "local": dict(),
    "slurm": dict(partition="gpu"),
    "gke": dict(image="img", accelerator="nvidia-h100-80gb", chips_per_host=8),
    "tpu-vm": dict(zone="z"),
}


def _plan(backend, grace, tmp_path):
    opts = LaunchOptions(
        backend=backend, grace_period_s=grace, launch_dir=str(tmp_path), **BACKENDS[backend]
    )
    return make_plan(opts, ARGS)


def _trainer_grace(backend, grace, tmp_path):
    """The values of GRACE_ENV the plan gives the trainer: in a process's environment, a
    script's export, a worker's command line, or the pods' env."""
    plan = _plan(backend, grace, tmp_path)
    if backend == "gke":
        _, job = yaml.safe_load_all(next(iter(plan.files.values())))
        env = job["spec"]["template"]["spec"]["containers"][0]["env"]
        return [e["value"] for e in env if e["name"] == GRACE_ENV]
    return re.findall(rf"{GRACE_ENV}=(\d+)", plan.describe())  # commands with their env


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_backend_tells_the_trainer_its_grace_period(backend, tmp_path):
    assert _trainer_grace(backend, 90, tmp_path) == ["90"]
    assert _trainer_grace(backend, 0, tmp_path) == []


def test_platforms_get_the_grace_period(tmp_path):
    (script,) = _plan("slurm", 90, tmp_path).files.values()
    assert "#SBATCH --signal=TERM@90" in script  # SIGTERM 90 s before the time limit
    assert "--signal" not in next(iter(_plan("slurm", 0, tmp_path).files.values()))
    _, job = yaml.safe_load_all(next(iter(_plan("gke", 90, tmp_path).files.values())))
    assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 90
    with pytest.raises(ValueError, match="--grace_period_s=-1 must be >= 0"):
        make_plan(LaunchOptions(grace_period_s=-1), ARGS)


def test_trainer_warns_once_when_a_step_and_a_save_outlast_the_grace_period(monkeypatch, caplog):
    assert loop.GRACE_ENV == launch_plans.GRACE_ENV
    progress = loop.Progress(last={"time/step_s": 20.0}, save_s=15.0)
    with caplog.at_level(logging.WARNING):
        monkeypatch.delenv(GRACE_ENV, raising=False)
        loop._warn_past_grace(progress, compiled=True)  # no grace period known
        monkeypatch.setenv(GRACE_ENV, "30")
        loop._warn_past_grace(progress, compiled=False)  # the first step compiles
        assert not caplog.records
        loop._warn_past_grace(progress, compiled=True)
        loop._warn_past_grace(progress, compiled=True)
    (record,) = caplog.records
    assert "take 35 s, longer than the 30 s" in record.getMessage()
    assert "--grace_period_s" in record.getMessage()
    monkeypatch.setenv(GRACE_ENV, "60")
    quiet = loop.Progress(last={"time/step_s": 20.0}, save_s=15.0)
    loop._warn_past_grace(quiet, compiled=True)
    assert not quiet.grace_warned
