"""Multi-turn rollouts on the paged KV cache (sampling/paged_turns.py): with a pool that
holds every row the dense multi-turn engine's rows (tokens, masks, lengths, logprobs); with
the smallest pool (one row at full length), which forces evictions, every row still ends
with the dense engine's rows; the same on a mesh, a pool per batch shard (its heads split
over tensor where the mesh has it); a smaller pool refused; the groups admitted at the
start and their pages."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.sampling import paged_turn_programs
from jaxrl4llm.sampling.turns import TurnLimits

from tests.sampling.test_multiturn import SAMPLED, FakeHandler, _prompts, _run

LIMITS = TurnLimits(max_turns=3, max_observation_tokens=8)
# Prompts of 5, 9, 3, 18 and 17 tokens: partial last pages, one of two full pages.
LENGTHS = (5, 9, 3, 18, 17)


def _rows(out, stats):
    arrays = {
        name: np.asarray(getattr(out, name))
        for name in ("tokens_BT", "mask_BT", "observation_BT", "lengths_B", "truncated_B")
    }
    return arrays, np.asarray(out.logprobs_BT), stats


def _sample(toy_policy, kv_cache_tokens):
    config, _ = toy_policy
    handler = FakeHandler(done_after=3)
    prompts = _prompts(config, LENGTHS)
    return _rows(*_run(toy_policy, handler, LIMITS, prompts, kv_cache_tokens=kv_cache_tokens))


@pytest.fixture(scope="module")
def dense(toy_policy):
    """The dense multi-turn engine's rows (same prompts, keys and replies)."""
    return _sample(toy_policy, None)


def _assert_same_rows(dense, paged, logprob_atol=1e-5):
    (a, lp_a, stats_a), (b, lp_b, stats_b) = dense, paged
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    np.testing.assert_allclose(lp_b, lp_a, atol=logprob_atol)
    np.testing.assert_array_equal(stats_b.turns_B, stats_a.turns_B)
    np.testing.assert_array_equal(stats_b.reward_B, stats_a.reward_B)


def test_a_rich_pool_samples_the_dense_engines_rows(toy_policy, dense):
    """Every row at full length (kv_cache_tokens=0): no eviction, the dense engine's rows,
    several of them over more than one turn."""
    paged = _sample(toy_policy, 0)
    _assert_same_rows(dense, paged)
    assert paged[2].evictions == 0 and paged[2].pages_left == 0
    assert (paged[2].turns_B > 1).sum() >= 3, "the toy model should end several turns"


def test_the_smallest_pool_evicts_and_every_row_ends_with_the_dense_rows(toy_policy, dense):
    """A pool of one row at full length (prompt bucket 24 + budget 24: 3 pages of 16) for
    10 rows: rows stall, parked and stalled rows are evicted and restored by prefill (some
    with the observation they waited for), and every row ends with the dense engine's rows
    (restored KV is prefilled, not decoded: the same tokens on the toy model, logprobs to
    float rounding); every page comes back."""
    paged = _sample(toy_policy, 3 * 16)
    assert paged[2].evictions >= 5 and paged[2].pages_left == 0
    _assert_same_rows(dense, paged, logprob_atol=1e-4)


def test_a_pool_below_one_row_at_full_length_is_refused(toy_policy):
    config, _ = toy_policy
    # Prompt bucket 24 + budget 24: 3 pages of 16 tokens.
    with pytest.raises(FlagError, match=r"--kv_cache_tokens=32 .* use --kv_cache_tokens=48"):
        _run(toy_policy, FakeHandler(), LIMITS, _prompts(config, LENGTHS), kv_cache_tokens=32)


@pytest.mark.parametrize(
    "mesh_spec", ["data:2,fsdp:2,expert:1,tensor:1", "data:1,fsdp:1,expert:1,tensor:2",
                  "data:2,fsdp:1,expert:1,tensor:2"],
)  # fmt: skip
def test_on_a_mesh_each_batch_shard_samples_the_dense_engines_rows(toy_policy, caplog, mesh_spec):
    """data:2,fsdp:2 (4 batch shards, one group of 2 rows each, paged_turns_mesh.py), tensor:2
    (one shard, its heads, pool and vocabulary split over 2 devices) and data:2,tensor:2 (2
    shards of 2 devices each), each shard with the smallest pool (one row at full length: 3
    pages of 16 for its rows, so rows are evicted inside their shard): the rows the dense
    engine samples on one device; every shard's pages come back; the decode segment
    compiled once for every shard."""
    config, _ = toy_policy
    prompts = _prompts(config, LENGTHS[:4])
    dense = _rows(*_run(toy_policy, FakeHandler(done_after=3), LIMITS, prompts))
    sizes = [int(axis.split(":")[1]) for axis in mesh_spec.split(",")]
    mesh = parallel.make_mesh(mesh_spec, jax.devices()[: int(np.prod(sizes))])
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        paged = _rows(
            *_run(
                toy_policy, FakeHandler(done_after=3), LIMITS, prompts, mesh=mesh,
                kv_cache_tokens=3 * 16,
            )
        )  # fmt: skip
    _assert_same_rows(dense, paged, logprob_atol=1e-4)
    assert paged[2].pages_left == 0 and paged[2].evictions > 0
    compiled = [r for r in caplog.records if "Compiling jit(segment_shards)" in r.getMessage()]
    assert len(compiled) == 1, "one program for every shard, not one per device"
    assert (paged[2].turns_B > 1).sum() >= 2, "the toy model should end several turns"


def test_the_groups_that_fit_at_the_start_get_shared_and_private_pages():
    """Pages of 16 tokens, a pool of 5: group 0 (5-token prompts, row 1 inactive) takes a
    private page for row 0; group 1 (20-token prompts) its full page once and a private
    page per row; group 2 (2 pages more) does not fit and starts evicted."""
    N = 5
    pages = paged_turn_programs.initial_pages(
        np.array([5, 5, 20, 20, 3, 3]),
        np.array([True, False, True, True, True, True]),
        group=2,
        num_pages=N,
        M=4,
        P=24,
        ps=16,
    )
    np.testing.assert_array_equal(pages.admitted_B, [True, False, True, True, False, False])
    expected = [[0, N, N, N], [N] * 4, [1, 2, N, N], [1, 3, N, N], [N] * 4, [N] * 4]
    np.testing.assert_array_equal(pages.table_BM, expected)
    np.testing.assert_array_equal(pages.shared_JM, [[N, N], [1, N], [N, N]])
    np.testing.assert_array_equal(pages.private_JG, [[0, N], [2, 3], [N, N]])


def test_a_batch_whose_every_prompt_was_dropped_runs(toy_policy):
    """Every prompt longer than max_prompt_len and dropped (--long_prompts=drop): no row
    runs, on a pool sized for every row (kv_cache_tokens=0) as on the dense engine."""
    config, _ = toy_policy
    prompts = _prompts(config, (9, 18))
    for tokens in (None, 0):
        out, stats = _run(
            toy_policy, FakeHandler(), LIMITS, prompts, max_prompt_len=4,
            long_prompts="drop", kv_cache_tokens=tokens,
        )  # fmt: skip
        assert np.asarray(out.dropped_B).all() and not np.asarray(out.lengths_B).any()
        assert not np.asarray(out.mask_BT).any() and stats.turns_B.sum() == 0


def _start_inputs(toy_policy):
    """16 rows (8 prompts x 2) of a rollout without stop sequences: (rows, settings, the
    decode weights) as multiturn.run gives them to paged_turns.start."""
    from jaxrl4llm.sampling import row_io, turn_programs
    from jaxrl4llm.sampling.layout import RowLayout

    config, params = toy_policy
    request = row_io.RowRequest(RowLayout(2), max_new_tokens=24)
    prompts = _prompts(config, [5, 9, 3, 18] * 2)
    rows = row_io.prompt_rows(prompts, config, jax.random.key(1), request)
    stop_BQL = jax.numpy.full((16, 1, 1), -1, np.int32)
    static = dict(model_config=config, sampling=SAMPLED, sharding=None)
    stop_ids = jax.numpy.asarray([1], np.int32)
    settings = turn_programs.RolloutSettings(stop_ids, stop_BQL, 0, 24, 16, static)
    return rows, settings, turn_programs.decode_weights(params, config, None)


def test_on_a_mesh_the_decode_segment_holds_no_collective(toy_policy):
    """On fsdp:8 the weights are gathered once, when the rollout starts
    (turn_programs.decode_weights): each shard's decode segment (its loop of decode steps)
    runs on its device with no collective, read right after SPMD partitioning
    (hlo_analysis.partitioned_hlo)."""
    from jaxrl4llm.models import transformer
    from jaxrl4llm.planner import hlo_analysis
    from jaxrl4llm.sampling import paged_turns_mesh, turn_programs

    config, params = toy_policy
    rows, settings, _ = _start_inputs(toy_policy)
    mesh = parallel.make_mesh("data:1,fsdp:8,expert:1,tensor:1")
    # The weights as the trainer's sampler gets them: split over fsdp.
    params = parallel.shard_pytree(
        params, transformer.param_logical_axes(config), mesh, parallel.DEFAULT_RULES
    )
    weights = turn_programs.decode_weights(params, config, parallel.ActivationSharding(mesh))
    state, programs = paged_turns_mesh.start(weights, rows, settings, 0, mesh)
    p = programs.shards[0]
    lowered = paged_turns_mesh.segment_shards.lower(
        p.weights, state, (p.stop_ids_S, p.stop_BQL), mesh=mesh, rules=parallel.DEFAULT_RULES,
        model_config=config, sampling=SAMPLED, max_steps=4,
    )  # fmt: skip
    _, hlo = hlo_analysis.partitioned_hlo(lowered)
    assert " while(" in hlo  # the decode loop is there
    assert not hlo_analysis.collectives(hlo)


def test_on_a_mesh_splitting_heads_a_shards_collectives_join_only_its_devices(toy_policy):
    """data:2,tensor:2 (2 batch shards of 2 devices, each splitting its heads): the decode
    segment's loop and the observation and restoration programs (run on every device,
    skipped by the shards other than their row's: lax.cond) hold collectives, and each
    joins only the 2 devices of one shard (the shards run different step counts and
    branches: a collective across shards, e.g. a collective permute, which CPU's runtime
    joins over every device, would wait forever). Read right after SPMD partitioning
    (hlo_analysis.partitioned_hlo)."""
    from jaxrl4llm.planner import hlo_analysis
    from jaxrl4llm.sampling import paged_turns_mesh, turn_programs

    config, params = toy_policy
    rows, settings, _ = _start_inputs(toy_policy)
    mesh = parallel.make_mesh("data:2,fsdp:1,expert:1,tensor:2", jax.devices()[:4])
    weights = turn_programs.decode_weights(params, config, parallel.ActivationSharding(mesh))
    state, programs = paged_turns_mesh.start(weights, rows, settings, 0, mesh)
    p, rules, D = programs.shards[0], parallel.DEFAULT_RULES, 2
    stops = (p.stop_ids_S, p.stop_BQL)
    segment = paged_turns_mesh.segment_shards.lower(
        p.weights, state, stops, mesh=mesh, rules=rules, model_config=config, sampling=SAMPLED,
        max_steps=4,
    )  # fmt: skip
    observation = (np.zeros(D, np.int32), np.zeros((D, 16), np.int32), np.ones(D, np.int32))
    observe = paged_turns_mesh._row_program.lower(
        p.weights, state, observation, stops, np.array([True, False]), program="observe",
        mesh=mesh, rules=rules, model_config=config, sampling=SAMPLED,
    )  # fmt: skip
    restoration = (np.zeros(D, np.int32), np.zeros((D, 32), np.int32), np.ones(D, bool))
    restore = paged_turns_mesh._row_program.lower(
        p.weights, state, restoration, (), np.array([False, True]), program="restore",
        mesh=mesh, rules=rules, model_config=config,
    )  # fmt: skip
    for lowered, looped in ((segment, True), (observe, False), (restore, False)):
        _, hlo = hlo_analysis.partitioned_hlo(lowered)
        ops = hlo_analysis.collectives(hlo, unknown_trip_count=2, num_devices=4)
        ops = [op for op in ops if op.executions > 1] if looped else ops
        assert ops, "the heads' split should need collectives"
        assert all(op.group_size == 2 for op in ops), [
            (op.kind, op.group_size, op.op_name) for op in ops if op.group_size != 2
        ]


def test_a_decode_step_computes_only_the_live_rows_smallest_level(toy_policy):
    """16 rows (row levels 16, 12, 8) of which only rows 3 and 11 decode (the others parked,
    as rows waiting for a tool's reply are): a step computes 8 rows, not 16, and rows 3 and
    11 get the tokens and logprobs they get in a step that computes all 16 rows."""
    from jaxrl4llm.sampling import paged_turns

    config, _ = toy_policy
    rows, settings, weights = _start_inputs(toy_policy)
    stop_ids, stop_BQL = settings.stop_ids_S, settings.stop_BQL

    def step(live):
        state, _ = paged_turns.start(weights, rows, settings, kv_cache_tokens=0)
        state = state.replace(live_B=jax.numpy.asarray(live))
        before = int(state.slot_steps)
        state = paged_turn_programs.segment(
            weights, state, (stop_ids, stop_BQL), model_config=config, sampling=SAMPLED,
            max_steps=1,
        )  # fmt: skip
        tokens, logprobs, step_B = jax.device_get(
            (state.tokens_BT, state.logprobs_BT, state.step_B)
        )
        return int(state.slot_steps) - before, tokens, logprobs, step_B

    two = np.isin(np.arange(16), [3, 11])
    computed_all, tokens_all, logprobs_all, step_all = step(np.ones(16, bool))
    computed_two, tokens_two, logprobs_two, step_two = step(two)
    assert (computed_all, computed_two) == (16, 8)
    np.testing.assert_array_equal(step_two, step_all - ~two)  # the parked rows did not move
    np.testing.assert_array_equal(tokens_two[two, 1], tokens_all[two, 1])
    np.testing.assert_allclose(logprobs_two[two, 1], logprobs_all[two, 1], atol=1e-6)


def test_at_most_max_rows_decode_at_a_step_the_lowest_live_ones(toy_policy):
    """16 rows, rows 2 and 4 parked, max_rows=6: one step computes 6 rows (16 uncapped: the
    level of 14 live rows), rows 0, 1, 3, 5, 6, 7 (the lowest 6 live) move with the tokens and
    logprobs a step of every row gives them, and the others stay; decoding on until no row
    is live, every row ends where an uncapped segment leaves it. The default pool holds
    max_rows rows at full length."""
    from jaxrl4llm.sampling import paged_turns

    config, _ = toy_policy
    rows, settings, weights = _start_inputs(toy_policy)
    stops = (settings.stop_ids_S, settings.stop_BQL)
    live = ~np.isin(np.arange(16), [2, 4])

    def run(max_rows, max_steps):  # a pool of every row at full length (48 pages)
        state, _ = paged_turns.start(weights, rows, settings, 48 * 16, max_rows=max_rows)
        state = state.replace(live_B=jax.numpy.asarray(live))
        before = int(state.slot_steps)
        state = paged_turn_programs.segment(
            weights, state, stops, model_config=config, sampling=SAMPLED, max_steps=max_steps,
            until_turn_end=False, max_rows=max_rows,
        )  # fmt: skip
        out = jax.device_get((state.tokens_BT, state.logprobs_BT, state.step_B))
        return int(state.slot_steps) - before, *out

    # The default pool holds the rows decoding at once at full length: the longest prompt
    # (18 tokens) and the budget (24) in 3 pages of 16 each, for 16 rows or for 6.
    assert [paged_turns.start(weights, rows, settings, 0, max_rows=m)[0].cache.pool.num_pages
            for m in (0, 6)] == [48, 18]  # fmt: skip
    computed_all, tokens_all, logprobs_all, step_all = run(0, 1)
    computed, tokens, logprobs, step_B = run(6, 1)
    moved = np.isin(np.arange(16), [0, 1, 3, 5, 6, 7])
    assert (computed_all, computed) == (16, 6)
    np.testing.assert_array_equal(step_B, step_all - (live & ~moved))
    np.testing.assert_array_equal(tokens[moved, 1], tokens_all[moved, 1])
    np.testing.assert_allclose(logprobs[moved, 1], logprobs_all[moved, 1], atol=1e-6)
    _, tokens_all, logprobs_all, step_all = run(0, 64)
    _, tokens, logprobs, step_B = run(6, 64)
    np.testing.assert_array_equal(step_B, step_all)
    np.testing.assert_array_equal(tokens, tokens_all)
    np.testing.assert_allclose(logprobs, logprobs_all, atol=1e-5)


@pytest.mark.parametrize(
    "mesh_spec", [None, "data:2,fsdp:1,expert:1,tensor:1"], ids=["one-device", "data:2"]
)
def test_with_max_rows_the_default_pool_holds_them_and_the_rows_are_the_dense_ones(
    toy_policy, dense, mesh_spec
):
    """max_rows=4 of 10 rows (--rollout_micro_batch; on data:2, 2 per shard) with the
    default pool: it holds 4 rows at full length (2 per shard), so rows beyond them wait
    and are evicted and restored, and every row ends with the dense engine's rows."""
    config, _ = toy_policy
    if mesh_spec is None:
        prompts, reference, mesh = _prompts(config, LENGTHS), dense, None
    else:
        prompts = _prompts(config, LENGTHS[:4])
        reference = _rows(*_run(toy_policy, FakeHandler(done_after=3), LIMITS, prompts))
        mesh = parallel.make_mesh(mesh_spec, jax.devices()[:2])
    paged = _rows(
        *_run(
            toy_policy, FakeHandler(done_after=3), LIMITS, prompts, mesh=mesh,
            kv_cache_tokens=0, max_rows=4,
        )
    )  # fmt: skip
    _assert_same_rows(reference, paged, logprob_atol=1e-4)
    assert paged[2].pages_left == 0
    assert mesh_spec or paged[2].evictions > 0  # on data:2 the toy rows end before


def test_the_dense_engine_refuses_max_rows_below_its_rows(toy_model_dir):
    """The compacted engine keeps a cache row per row for the whole trajectory: a Sampler
    capping the rows decoding at once below a multi-turn rollout's refuses it (the trainer
    refuses --rollout_micro_batch with --env on it at validation)."""
    from jaxrl4llm.models import registry
    from jaxrl4llm.sampling.frontend import Sampler
    from jaxrl4llm.sampling.layout import RowLayout

    config, params, tokenizer = registry.load_model(toy_model_dir)
    args = (params, [[5, 6, 7]] * 2, SAMPLED, 8, jax.random.key(0), FakeHandler(), LIMITS)
    with pytest.raises(FlagError, match="max_rows=2: multi-turn rollouts on the compacted"):
        Sampler(config, tokenizer, max_rows=2).generate_turns(*args, RowLayout(2))
