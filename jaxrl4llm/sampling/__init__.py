"""The jitted KV-cache sampler, its front-end and its sampling strategies.

from jaxrl4llm.sampling import Sampler, SamplingConfig
sampler = Sampler(config, tokenizer)
out = sampler.generate(params, prompt_ids, SamplingConfig(1.0), 256, key, group_size=8)
"""

from jaxrl4llm.sampling.frontend import Sampler, Samples
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.sampling.sampler import generate, generate_tokens
from jaxrl4llm.sampling.strategies import GREEDY, SamplingConfig

__all__ = [
    "GREEDY",
    "RowLayout",
    "SampleOutput",
    "Sampler",
    "Samples",
    "SamplingConfig",
    "generate",
    "generate_tokens",
]
