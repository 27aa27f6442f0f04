"""Continuous batching (sampling/continuous.py): the same samples as the compacted sampler,
whatever the number of slots, the lengths, dropped prompts or greedy rows; less decode work."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError, UserError
from jaxrl4llm.models import transformer
from jaxrl4llm.sampling import Sampler, continuous, sampler
from jaxrl4llm.sampling.strategies import GREEDY, SamplingConfig

from tests.sampling.test_sampler import alone_logprobs, assert_rows_equal_alone, chosen

# A stop token the random model emits often, so completion lengths differ row to row.
STOP = (5, 9)
N = 20
SAMPLED = SamplingConfig(temperature=1.0, top_k=12)


@pytest.fixture(scope="module")
def toy(toy_model_dir):
    from jaxrl4llm.models import registry

    config, params, _ = registry.load_model(toy_model_dir)
    return config, params


def _prompts(config, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(7, config.vocab_size, size=n).tolist() for n in lengths]


def _both(config, params, prompts, sampling, slots, **kw):
    """(today's compacted output, the continuous one), same prompts and key."""
    args = (params, config, prompts, sampling, N, jax.random.key(3))
    kw = dict(stop_ids=STOP, **kw)
    return (sampler.generate(*args, **kw), sampler.generate(*args, decode_slots=slots, **kw))


def _assert_same_samples(a, b):
    for field in (
        "tokens_BT",
        "mask_BT",
        "lengths_B",
        "truncated_B",
        "dropped_B",
        "prompt_tokens_BP",
        "prompt_mask_BP",
    ):
        np.testing.assert_array_equal(
            np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), err_msg=field
        )
    np.testing.assert_allclose(
        np.asarray(b.logprobs_BT), np.asarray(a.logprobs_BT), atol=1e-5, rtol=0
    )
    assert int(a.num_steps) == int(b.num_steps)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_same_samples_as_the_compacted_sampler_with_fewer_slots_than_rows(toy, sampling):
    config, params = toy
    prompts = _prompts(config, [3, 11, 6, 2, 9, 5])
    a, b = _both(config, params, prompts, sampling, slots=4, n=4)
    _assert_same_samples(a, b)
    lengths = np.asarray(b.lengths_B)
    # The mix the test needs: rows that stop early, rows that run to the cap, 24 rows > 4 slots.
    assert lengths.min() < N // 2 and lengths.max() == N and lengths.size == 24
    assert len(set(lengths.tolist())) >= 3
    # Decode work: one slot-step per decoded token beyond the first, plus the slots the
    # refills and the drain leave idle; never more than decoding every row to the end.
    useful = int(lengths.sum() - lengths.size)
    assert useful <= int(b.slot_steps) < lengths.size * (N - 1)


def test_dropped_prompts_and_long_rows_with_one_slot(toy):
    """One slot runs every row in turn; a dropped prompt never takes a slot."""
    config, params = toy
    prompts = _prompts(config, [4, 40, 7, 2], seed=1)
    a, b = _both(
        config, params, prompts, SAMPLED, slots=1, n=2, max_prompt_len=30, long_prompts="drop"
    )
    _assert_same_samples(a, b)
    assert np.asarray(b.dropped_B).tolist() == [False] * 2 + [True] * 2 + [False] * 4
    assert np.asarray(b.lengths_B)[2:4].tolist() == [0, 0]
    lengths = np.asarray(b.lengths_B)
    # With one slot nothing is idle: each decode step produces one token of a live row.
    assert int(b.slot_steps) == int(lengths.sum() - np.count_nonzero(lengths))


def test_greedy_last_rows(toy):
    """ReMax's greedy row beside sampled ones: the same tokens, and the greedy row's token
    is the argmax of a teacher-forced forward at every step."""
    config, params = toy
    prompts = _prompts(config, [5, 8, 3], seed=2)
    a, b = _both(config, params, prompts, SAMPLED, slots=2, n=3, greedy_last=1)
    _assert_same_samples(a, b)
    tokens, mask, positions = b.sequences()
    logits, _ = transformer.forward(params, config, tokens, positions, mask)
    P = b.prompt_tokens_BP.shape[1]
    argmax = np.asarray(logits[:, P - 1 : -1].argmax(-1))
    for r in (2, 5, 8):
        n = int(b.lengths_B[r])
        np.testing.assert_array_equal(np.asarray(b.tokens_BT[r, :n]), argmax[r, :n])


def test_decode_slots_more_than_rows_and_cap_of_one_token(toy):
    config, params = toy
    prompts = _prompts(config, [4, 6], seed=3)
    args = (params, config, prompts, SAMPLED, 1, jax.random.key(0))
    a = sampler.generate(*args, n=2, stop_ids=STOP)
    b = sampler.generate(*args, n=2, stop_ids=STOP, decode_slots=64)
    _assert_same_samples(a, b)
    assert int(b.slot_steps) == 0 and np.asarray(b.lengths_B).tolist() == [1] * 4


def test_sliding_window_rows(toy):
    """Each slot masks its own window: a window shorter than the rows gives the same tokens."""
    config, params = toy
    config = dataclasses.replace(config, sliding_window=4)
    prompts = _prompts(config, [3, 9, 6], seed=4)
    a, b = _both(config, params, prompts, SAMPLED, slots=3, n=2)
    _assert_same_samples(a, b)


def test_sliding_window_rows_equal_each_row_alone(toy):
    """Continuous slots with a window of 4 over rows longer than it: 12 rows through 4 slots
    (8 rows prefilled into a freed slot mid-loop), each prompt's cache copied to its 3 rows,
    the last one greedy. Every token's logprob equals log_softmax(logits / T) of a forward
    over its row alone (unpadded, no cache), and the greedy rows' tokens are its argmax."""
    config, params = toy
    config = dataclasses.replace(config, sliding_window=4)
    prompts = _prompts(config, [3, 9, 6, 12], seed=4)
    n, slots = 3, 4
    out = sampler.generate(
        params,
        config,
        prompts,
        SAMPLED,
        N,
        jax.random.key(3),
        n=n,
        stop_ids=STOP,
        greedy_last=1,
        decode_slots=slots,
    )
    tokens, logp = np.asarray(out.tokens_BT), np.asarray(out.logprobs_BT)
    lengths = np.asarray(out.lengths_B)
    assert lengths.size == 12 > slots and lengths.min() < N // 2 and lengths.max() == N
    assert_rows_equal_alone(params, config, prompts, n, tokens, logp, lengths, SAMPLED.temperature)
    # The window matters for these lengths: without it the longest row's logprobs differ.
    r = int(np.argmax(lengths))
    unwindowed = dataclasses.replace(config, sliding_window=None)
    ref = alone_logprobs(params, unwindowed, prompts[r // n], tokens[r], SAMPLED.temperature)
    assert np.abs(chosen(ref, tokens[r]) - logp[r]).max() > 1e-2


def test_on_a_mesh_and_its_refusal(toy):
    config, params = toy
    mesh = parallel.make_mesh("data:2,fsdp:2,tensor:2")
    with pytest.raises(
        FlagError, match="--decode_slots=6 must be a multiple of the data-parallel size 4"
    ):
        Sampler(config, mesh=mesh, decode_slots=6)
    assert issubclass(FlagError, UserError)
    smp = Sampler(config, mesh=mesh, stop_ids=STOP, decode_slots=4)
    prompts = _prompts(config, [5, 2, 7, 4], seed=5)
    key = jax.random.key(1)
    caps = [N, 3, N, 7, 1, N, 12, N]  # per-row caps, placed on the mesh like the rows
    b = smp.generate(
        smp.shard_params(params), prompts, SAMPLED, N, key, group_size=2, row_caps=caps
    )
    a = sampler.generate(
        params, config, prompts, SAMPLED, N, key, n=2, stop_ids=STOP, row_caps=caps
    )
    _assert_same_samples(a, b)
    assert np.all(np.asarray(b.lengths_B) <= caps)


def test_refill_rows():
    assert continuous.refill_rows(64) == 4 and continuous.refill_rows(8) == 1
    assert continuous.refill_rows(64, multiple=8) == 8 and continuous.refill_rows(512, 8) == 32
    with pytest.raises(FlagError, match="--decode_slots=-1 must be an int >= 0"):
        continuous.check_slots(-1, None)


@pytest.mark.parametrize("slots", [0, 8], ids=["compacted", "continuous"])
def test_row_caps_end_rows_early_as_truncated(toy, slots):
    """A capped row is the uncapped row cut at its cap: the same first tokens, its length
    min(cap, uncapped length), truncated unless it stopped within the cap (pad is a stop id
    here, so a cut row must not read as stopped). The compacted decoder runs in two chunks."""
    config, params = toy
    prompts = _prompts(config, [3, 11, 6, 2, 9, 5], seed=6)
    args = (params, config, prompts, SAMPLED, N, jax.random.key(4))
    kw = dict(stop_ids=STOP, n=4, pad_id=STOP[0])
    free = sampler.generate(*args, **kw)
    caps = np.random.default_rng(0).integers(1, N + 1, size=24)
    capped = sampler.generate(
        *args, row_caps=caps, decode_slots=slots, max_rows=None if slots else 12, **kw
    )
    free_len = np.asarray(free.lengths_B)
    stopped = ~np.asarray(free.truncated_B)
    want_len = np.minimum(free_len, caps)
    np.testing.assert_array_equal(np.asarray(capped.lengths_B), want_len)
    np.testing.assert_array_equal(np.asarray(capped.truncated_B), ~(stopped & (free_len <= caps)))
    for r in range(24):
        n = want_len[r]
        np.testing.assert_array_equal(
            np.asarray(capped.tokens_BT[r, :n]), np.asarray(free.tokens_BT[r, :n])
        )
        np.testing.assert_allclose(
            np.asarray(capped.logprobs_BT[r, :n]),
            np.asarray(free.logprobs_BT[r, :n]),
            atol=1e-5,
            rtol=0,
        )
    # The caps cut rows short of where they would have stopped, and spare others.
    assert np.any(caps < free_len) and np.any(caps > free_len)
    assert int(capped.slot_steps) >= int(want_len.sum() - want_len.size)


def test_row_caps_same_samples_in_both_decoders(toy):
    """No stop ids (a forced length mix): every row runs to exactly its cap in both."""
    config, params = toy
    prompts = _prompts(config, [4, 7, 2, 5], seed=7)
    caps = np.random.default_rng(1).integers(1, N + 1, size=16)
    args = (params, config, prompts, SAMPLED, N, jax.random.key(5))
    a = sampler.generate(*args, n=4, stop_ids=(), row_caps=caps)
    b = sampler.generate(*args, n=4, stop_ids=(), row_caps=caps, decode_slots=8)
    _assert_same_samples(a, b)
    np.testing.assert_array_equal(np.asarray(b.lengths_B), caps)
    assert np.asarray(b.truncated_B).all()
    # Every decode step past each row's first token is counted in the work.
    assert int(caps.sum() - caps.size) <= int(b.slot_steps)


@pytest.mark.parametrize("engine", [{}, {"decode_slots": 4}, {"kv_cache_tokens": 0}])
def test_a_prompt_capped_at_zero_does_not_run(toy, engine):
    """Cap 0 (partial rollouts' finished rows and bucket filler): the prompt's rows produce
    nothing; the other rows are those of the call with every row
    (a row's key is its prompt's and sample's)."""
    config, params = toy
    prompts = _prompts(config, [3, 11, 6, 2], seed=8)
    key = jax.random.key(6)
    kw = dict(stop_ids=STOP, n=2, **engine)
    full = sampler.generate(params, config, prompts, SAMPLED, N, key, **kw)
    caps = np.array([N, N, 0, 0, N, N, 0, 0])
    part = sampler.generate(params, config, prompts, SAMPLED, N, key, row_caps=caps, **kw)
    on = caps > 0
    np.testing.assert_array_equal(np.asarray(part.lengths_B)[~on], 0)
    assert not np.asarray(part.truncated_B)[~on].any()
    for r in np.flatnonzero(on):
        n = int(full.lengths_B[r])
        assert int(part.lengths_B[r]) == n
        np.testing.assert_array_equal(
            np.asarray(part.tokens_BT[r, :n]), np.asarray(full.tokens_BT[r, :n])
        )
    assert int(part.slot_steps) <= int(full.slot_steps)


def test_row_caps_refused(toy):
    config, params = toy
    with pytest.raises(
        ValueError,
        match=r"row_caps must hold len\(prompts\) \* n = 4 ints in "
        r"0..max_new_tokens=8",
    ):
        sampler.generate(
            params, config, [[1], [2]], SAMPLED, 8, jax.random.key(0), n=2, row_caps=[1, 2, 9, 3]
        )
    with pytest.raises(ValueError, match=r"a prompt's 2 rows are all 0"):
        sampler.generate(
            params, config, [[1], [2]], SAMPLED, 8, jax.random.key(0), n=2, row_caps=[1, 0, 2, 3]
        )
