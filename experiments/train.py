"""Train a policy with RL from verifiable rewards.

    python -m experiments.train --flagfile=experiments/configs/quickstart.flags
    python -m experiments.train --flagfile=... --algorithm=lite_ppo --clip_high=0.28

`--algorithm` picks a preset (grpo, dr_grpo, reinforce, reinforce_rej, reinforce_pp,
reinforce_pp_baseline, lite_ppo, rloo, raft, raft_pp); every knob of rl.AlgorithmConfig is
also a flag of the same name that overrides the preset. Flags on the command line override
the flagfile. The resolved configuration is written to WORKDIR/config.json.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import typing

from absl import app, flags, logging

from jaxrl4llm import parallel, rl
from jaxrl4llm.train.config import TrainConfig, algorithm_overrides
from jaxrl4llm.train.state import OptimizerConfig

_T = TrainConfig()
_O = OptimizerConfig()

# --- model
flags.DEFINE_string("model", _T.model, "Registered model name, HF folder or .gguf file.")
flags.DEFINE_enum("param_dtype", _T.param_dtype, ["float32", "bfloat16"], "Parameter dtype.")
flags.DEFINE_bool("remat", _T.remat, "Rematerialise each layer in the backward pass.")
flags.DEFINE_bool("share_prompts", _T.share_prompts, "Reference / old-policy / update passes "
                  "run each prompt once per group (same result, less compute and memory).")
# --- data
flags.DEFINE_string("data", _T.data, "Prompt source: synthetic:TASK?opts, jsonl:PATH, "
                    "parquet:PATH, tfds:NAME ({split} in a path is replaced by the split).")
flags.DEFINE_string("eval_data", _T.eval_data, "Held-out source (default: --data, split test).")
flags.DEFINE_string("prompt_field", None, "Column holding the question (default: auto).")
flags.DEFINE_string("answer_field", None, "Column holding the reference answer (default: auto).")
flags.DEFINE_string("instruction", _T.instruction, "Instruction appended to each question "
                    "(default: the boxed-answer instruction of the Minimalist paper).")
flags.DEFINE_string("system_prompt", _T.system_prompt, "Optional system turn.")
# --- rollout
flags.DEFINE_integer("prompts_per_step", _T.prompts_per_step, "Prompts per step (global).")
flags.DEFINE_integer("group_size", _T.group_size, "Samples per prompt (G).")
flags.DEFINE_integer("max_prompt_tokens", _T.max_prompt_tokens, "Longest prompt in tokens.")
flags.DEFINE_integer("max_new_tokens", _T.max_new_tokens, "Longest completion in tokens.")
flags.DEFINE_float("temperature", _T.temperature, "Sampling temperature.")
flags.DEFINE_float("top_p", _T.top_p, "Nucleus sampling mass (1 = off).")
flags.DEFINE_integer("top_k", _T.top_k, "Top-k sampling (0 = off).")
flags.DEFINE_enum("long_prompts", _T.long_prompts, ["error", "drop"],
                  "Prompts over --max_prompt_tokens: stop with an error, or drop and count.")
flags.DEFINE_integer("rollout_micro_batch", _T.rollout_micro_batch,
                     "Rows per sampler / reference / old-logprob pass, run one after another "
                     "(0 = all rows at once); bounds the KV cache and activation memory.")
# --- algorithm: a preset, then one overriding flag per AlgorithmConfig knob
flags.DEFINE_enum("algorithm", "grpo", sorted(rl.PRESETS), "Algorithm preset.")
_KNOBS = [f for f in dataclasses.fields(rl.AlgorithmConfig) if f.name != "name"]
_KNOB_TYPES = typing.get_type_hints(rl.AlgorithmConfig)
for _f in _KNOBS:
    flags.DEFINE_string(_f.name, None, f"AlgorithmConfig.{_f.name} ({_KNOB_TYPES[_f.name]}); "
                        "overrides the preset ('none' for None).")
# --- reward
flags.DEFINE_enum("reward_scale", _T.reward_scale, ["01", "pm1"], "{0,1} or {-1,1} rewards.")
flags.DEFINE_float("format_penalty", _T.format_penalty, "Penalty for a missing boxed answer.")
flags.DEFINE_integer("overlong_buffer", _T.overlong_buffer,
                     "DAPO soft overlong punishment window in tokens (0 = off).")
flags.DEFINE_integer("reward_workers", _T.reward_workers, "Verifier worker processes.")
flags.DEFINE_enum("answer_mode", _T.answer_mode, ["boxed", "lenient"],
                  "Final answer: the last \\boxed{}; lenient also accepts the last number.")
# --- optimisation
flags.DEFINE_float("learning_rate", _O.learning_rate, "AdamW peak learning rate.")
flags.DEFINE_integer("warmup_steps", _O.warmup_steps, "Linear warmup (optimizer updates).")
flags.DEFINE_enum("lr_schedule", _O.schedule, ["constant", "cosine", "linear"], "Decay.")
flags.DEFINE_integer("decay_steps", _O.decay_steps, "Updates to decay over (0 = none).")
flags.DEFINE_float("weight_decay", _O.weight_decay, "AdamW weight decay.")
flags.DEFINE_float("max_grad_norm", _O.max_grad_norm, "Global-norm clip (0 = off).")
flags.DEFINE_float("adam_b1", _O.b1, "Adam beta1.")
flags.DEFINE_float("adam_b2", _O.b2, "Adam beta2.")
flags.DEFINE_float("adam_eps", _O.eps, "Adam epsilon.")
flags.DEFINE_integer("mini_batch_size", _T.mini_batch_size,
                     "Rows per optimizer update (0 = the whole batch).")
flags.DEFINE_integer("ppo_epochs", _T.ppo_epochs, "Passes over each rollout batch.")
flags.DEFINE_integer("micro_batch_size", _T.micro_batch_size,
                     "Rows per gradient-accumulation slice (0 = the mini-batch).")
flags.DEFINE_bool("recompute_old_logprobs", _T.recompute_old_logprobs,
                  "Recompute pi_old with a teacher-forced pass (else the sampler's logprobs).")
# --- run
flags.DEFINE_integer("num_steps", _T.num_steps, "Training steps (rollouts).")
flags.DEFINE_string("mesh", _T.mesh, "Mesh spec, e.g. data:1,fsdp:-1,tensor:1.")
flags.DEFINE_integer("eval_every", _T.eval_every, "Steps between evals (0 = at the end only).")
flags.DEFINE_integer("eval_prompts", _T.eval_prompts, "Held-out prompts per eval (0 = none).")
flags.DEFINE_integer("eval_samples", _T.eval_samples, "k of avg@k / pass@k (1 = greedy only).")
flags.DEFINE_integer("checkpoint_every", _T.checkpoint_every, "Steps between checkpoints.")
flags.DEFINE_integer("keep_checkpoints", _T.keep_checkpoints, "Checkpoints to keep.")
flags.DEFINE_string("workdir", _T.workdir, "Output folder; a run resumes from its checkpoints.")
flags.DEFINE_integer("seed", _T.seed, "Random seed.")
flags.DEFINE_bool("tensorboard", _T.tensorboard, "Also write TensorBoard event files.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize (multi-host).")

FLAGS = flags.FLAGS


def _parse_knob(name: str, text: str):
    """A knob flag's string -> the AlgorithmConfig field's type."""
    kind = _KNOB_TYPES[name]
    if text.lower() in ("none", "null", ""):
        return None
    args = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
    base = typing.get_origin(args[0]) or args[0]
    try:
        if base is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if base is tuple:
            return tuple(float(x) for x in text.split(","))
        return base(text)
    except ValueError:
        raise app.UsageError(f"--{name}={text!r} is not a valid {kind}.") from None


def config_from_flags() -> TrainConfig:
    knobs = {f.name: _parse_knob(f.name, getattr(FLAGS, f.name)) for f in _KNOBS
             if getattr(FLAGS, f.name) is not None}
    algorithm = algorithm_overrides(rl.get_preset(FLAGS.algorithm), **knobs)
    optimizer = OptimizerConfig(
        learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
        schedule=FLAGS.lr_schedule, decay_steps=FLAGS.decay_steps,
        weight_decay=FLAGS.weight_decay, max_grad_norm=FLAGS.max_grad_norm, b1=FLAGS.adam_b1,
        b2=FLAGS.adam_b2, eps=FLAGS.adam_eps)
    plain = {f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(TrainConfig)
             if f.name not in ("algorithm", "optimizer")}
    return TrainConfig(algorithm=algorithm, optimizer=optimizer, **plain)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments {argv[1:]}: every option is a --flag.")
    parallel.maybe_initialize_distributed(auto_detect=FLAGS.distributed)
    config = config_from_flags()
    from jaxrl4llm.train import loop  # heavy imports after flag parsing: fast --help
    summary = loop.run(config)
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
