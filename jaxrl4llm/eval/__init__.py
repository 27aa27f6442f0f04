"""Held-out evaluation, the same in the trainer and in experiments/evaluate.py.

    sets.py        the --eval_sets grammar: named sets and the metrics each asks for
    config.py      EvalConfig, the `evaluation` options of the training config
    protocols.py   avg@k, unbiased pass@k, maj@k over a [prompts, K] table (pure numpy)
    evaluator.py   draws and scores completions (sampling.rounds, the trainer's entry point)
                   and reports the protocols: evaluate, evaluate_sets, evaluate_run, eval_key
    samples.py     the per-sample records a `sink` of the evaluator receives (--samples_out)

This package imports nothing from train/ (tests/test_layers.py).
"""
