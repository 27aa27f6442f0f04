"""Partial rollouts on one pool of pages per step (train/rollout/partial_pool.py): the steps
equal those of the rounds of sampler calls (each resumed row prefilled again), and what they
prefill is only the new groups' prompts and the rows begun in an earlier step."""

from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.models import registry
from jaxrl4llm.sampling.frontend import Sampler
from jaxrl4llm.train.config import RolloutConfig
from jaxrl4llm.train.rollout import partial, partial_pool

from tests.train.test_partial import Rewards

ROLLOUT = RolloutConfig(
    prompts_per_step=4,
    group_size=2,
    max_new_tokens=12,
    max_prompt_tokens=12,
    partial_rollout_tokens=3,
    max_staleness=2,
)
RECORDS = ["copy 1", "copy 2", "copy 3", "copy 1 answer", "copy 2 is", "copy 3 is"]


def _messages(record):
    return [{"role": "user", "content": record}]


def _steps(sampler, params, monkeypatch, steps=4):
    """`steps` steps of partial rollouts: per step the trained rows (host), the partial/*
    metrics and the tokens prefilled by hand: the prompts of the groups the step started, and
    for each unfinished row carried into it, its prompt and completion but the last token."""
    started = []
    start_groups = partial._start_groups

    def recorded(ctx, records):
        groups = start_groups(ctx, records)
        started.extend(g for g in groups if not g.dropped)
        return groups

    monkeypatch.setattr(partial, "_start_groups", recorded)
    ctx = types.SimpleNamespace(
        rollout=ROLLOUT,
        sampler=sampler,
        reward_fn=Rewards(),
        data=types.SimpleNamespace(messages=_messages),
    )
    records = iter(RECORDS * 20)
    more = lambda: [next(records) for _ in range(4)]  # noqa: E731
    carried, out = partial.Carried(), []
    for step in range(steps):
        started.clear()
        by_hand = sum(
            len(g.prompt) + int(n) - 1
            for g in carried.groups
            for n, done in zip(g.lengths_G, g.done_G)
            if not done
        )
        rows, carried, m = partial.sample_and_score(
            ctx, params, carried, more(), jax.random.key(step), more
        )
        by_hand += sum(len(g.prompt) for g in started)
        metrics = {k: v.value for k, v in m.items() if k.startswith("partial/")}
        out.append((jax.device_get(rows.samples.out), metrics, by_hand))
    return out


@pytest.fixture(scope="module")
def windowed(toy_model_dir):
    """The toy model with a sliding window of 4 (shorter than the prompts and rows)."""
    config, params, tokenizer = registry.load_model(toy_model_dir)
    return dataclasses.replace(config, sliding_window=4), params, tokenizer


@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("pool_tokens", [0, 48, 32], ids=["every-row", "three-pages", "one-row"])
def test_a_steps_rounds_on_one_pool_equal_the_rounds_of_sampler_calls(
    toy_model_dir, windowed, pool_tokens, window, monkeypatch
):
    """Four steps (groups carried between steps, rows going on over 4 rounds a step) with the
    paged engine: the rows, lengths and metrics of the compacted sampler's rounds, logprobs
    within 1e-5. A pool holding every row prefills exactly the started groups' prompts and the
    carried rows (never a row of this step again); smaller ones evict rows and restore them."""
    config, params, tokenizer = windowed if window else registry.load_model(toy_model_dir)
    stops = (3, 15)  # rows end at mixed lengths
    reference = _steps(Sampler(config, tokenizer, stop_ids=stops), params, monkeypatch)
    pooled = Sampler(config, tokenizer, stop_ids=stops, kv_cache_tokens=pool_tokens)
    assert partial_pool.applies(pooled)
    ours = _steps(pooled, params, monkeypatch)
    saved = 0
    for (a, ma, _), (b, mb, by_hand) in zip(reference, ours, strict=True):
        np.testing.assert_array_equal(b.lengths_B, a.lengths_B)
        np.testing.assert_array_equal(b.tokens_BT, a.tokens_BT)
        np.testing.assert_array_equal(b.truncated_B, a.truncated_B)
        np.testing.assert_allclose(b.logprobs_BT, a.logprobs_BT, atol=1e-5, rtol=0)
        for k in ma:
            if k != "partial/prefilled_tokens":
                assert ma[k] == mb[k], k
        if pool_tokens == 0:
            assert mb["partial/prefilled_tokens"] == by_hand
        saved += ma["partial/prefilled_tokens"] - mb["partial/prefilled_tokens"]
    # The steps carry groups and resume rows in later rounds: the test can fail.
    assert any(m["partial/carried_rows"] for _, m, _ in ours)
    assert all(m["partial/rounds"] > 1 for _, m, _ in ours)
    if pool_tokens == 0:
        assert saved > 0


@pytest.mark.parametrize(
    "mesh_spec,pool_tokens",
    [("data:2,fsdp:1,expert:1,tensor:1", 0), ("data:2,fsdp:1,expert:1,tensor:2", 32),
     ("data:1,fsdp:1,expert:1,tensor:2", 32)],
)  # fmt: skip
def test_on_a_mesh_a_pool_per_batch_shard_gives_the_same_steps(
    toy_model_dir, mesh_spec, pool_tokens, monkeypatch
):
    """data:2 (2 batch shards, a pool each, holding every row of the shard: exactly the new
    prompts and the carried rows prefilled), data:2,tensor:2 (each shard's heads and pool
    split over its 2 devices) and tensor:2 (one pool, split), these with pools holding one
    row at full length (rows evicted and restored in their shard): the one-device compacted
    sampler's steps."""
    config, params, tokenizer = registry.load_model(toy_model_dir)
    stops = (3, 15)
    reference = _steps(Sampler(config, tokenizer, stop_ids=stops), params, monkeypatch, steps=3)
    sizes = [int(axis.split(":")[1]) for axis in mesh_spec.split(",")]
    mesh = parallel.make_mesh(mesh_spec, jax.devices()[: int(np.prod(sizes))])
    sampler = Sampler(config, tokenizer, mesh=mesh, stop_ids=stops, kv_cache_tokens=pool_tokens)
    ours = _steps(sampler, sampler.shard_params(params), monkeypatch, steps=3)
    for (a, ma, _), (b, mb, by_hand) in zip(reference, ours, strict=True):
        np.testing.assert_array_equal(b.tokens_BT, a.tokens_BT)
        np.testing.assert_array_equal(b.lengths_B, a.lengths_B)
        np.testing.assert_allclose(b.logprobs_BT, a.logprobs_BT, atol=1e-5, rtol=0)
        assert ma["partial/decoded_tokens"] == mb["partial/decoded_tokens"]
        if pool_tokens == 0:
            assert mb["partial/prefilled_tokens"] == by_hand < ma["partial/prefilled_tokens"]
    assert any(m["partial/carried_rows"] for _, m, _ in ours)


@pytest.mark.parametrize("mesh_spec", [None, "data:2,fsdp:1,expert:1,tensor:1"])
def test_with_max_rows_at_most_that_many_rows_decode_at_once(toy_model_dir, mesh_spec, monkeypatch):
    """--rollout_micro_batch=4 of the 8 rows (Sampler(max_rows=4); on data:2, 2 per shard):
    every decode segment takes that cap, the default pool holds the capped rows at full
    length (12 + 12 tokens: 2 pages of 16 a row), and the steps are the one-device compacted
    sampler's, whose calls hold every row."""
    from jaxrl4llm.sampling import paged_rounds

    config, params, tokenizer = registry.load_model(toy_model_dir)
    stops = (3, 15)
    reference = _steps(Sampler(config, tokenizer, stop_ids=stops), params, monkeypatch, steps=3)
    mesh, D = None, 1
    if mesh_spec:
        mesh, D = parallel.make_mesh(mesh_spec, jax.devices()[:2]), 2
    caps, pools = [], []
    for lib, name in (
        (paged_rounds.programs_lib, "segment"),
        (paged_rounds.mesh_lib, "segment_shards"),
    ):
        program = getattr(lib, name)
        monkeypatch.setattr(
            lib, name, lambda *a, _p=program, **kw: caps.append(kw["max_rows"]) or _p(*a, **kw)
        )
    init = paged_rounds.StepPool.__init__
    monkeypatch.setattr(
        paged_rounds.StepPool,
        "__init__",
        lambda self, *a, **kw: pools.append(self) or init(self, *a, **kw),
    )
    sampler = Sampler(config, tokenizer, mesh=mesh, stop_ids=stops, kv_cache_tokens=0, max_rows=4)
    ours = _steps(sampler, sampler.shard_params(params) if mesh else params, monkeypatch, steps=3)
    assert caps and set(caps) == {4 // D}
    assert pools and all(p.num_pages == 4 // D * 2 for p in pools)
    for (a, ma, _), (b, mb, _) in zip(reference, ours, strict=True):
        np.testing.assert_array_equal(b.tokens_BT, a.tokens_BT)
        np.testing.assert_array_equal(b.lengths_B, a.lengths_B)
        np.testing.assert_allclose(b.logprobs_BT, a.logprobs_BT, atol=1e-4, rtol=0)
        assert ma["partial/decoded_tokens"] == mb["partial/decoded_tokens"]
    assert any(m["partial/carried_rows"] for _, m, _ in ours)


def test_only_the_paged_engine_on_one_host_uses_it(monkeypatch):
    """The compacted engine, or several hosts, run the rounds as sampler calls."""
    sampler = lambda tokens: types.SimpleNamespace(mesh=None, kv_cache_tokens=tokens)  # noqa: E731
    assert partial_pool.applies(sampler(0)) and partial_pool.applies(sampler(64))
    assert not partial_pool.applies(sampler(None))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not partial_pool.applies(sampler(0))
