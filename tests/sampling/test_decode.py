"""Compacting finished rows out of the decode batch changes the work, never the samples."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import TINY
from jaxrl4llm.sampling import decode, sampler
from jaxrl4llm.sampling.strategies import SamplingConfig

CONFIG = dataclasses.replace(TINY, tie_word_embeddings=False, vocab_size=32, pad_token_id=0)
STOPS = (2, 3, 4, 5)  # 4 of 32 tokens stop a row: lengths spread over the whole range
N = 24


def test_levels_halve_down_to_the_minimum():
    assert decode.levels(32, True) == (32, 16, 8)
    assert decode.levels(8, True) == (8,)
    assert decode.levels(24, True) == (24, 12)  # 6 < MIN_COMPACT_ROWS
    assert decode.levels(32, False) == (32,)


def test_compacted_decode_gives_the_same_samples_with_less_work():
    params = transformer.init_params(CONFIG, jax.random.key(0))
    params["unembed"] = params["unembed"] * 10.0
    rng = np.random.default_rng(0)
    prompts = [rng.integers(6, 32, size=n).tolist() for n in rng.integers(2, 10, 8)]
    # Compaction runs the decode steps at other batch sizes (another XLA program), so the
    # logits may differ in the last bits (~1e-6) and a draw that falls that close to the edge
    # of its token's CDF interval could go either way. With key 3 every one of the ~300 draws
    # is at least 8e-5 of the mass from an edge (measured; key 1 had one at 4e-6). A slot that
    # reads another row's cache or key changes the samples outright.
    run = lambda compact: sampler.generate(  # noqa: E731
        params,
        CONFIG,
        prompts,
        SamplingConfig(temperature=1.0),
        N,
        jax.random.key(3),
        stop_ids=STOPS,
        n=4,
        compact=compact,
    )
    full, compacted = run(False), run(True)
    lengths = np.asarray(full.lengths_B)
    assert lengths.min() < 6 and lengths.max() > 12, lengths  # a real spread of lengths
    np.testing.assert_array_equal(np.asarray(compacted.tokens_BT), np.asarray(full.tokens_BT))
    np.testing.assert_array_equal(np.asarray(compacted.lengths_B), lengths)
    np.testing.assert_array_equal(np.asarray(compacted.truncated_B), np.asarray(full.truncated_B))
    np.testing.assert_allclose(
        np.asarray(compacted.logprobs_BT), np.asarray(full.logprobs_BT), atol=1e-5
    )
    assert int(compacted.num_steps) == int(full.num_steps) == lengths.max()
    # Without compaction every step computes all 32 rows; with it, at most the live rows
    # rounded up to a level, and at least the live rows (a row is live for length - 1 steps).
    steps = int(full.num_steps) - 1
    assert int(full.slot_steps) == 32 * steps
    live = int((lengths - 1).sum())
    assert live <= int(compacted.slot_steps) < int(full.slot_steps)


def test_greedy_rows_stay_greedy_when_compacted():
    """ReMax's greedy baseline row keeps decoding greedily after its slot moves: it equals a
    greedy decode of the same prompt (argmax of the logits, checked by a separate run)."""
    params = transformer.init_params(CONFIG, jax.random.key(0))
    params["unembed"] = params["unembed"] * 10.0
    rng = np.random.default_rng(2)
    prompts = [rng.integers(6, 32, size=n).tolist() for n in rng.integers(2, 10, 8)]
    run = lambda compact: sampler.generate(  # noqa: E731
        params,
        CONFIG,
        prompts,
        SamplingConfig(temperature=1.0),
        N,
        jax.random.key(1),
        stop_ids=STOPS,
        n=4,
        greedy_last=1,
        compact=compact,
    )
    full, compacted = run(False), run(True)
    assert int(compacted.slot_steps) < int(full.slot_steps)  # compaction did happen
    np.testing.assert_array_equal(np.asarray(compacted.tokens_BT), np.asarray(full.tokens_BT))
    greedy = sampler.generate(
        params,
        CONFIG,
        prompts,
        SamplingConfig(temperature=0.0),
        N,
        jax.random.key(7),
        stop_ids=STOPS,
        n=1,
        compact=False,
    )
    last = np.arange(3, 32, 4)  # each prompt's 4th sample is its greedy row
    np.testing.assert_array_equal(
        np.asarray(compacted.tokens_BT)[last], np.asarray(greedy.tokens_BT)
    )
    # ... while the sampled rows are not greedy (so the check above can fail).
    sampled = np.asarray(compacted.tokens_BT).reshape(8, 4, N)[:, :3]
    assert (sampled != np.asarray(greedy.tokens_BT)[:, None]).any(axis=-1).mean() > 0.5
