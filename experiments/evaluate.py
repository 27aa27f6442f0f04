"""Evaluate a policy: greedy accuracy, avg@k, unbiased pass@k and maj@k over a data source,
or a paper's table over named sets.

    python -m experiments.evaluate --checkpoint=workdirs/quickstart
    python -m experiments.evaluate --checkpoint=workdirs/quickstart --eval_samples=8
    python -m experiments.evaluate --checkpoint=workdirs/quickstart --samples_out=samples.jsonl
    python -m experiments.evaluate --flagfile=experiments/configs/quickstart.flags
    python -m experiments.evaluate --checkpoint=WORKDIR --eval_prompts=0 \
        --eval_sets='math500;avg@16;t=1.0,minerva_math;avg@16;t=1.0,olympiadbench;avg@16;t=1.0'

The policy is a training workdir's checkpoint (--checkpoint=WORKDIR: its latest, or
--checkpoint_step=N), the embedded model (--model=NAME), a HF folder or .gguf (--model=PATH).
It takes every training flag (so a training flagfile works as is). With --checkpoint every
setting comes from the run's WORKDIR/config.json, except the flags given (on the command line
or in a --flagfile), which win; without, from the flags and the trainer's defaults. A header
says where each setting that shapes the score came from. It runs the trainer's own evaluation
(jaxrl4llm.eval.evaluator.evaluate_run, with the key of the run's evaluation at that step): the
--eval_data set (--eval_prompts N prompts, -1 the whole split, 0 none) and each --eval_sets set
with its own protocol, so a run's final checkpoint scores what the run logged at its end.

It prints the scores (one row per named set plus their mean) and writes them with the settings
to a JSON, never over a run's own files: --output, else WORKDIR/eval/STEP-WHAT.json for a
checkpoint, else workdirs/eval/MODEL-WHAT.json, WHAT naming the data (the split alone for the
run's own held-out data) and the sets. --samples_out=PATH also writes every completion (its
prompt, text, answer key and verdict) as JSON Lines (keys: jaxrl4llm/eval/samples.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from typing import TYPE_CHECKING, Any

from absl import flags

from experiments import train as _train  # defines the training flags (shared flagfiles)
from jaxrl4llm.config import cli, options, paths
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.config.options import require
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate

if TYPE_CHECKING:
    from jaxrl4llm.eval.samples import SamplesWriter, Sink


@dataclasses.dataclass(frozen=True)
class EvaluateOptions:
    """The evaluator's own options (beside every training flag).

    checkpoint: A training workdir: evaluate its checkpoint with the run's saved settings
        (WORKDIR/config.json; the flags given override them).
    checkpoint_step: Which checkpoint of --checkpoint (default: the latest).
    split: Split of the data source.
    batch_prompts: Prompts per sampler call.
    output: JSON path (default: WORKDIR/eval/STEP-WHAT.json for a checkpoint, else
        workdirs/eval/MODEL-WHAT.json).
    samples_out: JSON Lines path: one record per completion (set, prompt, completion, answer
        key, verdict, tokens; keys in jaxrl4llm/eval/samples.py), written as each batch is
        scored (default: none).
    """

    checkpoint: str | None = None
    checkpoint_step: int | None = None
    split: str = "test"
    batch_prompts: int = 16
    output: str | None = None
    samples_out: str | None = None


for _name in cli.define_flags(EvaluateOptions) + _train.FLAG_NAMES:
    flags.declare_key_flag(_name)  # --help lists them; --helpfull groups them by sub-config
FLAGS = flags.FLAGS

COMMAND_LINE, RUN_CONFIG, DEFAULT = "command line", "run config", "default"
# The settings that shape a score, shown with where each came from.
SHOWN = (
    "model",
    "param_dtype",
    "compute_dtype",
    "data",
    "eval_data",
    "eval_sets",
    "instruction",
    "system_prompt",
    "example",
    "answer_mode",
    "max_prompt_tokens",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "eval_prompts",
    "eval_samples",
    "seed",
    "mesh",
)
# What a checkpoint's weights are: a run's own, never another value.
CHECKPOINT_FIXED = ("model", "param_dtype")
EVAL_FOLDER = os.path.join("workdirs", "eval")  # a base model's results (no workdir)


def main(argv):
    del argv  # cli.run refuses positional arguments
    cli.quiet_logs()
    opts = cli.config_from_flags(EvaluateOptions)
    require(opts.batch_prompts >= 1, f"--batch_prompts={opts.batch_prompts} must be >= 1.")
    return evaluate_command(opts, cli.given_values(TrainConfig))


@dataclasses.dataclass(frozen=True)
class Plan:
    """One evaluation: the settings, where each came from (flag name -> COMMAND_LINE,
    RUN_CONFIG or DEFAULT), and the checkpoint (workdir, step) or None for a base model
    (step 0, whose key is that of the trainer's evaluation before its first step)."""

    config: TrainConfig
    origins: dict[str, str]
    checkpoint: str | None = None
    step: int = 0

    @property
    def name(self) -> str:
        return self.checkpoint or self.config.model.name

    @property
    def held_out_origin(self) -> str:
        """Where the held-out source came from (--eval_data, else --data)."""
        return self.origins["eval_data" if self.config.evaluation.eval_data else "data"]


def plan(opts: EvaluateOptions, given: dict[str, Any]) -> Plan:
    """The settings of an evaluation: a checkpoint's run config (else the trainer's defaults)
    with the `given` flags ({flag name: value}) over them."""
    from jaxrl4llm.train.infra.checkpoint import checkpoint_step, read_run_config

    if opts.checkpoint is None:
        if opts.checkpoint_step is not None:
            raise FlagError(
                f"--checkpoint_step={opts.checkpoint_step} needs "
                "--checkpoint=WORKDIR (the training run whose checkpoint to load)."
            )
        base, origin, step = TrainConfig(), DEFAULT, 0
    else:
        base, origin = read_run_config(opts.checkpoint), RUN_CONFIG
        step = checkpoint_step(opts.checkpoint, opts.checkpoint_step)
        saved = options.flatten(base)
        for name in CHECKPOINT_FIXED:
            if name in given and given[name] != saved[name]:
                raise FlagError(
                    f"--{name}={options.format_value(given[name])} with "
                    f"--checkpoint={opts.checkpoint}: that run trained --{name}="
                    f"{options.format_value(saved[name])}, which its checkpoint holds. Drop "
                    f"--{name} (or evaluate that model without --checkpoint)."
                )
        if "data" in given and "eval_data" not in given:
            given = {**given, "eval_data": None}  # the --data given is the held-out source
    try:
        config = options.replace(base, **given)
    except ValueError as exc:  # a flag the saved config's groups reject
        raise FlagError(str(exc)) from exc
    origins = {name: COMMAND_LINE if name in given else origin for name in options.flatten(config)}
    result = Plan(config, origins, opts.checkpoint, step)
    e = config.evaluation
    if e.eval_prompts == 0 and not e.sets:
        where = (
            f"the run config of {opts.checkpoint}"
            if origins["eval_prompts"] == RUN_CONFIG
            else f"the {origins['eval_prompts']}"
        )
        raise FlagError(
            f"--eval_prompts=0 evaluates nothing (from {where}); pass --eval_prompts=N prompts "
            "or -1 for the whole split, or name sets with --eval_sets."
        )
    if e.eval_samples < 1:
        raise FlagError(f"--eval_samples={e.eval_samples} must be >= 1 (1 = greedy only).")
    return result


def check(p: Plan) -> None:
    """Every setting of the plan checked (a FlagError names the flag and the fix), and the
    base model found when no checkpoint names it, before any data or model is read."""
    from jaxrl4llm import parallel
    from jaxrl4llm.models import registry

    parallel.maybe_initialize_distributed(auto_detect=p.config.run.distributed)
    import jax

    with cli.flag_errors():
        validate(p.config, jax.device_count())
    if not p.checkpoint:
        registry.check(p.config.model.name)


def _slug(text: str, limit: int = 80) -> str:
    """`text` as a file-name part: runs of other characters than [A-Za-z0-9_.] as one '-'."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-.")[:limit] or "model"


def output_path(opts: EvaluateOptions, p: Plan) -> str:
    """--output, else WORKDIR/eval/STEP-WHAT.json or workdirs/eval/MODEL-WHAT.json: WHAT is
    the held-out source's name (its path's last part and options; omitted for a run's own),
    the set names joined by '+', and the split."""
    if opts.output:
        return opts.output
    e = p.config.evaluation
    parts = []
    if e.eval_prompts != 0 and not (p.checkpoint and p.held_out_origin == RUN_CONFIG):
        path, query, options_text = (e.eval_data or p.config.data.source).partition("?")
        parts.append(_slug(os.path.basename(path.rstrip("/")) + query + options_text))
    if e.sets:
        parts.append("+".join(s.name for s in e.sets))
    what = "-".join([*parts, _slug(opts.split)])
    if p.checkpoint:
        return paths.join(p.checkpoint, "eval", f"{p.step}-{what}.json")
    model = _slug(os.path.basename(p.config.model.name.rstrip("/\\")))
    return os.path.join(EVAL_FOLDER, f"{model}-{what}.json")


_NONE_MEANS = {
    "eval_data": "--data",
    "compute_dtype": "the parameter dtype",
    "instruction": "the record's own, else the boxed-answer instruction",
}


def _shown_value(name: str, value: Any, split: str) -> str:
    if value is None and name in _NONE_MEANS:
        return f"none ({_NONE_MEANS[name]}{', split ' + split if name == 'eval_data' else ''})"
    if isinstance(value, str) and name in ("instruction", "system_prompt"):
        return repr(value)  # shows '' (no instruction)
    return options.format_value(value)


def settings(p: Plan) -> dict[str, dict[str, Any]]:
    """{flag name: {"value": ..., "from": origin}} of the SHOWN settings."""
    values = options.flatten(p.config)
    return {name: {"value": values[name], "from": p.origins[name]} for name in SHOWN}


def settings_header(p: Plan, split: str) -> str:
    """The settings table printed before the scores: value and origin of each SHOWN one."""
    source = (
        f"{RUN_CONFIG} = {os.path.join(p.checkpoint, 'config.json')}"
        if p.checkpoint
        else f"{DEFAULT} = the trainer's default"
    )
    rows = [
        (name, _shown_value(name, s["value"], split), s["from"]) for name, s in settings(p).items()
    ]
    width = max(len(value) for _, value, _ in rows)
    lines = [f"settings ({COMMAND_LINE} = flags given, a --flagfile's included; {source})"]
    lines += [f"  {name:18s} {value:{width}s}  {origin}" for name, value, origin in rows]
    return "\n".join(lines)


def evaluate_command(opts: EvaluateOptions, given: dict[str, Any]) -> int:
    """Evaluates the policy the flags name, prints the settings and scores, writes the JSON."""
    p = plan(opts, given)
    check(p)
    output = output_path(opts, p)
    checkpoint = f" checkpoint {p.step}" if p.checkpoint else ""
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open_samples_out(opts.samples_out)) if opts.samples_out else None
        print(f"Evaluating {p.name}{checkpoint}\n{settings_header(p, opts.split)}", flush=True)
        results, num_records = run_evaluation(p, opts, sink)
    config, sets = p.config, p.config.evaluation.sets
    report = {
        "model": p.name,
        "base_model": config.model.name,
        "split": opts.split,
        "checkpoint_step": p.step if p.checkpoint else None,
        "results": results,
        "settings": settings(p),
        "config": options.to_dict(config),
    }
    if num_records:
        report["data"] = config.evaluation.eval_data or config.data.source
    if sets:
        report["eval_sets"] = {s.name: dataclasses.asdict(s) for s in sets}
    if opts.samples_out:
        report["samples_out"] = opts.samples_out
    paths.write_text(output, json.dumps(report, indent=2, sort_keys=True, default=str))
    if num_records:
        print(f"\n{p.name}{checkpoint} on {report['data']} ({opts.split}, {num_records} prompts)")
        print(f"  {'metric':14s} value")
        for key, value in sorted(results.items()):
            if "/" not in key:
                print(f"  {key:14s} {value:.4f}")
    if sets:
        print(f"\n{p.name}{checkpoint} ({opts.split} splits)")
        print(table(results, [s.name for s in sets]))
    print(f"wrote {output}" + (f" and {opts.samples_out}" if opts.samples_out else ""))
    return 0


def open_samples_out(path: str) -> SamplesWriter:
    """The --samples_out writer (eval.samples.SamplesWriter; its folder created), opened
    before any model loads, so a path that cannot be written stops the command first."""
    from jaxrl4llm.eval.samples import SamplesWriter

    try:
        return SamplesWriter(path)
    except OSError as exc:
        raise FlagError(
            f"--samples_out={path} cannot be written ({exc.strerror or exc}): pass a file "
            "path in a folder you can write to, or drop --samples_out."
        ) from exc


def run_evaluation(
    p: Plan, opts: EvaluateOptions, sink: Sink | None = None
) -> tuple[dict[str, float], int]:
    """The scores (the trainer's evaluation, unprefixed, plus "seconds") and the number of
    --eval_data prompts scored; `sink` receives every completion's record."""
    from jaxrl4llm import parallel
    from jaxrl4llm.envs import open_env_service
    from jaxrl4llm.eval import evaluator
    from jaxrl4llm.models import registry
    from jaxrl4llm.rewards import RewardFn
    from jaxrl4llm.sampling.context import RolloutContext
    from jaxrl4llm.train.config import param_dtype
    from jaxrl4llm.train.trained import load_trained_policy

    config = p.config
    sets = config.evaluation.sets
    records = evaluator.held_out_records(config.data, config.evaluation, opts.split)
    set_records = evaluator.eval_set_records(sets, config.data, split=opts.split)
    mesh = parallel.make_mesh(config.run.mesh)
    if p.checkpoint:
        _, model_config, params, tokenizer = load_trained_policy(p.checkpoint, p.step, mesh=mesh)
    else:
        model_config, params, tokenizer = registry.load_model(
            config.model.name, mesh=mesh, dtype=param_dtype(config.model.param_dtype)
        )
    model_config = config.model.compute_config(model_config)  # --compute_dtype
    env_service = open_env_service(config.rollout, tokenizer, config.reward)
    with RewardFn("auto", config.reward) as reward_fn, contextlib.ExitStack() as stack:
        if env_service is not None:
            stack.callback(env_service.close)
        # The run's own environment (--env): a tool-using policy is evaluated with its tools.
        ctx = RolloutContext.create(
            model_config,
            tokenizer,
            reward_fn,
            mesh,
            config.data,
            config.rollout,
            turn_handlers=env_service,
        )
        start = time.perf_counter()
        results = evaluator.evaluate_run(
            ctx,
            params,
            records,
            sets,
            set_records,
            samples=config.evaluation.eval_samples,
            key=evaluator.eval_key(config.run.seed, p.step),
            prompts_per_batch=opts.batch_prompts,
            prefix="",
            progress=True,
            sink=sink,
        )
    results["seconds"] = time.perf_counter() - start
    return results, len(records)


def table(results: dict[str, float], names: list[str]) -> str:
    """One row per set (and the mean), one column per metric: the paper's table."""
    from jaxrl4llm.eval.sets import MEAN

    metrics = sorted(
        {key.split("/", 1)[1] for key in results if "/" in key} - {"num_prompts"},
        key=lambda m: (m != "greedy", m.split("@")[0], int(m.split("@")[-1]) if "@" in m else 0),
    )
    rows = [["set", *metrics, "prompts"]]
    for name in [*names, MEAN]:
        cells = [
            f"{100 * results[f'{name}/{m}']:.1f}" if f"{name}/{m}" in results else "-"
            for m in metrics
        ]
        prompts = results.get(f"{name}/num_prompts")
        rows.append([name, *cells, f"{prompts:.0f}" if prompts is not None else ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  "
        + "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    )


if __name__ == "__main__":
    cli.run(main)
