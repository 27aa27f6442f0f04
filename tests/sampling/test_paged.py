"""The paged rollout engine (sampling/paged.py, page_pool.py): the compacted sampler's samples
whatever the pool size, the rows decoding at once or preemptions; a full pool preempts and
loses no row; a group's prompt pages are held once; decode attention over pages against
numpy and JAX's Pallas paged attention kernel (interpret mode), and the engine decoding with
that kernel samples the gather reference's tokens."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import decode, page_pool, paged, paged_step, sampler
from jaxrl4llm.sampling.strategies import GREEDY, SamplingConfig

from tests.sampling.test_continuous import STOP, _assert_same_samples, _prompts

N = 40
SAMPLED = SamplingConfig(temperature=1.0, top_k=12)


def _both(config, params, prompts, sampling, *, kv_cache_tokens, max_rows=None, **kw):
    """(the compacted sampler's output, the paged engine's), same prompts and key."""
    args = (params, config, prompts, sampling, N, jax.random.key(3))
    kw = {"stop_ids": STOP, "n": 4, **kw}
    return (
        sampler.generate(*args, **kw),
        sampler.generate(*args, kv_cache_tokens=kv_cache_tokens, max_rows=max_rows, **kw),
    )


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    "pool,max_rows",
    [(0, None), (400, None), (0, 8)],
    ids=["rich", "small-pool", "8-rows"],
)
def test_same_samples_as_the_compacted_sampler(toy_policy, sampling, pool, max_rows):
    """Every row's tokens equal the compacted sampler's, whether the pool holds every row
    (rich), a few groups at a time (400 tokens: 25 pages; groups wait for pages),
    or at most 8 rows decode at once."""
    config, params = toy_policy
    prompts = _prompts(config, [3, 11, 6, 2, 9, 5, 20, 17])
    a, b = _both(config, params, prompts, sampling, kv_cache_tokens=pool, max_rows=max_rows)
    _assert_same_samples(a, b)
    lengths = np.asarray(b.lengths_B)
    assert lengths.min() < N // 4 and lengths.max() > N // 2  # short and long rows
    stats = jax.tree.map(int, b.engine_stats)
    assert stats.pages_left == 0  # every page came back
    if pool:
        assert stats.steps > lengths.max()  # groups waited for pages
    if max_rows:
        assert stats.live_rows <= 8 * stats.steps
        # The pool for 8 rows at once (pool_pages), not for all 32: no row ever preempted.
        assert stats.preemptions == 0


def test_tables_read_at_a_quarter_of_their_width_give_the_same_samples(toy_policy, monkeypatch):
    """A decode step whose rows' pages all lie in the first quarter of the tables reads only
    that quarter (tables of paged_step.WHOLE_TABLE_PAGES pages or more: here every table, of
    4 pages, and the first steps read one); the compacted sampler's samples."""
    config, params = toy_policy
    monkeypatch.setattr(paged_step, "WHOLE_TABLE_PAGES", 1)
    jax.clear_caches()  # the engine's widths are read when it is traced
    assert paged_step.widths(4) == (4, 1)
    # Prompts of a few tokens: the first steps' rows all sit in their first page.
    prompts = _prompts(config, [3, 1, 6, 2, 4, 5, 2, 7])
    a, b = _both(config, params, prompts, SAMPLED, kv_cache_tokens=0)
    _assert_same_samples(a, b)
    monkeypatch.undo()
    jax.clear_caches()


def test_a_pool_of_zero_tokens_holds_the_rows_decoding_at_once():
    """--kv_cache_tokens=0: every row at full length, or with S decode rows fewer than the
    rows, S rows at full length in the most groups that can be live at once (by hand,
    16-token pages: a 1024-token prompt is 64 pages, a row's 8192 new tokens 512 more and
    the copy of the prompt's last page)."""
    assert page_pool.pool_pages(0, 32, 1024, 8192, 8) == 32 * 576  # 32 rows, each 576 pages
    # S = 8 = G: one group at a time (it is admitted whole into 8 free rows).
    assert page_pool.pool_pages(0, 32, 1024, 8192, 8, decode_rows=8) == 64 + 8 * 513
    # S = 16: up to 9 groups (8 down to one row each, then a new group of 8).
    assert page_pool.pool_pages(0, 32, 1024, 8192, 8, decode_rows=16) == 9 * 64 + 16 * 513
    assert page_pool.pool_pages(0, 32, 1024, 8192, 8, decode_rows=64) == 32 * 576
    # Fewer decode rows than a group: one group at full length (min_pool_pages).
    assert page_pool.pool_pages(0, 32, 100, 40, 4, decode_rows=2) == 7 + 4 * (1 + 3)
    # Per batch shard: 256 rows at once over 32 shards of 32 rows, 8 each.
    settings = paged.program_settings(0, 256, 1024, 1024, 8192, 8, shards=32)
    assert settings["kv_pages"] == 64 + 8 * 513


def test_a_full_pool_preempts_and_loses_no_row(toy_policy):
    """The smallest pool the engine accepts (one group at full length): groups wait and are
    preempted, the loop ends, and every row is the compacted sampler's."""
    config, params = toy_policy
    prompts = _prompts(config, [9, 20, 4, 14], seed=1)
    # A one-page request: sampler.pool_pages raises it to page_pool.min_pool_pages.
    a, b = _both(config, params, prompts, GREEDY, kv_cache_tokens=paged.PAGE_SIZE, stop_ids=())
    _assert_same_samples(a, b)
    stats = jax.tree.map(int, b.engine_stats)
    assert np.all(np.asarray(b.lengths_B) == N)
    assert stats.preemptions > 0 and stats.pages_left == 0
    # Recomputed tokens are the only extra work: decoded = final tokens + recomputed ones.
    assert stats.decoded >= int(np.sum(np.asarray(b.lengths_B) - 1))


def test_a_groups_prompt_pages_are_held_once(toy_policy):
    """One group of 4 rows after a 40-token prompt (2 full pages of 16, 8 tokens in the third):
    each decode step holds the 2 full pages once plus one private page per row (the copied
    partial page), 6 pages, against 12 if every row held its own prompt."""
    config, params = toy_policy
    prompt = _prompts(config, [40], seed=2)
    out = sampler.generate(
        params,
        config,
        prompt,
        GREEDY,
        3,
        jax.random.key(0),
        n=4,
        stop_ids=(),
        kv_cache_tokens=0,
        min_prompt_bucket=64,
    )
    stats = jax.tree.map(int, out.engine_stats)
    assert stats.steps == 2  # the first token comes from the prefill
    assert stats.pages_in_use == 2 * (2 + 4)


def test_rows_that_all_end_at_their_first_token_take_no_decode_step(toy_policy):
    """One new token a row: the prefill draws every row's token, so the loop's iterations
    admit the groups and decode nothing: no step, no row computed, no page held; the
    compacted sampler's tokens."""
    config, params = toy_policy
    prompts = _prompts(config, [3, 11, 6, 2, 9])
    args = (params, config, prompts, SAMPLED, 1, jax.random.key(5))
    a = sampler.generate(*args, n=4, stop_ids=STOP)
    b = sampler.generate(*args, n=4, stop_ids=STOP, kv_cache_tokens=0, max_rows=8)
    np.testing.assert_array_equal(b.tokens_BT, a.tokens_BT)
    np.testing.assert_array_equal(b.lengths_B, np.ones(20))
    stats = jax.tree.map(int, b.engine_stats)
    assert (stats.steps, stats.live_rows, stats.pages_in_use, int(b.slot_steps)) == (0, 0, 0, 0)


def test_dropped_prompts_greedy_rows_and_row_caps(toy_policy):
    """Dropped prompts (no rows queued), ReMax's greedy last row and per-row caps decode as in
    the compacted sampler."""
    config, params = toy_policy
    prompts = _prompts(config, [3, 25, 6, 2, 9], seed=3)
    caps = np.random.default_rng(0).integers(1, N + 1, size=20)
    a, b = _both(
        config,
        params,
        prompts,
        SAMPLED,
        kv_cache_tokens=600,
        max_prompt_len=16,
        long_prompts="drop",
        greedy_last=1,
        row_caps=caps,
    )
    _assert_same_samples(a, b)
    assert np.asarray(b.dropped_B).sum() == 4


def test_a_pool_smaller_than_one_group_is_refused():
    with pytest.raises(FlagError, match="--kv_cache_tokens=.* or more"):
        paged.check_pool(10, 32, 64, 4, 16)


def _random_pool(rng, K=2, num_pages=13, ps=16, H=8):
    shape = (K, num_pages + 1, ps, H)
    return (
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
    )


def test_reference_attention_matches_numpy():
    """Each row's query against the first length_S tokens its table lists, by numpy loops."""
    rng = np.random.default_rng(0)
    k_pages, v_pages = _random_pool(rng)
    K, _, ps, H = k_pages.shape
    table = jnp.asarray(rng.permutation(12)[:9].reshape(3, 3), jnp.int32)
    lengths = jnp.array([1, 20, 48], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 4, H)), jnp.float32)  # 4 heads on 2 kv heads
    out = np.asarray(page_pool.reference_attention(q, k_pages, v_pages, table, lengths))
    kp, vp, tb = np.asarray(k_pages), np.asarray(v_pages), np.asarray(table)
    for s in range(3):
        slots = [(tb[s, t // ps], t % ps) for t in range(int(lengths[s]))]
        for n in range(4):
            k = np.stack([kp[n // 2, p, o] for p, o in slots])
            v = np.stack([vp[n // 2, p, o] for p, o in slots])
            w = np.exp(k @ np.asarray(q[s, n]) - np.max(k @ np.asarray(q[s, n])))
            np.testing.assert_allclose(out[s, n], (w / w.sum()) @ v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pages_per_block", [2, 3])
def test_pallas_paged_attention_kernel_matches_the_reference(pages_per_block):
    """JAX's Pallas paged attention kernel (the TPU path), run by the TPU interpreter on CPU,
    reads the same pool layout and agrees with the gather reference, with the table padded
    to whole blocks (3 pages a block: 4 pages padded to 6) and a row of length 0 reading its
    first slot. It reads the float32 pages as bfloat16, hence the 2e-2 on unit-scale inputs."""
    rng = np.random.default_rng(1)
    k_pages, v_pages = _random_pool(rng, K=2, num_pages=16, ps=16, H=128)
    table = jnp.asarray(rng.permutation(16)[:16].reshape(4, 4), jnp.int32)
    lengths = jnp.array([0, 17, 40, 64], jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, 4, 128)) / np.sqrt(128), jnp.float32)
    ref = page_pool.reference_attention(q, k_pages, v_pages, table, jnp.maximum(lengths, 1))
    out = page_pool.pallas_attention(q, k_pages, v_pages, table, lengths, pages_per_block)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-2)


def test_the_engine_decodes_with_the_pallas_kernel_as_with_the_reference(toy_policy):
    """The whole engine with its decode attention by the Pallas kernel (the TPU path, here in
    the TPU interpreter) samples the gather reference's tokens, logprobs within 2e-3, through
    a preemption (a 6-page pool), on grouped-query heads (the toy model's 4 on 2 kv heads).
    bfloat16 weights and pool, as on TPU: the kernel reads keys and values as bfloat16."""
    config, params = toy_policy
    assert config.num_kv_heads < config.num_heads
    params = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a, params
    )
    prompts = _prompts(config, [13, 3, 12, 14], seed=1)
    args = (params, config, prompts, SAMPLED, 12, jax.random.key(3))
    kw = dict(n=2, stop_ids=(), kv_cache_tokens=6 * paged.PAGE_SIZE, min_prompt_bucket=16)
    ref = sampler.generate(*args, **kw, paged_attention="reference")
    out = sampler.generate(*args, **kw, paged_attention="pallas")
    np.testing.assert_array_equal(np.asarray(out.tokens_BT), np.asarray(ref.tokens_BT))
    np.testing.assert_array_equal(np.asarray(out.lengths_B), np.asarray(ref.lengths_B))
    np.testing.assert_allclose(
        np.asarray(out.logprobs_BT), np.asarray(ref.logprobs_BT), atol=2e-3, rtol=0
    )
    stats = jax.tree.map(int, out.engine_stats)
    assert stats.preemptions > 0 and stats.pages_left == 0


def test_decode_attention_choice(toy_policy):
    """ "auto" runs the kernel only on TPU; the kernel has no sliding window."""
    from jaxrl4llm.sampling import paged_step

    config, _ = toy_policy
    assert not paged_step.uses_kernel("auto", config)  # CPU
    assert paged_step.uses_kernel("pallas", config)
    windowed = dataclasses.replace(config, sliding_window=4)
    assert not paged_step.uses_kernel("auto", windowed)
    with pytest.raises(ValueError, match="no sliding window"):
        paged_step.uses_kernel("pallas", windowed)
    with pytest.raises(ValueError, match="choose one of"):
        paged_step.uses_kernel("splash", config)


def test_on_a_tensor_parallel_mesh(toy_policy):
    """On a mesh that splits heads (tensor) but not the batch: one engine, the same samples."""
    from jaxrl4llm import parallel
    from jaxrl4llm.sampling import Sampler

    config, params = toy_policy
    mesh = parallel.make_mesh("data:1,fsdp:1,tensor:2", jax.devices()[:2])
    smp = Sampler(config, mesh=mesh, stop_ids=STOP, kv_cache_tokens=400)
    prompts = _prompts(config, [5, 2, 7, 4], seed=5)
    key = jax.random.key(1)
    b = smp.generate(smp.shard_params(params), prompts, SAMPLED, N, key, group_size=2)
    a = sampler.generate(params, config, prompts, SAMPLED, N, key, n=2, stop_ids=STOP)
    _assert_same_samples(a, b)


@pytest.mark.parametrize(
    "spec", ["data:2,fsdp:1,tensor:1", "data:2,fsdp:2,tensor:1", "data:2,fsdp:1,tensor:2"]
)
def test_on_a_mesh_splitting_the_batch(toy_policy, spec):
    """One engine and one pool per batch shard (paged_mesh.py): the one-device compacted
    sampler's samples, with the smallest pool (one group at full length, per shard: groups
    wait); the outputs split over the batch, the counts summed over the shards. With tensor:2
    each shard's engine splits its heads over its two devices."""
    from jaxrl4llm import parallel
    from jaxrl4llm.sampling import Sampler

    config, params = toy_policy
    mesh = parallel.make_mesh(spec, jax.devices()[: 2 if spec.endswith("fsdp:1,tensor:1") else 4])
    smp = Sampler(config, mesh=mesh, stop_ids=STOP, kv_cache_tokens=paged.PAGE_SIZE)
    prompts = _prompts(config, [3, 11, 6, 2, 9, 5, 20, 17, 8, 1, 14, 4, 12, 7, 19, 10], seed=4)
    key = jax.random.key(3)
    b = smp.generate(smp.shard_params(params), prompts, SAMPLED, N, key, group_size=4)
    a = sampler.generate(params, config, prompts, SAMPLED, N, key, n=4, stop_ids=STOP)
    _assert_same_samples(a, b)
    lengths = np.asarray(b.lengths_B)
    assert lengths.min() < N // 4 and lengths.max() > N // 2  # short and long rows
    stats = jax.tree.map(int, b.engine_stats)
    assert stats.pages_left == 0
    # Summed over the shards: with every group admitted at once a shard would decode for
    # its longest row's length - 1 steps; more steps: groups waited for pages.
    D = parallel.data_parallel_size(mesh)
    assert stats.steps > sum(rows.max() - 1 for rows in np.split(lengths, D))
    assert b.tokens_BT.sharding.is_equivalent_to(parallel.batch_sharding(mesh, 2), 2)
    assert stats.decoded >= int(np.sum(lengths - 1))


def test_a_shard_takes_whole_groups():
    """A batch that does not give each batch shard whole groups is refused."""
    from jaxrl4llm.sampling import paged_mesh

    paged_mesh.check_rows(16, 2, 4)
    with pytest.raises(FlagError, match="pad the batch to a multiple of 8 rows"):
        paged_mesh.check_rows(12, 2, 4)


def test_a_decode_step_holds_one_layers_gathered_pages_at_a_time():
    """The gather reference copies a layer's pages dense. Nothing but the layer's own input
    orders that gather after the layers before it, and XLA scheduled every layer's gather at
    the step's start, all the copies live at once: as much memory again as the rows' pages
    (a 7B rollout planned on v5p-64 took 94 GB against 65 GB). Compiled on 8 layers: the
    step's temporaries are about one layer's copy, not 8."""
    config = ModelConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=8, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=512,
    )  # fmt: skip
    params = decode.loop_params(transformer.init_params(config, jax.random.key(0)), config, None)
    S, M, ps = 32, 16, paged.PAGE_SIZE
    pool = page_pool.init_pool(config, S * M + 1, ps, jnp.float32)
    rows = jnp.zeros(S, jnp.int32)
    step = jax.jit(functools.partial(paged_step.paged_decode_step, model_config=config))
    compiled = step.lower(
        params, token_S=rows, position_S=rows, table_SM=jnp.zeros((S, M), jnp.int32), pool=pool
    ).compile()
    one_layer = 2 * S * M * ps * config.num_kv_heads * config.head_dim * 4  # keys and values
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * one_layer


def test_a_bfloat16_pool_is_written_in_place_on_the_cpu():
    """XLA:CPU runs a bfloat16 scatter in float32 over a converted copy of the whole pool;
    the pool's writes (a token per row, whole pages) hold no such copy, and write what
    numpy's indexed assignment writes."""
    from jaxrl4llm.sampling import page_pool

    K, Np, ps, H = 2, 4000, 16, 64
    pages = jax.ShapeDtypeStruct((K, Np, ps, H), jnp.bfloat16)
    nbytes = K * Np * ps * H * 2
    i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    tokens = jax.jit(page_pool.write_tokens, donate_argnums=0).lower(
        pages, i32(8), i32(8), jax.ShapeDtypeStruct((8, K, H), jnp.bfloat16)
    )
    whole = jax.jit(page_pool.write_pages, donate_argnums=0).lower(
        pages, i32(3), jax.ShapeDtypeStruct((K, 3, ps, H), jnp.bfloat16)
    )
    for lowered in (tokens, whole):
        assert lowered.compile().memory_analysis().temp_size_in_bytes < nbytes // 10
    rng = np.random.default_rng(0)
    small = rng.standard_normal((K, 9, ps, H)).astype(np.float32)
    x = rng.standard_normal((3, K, H)).astype(np.float32)
    page, offset = np.array([4, 0, 8]), np.array([15, 3, 0])
    want = small.copy()
    want[:, page, offset] = np.swapaxes(x, 0, 1)
    got = page_pool.write_tokens(jnp.asarray(small, jnp.bfloat16), page, offset, jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(jnp.bfloat16))
    y = rng.standard_normal((K, 2, ps, H)).astype(np.float32)
    want = small.copy()
    want[:, [7, 2]] = y
    got = page_pool.write_pages(jnp.asarray(small, jnp.bfloat16), np.array([7, 2]), jnp.asarray(y))
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(jnp.bfloat16))
