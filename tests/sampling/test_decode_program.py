"""sampler.decode_program: the decode program `sampler.generate` runs is the one a planner
builds from the same settings and lowers ahead of time on abstract inputs (the same HLO)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl4llm import parallel
from jaxrl4llm.program import Program
from jaxrl4llm.sampling import Sampler, page_pool, sampler

from tests.sampling.test_sampler import SAMPLING, TINY_UNTIED, _peaked_params, _prompts

N = 8
MESH = "data:2,fsdp:2,tensor:2"

# (generate's options, the settings a planner holding the same run configuration passes):
# 4 prompts x n=2 rows, padded to 8 rows.
CASES = {
    "one_device": (
        dict(),
        dict(prompt_group=2, num_chunks=1, decode_slots=0, greedy=False, row_caps=False),
    ),
    "mesh_chunks_greedy_caps": (
        dict(mesh=MESH, max_rows=4, greedy_last=1, row_caps=[8, 1, 3, 8, 5, 2, 8, 4]),
        dict(prompt_group=2, num_chunks=2, decode_slots=0, greedy=True, row_caps=True),
    ),
    "continuous_greedy": (
        dict(decode_slots=4, greedy_last=1),
        dict(prompt_group=2, num_chunks=1, decode_slots=4, greedy=True, row_caps=False),
    ),
    # The paged engine: its pool sized for the bucket (8 rows of 16-token prompts) as
    # StepPrograms.sample sizes it.
    "paged_greedy": (
        dict(kv_cache_tokens=0, greedy_last=1),
        dict(
            prompt_group=2,
            num_chunks=1,
            decode_slots=0,
            greedy=True,
            row_caps=False,
            kv_pages=page_pool.pool_pages(0, 8, 16, N, 2),
            max_rows=0,
            paged_attention="auto",
        ),
    ),
}


@pytest.fixture(scope="module")
def tiny():
    return TINY_UNTIED, _peaked_params(TINY_UNTIED)


def _abstract(x):
    """x's shape, dtype and sharding (of an array placed on devices; an uncommitted one, as
    numpy inputs, lowers without one), holding no data."""
    sharding = x.sharding if isinstance(x, jax.Array) and x.committed else None
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


@pytest.mark.parametrize("case", list(CASES))
def test_generate_runs_the_program_a_planner_lowers(tiny, monkeypatch, case):
    config, params = tiny
    options, planned_settings = dict(CASES[case][0]), CASES[case][1]
    mesh = parallel.make_mesh(options.pop("mesh")) if "mesh" in options else None
    if mesh is not None:
        params = Sampler(config, mesh=mesh).shard_params(params)
    built, calls = [], []
    build = sampler.decode_program

    def recording_build(**settings):
        program = build(**settings)
        built.append((settings, program))

        def run(*args, **per_call):
            calls.append((args, per_call))
            return program(*args, **per_call)

        return run

    monkeypatch.setattr(sampler, "decode_program", recording_build)
    prompts = _prompts(np.random.default_rng(5), [5, 3, 11, 7], config.vocab_size)
    sampler.generate(
        params, config, prompts, SAMPLING, N, jax.random.key(0), n=2, mesh=mesh, **options
    )
    assert len(built) == len(calls) == 1
    settings = dict(
        model_config=config,
        sampling=SAMPLING,
        max_new_tokens=N,
        mesh=mesh,
        rules=parallel.DEFAULT_RULES,
        compact=True,
        record_routing=False,  # a dense model: no routing record
        **planned_settings,
    )
    assert built[0][0] == settings
    # What generate ran: its Program lowered on its actual arrays.
    args, per_call = calls[0]
    ran = built[0][1].lower(*args, **per_call).as_text()

    # The planner: the same settings, abstract inputs of the same shapes, dtypes, shardings.
    planned = build(**settings)
    assert isinstance(planned, Program) and planned.name == "sample"
    abstract_args, abstract_per_call = jax.tree.map(_abstract, (args, per_call))
    assert {x.shape for x in jax.tree.leaves(abstract_args[1:5])} == {(8, 16), (8,)}
    assert sorted(per_call) == sorted(
        name
        for name, on in (("greedy_B", settings["greedy"]), ("row_caps_B", settings["row_caps"]))
        if on
    )
    assert planned.lower(*abstract_args, **abstract_per_call).as_text() == ran
