"""The jitted KV-cache sampler and its sampling strategies.

    from jaxrl4llm.sampling import Sampler, SamplingConfig
    sampler = Sampler(config, tokenizer)
    out = sampler.generate(params, prompt_ids, SamplingConfig(1.0), 256, key, n=8)
"""
from jaxrl4llm.sampling.sampler import SampleOutput, Sampler, generate, generate_tokens
from jaxrl4llm.sampling.strategies import GREEDY, SamplingConfig

__all__ = ["GREEDY", "SampleOutput", "Sampler", "SamplingConfig", "generate", "generate_tokens"]
