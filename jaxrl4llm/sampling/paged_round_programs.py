"""The device programs of a partial-rollout step's rounds on one pool of pages
(paged_rounds.py runs them), beside the multi-turn paged programs it also runs
(paged_turn_programs.segment, restore): the state is a turn_programs.TurnState over a
paged_turn_programs.PagedKV whose rows draw from TurnState.key_base_B.

  empty_state   rows holding nothing, every page free;
  start         new groups' prompts prefilled once (dense, at their bucket) into the pages
                the host picked (full pages shared, the last partial page copied per row),
                the rows' first tokens drawn: paged_turn_programs.prompts_into_pool, as the
                multi-turn prefill;
  place         rows begun in an earlier step written in, holding no page (restored by
                prefill as pages free);
  go_on         rows go on with a new key and cap, their pages kept;
  release       rows' pages returned.

Each runs on one device (`run_program`) or on each batch shard of a mesh (`run_on_shards`,
under paged_turns_mesh.map_shards: manual over the batch axes, a shard's heads split over
its devices, the logits gathered whole before sampling).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl4llm import parallel
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling import paged, paged_mesh, turn_programs
from jaxrl4llm.sampling import paged_turn_programs as programs_lib
from jaxrl4llm.sampling import paged_turns_mesh as mesh_lib
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turn_programs import TurnState


@functools.partial(
    jax.jit, static_argnames=("model_config", "rows", "budget", "num_pages", "M", "dtype")
)
def empty_state(
    pad_id: jax.Array,
    *,
    model_config: ModelConfig,
    rows: int,
    budget: int,
    num_pages: int,
    M: int,
    dtype: Any,
) -> TurnState:
    """`rows` rows holding no page and not decoding, a pool of `num_pages` free pages."""
    pool = pages_lib.init_pool(model_config, num_pages, paged.PAGE_SIZE, dtype)
    kv = programs_lib.PagedKV(
        pool, jnp.full((rows, M), num_pages, jnp.int32), jnp.zeros(rows, bool)
    )
    off = jnp.zeros((rows,), bool)
    keys = jax.random.split(jax.random.key(0), rows)
    state = turn_programs.initial_state(
        kv, jnp.zeros((rows, 1), bool), off, keys, None, pad_id, budget
    )
    return state.replace(key_base_B=jnp.zeros((rows,), jnp.int32))


def _put(x: jax.Array, rows_R: jax.Array, v: Any) -> jax.Array:
    return x.at[rows_R].set(v, mode="drop")


def _start_groups(
    s: TurnState,
    whole: tuple[Any, ...],
    split: tuple[Any, ...],
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    group: int,
    sharding: parallel.ActivationSharding | None = None,
) -> TurnState:
    """J groups' prompts (prompt_JP, mask_JP) prefilled once and written into `pages` for the
    groups that fit (pages.admitted_B), their R = J * G rows (rows_R; B for none) started:
    key keys_R, cap caps_R, first token drawn (fold_in(key, 0)); rows not admitted wait.
    `whole`: the weights, the stops and the pad id; `split`: the inputs and the pages."""
    weights, stops, pad_id = whole
    (prompt_JP, mask_JP, rows_R, keys_R, caps_R), pages = split
    kv = s.cache
    pool, tok_R, lp_R, plen_J = programs_lib.prompts_into_pool(
        weights, (prompt_JP, mask_JP, keys_R, None), kv.pool, pages, model_config, sampling,
        group, sharding,
    )  # fmt: skip
    kv = kv.replace(
        pool=pool,
        table_BM=_put(kv.table_BM, rows_R, pages.table_BM),
        stalled_B=_put(kv.stalled_B, rows_R, False),
    )
    B, zero = s.step_B.shape[0], jnp.zeros((), jnp.int32)
    plen_R = jnp.repeat(plen_J, group)
    s = _place(s.replace(cache=kv), rows_R, plen_R, zero, pad_id, keys_R, caps_R, pad_id)
    s = _set_rows(s, rows_R, logprobs_BT=0.0, model_BT=False, live_B=pages.admitted_B)
    emit_B = _put(jnp.zeros((B,), bool), rows_R, True)
    tok_B = _put(jnp.zeros((B,), jnp.int32), rows_R, tok_R)
    lp_B = _put(jnp.zeros((B,), jnp.float32), rows_R, lp_R)
    return turn_programs._emit(s, emit_B, tok_B, lp_B, *stops)


def _set_rows(s: TurnState, rows_R: jax.Array, **values: Any) -> TurnState:
    """`s` with rows rows_R (B: none) of each named field set to its value."""
    return s.replace(**{k: _put(getattr(s, k), rows_R, v) for k, v in values.items()})


def _place(
    s: TurnState,
    rows_R: jax.Array,
    plen_R: Any,
    step_R: Any,
    last_R: Any,
    keys_R: jax.Array,
    caps_R: Any,
    tokens_RT: Any,
) -> TurnState:
    """Rows rows_R at completion index step_R, their draws counting from it, not decoding:
    prompt lengths, last tokens (not in the KV), keys, caps and completion tokens."""
    assert s.key_base_B is not None  # empty_state's
    return _set_rows(
        s, rows_R, plen_B=plen_R, step_B=step_R, last_B=last_R, live_B=False, keys_B=keys_R,
        key_base_B=step_R, cap_B=caps_R, turn_start_B=step_R, ended_B=0, tokens_BT=tokens_RT,
    )  # fmt: skip


def _place_rows(s: TurnState, whole: tuple, split: tuple) -> TurnState:
    """Rows rows_R (B: none) begun in an earlier step, not decoding and holding no page: their
    prompt lengths plen_R, completions so far tokens_RT[:, :step_R], keys keys_R (drawing from
    0 again) and caps caps_R."""
    rows_R, plen_R, tokens_RT, step_R, keys_R, caps_R = split
    last_R = jnp.take_along_axis(tokens_RT, jnp.maximum(step_R - 1, 0)[:, None], axis=1)[:, 0]
    return _place(s, rows_R, plen_R, step_R, last_R, keys_R, caps_R, tokens_RT)


def _go_on(s: TurnState, whole: tuple, split: tuple) -> TurnState:
    """Rows rows_B (bool) go on: key keys_B (drawing from 0 again), cap caps_B; those of them
    holding their pages (live_B) decode at the next segment, the others wait for a restore."""
    rows_B, live_B, keys_B, caps_B = split
    assert s.key_base_B is not None  # empty_state's
    return s.replace(
        keys_B=jnp.where(rows_B, keys_B, s.keys_B),
        key_base_B=jnp.where(rows_B, s.step_B, s.key_base_B),
        cap_B=jnp.where(rows_B, caps_B, s.cap_B),
        turn_start_B=jnp.where(rows_B, s.step_B, s.turn_start_B),
        ended_B=jnp.where(rows_B, 0, s.ended_B),
        live_B=s.live_B | (rows_B & live_B),
    )


def _release_rows(s: TurnState, whole: tuple, split: tuple) -> TurnState:
    """Rows rows_B (bool) not decoding, their pages returned."""
    (rows_B,) = split
    kv = s.cache
    kv = kv.replace(
        pool=kv.pool.replace(refs_N=pages_lib.release(kv.pool.refs_N, kv.table_BM, rows_B)),
        table_BM=jnp.where(rows_B[:, None], kv.pool.num_pages, kv.table_BM),
        stalled_B=kv.stalled_B & ~rows_B,
    )
    return s.replace(cache=kv, live_B=s.live_B & ~rows_B)


# The step's programs on one pool, each (state, whole, split, **static) -> state: `whole` what
# every batch shard reads whole, `split` arrays whose first axis a mesh splits over shards.
PROGRAMS: dict[str, Callable[..., TurnState]] = {
    "start": _start_groups,
    "place": _place_rows,
    "go_on": _go_on,
    "release": _release_rows,
}


@functools.partial(jax.jit, static_argnames=("program", "static"), donate_argnums=0)
def run_program(s: TurnState, whole: tuple, split: tuple, *, program: str, static: Any) -> Any:
    """PROGRAMS[program] on one device (`static`: its static settings, sorted (key, value)
    pairs)."""
    return PROGRAMS[program](s, whole, split, **dict(static))


@functools.partial(
    jax.jit, static_argnames=("program", "static", "mesh", "rules"), donate_argnums=0
)
def run_on_shards(
    s: TurnState,
    whole: tuple,
    split: tuple,
    *,
    program: str,
    static: Any,
    mesh: Mesh,
    rules: parallel.LogicalRules,
) -> Any:
    """PROGRAMS[program] on each batch shard of `mesh` (paged_turns_mesh.map_shards), on its
    part of the state and of `split`, its heads split over its devices."""
    settings = dict(static)
    if program == "start":
        settings["sharding"] = paged_mesh.inside_shard(mesh, rules)

    def body(s: TurnState, whole: tuple, split: tuple) -> TurnState:
        return mesh_lib.shard_part(
            PROGRAMS[program](mesh_lib.local_state(s), whole, split, **settings)
        )

    row = P(paged_mesh.batch_axes(mesh, rules))
    return mesh_lib.map_shards(body, mesh, rules, (s, whole, split), (row, P(), row))
