"""DAPO's dynamic sampling by admission (sampling/admission.py, paged_segments.py): the batch
it gathers is the one the rounds of the compacted sampler gather from the same records (same
groups, same rows), with a pool that preempts, with later chunks of wider prompts, and when
every chunk runs short; it decodes less; where it does not apply, the rounds run."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from jaxrl4llm.models import transformer
from jaxrl4llm.parallel import DEFAULT_RULES
from jaxrl4llm.rewards.base import RewardBatch
from jaxrl4llm.sampling import paged_segments
from jaxrl4llm.sampling import rounds as rounds_lib
from jaxrl4llm.sampling.frontend import Sampler
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.rounds import Rounds, sample_and_score
from jaxrl4llm.sampling.strategies import SamplingConfig

from tests.sampling.test_continuous import STOP
from tests.train.test_routing_replay import MOE

P, G, N = 6, 4, 24


class Tokens:
    """A record is its prompt's token ids; a completion's text is its ids."""

    pad_token_id = 0

    def encode_chat(self, record, system=None):
        return list(record)

    def decode(self, ids):
        return ",".join(map(str, ids))


class SumVerifier:
    """A row is correct iff the sum of its completion's tokens is a multiple of `modulus`."""

    def __init__(self, modulus):
        self.modulus = modulus

    def score(self, texts, records, lengths=None):
        correct = np.array(
            [bool(t) and sum(map(int, t.split(","))) % self.modulus == 0 for t in texts]
        )
        reasons = ["correct" if c else "wrong" for c in correct]
        return RewardBatch(rewards=correct.astype(np.float32), correct=correct, reasons=reasons)


class Feed:
    """next_records over chunks, as the trainer's data iterator: a call takes the next chunk,
    peek(i) looks at the one i after it without taking it."""

    def __init__(self, chunks):
        self.chunks, self.taken = chunks, 0

    def __call__(self):
        self.taken += 1
        return self.chunks[self.taken - 1]

    def peek(self, offset):
        at = self.taken + offset
        return self.chunks[at] if at < len(self.chunks) else None


def _chunks(config, widths, seed=0):
    """Chunks of P records: chunk k's prompts have 2 to widths[k] tokens."""
    rng = np.random.default_rng(seed)
    return [
        [
            tuple(rng.integers(7, config.vocab_size, size=int(rng.integers(2, w + 1))))
            for _ in range(P)
        ]
        for w in widths
    ]


def _sample(toy_policy, chunks, kv_cache_tokens, by_admission, modulus=6, cap=4, **sampler):
    config, params = toy_policy
    sampler = Sampler(
        config, Tokens(), kv_cache_tokens=kv_cache_tokens, **{"stop_ids": STOP, **sampler}
    )
    ctx = types.SimpleNamespace(
        sampler=sampler,
        reward_fn=SumVerifier(modulus),
        data=types.SimpleNamespace(messages=lambda r: r),
        rollout=types.SimpleNamespace(sampling=SamplingConfig(1.0, top_k=12), max_new_tokens=N),
        turn_handlers=None,
    )
    feed = Feed(chunks[1:])
    rounds = Rounds(dynamic_sampling=True, max_resample_rounds=cap, by_admission=by_admission)
    rows, metrics = sample_and_score(
        ctx, params, chunks[0], jax.random.key(1), RowLayout(G), rounds, feed
    )
    return rows, {**metrics, "chunks_taken": feed.taken}


def _rows(scored):
    """Each row's prompt (unpadded), completion, logprobs and reward."""
    out = jax.tree.map(np.asarray, scored.samples.out)
    rows = []
    for b in range(out.tokens_BT.shape[0]):
        n = int(out.lengths_B[b])
        rows.append(
            (
                tuple(out.prompt_tokens_BP[b][out.prompt_mask_BP[b]]),
                tuple(out.tokens_BT[b, :n]),
                out.logprobs_BT[b, :n],
                bool(out.truncated_B[b]),
                float(scored.verdicts.rewards[b]),
            )
        )
    return rows


@pytest.mark.parametrize(
    "pool,widths,modulus",
    [(0, (12,) * 5, 6), (160, (6, 20, 12, 30, 8), 6), (0, (10,) * 5, 97)],
    ids=["rich", "small-pool-wider-chunks", "every-chunk-short"],
)
def test_the_batch_of_the_compacted_samplers_rounds(toy_policy, pool, widths, modulus):
    """Same groups, in the same order, with the same rows as the rounds of the compacted
    sampler (a different engine) on the same records and keys; logprobs within 1e-5. With
    modulus 97 hardly a group has spread: every chunk runs and the batch is filled with
    groups without spread, in the records' order, as the rounds fill it."""
    chunks = _chunks(toy_policy[0], widths)
    ref, ref_m = _sample(toy_policy, chunks, None, False, modulus)
    got, got_m = _sample(toy_policy, chunks, pool, True, modulus)
    a, b = _rows(ref), _rows(got)
    assert len(a) == len(b) == P * G
    for ra, rb in zip(a, b):
        assert ra[0] == rb[0] and ra[1] == rb[1] and ra[3:] == rb[3:]
        np.testing.assert_allclose(rb[2], ra[2], atol=1e-5, rtol=0)
    # The same records taken: the chunks the rounds drew, no more.
    assert got_m["chunks_taken"] == ref_m["chunks_taken"]
    for k in ("rollout/groups_short", "rollout/rounds"):
        assert got_m[k].value == ref_m[k].value
    stats = jax.tree.map(int, got.samples.out.engine_stats)
    assert stats.pages_left == 0 or got_m["rollout/groups_dropped"].value > 0
    if pool:  # a pool of about one group at full length: the groups wait for pages
        assert stats.live_rows < stats.steps * G * 2
    if modulus == 97:
        assert got_m["rollout/groups_short"].value > 0
        assert got_m["rollout/rounds"].value == len(widths)


def test_it_decodes_less_than_the_rounds_of_the_same_engine(toy_policy, monkeypatch):
    """The paged engine in rounds waits for each round's longest row and samples the last
    round whole; by admission (segments of 4 steps: the host sees a group finish within 4
    steps, as within 32 of thousands in a real run) it decodes fewer tokens, in about as
    many decode steps, for the same batches (rows equal), over three steps' records."""
    monkeypatch.setattr(paged_segments, "SEGMENT_STEPS", 4)
    work = np.zeros((2, 2), int)  # [rounds, admission] x [tokens decoded, decode steps]
    for seed in range(3):
        chunks = _chunks(toy_policy[0], (12,) * 6, seed=seed)
        ref, _ = _sample(toy_policy, chunks, 0, False, modulus=5, cap=5)
        got, metrics = _sample(toy_policy, chunks, 0, True, modulus=5, cap=5)
        assert [r[:2] for r in _rows(ref)] == [r[:2] for r in _rows(got)]
        stats = [x.samples.out.engine_stats for x in (ref, got)]
        work += [[int(s.decoded), int(s.steps)] for s in stats]
        # At most one chunk looked at ahead and not taken.
        assert metrics["rollout/groups_admitted"].value <= (metrics["chunks_taken"] + 2) * P
    assert work[1, 0] < 0.97 * work[0, 0] and work[1, 1] <= work[0, 1] + 3, work


@pytest.mark.parametrize(
    "spec", ["data:1,fsdp:2,tensor:1", "data:2,fsdp:1,tensor:2", "data:1,fsdp:1,tensor:2"]
)
def test_on_a_mesh(toy_policy, spec):
    """On fsdp:2 (the weights split, gathered once) a pool and a queue per batch shard, each
    shard's loop on its own device; with tensor:2 each shard's engine (one without a batch
    split) splits its heads and pool over its two devices: the batch of the one-device
    compacted sampler's rounds, also with the smallest pools and wider later chunks."""
    from jaxrl4llm import parallel

    mesh = parallel.make_mesh(spec, jax.devices()[: 2 if spec.count(":1") == 2 else 4])
    chunks = _chunks(toy_policy[0], (6, 20, 12, 30, 8), seed=2)
    ref, ref_m = _sample(toy_policy, chunks, None, False)
    got, got_m = _sample(toy_policy, chunks, 160, True, mesh=mesh)
    assert "rollout/groups_admitted" in got_m  # by admission
    assert got_m["chunks_taken"] == ref_m["chunks_taken"]
    a, b = _rows(ref), _rows(got)
    for ra, rb in zip(a, b):
        assert ra[0] == rb[0] and ra[1] == rb[1] and ra[3:] == rb[3:]
        np.testing.assert_allclose(rb[2], ra[2], atol=1e-5, rtol=0)
    out = got.samples.out
    assert out.tokens_BT.sharding.is_equivalent_to(parallel.batch_sharding(mesh, 2), 2)
    stats = jax.tree.map(int, out.engine_stats)
    assert stats.decoded > 0 and stats.live_rows <= stats.steps * P * G


def test_a_mixture_of_experts_routing_record():
    """With record_routing, the batch carries the compacted sampler's record: each prompt's
    experts at its real tokens and each completion column's (zeros past a row's fed tokens,
    also in a slot a finished group left), through chunks of wider prompts."""
    params = transformer.init_params(MOE, jax.random.key(0))
    chunks = _chunks(MOE, (6, 20, 12, 30, 8), seed=1)
    kw = dict(stop_ids=(237,), record_routing=True)
    ref, _ = _sample((MOE, params), chunks, None, False, modulus=4, **kw)
    got, metrics = _sample((MOE, params), chunks, 0, True, modulus=4, **kw)
    assert metrics["rollout/rounds"].value > 1  # slots were reused
    a, b = (jax.tree.map(np.asarray, x.samples.out) for x in (ref, got))
    np.testing.assert_array_equal(b.tokens_BT, a.tokens_BT)
    real_a, real_b = a.prompt_mask_BP, b.prompt_mask_BP
    np.testing.assert_array_equal(b.prompt_experts_BPLK[real_b], a.prompt_experts_BPLK[real_a])
    assert not b.prompt_experts_BPLK[~real_b].any()
    np.testing.assert_array_equal(b.experts_BTLK, a.experts_BTLK)


def test_the_engine_counts_are_each_rounds_once(toy_policy):
    """In rounds, the paged engine's counts add up each round once (a round's rows are split
    into kept and set-aside groups): one round without preemption decodes every row's tokens
    but its first (drawn from the prompt's prefill)."""
    chunks = _chunks(toy_policy[0], (12,))
    scored, _ = _sample(toy_policy, chunks, 0, False, cap=0)
    stats = jax.tree.map(int, scored.samples.out.engine_stats)
    lengths = np.asarray(scored.samples.out.lengths_B)
    assert 0 < stats.decoded == int(np.maximum(lengths - 1, 0).sum())


def _mesh(spec):
    """An abstract mesh "axis:size,...", e.g. "data:2,fsdp:2"."""
    axes = [x.split(":") for x in spec.split(",")]
    return AbstractMesh(tuple(int(n) for _, n in axes), tuple(a for a, _ in axes))


def test_where_it_applies():
    """By admission: the paged engine on one host (one device or any mesh), single-turn, no
    greedy rows; anything else runs in rounds."""

    def ctx(mesh=None, kv=0, handlers=None):
        sampler = types.SimpleNamespace(mesh=mesh, kv_cache_tokens=kv, rules=DEFAULT_RULES)
        return types.SimpleNamespace(sampler=sampler, turn_handlers=handlers)

    dapo = Rounds(dynamic_sampling=True, max_resample_rounds=2)
    assert rounds_lib.admits(ctx(), dapo)
    for spec, admits in [("data:1", True), ("data:2,fsdp:2", True), ("fsdp:2,tensor:2", True)]:
        assert rounds_lib.admits(ctx(mesh=_mesh(spec)), dapo) == admits
    assert not rounds_lib.admits(ctx(kv=None), dapo)
    assert not rounds_lib.admits(ctx(handlers=object()), dapo)
    assert not rounds_lib.admits(ctx(), Rounds(dynamic_sampling=True, greedy_baseline=True))
    assert not rounds_lib.admits(ctx(), Rounds())
    assert not rounds_lib.admits(ctx(), Rounds(dynamic_sampling=True, by_admission=False))


@pytest.mark.parametrize(
    "spec", ["data:1,fsdp:1,expert:2,tensor:1", "data:1,fsdp:1,expert:2,tensor:2"]
)
def test_a_mixture_of_experts_on_a_mesh_whose_expert_axis_splits_the_experts(spec):
    """On expert:2 each batch shard's engine holds half of the experts (with tensor:2 also
    split over its two devices) and the two shards run their segments in lockstep
    (paged_lockstep.py): the batch, and its routing record, of the one-device compacted
    sampler's rounds, in small pools and through wider later chunks."""
    from unittest import mock

    from jaxrl4llm import parallel
    from jaxrl4llm.models import moe

    params = transformer.init_params(MOE, jax.random.key(0))
    chunks = _chunks(MOE, (6, 20, 12, 30, 8), seed=3)
    kw = dict(stop_ids=(237,), record_routing=True)
    ref, ref_m = _sample((MOE, params), chunks, None, False, modulus=4, **kw)
    mesh = parallel.make_mesh(spec, jax.devices()[: 2 if spec.endswith("tensor:1") else 4])
    with mock.patch.object(moe, "_manual_experts", wraps=moe._manual_experts) as split:
        got, got_m = _sample((MOE, params), chunks, 160, True, modulus=4, mesh=mesh, **kw)
    assert split.called  # the shards' layers held only their experts
    assert "rollout/groups_admitted" in got_m and got_m["chunks_taken"] == ref_m["chunks_taken"]
    a, b = (jax.tree.map(np.asarray, x.samples.out) for x in (ref, got))
    np.testing.assert_array_equal(b.tokens_BT, a.tokens_BT)
    np.testing.assert_array_equal(b.experts_BTLK, a.experts_BTLK)
    real_a, real_b = a.prompt_mask_BP, b.prompt_mask_BP
    np.testing.assert_array_equal(b.prompt_experts_BPLK[real_b], a.prompt_experts_BPLK[real_a])
