"""The compiled programs of a multi-turn rollout (multiturn.py runs them from its host loop).

Every row owns a cache row for its whole trajectory: the left-padded prompt at slots [0, P),
completion token t (a model token or an observation token) at slot P + t, RoPE position
prompt_len + t. Three compiled programs act on one device-side state (`TurnState`):

  prefill   all prompts (each group's once, as sampler.generate) and every row's first token;
  segment   a while loop decoding one token for every live row (decode.slot_decode_step:
            per-row write slot and attention mask) until some row ends its turn (EOS, one of
            its handler's stop sequences, its token budget) or `max_steps` steps ran;
  observe   one row's reply: the model turn's last token (sampled, not yet in the cache) and
            the observation tokens are prefilled as one chunk at that row's position, and the
            row's next model token is sampled from the chunk's last logits.

A parked row (waiting for its reply) is not live: its slot still computes a dropped token
each segment step, as continuous.py's free slots do, and its cache row does not change.
A row draws completion token t with fold_in(row_key, t) (t over model and observation
tokens), so a row whose first turn is its only one samples what sampler.generate samples.

On a mesh (one host) the rows are split over the data-parallel devices and the cache as the
single-turn sampler's (`_laid_out`); the weights are laid out once per rollout
(`decode_weights`: decode.loop_params), and `observe` reads and writes its row with selects
(`_row_access`), so no program gathers the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import parallel
from jaxrl4llm.models import kv_cache, transformer, unembedding
from jaxrl4llm.models.attention import AttentionConfig
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import decode, sampler, strategies
from jaxrl4llm.sampling.strategies import SamplingConfig

_MIN_CHUNK = 16
# Decode steps per segment when no row ends its turn: how long a ready reply may wait for
# the host (one device-to-host sync per segment).
SEGMENT_STEPS = 16


class TurnState(flax.struct.PyTreeNode):
    """The device state of a multi-turn rollout, per row (B rows, N completion slots)."""

    # The KV: here a dense cache [B, ...] (prompt at [0, P), completion token t at P + t);
    # paged_turns.py's rollouts hold a paged_turns.PagedKV (pages and page tables) instead.
    cache: Any
    plen_B: jax.Array  # prompt length: completion token t sits at RoPE position plen + t
    step_B: jax.Array  # completion tokens so far (the index of the next one)
    last_B: jax.Array  # token step - 1, not yet in the cache
    live_B: jax.Array  # decoding (else parked, finished or inactive)
    keys_B: jax.Array
    cap_B: jax.Array  # the row's completion budget
    turn_start_B: jax.Array  # index of the current model turn's first token
    ended_B: jax.Array  # int32: how the row's turn ended, until the host has submitted it
    tokens_BT: jax.Array
    logprobs_BT: jax.Array
    model_BT: jax.Array  # bool: model tokens (observation tokens are False)
    slot_steps: jax.Array
    greedy_B: jax.Array | None = None
    # Where a row's draws count from (None: 0): partial rollouts on pages (paged_rounds.py)
    # restart a row's count at each round, as a resumed sampler call does.
    key_base_B: jax.Array | None = None

    def draw_keys(self, rows: jax.Array) -> jax.Array:
        """The keys rows `rows` draw their next token with: fold_in(row_key, step - base)."""
        step = self.step_B[rows]
        if self.key_base_B is not None:
            step = step - self.key_base_B[rows]
        return jax.vmap(jax.random.fold_in)(self.keys_B[rows], step.astype(jnp.uint32))

    def clear_ended(self) -> TurnState:
        """The state with no turn ended (the host submitted them), ended_B placed as before."""
        zeros_B = np.zeros(self.ended_B.shape, self.ended_B.dtype)
        return self.replace(ended_B=jax.device_put(zeros_B, self.ended_B.sharding))


def _laid_out(s: TurnState, sharding: parallel.ActivationSharding | None) -> TurnState:
    """The state in its one layout on a mesh: rows over the data-parallel devices, the cache
    as the single-turn sampler's (sampler.cache_sharding: kv heads over tensor). Every program
    returns it so, so the next one takes it as it is (no resharding, one compile)."""
    if sharding is None:
        return s
    cache = jax.lax.with_sharding_constraint(s.cache, sampler.cache_sharding(sharding, s.cache))
    rows = jax.tree.map(
        lambda x: x if x.ndim == 0 else sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1)),
        s.replace(cache=None),
    )
    return rows.replace(cache=cache)


def stop_sequence_array(seqs_per_row: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """int32 [B, Q, L]: each row's stop sequences right-aligned, -1 before them and in unused
    entries; Q and L powers of two (few distinct shapes). Empty sequences are ignored."""
    rows = [[tuple(int(t) for t in s) for s in seqs if len(s)] for seqs in seqs_per_row]
    Q = 1 << max(0, (max((len(r) for r in rows), default=1) - 1).bit_length())
    L = 1 << max(0, (max((len(s) for r in rows for s in r), default=1) - 1).bit_length())
    out = np.full((len(rows), Q, L), -1, np.int32)
    for b, seqs in enumerate(rows):
        for q, s in enumerate(seqs):
            out[b, q, L - len(s) :] = s
    return out


def _emit(
    s: TurnState,
    emit_B: jax.Array,
    tok_B: jax.Array,
    lp_B: jax.Array,
    stop_ids_S: jax.Array,
    stop_BQL: jax.Array,
) -> TurnState:
    """Rows `emit_B` append model token tok_B at their step; a row whose turn ends with it
    (EOS, a stop sequence inside the turn, the budget: checked in that order) stops decoding
    and records how in ended_B."""
    B, N = s.tokens_BT.shape
    rows = jnp.arange(B)
    at_B = jnp.where(emit_B, s.step_B, N)  # N: dropped
    tokens_BT = s.tokens_BT.at[rows, at_B].set(tok_B, mode="drop")
    step_B = s.step_B + emit_B.astype(jnp.int32)
    L = stop_BQL.shape[2]
    index_BL = step_B[:, None] - L + jnp.arange(L)[None, :]
    recent_BL = jnp.take_along_axis(tokens_BT, jnp.clip(index_BL, 0, N - 1), axis=1)
    in_turn_BL = index_BL >= s.turn_start_B[:, None]
    hit_BQL = (stop_BQL < 0) | ((recent_BL[:, None, :] == stop_BQL) & in_turn_BL[:, None, :])
    used_BQ = jnp.any(stop_BQL >= 0, axis=2)
    stop_B = jnp.any(jnp.all(hit_BQL, axis=2) & used_BQ, axis=1)
    code_B = jnp.where(
        decode.is_stop(tok_B, stop_ids_S),
        2,
        jnp.where(stop_B, 1, jnp.where(step_B >= s.cap_B, 3, 0)),
    )
    end_B = emit_B & (code_B > 0)
    return s.replace(
        step_B=step_B,
        last_B=jnp.where(emit_B, tok_B, s.last_B),
        live_B=s.live_B & ~end_B,
        ended_B=jnp.where(end_B, code_B, s.ended_B),
        tokens_BT=tokens_BT,
        logprobs_BT=s.logprobs_BT.at[rows, at_B].set(lp_B, mode="drop"),
        model_BT=s.model_BT.at[rows, at_B].set(True, mode="drop"),
    )


# The weights the three programs compute with (decode.loop_params), made once per rollout: on
# a mesh the FSDP shards are gathered here, not in every segment and observation.
decode_weights = jax.jit(decode.loop_params, static_argnums=(1, 2))


@functools.partial(
    jax.jit,
    static_argnames=("model_config", "sampling", "max_new_tokens", "chunk", "group", "sharding"),
)
def prefill(
    weights: Any,
    prompt_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    active_B: jax.Array,
    keys_B: jax.Array,
    greedy_B: jax.Array | None,
    stop_ids_S: jax.Array,
    stop_BQL: jax.Array,
    pad_id: jax.Array,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    chunk: int,
    group: int,
    sharding: parallel.ActivationSharding | None,
) -> TurnState:
    """The prompts in the cache and every active row's first token."""
    B, P = prompt_BP.shape
    N = max_new_tokens
    # Room for an observation chunk written at any position before the budget's end.
    cache = kv_cache.init_kv_cache(
        model_config, B // group, P + N + chunk, decode.cache_dtype_for(weights)
    )
    tok_B, lp_B, cache, _ = decode.prefill_first_tokens(
        weights,
        model_config,
        prompt_BP[::group],
        prompt_mask_BP[::group],
        cache,
        keys_B,
        sampling,
        greedy_B,
        sharding,
    )
    state = initial_state(cache, prompt_mask_BP, active_B, keys_B, greedy_B, pad_id, N)
    return _laid_out(_emit(state, active_B, tok_B, lp_B, stop_ids_S, stop_BQL), sharding)


def initial_state(
    cache: Any,
    prompt_mask_BP: jax.Array,
    active_B: jax.Array,
    keys_B: jax.Array,
    greedy_B: jax.Array | None,
    pad_id: jax.Array,
    max_new_tokens: int,
) -> TurnState:
    """The rows before their first token: no completion token, the active rows live."""
    B, N = prompt_mask_BP.shape[0], max_new_tokens
    zeros = jnp.zeros((B,), jnp.int32)
    return TurnState(
        cache=cache,
        plen_B=jnp.sum(prompt_mask_BP, axis=1, dtype=jnp.int32),
        step_B=zeros,
        last_B=jnp.full((B,), pad_id, jnp.int32),
        live_B=active_B,
        keys_B=keys_B,
        cap_B=jnp.full((B,), N, jnp.int32),
        turn_start_B=zeros,
        ended_B=zeros,
        tokens_BT=jnp.full((B, N), pad_id, jnp.int32),
        logprobs_BT=jnp.zeros((B, N), jnp.float32),
        model_BT=jnp.zeros((B, N), bool),
        slot_steps=jnp.array(0, jnp.int32),
        greedy_B=greedy_B,
    )


def _sample_step(
    s: TurnState, logits_BV: jax.Array, sampling: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Each row's token at its step, drawn with fold_in(row_key, step)."""
    keys_B = s.draw_keys(jnp.arange(s.step_B.shape[0]))
    return strategies.sample(logits_BV, keys_B, sampling, s.greedy_B)


@functools.partial(
    jax.jit,
    static_argnames=("model_config", "sampling", "prompt_len", "max_steps", "sharding"),
    donate_argnames=("s",),
)
def segment(
    weights: Any,
    s: TurnState,
    stop_ids_S: jax.Array,
    stop_BQL: jax.Array,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    prompt_len: int,
    max_steps: int,
    sharding: parallel.ActivationSharding | None,
) -> TurnState:
    """Decodes the live rows until one ends its turn or `max_steps` steps ran."""
    B = s.step_B.shape[0]

    def body(carry: tuple[TurnState, jax.Array]) -> tuple[TurnState, jax.Array]:
        x, k = carry
        # A parked or finished row feeds its last token again at the same slot: the same
        # key and value as its own, so its cache row does not change.
        write_B = jnp.minimum(prompt_len + x.step_B - 1, x.cache.max_len - 1)
        logits_BV, cache = decode.slot_decode_step(
            weights, model_config, x.last_B, x.plen_B + x.step_B - 1, write_B, x.cache, sharding
        )
        tok_B, lp_B = _sample_step(x, logits_BV, sampling)
        x = x.replace(cache=cache, slot_steps=x.slot_steps + B)
        return _laid_out(_emit(x, x.live_B, tok_B, lp_B, stop_ids_S, stop_BQL), sharding), k + 1

    cond = functools.partial(segment_continues, max_steps)
    s, _ = jax.lax.while_loop(cond, body, (s, jnp.array(0, jnp.int32)))
    return s


def segment_continues(max_steps: int, carry: tuple[TurnState, jax.Array]) -> jax.Array:
    """A segment's loop condition: some row live, none ended its turn, under max_steps."""
    x, k = carry
    return jnp.any(x.live_B) & (k < max_steps) & ~jnp.any(x.ended_B > 0)


def _row_access(
    B: int, row: jax.Array, sharded: bool
) -> tuple[Callable[[jax.Array], jax.Array], Callable[[jax.Array, jax.Array], jax.Array]]:
    """(take, put): read row `row` of a [B, ...] array as [1, ...], and write it back.

    On one device a dynamic slice. With rows sharded over devices, a slice at a traced row
    would make the partitioner gather the whole array (the KV cache) onto every device; a
    select instead reads the row on the device that holds it and sums it over the batch (one
    row's bytes all-reduced: exact, the other rows add zeros) and writes it back with a
    select (no collective)."""
    if not sharded:
        return (
            lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0),
            lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, row, axis=0),
        )
    pick_B = jnp.arange(B) == row

    def pick(x: jax.Array) -> jax.Array:
        return pick_B.reshape((B,) + (1,) * (x.ndim - 1))

    def take(x: jax.Array) -> jax.Array:
        if x.dtype == jnp.bool_:
            return jnp.any(pick(x) & x, axis=0, keepdims=True)
        return jnp.sum(jnp.where(pick(x), x, 0), axis=0, keepdims=True, dtype=x.dtype)

    return take, lambda x, r: jnp.where(pick(x), r, x)


@functools.partial(
    jax.jit,
    static_argnames=("model_config", "sampling", "prompt_len", "sharding"),
    donate_argnames=("s",),
)
def observe(
    weights: Any,
    s: TurnState,
    row: jax.Array,
    chunk_C: jax.Array,
    num_obs: jax.Array,
    stop_ids_S: jax.Array,
    stop_BQL: jax.Array,
    *,
    model_config: ModelConfig,
    sampling: SamplingConfig,
    prompt_len: int,
    sharding: parallel.ActivationSharding | None,
) -> TurnState:
    """Appends `num_obs` observation tokens (chunk_C[1 : 1 + num_obs]; chunk_C[0] is the
    row's last model token) to row `row`, prefills them into its cache row and samples the
    row's next model token, which starts its next turn."""
    B, C = s.tokens_BT.shape[0], chunk_C.shape[0]
    n = s.step_B[row]
    take_row, put_row = _row_access(B, row, sharding is not None)
    cache_1 = jax.tree.map(take_row, s.cache)
    index_C = jnp.arange(C, dtype=jnp.int32)
    real_C = index_C <= num_obs
    h_1CD, cache_1 = transformer.hidden_states(
        weights,
        model_config,
        chunk_C[None],
        (s.plen_B[row] + n - 1 + index_C)[None],
        real_C[None],
        cache_1,
        prompt_len + n - 1,
        # The chunk's offset is traced: the kernels that need a static one do not apply.
        attention=AttentionConfig(impl="reference"),
        sharding=sharding,
    )
    assert cache_1 is not None  # hidden_states returns the cache it is given, updated
    h_11D = jax.lax.dynamic_slice_in_dim(h_1CD, num_obs, 1, axis=1)
    logits_1V = unembedding.unembed(weights, model_config, h_11D, sharding)[:, 0]
    s = s.replace(cache=jax.tree.map(put_row, s.cache, cache_1))
    s = resume_row(s, row, chunk_C, num_obs, logits_1V, stop_ids_S, stop_BQL, sampling)
    return _laid_out(s, sharding)


def resume_row(
    s: TurnState,
    row: jax.Array,
    chunk_C: jax.Array,
    num_obs: jax.Array,
    logits_1V: jax.Array,
    stop_ids_S: jax.Array,
    stop_BQL: jax.Array,
    sampling: SamplingConfig,
) -> TurnState:
    """Row `row` after its observation chunk (in its KV; `logits_1V` from the chunk's last
    token): the observation tokens appended, the next model token sampled (fold_in(row_key,
    step)), which starts the row's next turn."""
    B, N = s.tokens_BT.shape
    n = s.step_B[row]
    index_C = jnp.arange(chunk_C.shape[0], dtype=jnp.int32)
    obs_at_C = jnp.where(index_C[1:] <= num_obs, n + index_C[1:] - 1, N)  # N: dropped
    step_B = s.step_B.at[row].add(num_obs)
    s = s.replace(
        step_B=step_B,
        tokens_BT=s.tokens_BT.at[row, obs_at_C].set(chunk_C[1:], mode="drop"),
        turn_start_B=s.turn_start_B.at[row].set(step_B[row]),
        live_B=s.live_B.at[row].set(True),
    )
    keys_1 = s.replace(step_B=step_B).draw_keys(row[None])
    greedy_1 = None if s.greedy_B is None else s.greedy_B[row][None]
    tok_1, lp_1 = strategies.sample(logits_1V, keys_1, sampling, greedy_1)
    emit_B = jnp.arange(B) == row
    tok_B = jnp.where(emit_B, tok_1[0], 0)
    lp_B = jnp.where(emit_B, lp_1[0], 0.0)
    return _emit(s, emit_B, tok_B, lp_B, stop_ids_S, stop_BQL)


def chunk_length(num_tokens: int) -> int:
    """Observation chunk slots for `num_tokens` tokens: a power of two >= 16 (few shapes)."""
    return max(_MIN_CHUNK, 1 << (num_tokens - 1).bit_length())


def observe_inputs(
    state: TurnState, row: int, obs: list[int], pad_id: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`observe`'s (row, chunk, observation tokens): the chunk is the row's last model token,
    then the observation tokens, padded to chunk_length."""
    chunk = np.full(chunk_length(len(obs) + 1), pad_id, np.int32)
    chunk[0] = jax.device_get(state.last_B[row])
    chunk[1 : 1 + len(obs)] = obs
    return jnp.int32(row), jnp.asarray(chunk), jnp.int32(len(obs))


class RolloutSettings(NamedTuple):
    """What a rollout's programs are started with besides the weights and the rows."""

    stop_ids_S: jax.Array
    stop_BQL: jax.Array
    pad_id: int
    budget: int  # completion tokens per row
    chunk: int  # the longest observation chunk (chunk_length)
    static: dict[str, Any]  # model_config, sampling, sharding


class Programs(Protocol):
    """The compiled programs multiturn.py's host loop runs over a rollout's TurnState: every
    row in its own dense cache row (DensePrograms), in pages (paged_turns.PagedPrograms), or
    in a pool per batch shard (paged_turns_mesh.ShardedPrograms)."""

    @property
    def evictions(self) -> int: ...
    def segment(self, state: TurnState) -> TurnState: ...
    def observe(self, state: TurnState, row: int, obs: list[int], pad_id: int) -> TurnState: ...
    def finish(self, state: TurnState, row: int) -> TurnState: ...
    def unblock(self, state: TurnState) -> TurnState: ...
    def pages_left(self, state: TurnState) -> int: ...


@dataclasses.dataclass(frozen=True, eq=False)
class DensePrograms:
    """segment and observe with what every call of one rollout passes (the laid-out weights,
    the stop ids and stop sequences, the prompt width and the static settings: model_config,
    sampling, sharding), as multiturn.py's host loop runs them; every row keeps its cache row,
    so no row waits for memory (unblock, finish: nothing to do)."""

    weights: Any
    stop_ids_S: jax.Array
    stop_BQL: jax.Array
    prompt_len: int
    static: dict[str, Any]
    evictions: int = 0

    def segment(self, state: TurnState) -> TurnState:
        """Up to SEGMENT_STEPS decode steps of the live rows (until some row ends its turn)."""
        state = segment(
            self.weights,
            state,
            self.stop_ids_S,
            self.stop_BQL,
            prompt_len=self.prompt_len,
            max_steps=SEGMENT_STEPS,
            **self.static,
        )
        jax.block_until_ready(state.ended_B)
        return state

    def observe(self, state: TurnState, row: int, obs: list[int], pad_id: int) -> TurnState:
        """Row `row` resumed after the observation tokens `obs`."""
        return observe(
            self.weights,
            state,
            *observe_inputs(state, row, obs, pad_id),
            self.stop_ids_S,
            self.stop_BQL,
            prompt_len=self.prompt_len,
            **self.static,
        )

    def finish(self, state: TurnState, row: int) -> TurnState:
        return state

    def unblock(self, state: TurnState) -> TurnState:
        return state

    def pages_left(self, state: TurnState) -> int:
        return 0
