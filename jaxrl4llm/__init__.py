"""jaxrl4llm: a JAX-native reinforcement-learning trainer for LLM reasoning.

Subpackages:
  rl        pure, jittable RL math (advantages, filters, losses, algorithm presets)
  models    the decoder (Llama / Qwen2 / Qwen3) and its weights / tokenizer
  sampling  the jitted KV-cache sampler
  rewards   verifiers (math, countdown, knights and knaves)
  data      prompt sources and procedural tasks
  train     the training loop, state, checkpoints and metrics
  parallel  device mesh and logical-axis sharding rules
"""

__version__ = "0.1.0"
