"""The rollout's program planned (planner/programs.py's rollout row): the paged engine's one
program over the step's rows (`sample`), or, where the run samples DAPO's dynamic sampling
by admission (StepPrograms.by_admission), its segment program (`segment`: the weights laid
out before it, by paged_mesh.decode_weights, once per step; its queue and state, the page
pool among them, as paged_driver.Driver holds them between segments), lowered on abstract
inputs with the shardings the run gives the real arrays.

Counts the HLO cannot give: the engine's decode loop runs at most `paged.loop_bounds` steps
(every row at full length, the rows in waves of the decode rows), its prefill once per
admitted block of groups (decode.PREFILL_SCOPE); a segment program runs SEGMENT_STEPS of
them per call, as many calls as a step of one chunk of groups needs (dynamic sampling's
further chunks left out).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.planner import abstract as abs_lib
from jaxrl4llm.planner import hlo_analysis
from jaxrl4llm.planner.measured import Rollout, Row, link_bytes, measure
from jaxrl4llm.planner.shared import Setup
from jaxrl4llm.sampling import decode, paged, paged_mesh, paged_segments
from jaxrl4llm.sampling import page_pool as pages_lib


def sample_layout(s: Setup) -> tuple[int, int, int]:
    """(rows, prompt group, chunks) of the rollout's decode: one call of the paged engine
    (at most --rollout_micro_batch rows decode at once inside it), its rows padded as
    sampler.generate pads them, to whole groups on each batch shard. ReMax samples one more
    (greedy) row per prompt in the same call."""
    c = s.config
    G = c.rollout.group_size
    Gs = G + 1 if c.algorithm.advantage == "remax" else G
    D = paged_mesh.shards(s.mesh, parallel.DEFAULT_RULES)
    unit = s.programs.data_parallel * (Gs if D > 1 else 1)
    return -(-(c.batch_size // G * Gs) // unit) * unit, Gs, 1


def sample_inputs(s: Setup, Bs: int, P: int, greedy: bool) -> tuple[tuple, dict]:
    """(arguments, keyword arguments) of the decode program for Bs rows of P columns."""
    mesh, key_dtype = s.mesh, jax.random.key(0).dtype
    args = (
        s.params,
        abs_lib.rows(mesh, (Bs, P), jnp.int32),
        abs_lib.rows(mesh, (Bs, P), bool),
        abs_lib.rows(mesh, (Bs,), bool),
        abs_lib.rows(mesh, (Bs,), key_dtype),
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    return args, dict(greedy_B=abs_lib.rows(mesh, (Bs,), bool)) if greedy else {}


def lower_sample(s: Setup, P: int) -> Any:
    """The rollout's decode program lowered for prompts of P columns."""
    Bs, Gs, sample_chunks = sample_layout(s)
    remax = s.config.algorithm.advantage == "remax"
    args, kwargs = sample_inputs(s, Bs, P, remax)
    program = s.programs.sample(
        Gs, sample_chunks, greedy=remax, cache_dtype=s.cache_dtype, rows=Bs, prompt_len=P
    )
    return s.lower(program)(*args, **kwargs)


def lower_rollout(s: Setup, P: int) -> Any:
    """The rollout's program lowered for prompts of P columns: the segment program by
    admission, else the engine's one program."""
    return lower_segment(s, P)[0] if s.programs.by_admission else lower_sample(s, P)


def _laid_out_weights(s: Setup) -> tuple[Any, str]:
    """The abstract weights the segments read (paged_mesh.decode_weights of the policy's, with
    the shardings its compiled program gives them) and that program's partitioned HLO."""
    mesh = s.mesh if s.mesh.size > 1 else None
    layout = dict(model_config=s.programs.model_config, mesh=mesh, rules=parallel.DEFAULT_RULES)
    fn = jax.jit(functools.partial(paged_mesh.decode_weights, **layout))
    lowered = fn.lower(s.params)
    compiled, hlo = (
        hlo_analysis.partitioned_hlo(lowered) if mesh is not None else (lowered.compile(), "")
    )
    shapes = jax.eval_shape(fn, s.params)
    weights = jax.tree.map(
        lambda x, sharding: abs_lib.abstract(x.shape, x.dtype, sharding),
        shapes,
        compiled.output_shardings,
    )
    return weights, hlo


def lower_segment(s: Setup, width: int) -> tuple[Any, str]:
    """The segment program lowered on the run's abstract weights, queue and state for prompts
    `width` wide; and the weights' layout program's partitioned HLO."""
    r, mesh, rules = s.config.rollout, s.mesh, parallel.DEFAULT_RULES
    G, N, D = r.group_size, r.max_new_tokens, paged_mesh.shards(mesh, rules)
    program = s.programs.segment()
    run = {k: program.static[k] for k in paged_segments.RUN}  # the settings start shares
    slots, rows = s.programs.admission_layout
    pages = pages_lib.pool_pages(r.pool_tokens or 0, slots * G, width, N, G, rows)
    max_groups = (1 + r.dynamic.max_resample_rounds) * (s.config.batch_size // G)
    weights, weights_hlo = _laid_out_weights(s)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    queue = jax.eval_shape(
        functools.partial(paged_segments.empty_queue, D, slots, G, width, max_groups, N), key
    )
    pad = jax.ShapeDtypeStruct((), jnp.int32)
    state = jax.eval_shape(
        functools.partial(paged_segments.start, num_pages=pages, cache_dtype=s.cache_dtype, **run),
        weights,
        queue,
        pad,
    )
    if mesh.size > 1:  # laid out as the driver lays them out (paged_segments.lay_out)
        both = (queue, state)
        placed = paged_segments.lay_out.lower(both, paged_segments.run_shardings(both, mesh, rules))
        shardings = placed.compile().output_shardings
        queue, state = jax.tree.map(
            lambda x, sharding: abs_lib.abstract(x.shape, x.dtype, sharding), both, shardings
        )
    stop = jax.ShapeDtypeStruct((8,), jnp.int32)
    return s.lower(program)(weights, queue, state, stop, pad), weights_hlo


def sample_row(s: Setup) -> tuple[Row, Rollout]:
    """The rollout: all rows of a step (by admission: one chunk of groups, in segments); and
    its weight traffic."""
    (_, P, N), num_chunks = s.rows, s.rollout_chunks
    Bs, Gs, sample_chunks = sample_layout(s)
    D = paged_mesh.shards(s.mesh, parallel.DEFAULT_RULES)
    R = s.config.rollout.rollout_micro_batch  # the rows decoding at once (0: all)
    # Its decode loop's iterations and prefills, at most (the HLO knows neither).
    steps, prefills = paged.loop_bounds(Bs // D, paged.shard_decode_rows(R, D, Gs), Gs, N)
    calls, weights_hlo = 1, ""
    if s.programs.by_admission:
        lowered, weights_hlo = lower_segment(s, P)
        calls = -(-steps // paged_segments.SEGMENT_STEPS)
        steps, prefills = paged_segments.SEGMENT_STEPS, -(-prefills // calls)
    else:
        lowered = lower_sample(s, P)
    # One device: nothing is partitioned, no collective to read.
    compiled, partitioned = (
        hlo_analysis.partitioned_hlo(lowered) if s.mesh.size > 1 else (lowered.compile(), "")
    )
    m = measure(compiled, calls, s.chip, steps, {f"/{decode.PREFILL_SCOPE}/": prefills})
    scope = f"/{decode.WEIGHTS_SCOPE}/"
    gathers = [op for op in hlo_analysis.collectives(partitioned) if scope in op.op_name]
    gathers += hlo_analysis.collectives(weights_hlo) if weights_hlo else []
    rollout = Rollout(
        Bs,
        min(R, Bs) if R else Bs // sample_chunks,
        N,
        link_bytes(gathers),
        link_bytes(hlo_analysis.loop_invariant_collectives(partitioned)),
        apart=bool(weights_hlo),
    )
    resident = s.state_bytes - s.param_bytes + s.ref_bytes + s.critic_bytes
    row = Row(
        "rollout",
        resident=resident,
        estimate=s.est.rollout(num_chunks, resident),
        t_hbm=s.est.rollout_hbm_bytes(num_chunks) / s.chip.hbm_bw / calls,
        **m,
    )
    return row, rollout
