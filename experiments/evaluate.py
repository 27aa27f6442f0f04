"""Evaluate a policy: greedy accuracy, avg@k, unbiased pass@k and maj@k over a data source,
or a paper's table over named sets.

    python -m experiments.evaluate --model=smollm2-135m-instruct --data=synthetic:arithmetic
    python -m experiments.evaluate --checkpoint=workdirs/quickstart --eval_samples=8
    python -m experiments.evaluate --flagfile=experiments/configs/quickstart.flags
    python -m experiments.evaluate --checkpoint=WORKDIR \
        --eval_sets='math500;avg@16;t=1.0,minerva_math;avg@16;t=1.0,olympiadbench;avg@16;t=1.0'

With --eval_sets (the grammar of jaxrl4llm/evalsets.py) it scores each named set with its own
protocol and prints one row per set plus their mean; without, the one --eval_data set.

The policy is the embedded model (--model=NAME), a HF folder or .gguf (--model=PATH), or a
training workdir's latest checkpoint (--checkpoint=WORKDIR). Writes a JSON and prints a table.
It takes every training flag (so a training flagfile works as is) and builds the training
config from them exactly as the trainer does; it reads the model, data, rollout (prompt
limits, max new tokens, sampling), reward and evaluation parts. It runs the trainer's own
evaluation (jaxrl4llm.evaluation.evaluate); --eval_prompts means the same as in training (N
prompts, -1 the whole split).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import flags

from experiments import train as _train  # defines the training flags (shared flagfiles)
from jaxrl4llm import cli
from jaxrl4llm.options import require
from jaxrl4llm.train.checkpoint import check_workdir


@dataclasses.dataclass(frozen=True)
class EvaluateOptions:
    """The evaluator's own options (beside every training flag).

    checkpoint: A training workdir: evaluate its latest checkpoint (overrides --model).
    split: Split of the data source.
    batch_prompts: Prompts per sampler call.
    output: JSON path (default: WORKDIR/eval.json or ./eval.json).
    """

    checkpoint: str | None = None
    split: str = "test"
    batch_prompts: int = 16
    output: str | None = None


for _name in cli.define_flags(EvaluateOptions) + _train.FLAG_NAMES:
    flags.declare_key_flag(_name)   # --help lists them; --helpfull groups them by sub-config
FLAGS = flags.FLAGS


def main(argv):
    del argv   # cli.run refuses positional arguments
    cli.quiet_logs()
    opts = cli.config_from_flags(EvaluateOptions)
    # Every flag (and --model, unless a checkpoint replaces it) checked before anything loads.
    config = _train.checked_config(check_model=not opts.checkpoint)
    require(opts.batch_prompts >= 1, f"--batch_prompts={opts.batch_prompts} must be >= 1.")
    if opts.checkpoint:
        check_workdir(opts.checkpoint, f"--checkpoint={opts.checkpoint}")
    sets = config.evaluation.sets
    require(config.evaluation.eval_prompts != 0 or sets,
            "--eval_prompts=0 evaluates nothing; pass N prompts or -1 for the whole split, or "
            "name sets with --eval_sets.")
    import jax

    from jaxrl4llm import evaluation, parallel
    from jaxrl4llm.models import registry
    from jaxrl4llm.rewards import RewardFn
    from jaxrl4llm.train.checkpoint import load_trained_policy
    from jaxrl4llm.train.config import param_dtype
    from jaxrl4llm.train.rollout import RolloutContext

    mesh = parallel.make_mesh(config.run.mesh)
    if opts.checkpoint:
        _, model_config, params, tokenizer = load_trained_policy(opts.checkpoint, mesh=mesh)
        name = opts.checkpoint
    else:
        model_config, params, tokenizer = registry.load_model(
            config.model.name, mesh=mesh, dtype=param_dtype(config.model.param_dtype))
        name = config.model.name
    model_config = config.model.compute_config(model_config)   # --compute_dtype
    spec = config.evaluation.eval_data or config.data.source
    records = (evaluation.eval_set_records(sets, config.data, split=opts.split) if sets
               else evaluation.held_out_records(config.data, config.evaluation, opts.split))
    with RewardFn("auto", config.reward) as reward_fn:
        ctx = RolloutContext.create(model_config, tokenizer, reward_fn, mesh, config.data,
                                    config.rollout)
        start = time.perf_counter()
        key = jax.random.key(config.run.seed)
        if sets:
            results = evaluation.evaluate_sets(ctx, params, sets, records, key=key,
                                               prompts_per_batch=opts.batch_prompts,
                                               progress=True, prefix="")
        else:
            results = evaluation.evaluate(ctx, params, records,
                                          samples=config.evaluation.eval_samples, key=key,
                                          prompts_per_batch=opts.batch_prompts, progress=True,
                                          prefix="")
    results["seconds"] = time.perf_counter() - start
    report = {"model": name, "split": opts.split, "results": results}
    if sets:
        report["eval_sets"] = {s.name: dataclasses.asdict(s) for s in sets}
    else:
        report["data"] = spec
    output = opts.output or os.path.join(opts.checkpoint or ".", "eval.json")
    with open(output, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    if sets:
        print(f"\n{name} ({opts.split} splits)")
        print(table(results, [s.name for s in sets]))
    else:
        print(f"\n{name} on {spec} ({opts.split}, {len(records)} prompts)")
        print(f"  {'metric':14s} value")
        for key, value in sorted(results.items()):
            print(f"  {key:14s} {value:.4f}")
    print(f"wrote {output}")
    return 0


def table(results: dict[str, float], names: list[str]) -> str:
    """One row per set (and the mean), one column per metric: the paper's table."""
    from jaxrl4llm.evalsets import MEAN
    metrics = sorted({key.split("/", 1)[1] for key in results if "/" in key} - {"num_prompts"},
                     key=lambda m: (m != "greedy", m.split("@")[0], int(m.split("@")[-1])
                                    if "@" in m else 0))
    rows = [["set", *metrics, "prompts"]]
    for name in [*names, MEAN]:
        cells = [f"{100 * results[f'{name}/{m}']:.1f}" if f"{name}/{m}" in results else "-"
                 for m in metrics]
        prompts = results.get(f"{name}/num_prompts")
        rows.append([name, *cells, f"{prompts:.0f}" if prompts is not None else ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(cell.rjust(w) if i else cell.ljust(w)
                                       for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


if __name__ == "__main__":
    cli.run(main)
