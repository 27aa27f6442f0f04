"""Teacher-forced per-token logprobs and entropies of completions.

The same function gives the policy's logprobs inside the update, the old-policy logprobs and
the reference logprobs in the rollout, so all three share one definition: log_softmax of the
logits divided by the sampling temperature (the sampler's definition too).

Layout: a row is `prompt (left-padded, Tp) ++ completion (Tc)`. The logits at column
Tp-1+t predict completion token t, so the model reads the first Tp+Tc-1 tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.models import decoder_layer, layer_stack, transformer, unembedding
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling.layout import prompt_completion_rows

Sharding = parallel.ActivationSharding | None


class Sequences(flax.struct.PyTreeNode):
    """Prompt + completion token blocks of a batch of samples. A row's completion is
    contiguous: `sequence_mask_BT` is set on its first `lengths_B()` columns and nowhere
    after (a token the loss skips but the model reads is an observation, not a gap), so a
    slot and a RoPE position advance together (the sliding window counts either)."""

    prompt_tokens_BP: jax.Array  # int32, left-padded
    prompt_mask_BP: jax.Array  # bool, real prompt tokens
    completion_tokens_BT: jax.Array  # int32, padded after the stop token
    # bool, the model's tokens up to and including the first stop token: the loss mask
    completion_mask_BT: jax.Array
    # Multi-turn rollouts: bool, observation tokens between the model's turns (in the
    # sequence, so the forward pass reads them, but off completion_mask_BT: no loss, KL,
    # entropy or denominator counts them). None: every real completion token is the model's.
    observation_mask_BT: jax.Array | None = None
    # A mixture of experts' routing record: the experts [L_moe, K] the sampler ran for each
    # prompt token and each completion token (SampleOutput's). With `replay` the passes run
    # them instead of their routers' top-k (--routing_replay); without, the update only
    # compares its routers' choice with them (router/flip_frac). None: no record.
    prompt_experts_BPLK: jax.Array | None = None
    experts_BTLK: jax.Array | None = None
    replay: bool = flax.struct.field(pytree_node=False, default=True)

    @property
    def sequence_mask_BT(self) -> jax.Array:
        """bool: every real completion token (what the forward pass attends to)."""
        if self.observation_mask_BT is None:
            return self.completion_mask_BT
        return self.completion_mask_BT | self.observation_mask_BT

    def lengths_B(self) -> jax.Array:
        """int32: each row's completion length, observation tokens included (its last real
        token is at length - 1; sum(completion_mask_BT) is only the model's tokens)."""
        return jnp.sum(self.sequence_mask_BT, axis=1, dtype=jnp.int32)


def _inputs(seqs: Sequences) -> tuple[jax.Array, jax.Array, jax.Array]:
    tokens, mask, positions = prompt_completion_rows(
        seqs.prompt_tokens_BP,
        seqs.prompt_mask_BP,
        seqs.completion_tokens_BT,
        seqs.sequence_mask_BT,
    )
    return tokens[:, :-1], positions[:, :-1], mask[:, :-1]


def _chunk_logprobs(
    spec: str, w: jax.Array, h_BCD: jax.Array, targets_BC: jax.Array, temperature: float
) -> tuple[jax.Array, jax.Array]:
    logits_BCV = (
        jnp.einsum(spec, h_BCD.astype(w.dtype), w, preferred_element_type=jnp.float32) / temperature
    )
    logz_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    target_logit_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
    probs_BCV = jnp.exp(logits_BCV - logz_BC[..., None])
    entropy_BC = logz_BC - jnp.sum(probs_BCV * logits_BCV, axis=-1)
    return target_logit_BC - logz_BC, entropy_BC


# Budget (per device) for one chunk of float32 logits [B, C, V]; the backward holds about
# three of them.
LOGITS_CHUNK_BYTES = 64 * 2**20


def logits_chunk_size(batch: int, length: int, vocab_size: int) -> int:
    """Positions per unembedding chunk: a power of two whose [B, C, V] f32 logits fit the
    budget. `batch` and `vocab_size` are what one device holds."""
    fit = max(1, LOGITS_CHUNK_BYTES // (4 * batch * vocab_size))
    return min(1 << (fit.bit_length() - 1), length)


def routed_completion_logprobs(
    params: Any,
    config: ModelConfig,
    seqs: Sequences,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    remat: bool = False,
    prompt_group: int = 1,
    sharding: Sharding = None,
) -> tuple[jax.Array, jax.Array, TokenRouting | None]:
    """Returns (logp_BT, entropy_BT) of the completion tokens, float32, at `temperature` (the
    sampler's logprob temperature, SamplingConfig.effective_temperature: 1 for greedy), and
    the pass's TokenRouting (None in a dense model); `completion_logprobs` returns the two.

    The [B, T, V] logits are never materialised whole: the completion is unembedded in chunks
    of `chunk_size` positions (default: `logits_chunk_size`), each rematerialised in the
    backward pass, so peak memory holds one chunk's logits (SmolLM2's vocabulary is 49k;
    32 x 128 x 49k float32 would be 800 MB).

    `prompt_group` > 1 declares that rows [i*g, (i+1)*g) share one prompt (a rollout's group
    of g samples, as the sampler lays them out): the prompt then runs once per group
    (`transformer.hidden_states_shared_prefix`), which saves (g-1)/g of the prompt's compute
    and activations. The result is the same up to float rounding.

    `sharding` (a mesh): activations are constrained to the batch layout; the unembedding
    matrix is gathered once and each device unembeds its own rows (chunk size from what one
    device holds).
    """
    params = transformer.cast_for_compute(params, config)  # mixed precision (compute_dtype)
    h_BTD, routing = routed_completion_hidden_states(
        params, config, seqs, remat=remat, prompt_group=prompt_group, sharding=sharding
    )
    logp_BT, entropy_BT = logprobs_from_hidden(
        params, config, h_BTD, seqs.completion_tokens_BT, temperature, chunk_size, sharding
    )
    return logp_BT, entropy_BT, routing


# (logp_BT, entropy_BT): routed_completion_logprobs without the routing.
completion_logprobs = layer_stack.without_routing(routed_completion_logprobs)


def logprobs_from_hidden(
    params: Any,
    config: ModelConfig,
    h_BTD: jax.Array,
    targets_BT: jax.Array,
    temperature: float,
    chunk_size: int | None = None,
    sharding: Sharding = None,
) -> tuple[jax.Array, jax.Array]:
    """(logp_BT, entropy_BT) float32 of `targets_BT` under the final hidden states h_BTD
    (`params` already cast for compute), unembedded in chunks (see `completion_logprobs`)."""
    spec, w = unembedding.unembedding_matrix(params, config, sharding)
    V = config.vocab_size
    chunked = functools.partial(
        _chunked_logprobs,
        spec,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_per_device=V if sharding is None else V // sharding.shards("vocab", V),
    )
    if sharding is None or sharding.shards("batch", h_BTD.shape[0]) == 1:
        return chunked(w, h_BTD, targets_BT)
    rows = sharding.spec(("batch",), h_BTD.shape[:1])[0]
    # Per device over its own rows: each chunk's unembedding gradient then accumulates
    # locally and is reduced once after the chunk loop (traced on the whole mesh, it would
    # be all-reduced at every chunk: the vocabulary-sized matrix, once per chunk).
    rows = (rows,) if isinstance(rows, str) else tuple(rows)
    P = jax.sharding.PartitionSpec
    dtype = w.dtype
    # XLA's CPU compiler aborts on the bfloat16 all-reduce that sums this input's gradient
    # over the devices (AllReducePromotion: "Invalid binary instruction opcode copy"), so on
    # CPU the matrix crosses the boundary in float32 (and its gradient is summed in float32).
    boundary = jnp.float32 if parallel.backend() == "cpu" else dtype
    # Varying before the cast, so the gradient's sum over devices happens in `boundary`.
    per_device = lambda w, h, t: chunked(  # noqa: E731
        jax.lax.pcast(w, rows, to="varying").astype(dtype), h, t
    )
    return jax.shard_map(
        per_device,
        mesh=sharding.mesh,
        in_specs=(P(), P(rows), P(rows)),
        out_specs=(P(rows), P(rows)),
        axis_names=set(rows),
    )(w.astype(boundary), h_BTD, targets_BT)


class TokenRouting(flax.struct.PyTreeNode):
    """The routing of a teacher-forced pass's tokens, flattened over them: router logits
    [L_moe, N, E], the experts run [L_moe, N, K] (the replayed ones under replay), and the
    tokens' weights [N] (1 for a real token; 0 for padding). A shared prompt counts once per
    group. models/routing_stats.py reads it (as [L, 1, N, ...])."""

    logits_LNE: jax.Array
    experts_LNK: jax.Array
    weight_N: jax.Array
    recorded_LNK: jax.Array | None = None  # the sampler's experts (replay's record), if any


def completion_hidden_states(
    params: Any, config: ModelConfig, seqs: Sequences, **options: Any
) -> jax.Array:
    """h_BTD: the last layer's hidden state (after the final norm) at the column that predicts
    each completion token, i.e. of the prefix before it; `params` already cast for compute.
    The policy unembeds it into logprobs, the critic's head reads V(s_t) from it. With
    `seqs`' routing record (replay), the MoE layers run the recorded experts. `options`:
    routed_completion_hidden_states' keywords (remat, prompt_group, sharding)."""
    return routed_completion_hidden_states(params, config, seqs, **options)[0]


def _layers_first(experts_BTLK: jax.Array) -> jax.Array:
    """A routing record [B, T, L, K] as the layers take it: [L, B, T, K] int32."""
    return jnp.moveaxis(experts_BTLK, 2, 0).astype(jnp.int32)


def _replayed(experts_BTLK: jax.Array | None, replay: bool) -> jax.Array | None:
    return _layers_first(experts_BTLK) if replay and experts_BTLK is not None else None


def _record(seqs: Sequences) -> tuple[jax.Array, jax.Array] | None:
    """(the prompt's record [B, P, L, K], the fed completion tokens' [B, T - 1, L, K] int32).
    A token the sampler fed no further token after (a row's last, padding) has no record: -1,
    so replay lets it route itself and the flip metric skips it."""
    if seqs.experts_BTLK is None or seqs.prompt_experts_BPLK is None:
        return None
    fed_BT11 = seqs.sequence_mask_BT[:, 1:, None, None]
    fed_BTLK = jnp.where(fed_BT11, seqs.experts_BTLK[:, :-1].astype(jnp.int32), -1)
    return seqs.prompt_experts_BPLK, fed_BTLK


def routed_completion_hidden_states(
    params: Any,
    config: ModelConfig,
    seqs: Sequences,
    *,
    remat: bool = False,
    prompt_group: int = 1,
    sharding: Sharding = None,
) -> tuple[jax.Array, TokenRouting | None]:
    """(completion_hidden_states, the pass's TokenRouting; None in a dense model)."""
    num_prompt = seqs.prompt_tokens_BP.shape[1]
    record, replay = _record(seqs), seqs.replay
    masks: tuple[jax.Array, ...]
    if prompt_group > 1:
        g = prompt_group
        prompt_experts, rest_experts = (None, None) if record is None else record
        prompt_experts = None if prompt_experts is None else prompt_experts[::g]
        h_GPD, h_rest_BTD, routing = transformer.routed_hidden_states_shared_prefix(
            params,
            config,
            seqs.prompt_tokens_BP[::g],
            seqs.prompt_mask_BP[::g],
            seqs.completion_tokens_BT[:, :-1],
            seqs.sequence_mask_BT[:, :-1],
            group=g,
            remat=remat,
            sharding=sharding,
            experts_LGPK=_replayed(prompt_experts, replay),
            experts_LBTK=_replayed(rest_experts, replay),
        )
        h_BTD = jnp.concatenate([jnp.repeat(h_GPD[:, -1:], g, axis=0), h_rest_BTD], axis=1)
        parts = None if routing is None else list(zip(routing, (prompt_experts, rest_experts)))
        masks = (seqs.prompt_mask_BP[::g], seqs.sequence_mask_BT[:, :-1])
    else:
        tokens, positions, mask = _inputs(seqs)
        experts = None if record is None else jnp.concatenate(record, axis=1)
        hidden_BLD, _, one = transformer.routed_hidden_states(
            params,
            config,
            tokens,
            positions,
            mask,
            remat=remat,
            sharding=sharding,
            experts_LBTK=_replayed(experts, replay),
        )
        h_BTD = hidden_BLD[:, num_prompt - 1 :]
        parts, masks = (None if one is None else [(one, experts)]), (mask,)
    h_BTD = parallel.constrain(h_BTD, decoder_layer.H_AXES, sharding)
    return h_BTD, None if parts is None else _token_routing(parts, masks)


def _token_routing(parts: list, masks: tuple) -> TokenRouting:
    """TokenRouting of passes' (moe.Routing, recorded experts [B, T, L, K] or None) parts."""

    def flat(x_LBT_: jax.Array) -> jax.Array:  # [L, B, T, ...] -> [L, B * T, ...]
        return x_LBT_.reshape((x_LBT_.shape[0], -1) + x_LBT_.shape[3:])

    logits = jnp.concatenate([flat(r.logits_BTE) for r, _ in parts], axis=1)
    experts = jnp.concatenate([flat(r.experts_BTK) for r, _ in parts], axis=1)
    weight = jnp.concatenate([m.reshape(-1).astype(jnp.float32) for m in masks])
    recorded = None
    if all(e is not None for _, e in parts):
        recorded = jnp.concatenate([flat(_layers_first(e)) for _, e in parts], axis=1)
    return TokenRouting(logits, experts, weight, recorded)


def _chunked_logprobs(
    spec: str,
    w: jax.Array,
    h_BTD: jax.Array,
    targets_BT: jax.Array,
    *,
    temperature: float,
    chunk_size: int | None,
    vocab_per_device: int,
) -> tuple[jax.Array, jax.Array]:
    """(logp_BT, entropy_BT) from final hidden states, unembedded `chunk_size` positions at a
    time (default: as many as the logits budget allows for these rows)."""
    B, T, D = h_BTD.shape
    chunk = min(chunk_size or logits_chunk_size(B, T, vocab_per_device), T)
    pad = (-T) % chunk
    if pad:
        h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    n = (T + pad) // chunk
    h_NBCD = h_BTD.reshape(B, n, chunk, D).swapaxes(0, 1)
    t_NBC = targets_BT.reshape(B, n, chunk).swapaxes(0, 1)
    fn = jax.checkpoint(functools.partial(_chunk_logprobs, spec, w, temperature=temperature))
    logp_NBC, ent_NBC = jax.lax.map(lambda xs: fn(xs[0], xs[1]), (h_NBCD, t_NBC))
    logp_BT = logp_NBC.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
    ent_BT = ent_NBC.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
    return logp_BT, ent_BT


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "temperature",
        "chunk_size",
        "prompt_group",
        "num_chunks",
        "sharding",
    ),
)
def completion_logprobs_jit(
    params: Any,
    config: ModelConfig,
    seqs: Sequences,
    temperature: float,
    chunk_size: int | None = None,
    prompt_group: int = 1,
    num_chunks: int = 1,
    sharding: Sharding = None,
) -> jax.Array:
    """Jitted logprobs only (old-policy and reference passes in the rollout).

    `num_chunks` > 1 runs the rows in that many strided row chunks one after another (whole
    prompt groups each; every chunk spans every device), so activations are sized by one
    chunk; the result equals one pass over all rows.
    """
    params = transformer.cast_for_compute(params, config)  # once, not once per chunk

    def logprobs(seqs: Sequences) -> jax.Array:
        logp_BT, _ = completion_logprobs(
            params,
            config,
            seqs,
            temperature,
            chunk_size,
            prompt_group=prompt_group,
            sharding=sharding,
        )
        return jnp.where(seqs.completion_mask_BT, logp_BT, 0.0)

    return over_row_chunks(logprobs, seqs, num_chunks, prompt_group, sharding)


def over_row_chunks(
    fn: Any, seqs: Sequences, num_chunks: int, prompt_group: int, sharding: Sharding
) -> jax.Array:
    """fn(seqs) -> [B, T], run over `num_chunks` strided row chunks one after another (whole
    prompt groups each) and merged back into row order."""
    if num_chunks == 1:
        return fn(seqs)
    chunks = jax.tree.map(
        lambda x: parallel.constrain(
            parallel.split_strided(x, num_chunks, prompt_group), (None, "batch"), sharding
        ),
        seqs,
    )
    return parallel.merge_strided(jax.lax.map(fn, chunks), prompt_group)
