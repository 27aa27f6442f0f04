"""tools/plan.py on every shipped flagfile, as it stands and as each shipped study runs it with
another algorithm (or a reference, a critic): at full size on the topology its header names,
where every program must fit (tools/scaling_tables.py's settings, the K&K flagfile as PPO
among them), and scaled down (each one's algorithm and settings, a tiny model of its
architecture's family, its experts too, 4 simulated devices, a few rows of 16 + 16 tokens).
Both slow (every program of each is compiled; at full size about half a minute a plan):
`pytest -m slow`."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest
from absl import flags

from jaxrl4llm import parallel
from jaxrl4llm.models.config import TINY
from jaxrl4llm.train.config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import scaling_tables  # noqa: E402

import plan  # noqa: E402

FLAGFILES = sorted(glob.glob(os.path.join(REPO, "experiments", "configs", "*.flags")))
TOPOLOGIES = scaling_tables.named_topologies()
# Every flagfile as it stands, then as each study runs it with another algorithm.
RUNS = [
    run
    for runs in scaling_tables.named_runs(
        os.path.basename(f)[: -len(".flags")] for f in FLAGFILES
    ).values()
    for run in runs
]
# The runs of the flagfiles that name a topology, on it.
SETTINGS = [s for ss in scaling_tables.flagfile_settings(TOPOLOGIES).values() for s in ss]


def _id(run: scaling_tables.Run | scaling_tables.Setting) -> str:
    """reinforce_pp_knights_knaves, or reinforce_pp_knights_knaves+reinforcepp_vs_grpo.ppo for
    a study's run of it."""
    name = os.path.basename(_flagfile(run.argv))[: -len(".flags")]
    if len(TOPOLOGIES.get(name, ())) > 1 and isinstance(run, scaling_tables.Setting):
        name += "@" + run.argv[-1].removeprefix("--topology=")  # one plan per topology
    if not run.where:
        return name
    m = re.match(r"study (\S+), arm (\S+) ", run.where)
    assert m is not None, run.where
    return f"{name}+{m.group(1)}.{m.group(2)}"


def _flagfile(argv: tuple[str, ...]) -> str:
    return next(a for a in reversed(argv) if a.startswith("--flagfile="))


DEVICES = 4
# What a tiny model keeps of the real architecture: its family's computation and context.
_FAMILY = (
    "attention_bias",
    "qk_norm",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "max_position_embeddings",
    "model_type",
)


def tiny_like(model_config):
    """TINY with the family's fields, and a mixture of experts in its one layer when the
    model has one: 4 experts of width 32, 2 per token (the family's renormalisation and
    shared expert kept)."""
    tiny = dataclasses.replace(TINY, num_layers=1, **{f: getattr(model_config, f) for f in _FAMILY})
    moe = model_config.moe
    if not moe.num_experts:
        return tiny
    shared = 32 if moe.shared_expert_intermediate_size else 0
    return dataclasses.replace(
        tiny,
        moe=dataclasses.replace(
            moe,
            num_experts=4,
            experts_per_token=min(2, moe.experts_per_token),
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            shared_expert_intermediate_size=shared,
        ),
    )


def scaled_down(config: TrainConfig) -> list[str]:
    """Flags that shrink `config` (a flagfile's TrainConfig) to 2 prompts of its group size
    and 16 + 16 tokens on DEVICES devices, keeping its shape: several mini-batches when it
    has several, row chunks when it chunks, micro-batches smaller than the mini-batch when
    its are."""
    G = config.rollout.group_size
    B = 2 * G
    mini = B // 2 if config.mini_batch < config.batch_size else B
    micro = max(DEVICES, mini // 2) if config.micro_batch < config.mini_batch else mini
    out = [
        "--prompts_per_step=2",
        f"--mini_batch_size={mini}",
        f"--micro_batch_size={micro}",
        "--max_prompt_tokens=16",
        "--max_new_tokens=16",
        f"--topology=cpu-{DEVICES}",
    ]
    if config.rollout.rollout_micro_batch:
        out.append(f"--rollout_micro_batch={G}")
    if config.rollout.decode_slots:
        out.append(f"--decode_slots={DEVICES}")
    if config.reward.overlong_buffer:
        out.append("--overlong_buffer=4")
    if parallel.MeshSpec.parse(config.run.mesh).expert > 1:  # experts split 2 ways, fsdp 2
        out.append("--mesh=data:1,fsdp:-1,expert:2,tensor:1")
    return out


def test_the_studies_algorithms_are_planned_on_the_flagfiles_topology():
    """Each run a shipped study makes of a flagfile that names a topology, with another
    algorithm, reference or critic than the flagfile's own, is among the plans that must fit
    there: the K&K flagfile as REINFORCE++, REINFORCE++-baseline and PPO (its critic)."""
    kk = {
        s.algorithm: s
        for s in scaling_tables.flagfile_settings(TOPOLOGIES)["reinforce_pp_knights_knaves"]
    }
    assert list(kk) == ["reinforce_pp", "reinforce_pp_baseline", "ppo"]
    assert kk["ppo"].argv == (
        "--log_kl_ref",
        "--flagfile=experiments/configs/reinforce_pp_knights_knaves.flags",
        "--algorithm=ppo",
        "--advantage=gae",
        "--critic_learning_rate=9e-6",
        "--topology=8xh100",
    )
    planned = {(_flagfile(s.argv), s.algorithm) for s in SETTINGS}
    for name, argv, where in scaling_tables.study_runs():
        if name in TOPOLOGIES:
            algorithm = scaling_tables.study_spec.resolve_config(list(argv), where).algorithm.name
            assert (scaling_tables.flagfile_flag(name), algorithm) in planned, where


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS, ids=_id)
def test_every_flagfile_fits_its_topology_for_every_algorithm_it_names(setting):
    """Full size, on the topology the flagfile's header names: plan.py exits 0 (1 when a
    program does not fit, naming it on its last line)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # plan.py fakes its own
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "plan.py"), *setting.argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (setting.command, done.stdout[-2000:], done.stderr[-2000:])
    assert "every program fits" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=_id)
def test_every_flagfile_plans_scaled_down(run, monkeypatch, capsys):
    FLAGS = flags.FLAGS
    monkeypatch.chdir(REPO)  # the studies' flagfile paths are the repository's
    try:
        FLAGS.unparse_flags()
        FLAGS(["plan", *run.argv])
        config = plan.train.config_from_flags()
        real = plan.programs.architecture(config.model.name)
        FLAGS.unparse_flags()
        FLAGS(["plan", *run.argv, *scaled_down(config)])
        monkeypatch.setattr(plan.programs, "architecture", lambda name: tiny_like(real))
        assert plan.main([]) == 0
    finally:
        FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert "every program fits" in out
    programs = ["create", "rollout", "logprobs", "update"]
    if config.needs_critic:
        programs += ["critic values", "critic update"]
    for program in programs:
        assert f"\n{program} " in out, (program, out)
