"""tools/profile_decode.py --trace: every op of the compiled decode loop lands in the category
its HLO says (dense matmul, attention over the cache, unembedding, vocabulary work, other),
and nothing outside the loop (the prefill) is counted."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import TINY
from jaxrl4llm.sampling import sampler
from jaxrl4llm.sampling.strategies import SamplingConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools import profile_decode  # noqa: E402

# A vocabulary much larger than any layer activation, so "vocabulary-sized" is unambiguous.
CONFIG = dataclasses.replace(TINY, vocab_size=1024)
B, P, N = 4, 5, 6


def test_shape_helpers():
    assert profile_decode._elements("f32[32,3072,16]{2,1,0}") == 32 * 3072 * 16
    assert profile_decode._elements("(pred[32]{0}, s32[32,7]{1,0})") == 32 * 7
    assert profile_decode._elements("s32[]") == 1
    assert profile_decode._rank("f32[32,3,3,192]{3,2,1,0}") == 4
    assert profile_decode._rank("f32[32,576]{1,0}") == 2
    # Two ops side by side count once: [0, 3] covered, then [5, 6].
    assert profile_decode.busy_ms([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (1.5, 2.5)]) == 4.0
    assert profile_decode.busy_ms([]) == 0.0


def test_decode_loop_ops_are_categorized_from_the_compiled_hlo():
    params = transformer.init_params(CONFIG, jax.random.key(0))
    inputs = (
        params,
        jnp.full((B, P), 7, jnp.int32),
        jnp.ones((B, P), bool),
        jnp.ones((B,), bool),
        jax.random.split(jax.random.key(1), B),
        jnp.full((1,), -1, jnp.int32),
        jnp.int32(0),
    )
    hlo = (
        sampler.generate_tokens.lower(
            *inputs,
            model_config=CONFIG,
            sampling=SamplingConfig(temperature=1.0),
            max_new_tokens=N,
            compact=False,
        )
        .compile()
        .as_text()
    )
    categories = profile_decode.categorize_ops(hlo, B, CONFIG.vocab_size)
    found = set(categories.values())
    assert found >= set(profile_decode.CATEGORIES[:4]), found
    # Only instructions of the decode loop's body: the prefill's ops (outside the while loop)
    # are not counted, and every counted one that names its source is in a while body.
    for name in categories:
        line = next(x for x in hlo.splitlines() if f"%{name} = " in x)
        assert "op_name=" not in line or "/while/body/" in line, line
    everything = profile_decode.categorize_ops(hlo, B, CONFIG.vocab_size, loop_only=False)
    assert len(everything) > len(categories)
    # The loop's matmuls, counted by hand: 7 dense ones per layer (q, k, v, o, gate, up, down)
    # and one unembedding, each its own op (XLA fuses a dot with elementwise neighbours, not
    # with another dot; ops inside a fusion are not counted again).
    counts = {c: sum(v == c for v in categories.values()) for c in profile_decode.CATEGORIES}
    assert counts[profile_decode.CATEGORIES[2]] == 1, counts
    assert counts[profile_decode.CATEGORIES[0]] == 7 * CONFIG.num_layers, counts
