"""The planner lowers the trainer's own programs: for the quickstart configuration (and a PPO
run of it with a KL term, which adds the reference's logprobs and the critic's programs; on
the toy model, to keep it quick), every program a training step runs is lowered once through
the trainer's path (recorded as the step calls it, on its real arrays) and once through the
planner's (planner/programs.py, on abstract inputs of the same shapes), and the two HLO texts
are identical. A static setting, an input's dtype, sharding or presence that differs between
the run and the plan fails here."""

from __future__ import annotations

import dataclasses
import difflib
import os

import jax
import pytest
from absl import flags

from experiments import train
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.planner import programs as plan_programs
from jaxrl4llm.planner import rollout as plan_rollout
from jaxrl4llm.planner.topology import topology
from jaxrl4llm.program import Program
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGFILE = os.path.join(REPO, "experiments", "configs", "quickstart.flags")
# One short step: the programs' settings are the quickstart's, their shapes small.
SHORT = [
    "--num_steps=1",
    "--eval_every=0",
    "--eval_prompts=0",
    "--checkpoint_every=1",
    "--max_new_tokens=16",
]


def _config(workdir: str, *extra: str) -> TrainConfig:
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train", f"--flagfile={FLAGFILE}", *SHORT, f"--workdir={workdir}", *extra])
    try:
        return train.config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()


def _run_recording(config: TrainConfig, monkeypatch) -> tuple[dict, ModelConfig]:
    """Trains one step; returns {program name: (HLO text, its arguments' shapes)} of the
    first call of each program, lowered on the arrays the step passed, and the model's
    ModelConfig (with --compute_dtype) the run's programs were built with."""
    seen: dict[str, tuple[str, tuple, dict]] = {}
    model_configs = []
    call = Program.__call__

    def recording(self, *args, **kwargs):
        if self.name not in seen:  # lowered before the call: a donated state is still live
            shapes = jax.tree.map(lambda x: getattr(x, "shape", None), (args, kwargs))
            seen[self.name] = (self.lower(*args, **kwargs).as_text(), *shapes)
            if "model_config" in self.static:
                model_configs.append(self.static["model_config"])
        return call(self, *args, **kwargs)

    monkeypatch.setattr(Program, "__call__", recording)
    loop.run(config)
    return seen, model_configs[0]


def _planned(config: TrainConfig, model_config: ModelConfig, run: dict) -> dict[str, str]:
    """The planner's HLO of each program, lowered on the shapes the run's calls had, from
    the model's own config as tools/plan.py reads it (the planner applies --compute_dtype)."""
    model_config = dataclasses.replace(model_config, compute_dtype=None)
    s = plan_programs.setup(config, model_config, topology("cpu-8"), jax.devices())
    B = config.batch_size
    # The shapes the rollout ran at: prompt columns of the sampled bucket (the decode's
    # prompt_BP), completion columns trimmed to the batch's longest row (bucketed).
    text = {"create": s.programs.create(s.trained).lower(s.trained)}
    if "sample" in run:
        P = run["sample"][1][1][1]
        text["sample"] = plan_rollout.lower_sample(s, P)
    if "segment" in run:  # by admission: its queue's prompts [shards, rows, P]
        P = run["segment"][1][1].prompt_BP[2]
        text["segment"] = plan_rollout.lower_segment(s, P)[0]
    for name, lower in (
        ("logprobs", plan_programs.lower_logprobs),
        ("values", plan_programs.lower_values),
    ):
        if name in run:
            T = run[name][2]["seqs"].completion_tokens_BT[1]
            text[name] = lower(s, B, P, T)
    for name, lower in (
        ("policy_update", plan_programs.lower_update),
        ("critic_update", plan_programs.lower_critic_update),
    ):
        if name in run:
            T = run[name][1][1].seqs.completion_tokens_BT[1]  # (state, mini-batch)
            text[name] = lower(s, P, T)
    return {name: lowered.as_text() for name, lowered in text.items()}


@pytest.mark.parametrize(
    "extra, names",
    [
        ([], {"create", "sample", "advantages", "policy_update"}),
        (
            # PPO's KL in the reward: the reference's logprobs too; in bfloat16.
            ["TOY", "--algorithm=ppo", "--critic_warmup_steps=0", "--kl_coef=0.01"]
            + ["--kl_in=reward", "--max_prompt_tokens=32", "--instruction="]
            + ["--compute_dtype=bfloat16"],
            {"create", "sample", "logprobs", "values", "advantages", "policy_update"}
            | {"critic_update"},
        ),
        (
            # DAPO's dynamic sampling by admission: the paged engine's segment program, its
            # weights, queue and state as the run's driver holds them.
            # Rows longer than a segment: a segment also follows a segment, not only enqueue.
            ["TOY", "--algorithm=dapo", "--max_resample_rounds=1", "--instruction="]
            + ["--max_prompt_tokens=16", "--max_new_tokens=40"],
            {"create", "segment", "advantages", "policy_update"},
        ),
    ],
    ids=["quickstart", "ppo", "dapo-by-admission"],
)
def test_the_planner_lowers_the_programs_the_trainer_runs(
    extra, names, tmp_path, monkeypatch, toy_model_dir, copy_task_file
):
    toy = [f"--model={toy_model_dir}", f"--data={copy_task_file}"]
    extra = [f for flag in extra for f in (toy if flag == "TOY" else [flag])]
    config = _config(str(tmp_path / "run"), *extra)
    compiled: list[str] = []

    def count(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        run, model_config = _run_recording(config, monkeypatch)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    if "segment" in names:  # every segment took its inputs in one layout: compiled once
        assert compiled.count("jit(segment)") == 1, compiled
    assert names <= set(run), sorted(run)
    planned = _planned(config, model_config, run)
    assert set(planned) == set(run) - {"advantages"}  # the plan's table leaves it out
    for name, text in planned.items():
        diff = "\n".join(difflib.unified_diff(run[name][0].splitlines(), text.splitlines(), n=0))
        assert not diff, f"{name}: the plan's program differs from the run's:\n{diff[:4000]}"
