"""The paged rollout engine's routing record (record_routing, a mixture of experts): each
prompt token's experts from its group's prefill and each completion token's from the decode
step that fed it, the compacted sampler's record, in a pool that holds every row and in one
so small that a group is preempted and recomputed; both against an uncached teacher-forced
pass."""

import jax
import numpy as np
import pytest

from jaxrl4llm.models import transformer
from jaxrl4llm.sampling import paged, sampler
from jaxrl4llm.sampling.strategies import SamplingConfig

from tests.train.test_routing_replay import MOE

N = 32
# Prompts of 1 to 2 pages (one holds a full page its group shares), 2 samples each.
PROMPT_LENS, G = [9, 20, 4, 14], 2
STOP = (237,)  # ends 3 of the 8 rows early (after 6 to 10 tokens); the others run to N


@pytest.fixture(scope="module")
def compacted():
    """(params, generate's arguments and keywords, the compacted sampler's output)."""
    params = transformer.init_params(MOE, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 60, n)] for n in PROMPT_LENS]
    args = (params, MOE, prompts, SamplingConfig(1.0), N, jax.random.key(1))
    kw = dict(n=G, stop_ids=STOP, record_routing=True)
    return params, args, kw, sampler.generate(*args, **kw)


def _teacher_forced_experts(params, out):
    """[B, P + T, L, K]: the routers' top-k of an uncached pass over prompt + completion,
    each token's experts sorted (the record keeps the router's order; ties aside, the same
    set)."""
    tokens, mask, positions = out.sequences()
    _, _, routing = transformer.routed_hidden_states(params, MOE, tokens, positions, mask)
    return np.sort(np.moveaxis(np.asarray(routing.experts_BTK), 0, 2), axis=-1)


@pytest.mark.parametrize("pool", [0, paged.PAGE_SIZE], ids=["rich", "preempting"])
def test_the_paged_record_is_the_compacted_samplers(compacted, pool):
    """Same tokens, and the same record: the prompt's experts at its real tokens, every
    completion column (a row's fed tokens, then zeros from its last token on), in a pool
    holding every row and in the smallest one (a group preempted and recomputed); the
    record is the teacher-forced pass's routing."""
    params, args, kw, a = compacted
    b = sampler.generate(*args, kv_cache_tokens=pool, **kw)
    np.testing.assert_array_equal(np.asarray(b.tokens_BT), np.asarray(a.tokens_BT))
    lengths = np.asarray(b.lengths_B)
    assert lengths.min() < N // 2 and lengths.max() == N  # rows that stop, rows at the cap
    if pool:
        assert int(b.engine_stats.preemptions) > 0
    real_BP = np.asarray(a.prompt_mask_BP)
    got_prompt, want_prompt = np.asarray(b.prompt_experts_BPLK), np.asarray(a.prompt_experts_BPLK)
    np.testing.assert_array_equal(got_prompt[real_BP], want_prompt[real_BP])
    np.testing.assert_array_equal(np.asarray(b.experts_BTLK), np.asarray(a.experts_BTLK))
    # Independently: the routers' choice in one uncached pass, at every fed token.
    P = real_BP.shape[1]
    fed_BT = np.arange(N)[None, :] < lengths[:, None] - 1
    want = _teacher_forced_experts(params, b)
    np.testing.assert_array_equal(np.sort(got_prompt, axis=-1)[real_BP], want[:, :P][real_BP])
    got = np.sort(np.asarray(b.experts_BTLK), axis=-1)
    np.testing.assert_array_equal(got[fed_BT], want[:, P:][fed_BT])
    assert not got[~fed_BT].any()  # a row's last token is never fed, nor padding


@pytest.mark.parametrize(
    "spec", ["data:1,fsdp:2,expert:4,tensor:1", "data:2,fsdp:1,expert:2,tensor:2"]
)
def test_on_a_mesh_whose_expert_axis_splits_the_batch_and_the_experts(spec):
    """Experts split over `expert`, which also splits the batch: each batch shard's engine
    holds its part of the experts (the weights it receives are E / expert experts, not all),
    its expert group's shards step together (paged_lockstep.py) in the smallest pool (groups
    wait for pages, shards finish at different steps), and the tokens and routing record
    are the one-device compacted sampler's. With tensor:2 each engine also splits its heads
    and the experts' width."""
    import unittest.mock

    from jaxrl4llm import parallel
    from jaxrl4llm.sampling import Sampler, paged_mesh

    params = transformer.init_params(MOE, jax.random.key(0))
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, 60, n)] for n in rng.integers(2, 30, 16)]
    key = jax.random.key(4)
    a = sampler.generate(
        params, MOE, prompts, SamplingConfig(1.0), N, key, n=G, stop_ids=STOP,
        record_routing=True,
    )  # fmt: skip
    mesh = parallel.make_mesh(spec)
    assert paged_mesh.lockstep_axes(mesh, parallel.DEFAULT_RULES, MOE) == ("expert",)
    smp = Sampler(
        MOE, mesh=mesh, stop_ids=STOP, kv_cache_tokens=paged.PAGE_SIZE, record_routing=True
    )
    held, real = [], paged.generate_paged

    def spy(params, *a, **k):  # the expert weights one shard's engine receives
        held.append(params["layers"][1]["expert_gate"].shape[0])
        return real(params, *a, **k)

    with unittest.mock.patch.object(paged, "generate_paged", spy):
        b = smp.generate(
            smp.shard_params(params), prompts, SamplingConfig(1.0), N, key, group_size=G
        )
    assert held and set(held) == {MOE.moe.num_experts // mesh.shape["expert"]}
    np.testing.assert_array_equal(np.asarray(b.tokens_BT), np.asarray(a.tokens_BT))
    np.testing.assert_array_equal(np.asarray(b.experts_BTLK), np.asarray(a.experts_BTLK))
    real_BP = np.asarray(a.prompt_mask_BP)
    got_prompt = np.asarray(b.prompt_experts_BPLK)[real_BP]
    np.testing.assert_array_equal(got_prompt, np.asarray(a.prompt_experts_BPLK)[real_BP])
    stats = jax.tree.map(int, b.engine_stats)
    assert stats.preemptions > 0 and stats.pages_left == 0
