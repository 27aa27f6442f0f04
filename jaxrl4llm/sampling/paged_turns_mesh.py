"""Multi-turn rollouts on the paged KV cache on a mesh: one page pool per batch shard, each
shard's rows and pool on its own devices (its heads split over tensor where the mesh has
it), every program compiled once.

The rows are split into D shards of whole groups (D: the mesh's batch shards, the data,
fsdp and expert axes; paged_mesh.shards; 1 on a mesh that splits only tensor). The
rollout's state is one TurnState whose arrays are the shards' states laid end to end on
their first axis (the rows in order; a shard's pool on its devices; slot_steps one count
per shard), split over the batch axes, the pools' keys and values also over kv heads
(`layout`). Each program of paged_turn_programs.py runs under jax.shard_map, manual over
the batch axes only, on each shard's part as on one device; the other axes (tensor) stay
with the partitioner: the weights enter whole over the batch axes and split over tensor
(`start`), and each shard's programs split their heads, pool and vocabulary over its own
devices (paged_mesh.inside_shard), the logits gathered whole before sampling:

  prefill, segment   every shard at once (the shards decode together);
  observe, restore,  one row of one shard: the program runs on every device, and the shards
  release, unstall   other than the row's skip it (lax.cond, or an empty row set).

Every collective in a loop or a skipped branch joins only one shard's devices: the shards
run different step counts and branches (a collective across shards would wait forever;
tests/sampling/test_paged_turns.py reads the programs' HLO).

paged_turns.py's memory policy runs per shard on the host (a PagedPrograms per shard, reading
its shard's part of the state: ShardView, a device's own buffers, no copy), so a shard stalls,
serves and evicts within its own pool. A row draws its tokens with its own key
(fold_in(row_key, t)), so the samples are the ones one device draws.

Refused: a batch whose shards would split a group (paged_mesh.check_rows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl4llm import parallel
from jaxrl4llm.models import transformer
from jaxrl4llm.sampling import buckets, paged, paged_mesh, paged_turns
from jaxrl4llm.sampling import paged_turn_programs as programs_lib
from jaxrl4llm.sampling.row_io import PromptRows
from jaxrl4llm.sampling.turn_programs import SEGMENT_STEPS, RolloutSettings, TurnState


def local_state(s: TurnState) -> TurnState:
    """A shard's part of the state as one device's state (its one slot_steps a scalar)."""
    return s.replace(slot_steps=s.slot_steps.reshape(()))


def shard_part(s: TurnState) -> TurnState:
    """One device's state as its shard's part of the mesh's state."""
    return s.replace(slot_steps=s.slot_steps.reshape((1,)))


def layout(s: TurnState, mesh: Mesh, rules: parallel.LogicalRules) -> Any:
    """Where the mesh's state lives: every array's first axis over the batch axes; the
    pools' keys and values [D * K, ...] also over kv heads, as each shard's programs split
    them (the layout every program leaves, so each compiles for one)."""
    axes, inner = paged_mesh.batch_axes(mesh, rules), paged_mesh.inside_shard(mesh, rules)
    pool = s.cache.pool
    K = pool.k_pages[0].shape[0] // paged_mesh.shards(mesh, rules)
    heads = None if inner is None else inner.spec(("kv_heads",), (K,))[0]
    rows = NamedSharding(mesh, P(axes))
    split = NamedSharding(mesh, P((*axes, *parallel.mesh_axes(heads))))
    out = jax.tree.map(lambda _: rows, s)
    n = len(pool.k_pages)
    return out.replace(
        cache=out.cache.replace(
            pool=out.cache.pool.replace(k_pages=(split,) * n, v_pages=(split,) * n)
        )
    )


def map_shards(
    body: Any, mesh: Mesh, rules: parallel.LogicalRules, args: tuple, specs: tuple
) -> Any:
    """`body` on each shard's parts of `args` (specs: P(axes) split, P() whole), manual over
    the batch axes (paged_mesh.manual_axes); the state it returns laid out as `layout`."""
    axes = paged_mesh.batch_axes(mesh, rules)
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=specs,
        out_specs=P(axes),
        axis_names=paged_mesh.manual_axes(mesh, rules),
        check_vma=False,
    )
    out = run(*args)
    return jax.lax.with_sharding_constraint(out, layout(out, mesh, rules))


_MESH = ("mesh", "rules")


def _inside(mesh: Mesh, rules: parallel.LogicalRules) -> dict[str, Any]:
    """The programs' `sharding` inside a shard (paged_mesh.inside_shard; None: on one device)."""
    return {"sharding": paged_mesh.inside_shard(mesh, rules)}


@functools.partial(
    jax.jit,
    static_argnames=(*_MESH, "model_config", "sampling", "max_new_tokens", "num_pages", "group"),
)
def _prefill(
    weights: Any,
    inputs: tuple,
    optional: dict,
    stops: tuple,
    pad_id: jax.Array,
    pages: programs_lib.PromptPages,
    *,
    mesh: Mesh,
    rules: parallel.LogicalRules,
    **static: Any,
) -> TurnState:
    """programs_lib.prefill of each shard's rows (inputs, the optional greedy_B and the
    stop sequences split by rows, `pages` each shard's own PromptPages end to end)."""
    static |= _inside(mesh, rules)

    def body(w: Any, inputs: tuple, opt: dict, ids: Any, stop: Any, pad: Any, pages: Any) -> Any:
        state = programs_lib.prefill(
            w, inputs, opt.get("greedy_B"), (ids, stop), pad, pages, **static
        )
        return shard_part(state)

    row, whole = P(paged_mesh.batch_axes(mesh, rules)), P()
    args = (weights, inputs, optional, *stops, pad_id, pages)
    return map_shards(body, mesh, rules, args, (whole, row, row, whole, row, whole, row))


@functools.partial(
    jax.jit,
    static_argnames=(
        *(*_MESH, "model_config", "sampling", "max_steps", "until_turn_end", "max_rows"),
    ),
    donate_argnums=1,
)
def segment_shards(
    weights: Any,
    s: TurnState,
    stops: tuple,
    *,
    mesh: Mesh,
    rules: parallel.LogicalRules,
    **static: Any,
) -> TurnState:
    """programs_lib.segment of every shard at once (each until one of its rows ends a turn,
    none of them decodes or max_steps steps ran; max_rows: each shard's)."""
    static |= _inside(mesh, rules)

    def body(w: Any, s: TurnState, ids: Any, stop: Any) -> TurnState:
        return shard_part(programs_lib.segment(w, local_state(s), (ids, stop), **static))

    row = P(paged_mesh.batch_axes(mesh, rules))
    return map_shards(body, mesh, rules, (weights, s, *stops), (P(), row, P(), row))


@functools.partial(jax.jit, static_argnames=_MESH, donate_argnums=0)
def _release(s: TurnState, row_D: jax.Array, *, mesh: Mesh, rules: parallel.LogicalRules) -> Any:
    """programs_lib.release of each shard's row_D (-1: none)."""
    body = lambda s, row: shard_part(programs_lib.release(local_state(s), row[0]))  # noqa: E731
    return map_shards(body, mesh, rules, (s, row_D), (P(paged_mesh.batch_axes(mesh, rules)),) * 2)


@functools.partial(jax.jit, static_argnames=_MESH, donate_argnums=0)
def _unstall(s: TurnState, rows_B: jax.Array, *, mesh: Mesh, rules: parallel.LogicalRules) -> Any:
    """programs_lib.unstall of the rows rows_B (bool over every shard's rows)."""
    body = lambda s, rows: shard_part(programs_lib.unstall(local_state(s), rows))  # noqa: E731
    return map_shards(body, mesh, rules, (s, rows_B), (P(paged_mesh.batch_axes(mesh, rules)),) * 2)


@functools.partial(
    jax.jit, static_argnames=(*_MESH, "program", "model_config", "sampling"), donate_argnums=1
)
def _row_program(
    weights: Any,
    s: TurnState,
    args_D: tuple,
    stops: tuple,
    apply_D: jax.Array,
    *,
    program: str,
    mesh: Mesh,
    rules: parallel.LogicalRules,
    **static: Any,
) -> TurnState:
    """paged_turn_programs' `program` ("observe" or "restore") on the shard where apply_D,
    with its args_D (each [D, ...]: that shard's at its index); the other shards unchanged
    (their devices skip the program: lax.cond)."""
    static |= _inside(mesh, rules)

    def body(w: Any, s: TurnState, args: tuple, stops: tuple, apply: Any) -> TurnState:
        args = tuple(a[0] for a in args)
        if program == "observe":
            run = lambda x: programs_lib.observe(w, x, args, stops, **static)  # noqa: E731
        else:
            run = lambda x: programs_lib.restore(w, x, *args, **static)  # noqa: E731
        return shard_part(jax.lax.cond(apply[0], run, lambda x: x, local_state(s)))

    row = P(paged_mesh.batch_axes(mesh, rules))
    stop_specs = (P(), row) if stops else ()  # the stop ids and each row's stop sequences
    return map_shards(
        body, mesh, rules, (weights, s, args_D, stops, apply_D), (P(), row, row, stop_specs, row)
    )


class ShardView:
    """Shard d's (of D) part of the mesh's state, read as one device's TurnState: an array
    whole on each device of the shard (the rows' tokens, tables, counts) is one device's own
    buffer (no copy); one split over the shard's devices (the pool's keys and values, over
    heads) reads as its shape only (the host reads no KV). Programs take `state`."""

    def __init__(self, state: TurnState, d: int, D: int):
        self.state, self.d, self.D = state, d, D

    def __getattr__(self, name: str) -> Any:
        return jax.tree.map(self._part, getattr(self.state, name))

    def _part(self, a: jax.Array) -> jax.Array | jax.ShapeDtypeStruct:
        n = a.shape[0] // self.D
        shape = (n, *a.shape[1:])
        whole = [
            s
            for s in a.addressable_shards
            if s.data.shape == shape and (s.index[0].start or 0) == self.d * n
        ]
        if not whole:
            return jax.ShapeDtypeStruct(shape, a.dtype)
        return min(whole, key=lambda s: s.device.id).data


@dataclasses.dataclass(frozen=True)
class ShardPrograms:
    """paged_turn_programs' row programs as one shard's PagedPrograms calls them (the same
    signatures, on a ShardView): each runs on the whole mesh's state, for this shard only."""

    d: int
    D: int
    rows: int
    mesh: Mesh
    rules: parallel.LogicalRules

    def _one(self, value: Any, empty: Any) -> jax.Array:
        """[D, ...]: `value` at this shard's index, `empty` at the others'."""
        value = np.asarray(jax.device_get(value))
        out = np.broadcast_to(np.asarray(empty, value.dtype), (self.D, *value.shape)).copy()
        out[self.d] = value
        return jnp.asarray(out)

    def release(self, view: ShardView, row: jax.Array) -> ShardView:
        s = _release(view.state, self._one(row, -1), mesh=self.mesh, rules=self.rules)
        return ShardView(s, self.d, self.D)

    def unstall(self, view: ShardView, rows_B: jax.Array) -> ShardView:
        rows = self._one(rows_B, False).reshape(-1)
        s = _unstall(view.state, rows, mesh=self.mesh, rules=self.rules)
        return ShardView(s, self.d, self.D)

    def observe(
        self, w: Any, view: ShardView, observation: tuple, stops: tuple, **static: Any
    ) -> ShardView:
        return self._row("observe", w, view, observation, stops, static)

    def restore(self, w: Any, view: ShardView, *args: Any, **static: Any) -> ShardView:
        return self._row("restore", w, view, args, (), static)

    def _row(
        self, program: str, w: Any, view: ShardView, args: tuple, stops: tuple, static: dict
    ) -> ShardView:
        args_D = tuple(self._one(a, 0) for a in args)
        s = _row_program(
            w, view.state, args_D, stops, self._one(True, False),
            program=program, mesh=self.mesh, rules=self.rules, **static,
        )  # fmt: skip
        return ShardView(s, self.d, self.D)


@dataclasses.dataclass(eq=False)
class ShardedPrograms:
    """The programs multiturn.py's host loop runs over the mesh's state: a segment of every
    shard at once; a call for a row through its shard's PagedPrograms (rows `rows` each)."""

    shards: tuple[paged_turns.PagedPrograms, ...]
    rows: int
    mesh: Mesh
    rules: parallel.LogicalRules

    def segment(self, state: TurnState) -> TurnState:
        p = self.shards[0]
        state = segment_shards(
            p.weights, state, (p.stop_ids_S, p.stop_BQL), mesh=self.mesh, rules=self.rules,
            model_config=p.model_config, sampling=p.sampling, max_steps=SEGMENT_STEPS,
            max_rows=p.max_rows,
        )  # fmt: skip
        jax.block_until_ready(state.ended_B)
        return state

    def observe(self, state: TurnState, row: int, obs: list[int], pad_id: int) -> TurnState:
        d, local = divmod(row, self.rows)
        return self._on(d, "observe", state, local, obs, pad_id)

    def finish(self, state: TurnState, row: int) -> TurnState:
        d, local = divmod(row, self.rows)
        return self._on(d, "finish", state, local)

    def unblock(self, state: TurnState) -> TurnState:
        for d in range(len(self.shards)):
            state = self._on(d, "unblock", state)
        return state

    def _on(self, d: int, method: str, state: TurnState, *args: Any) -> TurnState:
        """Shard d's PagedPrograms `method` on its view of `state`; the mesh's new state."""
        view: Any = ShardView(state, d, len(self.shards))
        return getattr(self.shards[d], method)(view, *args).state

    def pages_left(self, state: TurnState) -> int:
        D = len(self.shards)
        views: list[Any] = [ShardView(state, d, D) for d in range(D)]
        return sum(p.pages_left(v) for p, v in zip(self.shards, views))

    @property
    def evictions(self) -> int:
        return sum(p.evictions for p in self.shards)


def start(
    weights: Any,
    rows: PromptRows,
    settings: RolloutSettings,
    kv_cache_tokens: int,
    mesh: Mesh,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    max_rows: int = 0,
) -> tuple[TurnState, ShardedPrograms]:
    """paged_turns.start on each batch shard of `mesh`, with a pool of `kv_cache_tokens` each
    (0: the rows decoding at once in the fullest shard at full length; every shard's pool is
    one size), `max_rows` over all shards decoding at once (paged.shard_decode_rows; 0:
    every row)."""
    D, batch = paged_mesh.shards(mesh, rules), rows.batch
    B = batch.prompt_BP.shape[0]
    paged_mesh.check_rows(B, D, rows.prompt_group)
    n, local_rows = B // D, paged.shard_decode_rows(max_rows, D, rows.prompt_group)
    shards = [_batch_rows(batch, slice(d * n, (d + 1) * n), d * n) for d in range(D)]
    active = max(paged_turns.decoding_rows(int(b.active_B.sum()), local_rows) for b in shards)
    plen_B = paged_turns.prompt_lengths(batch)
    longest = paged_turns.longest(plen_B, batch)
    num_pages = paged_turns.pool_pages(kv_cache_tokens, active, longest, settings.budget)
    pages = [paged_turns.first_pages(b, rows.prompt_group, settings, num_pages) for b in shards]
    weights = placed_weights(weights, settings.static["model_config"], mesh, rules)
    args, static = paged_turns.prefill_args(rows, settings, num_pages)
    inputs, greedy_B, stops, pad = args
    optional = {} if greedy_B is None else {"greedy_B": greedy_B}
    all_pages = jax.tree.map(lambda *a: jnp.concatenate(a), *pages)
    state = _prefill(
        weights, inputs, optional, stops, pad, all_pages, mesh=mesh, rules=rules, **static
    )
    programs = []
    for d, (shard, shard_pages) in enumerate(zip(shards, pages)):
        lib = ShardPrograms(d, D, n, mesh, rules)
        p = paged_turns.PagedPrograms.of(weights, settings, shard, lib, local_rows)
        state = paged_turns.admit(p, ShardView(state, d, D), shard_pages.admitted_B).state
        programs.append(p)
    return state, ShardedPrograms(tuple(programs), n, mesh, rules)


def placed_weights(
    weights: Any, model_config: Any, mesh: Mesh, rules: parallel.LogicalRules
) -> Any:
    """The decode weights (turn_programs.decode_weights) placed once as every shard's
    programs read them: whole over the batch axes, split over the others as a shard splits
    them (heads and vocabulary over tensor: parallel.inside_batch_shard)."""
    axes = transformer.unstacked_logical_axes(model_config)
    inside = parallel.inside_batch_shard(rules)
    return jax.device_put(weights, parallel.logical_to_sharding(axes, mesh, inside, weights))


def _batch_rows(batch: buckets.PromptBatch, part: slice, first: int) -> buckets.PromptBatch:
    """Rows `part` (from row `first`) of `batch`, its padding rows past num_rows kept so."""
    arrays = {
        f.name: getattr(batch, f.name)[part]
        for f in dataclasses.fields(batch)
        if f.name != "num_rows"
    }
    num_rows = min(max(batch.num_rows - first, 0), part.stop - part.start)
    return buckets.PromptBatch(**arrays, num_rows=num_rows)
