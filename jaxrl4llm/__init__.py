"""jaxrl4llm: a JAX-native reinforcement-learning trainer for LLM reasoning.

Subpackages, bottom layer first (docs/architecture.md, "Layers"):
  config    config trees whose leaf fields are the options; user errors and exit codes; the
            absl flags and the entry points' error contract (config/cli.py)
  parallel  device mesh, logical-axis sharding rules, multi-host start-up
  rl        pure, jittable RL math (advantages, filters, losses, metrics, algorithm presets)
  models    the decoder (Llama / Qwen2 / Qwen3 / Mistral), its parameter schema, weights,
            tokenizer, Hub access
  sampling  the sampling front-end and the jitted KV-cache sampler
  rewards   verifiers (math, countdown, knights and knaves)
  data      prompt sources and procedural tasks
  train     the training loop, state, checkpoints and metrics
"""

__version__ = "0.1.0"
