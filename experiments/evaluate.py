"""Evaluate a policy: greedy accuracy, avg@k, unbiased pass@k and maj@k over a data source.

    python -m experiments.evaluate --model=smollm2-135m-instruct --data=synthetic:arithmetic
    python -m experiments.evaluate --checkpoint=workdirs/quickstart --eval_samples=8
    python -m experiments.evaluate --flagfile=experiments/configs/quickstart.flags

The policy is the embedded model (--model=NAME), a HF folder or .gguf (--model=PATH), or a
training workdir's latest checkpoint (--checkpoint=WORKDIR). Writes a JSON and prints a table.
It runs the same code as the trainer's periodic evaluation (jaxrl4llm.evaluation.evaluate).
It takes every training flag (so a training flagfile works as is); here --eval_prompts=0
means the whole split.
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

# The training flags (model, data, sampling, answer_mode, mesh, eval_prompts, eval_samples,
# ...) are shared, so a training flagfile evaluates as is; these are the evaluator's own.
from experiments import train as _train_flags  # noqa: E402,F401  (defines the shared flags)

flags.DEFINE_string("checkpoint", None, "A training workdir: evaluate its latest checkpoint "
                    "(overrides --model).")
flags.DEFINE_string("split", "test", "Split of the data source.")
flags.DEFINE_integer("batch_prompts", 16, "Prompts per sampler call.")
flags.DEFINE_string("output", None, "JSON path (default: WORKDIR/eval.json or ./eval.json).")

FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments {argv[1:]}: every option is a --flag.")
    import jax

    from jaxrl4llm import evaluation, parallel
    from jaxrl4llm.data import make_source
    from jaxrl4llm.models import registry
    from jaxrl4llm.rewards import make_reward_fn
    from jaxrl4llm.train.checkpoint import load_trained_policy
    from jaxrl4llm.train.config import TrainConfig, param_dtype
    from jaxrl4llm.train.rollout import RolloutContext

    mesh = parallel.make_mesh(FLAGS.mesh)
    if FLAGS.checkpoint:
        _, model_config, params, tokenizer = load_trained_policy(FLAGS.checkpoint, mesh=mesh)
        name = FLAGS.checkpoint
    else:
        model_config, params, tokenizer = registry.load_model(
            FLAGS.model, mesh=mesh, dtype=param_dtype(FLAGS.param_dtype))
        name = FLAGS.model
    spec = FLAGS.eval_data or FLAGS.data
    field_names = {k: getattr(FLAGS, k) for k in ("prompt_field", "answer_field")
                   if getattr(FLAGS, k)}
    source = make_source(spec, split=FLAGS.split, **field_names)
    count = len(source) if FLAGS.eval_prompts == 0 else min(FLAGS.eval_prompts, len(source))
    records = [source[i] for i in range(count)]
    config = TrainConfig(model=name, data=spec, instruction=FLAGS.instruction,
                         system_prompt=FLAGS.system_prompt, max_new_tokens=FLAGS.max_new_tokens,
                         max_prompt_tokens=FLAGS.max_prompt_tokens,
                         temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k)
    with make_reward_fn("auto", answer_mode=FLAGS.answer_mode) as reward_fn:
        ctx = RolloutContext(config, model_config, tokenizer, reward_fn, mesh)
        start = time.perf_counter()
        results = evaluation.evaluate(ctx, params, records, samples=FLAGS.eval_samples,
                                      key=jax.random.key(FLAGS.seed),
                                      prompts_per_batch=FLAGS.batch_prompts, progress=True,
                                      prefix="")
    results["seconds"] = time.perf_counter() - start
    report = {"model": name, "data": spec, "split": FLAGS.split, "results": results}
    output = FLAGS.output or os.path.join(FLAGS.checkpoint or ".", "eval.json")
    with open(output, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    print(f"\n{name} on {spec} ({FLAGS.split}, {count} prompts)")
    print(f"  {'metric':14s} value")
    for key, value in sorted(results.items()):
        print(f"  {key:14s} {value:.4f}")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
