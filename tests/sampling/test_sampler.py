"""The KV-cache sampler on tiny random models: cache parity (with and without a sliding
window), distributions, stops, RNG, sharding."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl4llm import parallel
from jaxrl4llm.models import kv_cache, transformer
from jaxrl4llm.models.config import TINY
from jaxrl4llm.sampling import Sampler, buckets, sampler
from jaxrl4llm.sampling.strategies import GREEDY, SamplingConfig

# Untied embeddings, so a scaled-up unembedding spreads the logits without making the model
# simply repeat its input token; a small vocabulary so first-token histograms need few draws.
TINY_UNTIED = dataclasses.replace(TINY, tie_word_embeddings=False)
SMALL = dataclasses.replace(TINY_UNTIED, vocab_size=32, eos_token_ids=(2,), pad_token_id=0)


def _peaked_params(config, seed=0):
    """Random params whose logits spread over several nats (a wrong temperature, a padding
    leak or an off-by-one position then shows in the numbers)."""
    params = transformer.init_params(config, jax.random.key(seed))
    params["unembed"] = params["unembed"] * 15.0
    return params


def _prompts(rng, lengths, vocab):
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


# Compiled once per test module; tests reuse a few shape buckets (8 rows, prompt bucket 16,
# 8 new tokens) so the module compiles a handful of sampler programs.
_forward = jax.jit(transformer.forward, static_argnums=1)
N = 8
SAMPLING = SamplingConfig(temperature=0.8, top_k=20)

# The independent reference for the sampler's logprobs (also test_continuous.py's and
# test_partial.py's): one row alone. One program per sequence length, compiled without XLA's
# backend optimizations, which would take most of the time of a test that runs one per row.
_alone_forward = jax.jit(
    transformer.forward,
    static_argnums=1,
    compiler_options={"xla_backend_optimization_level": 0},
)


def alone_logprobs(params, config, prompt, completion, temperature=1.0):
    """[len(completion), V] float64: log_softmax(logits / T) where each completion token is
    predicted, from one transformer.forward over prompt ++ completion alone: a single
    unpadded row at positions 0, 1, ..., no KV cache."""
    ids = np.asarray([*prompt, *completion], np.int32)[None]
    positions = np.arange(ids.shape[1], dtype=np.int32)[None]
    logits, _ = _alone_forward(params, config, ids, positions, np.ones_like(ids, bool))
    logits = np.asarray(logits[0, len(prompt) - 1 : -1], np.float64) / temperature
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def chosen(logp_TV, tokens):
    """Each step's logprob of its token: logp_TV[t, tokens[t]]."""
    return np.take_along_axis(logp_TV, np.asarray(tokens)[:, None], axis=-1)[:, 0]


def assert_rows_equal_alone(params, config, prompts, n, tokens, logp, lengths, temperature):
    """Each row r (prompt r // n; the last of each n greedy) scores and, where greedy,
    picks as `alone_logprobs` does."""
    for r in range(lengths.size):
        prompt, completion = prompts[r // n], tokens[r, : lengths[r]]
        ref = alone_logprobs(params, config, prompt, completion, temperature)
        np.testing.assert_allclose(
            logp[r, : lengths[r]], chosen(ref, completion), atol=1e-5, rtol=0, err_msg=f"{r}"
        )
        if r % n == n - 1:  # the greedy row
            np.testing.assert_array_equal(completion, ref.argmax(-1), err_msg=f"{r}")


@pytest.fixture(scope="module")
def tiny():
    return TINY_UNTIED, _peaked_params(TINY_UNTIED)


def test_prompt_buckets_are_two_per_octave():
    """Prompt widths are 2^k or 1.5 * 2^k (at least 16, multiples of 1024 past 1024): a
    block is at most a third padding, where powers of two alone allowed half (33 -> 64)."""
    expected = {
        0: 16,
        1: 16,
        16: 16,
        17: 24,
        24: 24,
        25: 32,
        33: 48,
        43: 48,
        48: 48,
        49: 64,
        65: 96,
        97: 128,
        129: 192,
        513: 768,
        769: 1024,
        1024: 1024,
        1025: 2048,
    }
    assert {n: buckets.bucket_prompt_length(n) for n in expected} == expected
    assert buckets.bucket_prompt_length(20, minimum=40) == 48  # a floor, then bucketed
    for n in range(1, 1025):
        width = buckets.bucket_prompt_length(n)
        assert n <= width and (width <= 16 or 3 * (width - n) < width), n
    batch = buckets.prepare_batch(
        [[5] * 40, [6] * 3], n=2, max_prompt_len=100, long_prompts="error", pad_id=0, vocab_size=10
    )
    assert batch.prompt_BP.shape == (4, 48)


# A sliding window of 4, shorter than most prompt + completion rows below.
WINDOWS = [None, 4]


@pytest.mark.parametrize("window", WINDOWS)
def test_cache_parity_with_mixed_left_padding(tiny, window):
    config, params = tiny
    config = dataclasses.replace(config, sliding_window=window)
    rng = np.random.default_rng(0)
    lengths, steps = [3, 7, 12], 6
    prompts = _prompts(rng, lengths, config.vocab_size)
    cont_BT = rng.integers(3, config.vocab_size, size=(3, steps))
    batch = buckets.prepare_batch(
        prompts,
        n=1,
        max_prompt_len=64,
        long_prompts="error",
        pad_id=0,
        vocab_size=config.vocab_size,
    )
    P = batch.prompt_BP.shape[1]

    @jax.jit
    def incremental(params):
        cache = kv_cache.init_kv_cache(config, 4, P + steps - 1)
        logits, cache, _ = sampler.prefill(params, config, batch.prompt_BP, batch.mask_BP, cache)
        out = [logits]
        pos_B = batch.mask_BP.sum(1)
        for t in range(steps - 1):
            tok_B = jnp.concatenate([cont_BT[:, t], jnp.zeros((1,), int)])
            logits, cache, _ = sampler.decode_step(params, config, tok_B, pos_B + t, cache, P + t)
            out.append(logits)
        return jnp.stack(out, axis=1)[:3]

    inc_BTV = incremental(params)
    assert float(jnp.std(inc_BTV)) > 1.0  # logits are not trivially small
    # Reference 1: one full forward over the padded batch, prompt + continuation.
    tokens = np.concatenate([batch.prompt_BP[:3], cont_BT], axis=1)
    mask = np.concatenate([batch.mask_BP[:3], np.ones((3, steps), bool)], axis=1)
    full, _ = _forward(params, config, tokens, transformer.positions_from_mask(mask), mask)
    np.testing.assert_allclose(inc_BTV, full[:, P - 1 : P - 1 + steps], atol=1e-4, rtol=0)
    # Reference 2: each row alone, unpadded: padding changes nothing.
    for r, prompt in enumerate(prompts):
        seq = np.array([prompt + cont_BT[r].tolist()])
        alone, _ = _forward(
            params, config, seq, np.arange(seq.shape[1])[None], np.ones_like(seq, bool)
        )
        np.testing.assert_allclose(
            inc_BTV[r], alone[0, len(prompt) - 1 : len(prompt) - 1 + steps], atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("window", WINDOWS)
def test_logprobs_equal_teacher_forced_recompute(tiny, window):
    config, params = tiny
    config = dataclasses.replace(config, sliding_window=window)
    prompts = _prompts(np.random.default_rng(1), [4, 9, 2, 6], config.vocab_size)
    out = sampler.generate(
        params, config, prompts, SAMPLING, N, jax.random.key(0), n=2, stop_ids=()
    )
    tokens, mask, positions = out.sequences()
    logits, _ = _forward(params, config, tokens, positions, mask)
    P = out.prompt_tokens_BP.shape[1]
    logp = jax.nn.log_softmax(logits[:, P - 1 : -1] / SAMPLING.temperature)  # untruncated
    ref = jnp.take_along_axis(logp, out.tokens_BT[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(out.logprobs_BT, ref, atol=1e-4, rtol=0)
    assert out.tokens_BT.shape == (8, N) and bool(out.mask_BT.all())
    assert bool(out.truncated_B.all()) and out.lengths_B.tolist() == [N] * 8


def test_window_logprobs_equal_each_row_alone_with_compaction_and_greedy_rows():
    """A sliding window of 4 over rows several times longer, mixed prompt lengths (left
    padding) and a stop token that ends rows at mixed lengths, so the decode batch halves
    (finished rows compacted away, live rows' cache moved to other slots); each prompt's
    cache is copied to its 3 rows and its last row decodes greedily (ReMax). Every token's
    logprob equals log_softmax(logits / T) of a forward over its row alone (unpadded, no
    cache), and the greedy rows' tokens are that forward's argmax."""
    config = dataclasses.replace(SMALL, sliding_window=4)
    params = _peaked_params(config)
    prompts = _prompts(np.random.default_rng(0), [3, 11, 6, 2, 9, 5], config.vocab_size)
    n, steps = 3, 20
    out = sampler.generate(
        params,
        config,
        prompts,
        SAMPLING,
        steps,
        jax.random.key(1),
        n=n,
        stop_ids=(2,),
        greedy_last=1,
    )
    tokens, logp = np.asarray(out.tokens_BT), np.asarray(out.logprobs_BT)
    lengths = np.asarray(out.lengths_B)
    B = lengths.size
    assert_rows_equal_alone(params, config, prompts, n, tokens, logp, lengths, SAMPLING.temperature)
    # Compaction ran: fewer slot-steps than decoding all B rows to the last step, and rows of
    # the batch's second half decoded on after at most half the rows were left (the first
    # level's end), so their cache rows moved to other slots.
    assert int(out.slot_steps) < B * (int(out.num_steps) - 1)
    halved = next((s for s in range(1, steps) if (lengths > s).sum() <= B // 2), steps)
    assert (lengths[B // 2 :] > halved).any()
    assert lengths.min() < halved < lengths.max() == steps
    # The window matters for these lengths: without it the longest row's logprobs differ.
    r = int(np.argmax(lengths))
    unwindowed = dataclasses.replace(config, sliding_window=None)
    ref = alone_logprobs(params, unwindowed, prompts[r // n], tokens[r], SAMPLING.temperature)
    assert np.abs(chosen(ref, tokens[r]) - logp[r]).max() > 1e-2


def _first_tokens(params, prompt, sampling, key, draws=2048):
    out = sampler.generate(params, SMALL, [prompt], sampling, 1, key, n=draws, stop_ids=())
    return np.asarray(out.tokens_BT[:, 0])


def test_first_token_distribution_matches_softmax_over_temperature():
    params = _peaked_params(SMALL, seed=1)
    prompt = [5, 9, 17, 4]
    logits, _ = _forward(
        params, SMALL, np.array([prompt]), np.arange(4)[None], np.ones((1, 4), bool)
    )
    last = np.asarray(logits[0, -1], np.float64)
    temperature = 0.7
    tokens = _first_tokens(params, prompt, SamplingConfig(temperature), jax.random.key(7))
    counts = np.bincount(tokens, minlength=SMALL.vocab_size)

    def p_value(t):
        p = np.exp((last - last.max()) / t)
        expected = p / p.sum() * tokens.size
        keep = expected > 5  # pool the rare tokens: chi-square needs expected >= 5
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum())
        return stats.chisquare(obs, exp).pvalue

    assert p_value(temperature) > 1e-3
    assert p_value(1.0) < 1e-6 and p_value(0.5) < 1e-6  # a wrong temperature is caught


def test_top_k_and_top_p_never_emit_excluded_tokens():
    params = _peaked_params(SMALL, seed=2)
    prompt = [3, 8, 6]
    logits, _ = _forward(
        params, SMALL, np.array([prompt]), np.arange(3)[None], np.ones((1, 3), bool)
    )
    order = np.argsort(-np.asarray(logits[0, -1]))
    tokens = _first_tokens(params, prompt, SamplingConfig(1.0, top_k=3), jax.random.key(1), 1024)
    assert set(tokens.tolist()) == set(order[:3].tolist())
    probs = np.asarray(jax.nn.softmax(logits[0, -1]))[order]
    nucleus = int(np.searchsorted(np.cumsum(probs), 0.6) + 1)  # smallest set with mass >= 0.6
    assert 1 < nucleus < SMALL.vocab_size
    tokens = _first_tokens(params, prompt, SamplingConfig(1.0, top_p=0.6), jax.random.key(2), 1024)
    assert set(tokens.tolist()) == set(order[:nucleus].tolist())


def test_stop_tokens_end_rows_and_groups_are_contiguous(tiny):
    config, params = tiny
    prompts = _prompts(np.random.default_rng(3), [5, 3, 8, 6], config.vocab_size)
    free = sampler.generate(params, config, prompts, GREEDY, N, jax.random.key(0), n=2, stop_ids=())
    free_tokens = np.asarray(free.tokens_BT)
    for r in range(8):  # row p * n + g is sample g of prompt p
        p = prompts[r // 2]
        assert np.asarray(free.prompt_tokens_BP[r, -len(p) :]).tolist() == p
        assert int(free.prompt_mask_BP[r].sum()) == len(p)
    stop = int(free_tokens[0, 2])
    assert stop not in free_tokens[0, :2]
    unused = int(np.setdiff1d(np.arange(3, 256), free_tokens)[0])  # a stop id never emitted
    out = sampler.generate(
        params,
        config,
        prompts,
        GREEDY,
        N,
        jax.random.key(0),
        n=2,
        stop_ids=(stop, unused),
        pad_id=1,
    )
    tokens, mask = np.asarray(out.tokens_BT), np.asarray(out.mask_BT)
    for r in range(8):
        hits = np.flatnonzero(free_tokens[r] == stop)
        length = hits[0] + 1 if hits.size else N
        assert out.lengths_B[r] == length and mask[r].sum() == length
        np.testing.assert_array_equal(tokens[r, :length], free_tokens[r, :length])
        assert (tokens[r, length:] == 1).all()  # pad after the stop token
        assert (np.asarray(out.logprobs_BT)[r, length:] == 0).all()
        assert bool(out.truncated_B[r]) == (hits.size == 0)
    assert out.lengths_B[0] == 3
    # When every row stops early, the loop exits early.
    one = sampler.generate(
        params, config, [prompts[0]] * 4, GREEDY, N, jax.random.key(0), n=2, stop_ids=(stop,)
    )
    assert int(one.num_steps) == 3 and not bool(one.truncated_B.any())


def test_per_row_rng_does_not_depend_on_batch_composition(tiny):
    config, params = tiny
    rng = np.random.default_rng(4)
    a, b, c, d, e, f = _prompts(rng, [5, 9, 30, 4, 7, 3], config.vocab_size)
    key = jax.random.key(11)
    # Different partners and prompt buckets (32 vs 16): row keys come from (key, prompt, sample).
    one = sampler.generate(params, config, [a, b, c], SAMPLING, N, key, n=2, stop_ids=())
    two = sampler.generate(params, config, [a, d, e, f], SAMPLING, N, key, n=2, stop_ids=())
    np.testing.assert_array_equal(one.tokens_BT[:2], two.tokens_BT[:2])
    np.testing.assert_allclose(one.logprobs_BT[:2], two.logprobs_BT[:2], atol=1e-4)
    assert (np.asarray(one.tokens_BT[0]) != np.asarray(one.tokens_BT[1])).any()  # group differs
    # Explicit row keys follow their rows.
    keys = jax.random.split(jax.random.key(5), 8)
    fwd = sampler.generate(
        params, config, [a, d, e, f], SAMPLING, N, key, n=2, row_keys=keys, stop_ids=()
    )
    rev = sampler.generate(
        params, config, [f, e, d, a], SAMPLING, N, key, n=2, row_keys=keys[::-1], stop_ids=()
    )
    np.testing.assert_array_equal(fwd.tokens_BT, rev.tokens_BT[::-1])


def test_group_prefill_equals_one_prefill_per_row(tiny):
    config, params = tiny
    prompts = _prompts(np.random.default_rng(6), [5, 9, 4, 7], config.vocab_size)
    keys = jax.random.split(jax.random.key(8), 8)
    key = jax.random.key(0)
    # n=2: each prompt is prefilled once and its cache copied to both rows; n=1 over the
    # repeated prompts prefills every row. Same row keys, so the same draws.
    grouped = sampler.generate(
        params, config, prompts, SAMPLING, N, key, n=2, row_keys=keys, stop_ids=()
    )
    per_row = sampler.generate(
        params,
        config,
        [p for p in prompts for _ in range(2)],
        SAMPLING,
        N,
        key,
        n=1,
        row_keys=keys,
        stop_ids=(),
    )
    np.testing.assert_array_equal(grouped.tokens_BT, per_row.tokens_BT)
    np.testing.assert_allclose(grouped.logprobs_BT, per_row.logprobs_BT, atol=1e-5)
    np.testing.assert_array_equal(grouped.prompt_tokens_BP, per_row.prompt_tokens_BP)
    assert (np.asarray(grouped.tokens_BT[0]) != np.asarray(grouped.tokens_BT[1])).any()


def test_long_prompts_error_or_are_dropped_and_counted(tiny):
    config, params = tiny
    rng = np.random.default_rng(6)
    short, long_, other = _prompts(rng, [4, 12, 5], config.vocab_size)
    with pytest.raises(ValueError, match="--max_prompt_tokens=8.*--long_prompts=drop"):
        sampler.generate(
            params, config, [short, long_], GREEDY, N, jax.random.key(0), max_prompt_len=8
        )
    out = sampler.generate(
        params,
        config,
        [short, long_],
        GREEDY,
        N,
        jax.random.key(0),
        n=4,
        max_prompt_len=8,
        long_prompts="drop",
    )
    assert out.num_dropped == 4 and out.dropped_B.tolist() == [False] * 4 + [True] * 4
    assert out.lengths_B.tolist()[4:] == [0] * 4 and not bool(out.mask_BT[4:].any())
    assert not bool(out.prompt_mask_BP[4:].any()) and not bool(out.truncated_B[4:].any())
    alone = sampler.generate(params, config, [short, other], GREEDY, N, jax.random.key(0), n=4)
    np.testing.assert_array_equal(out.tokens_BT[:4], alone.tokens_BT[:4])


def test_bad_inputs_raise_clear_errors(tiny):
    config, params = tiny
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="Prompt 1 is empty"):
        sampler.generate(params, config, [[5], []], GREEDY, 4, key)
    with pytest.raises(ValueError, match="token id 300 outside \\[0, 256\\)"):
        sampler.generate(params, config, [[5, 300]], GREEDY, 4, key)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampler.generate(params, config, [[5]], GREEDY, 0, key)
    with pytest.raises(ValueError, match="long_prompts"):
        sampler.generate(params, config, [[5]], GREEDY, 2, key, long_prompts="truncate-left")
    with pytest.raises(ValueError, match="row_keys has 2 keys"):
        sampler.generate(
            params, config, [[5]], GREEDY, 2, key, n=3, row_keys=jax.random.split(key, 2)
        )


def test_sharded_sampling_equals_unsharded(tiny):
    config, params = tiny
    mesh = parallel.make_mesh("data:1,fsdp:4,tensor:2")
    sampler_ = Sampler(config, mesh=mesh, stop_ids=())
    sharded = sampler_.shard_params(params)
    assert len(sharded["layers"]["k"].sharding.device_set) == 8
    prompts = _prompts(np.random.default_rng(7), [5, 3, 11, 7], config.vocab_size)
    ref = sampler.generate(params, config, prompts, GREEDY, N, jax.random.key(0), n=2, stop_ids=())
    out = sampler_.generate(sharded, prompts, GREEDY, N, jax.random.key(0), group_size=2)
    np.testing.assert_array_equal(out.tokens_BT, ref.tokens_BT)
    np.testing.assert_allclose(out.logprobs_BT, ref.logprobs_BT, atol=1e-4)
    assert len(out.tokens_BT.sharding.device_set) == 8


def test_sampler_honours_share_prompts(tiny, monkeypatch):
    """The front-end passes the layout's prompt sharing to the compiled sampler: a prompt's
    prefill runs once per group only when share_prompts is on."""
    config, params = tiny
    seen = []
    compiled = sampler.generate_tokens

    def spy(*args, prompt_group, **kwargs):
        seen.append(prompt_group)
        return compiled(*args, prompt_group=prompt_group, **kwargs)

    monkeypatch.setattr(sampler, "generate_tokens", spy)
    smp = Sampler(config, stop_ids=())
    prompts = _prompts(np.random.default_rng(3), [4, 6], config.vocab_size)
    shared = smp.generate(params, prompts, GREEDY, 3, jax.random.key(0), group_size=4)
    per_row = smp.generate(
        params, prompts, GREEDY, 3, jax.random.key(0), group_size=4, share_prompts=False
    )
    assert seen == [4, 1]
    np.testing.assert_array_equal(per_row.tokens_BT, shared.tokens_BT)


@pytest.mark.parametrize("mesh_spec", [None, "data:2,fsdp:2,tensor:2"])
def test_chunked_rollout_equals_one_pass(tiny, mesh_spec):
    """Rows decoded in strided chunks of whole prompts (max_rows) give the one-pass samples:
    same tokens and logprobs, same row order, same stops."""
    config, params = tiny
    mesh = None if mesh_spec is None else parallel.make_mesh(mesh_spec)
    if mesh is not None:
        params = Sampler(config, mesh=mesh).shard_params(params)
    prompts = _prompts(np.random.default_rng(9), [5, 3, 11, 7, 2, 6, 9, 4], config.vocab_size)
    stop = 17
    run = lambda max_rows: sampler.generate(  # noqa: E731
        params,
        config,
        prompts,
        SAMPLING,
        N,
        jax.random.key(3),
        n=2,
        stop_ids=(stop,),
        mesh=mesh,
        max_rows=max_rows,
    )
    one, chunked = run(None), run(4)
    assert one.tokens_BT.shape == chunked.tokens_BT.shape == (16, N)
    np.testing.assert_array_equal(chunked.tokens_BT, one.tokens_BT)
    np.testing.assert_allclose(chunked.logprobs_BT, one.logprobs_BT, atol=1e-5)
    for field in ("mask_BT", "lengths_B", "truncated_B", "prompt_tokens_BP", "prompt_mask_BP"):
        np.testing.assert_array_equal(getattr(chunked, field), getattr(one, field))
    assert int(chunked.num_steps) == int(one.num_steps)
    assert (np.asarray(one.tokens_BT) == stop).any()  # some rows stopped early


@pytest.mark.parametrize("mesh_spec,max_rows", [(None, None), ("data:2,fsdp:2,tensor:2", 6)])
def test_greedy_last_rows_decode_greedily_in_the_same_call(tiny, mesh_spec, max_rows):
    """ReMax's baseline row: with greedy_last=1 the last sample of each prompt is the greedy
    completion (the argmax path of a GREEDY run) and the other rows are the usual samples."""
    config, params = tiny
    mesh = None if mesh_spec is None else parallel.make_mesh(mesh_spec)
    if mesh is not None:
        params = Sampler(config, mesh=mesh).shard_params(params)
    prompts = _prompts(np.random.default_rng(12), [5, 3, 11, 7], config.vocab_size)
    key = jax.random.key(4)
    run = functools.partial(
        sampler.generate,
        params,
        config,
        prompts,
        max_new_tokens=N,
        key=key,
        n=3,
        stop_ids=(),
        mesh=mesh,
        max_rows=max_rows,
    )
    mixed = run(sampling=SAMPLING, greedy_last=1)
    sampled = run(sampling=SAMPLING)
    greedy = sampler.generate(params, config, prompts, GREEDY, N, key, n=1, stop_ids=())
    tokens = np.asarray(mixed.tokens_BT).reshape(4, 3, N)
    np.testing.assert_array_equal(tokens[:, 2], np.asarray(greedy.tokens_BT))
    np.testing.assert_array_equal(
        tokens[:, :2], np.asarray(sampled.tokens_BT).reshape(4, 3, N)[:, :2]
    )
    assert (tokens[:, 0] != tokens[:, 2]).any()  # the sampled rows are not greedy
