"""Sampling strategies: greedy, temperature, top-k and top-p as one frozen, hashable config.

`SamplingConfig(temperature, top_k, top_p)` combines them (greedy when temperature == 0) and
is a static argument of the jitted sampler. The functions below are pure and jittable over a
[B, V] block of float32 logits.

Log-probability definition (the trainer must use the same one):

    logprob(token) = log_softmax(logits / temperature)[token]

taken BEFORE top-k / top-p truncation; with temperature == 0 (greedy) it is the temperature-1
log-probability, log_softmax(logits)[token].

Truncation follows transformers' warpers: top-k first, then top-p over the top-k set
renormalized. Ties at a cut-off value are kept (top-k may keep more than k tokens when
several logits equal the k-th one), so two implementations never disagree on a tie.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Top-p first looks for the nucleus among this many highest tokens (a cheap lax.top_k); rows
# whose nucleus is larger fall back to an exact bisection over the whole vocabulary.
TOP_P_CANDIDATES = 64


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = off).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(
                f"--temperature={self.temperature} must be >= 0 (0 means greedy decoding)."
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"--top_k={self.top_k!r} must be an int >= 0 (0 = off).")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top_p={self.top_p} must be in (0, 1] (1.0 = off).")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_temperature(self) -> float:
        """The temperature of the reported logprobs: 1.0 for greedy decoding."""
        return 1.0 if self.is_greedy else float(self.temperature)

    @property
    def truncates(self) -> bool:
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)

    @classmethod
    def greedy(cls) -> "SamplingConfig":
        return cls(temperature=0.0)


GREEDY = SamplingConfig(temperature=0.0)


def scaled_logits(logits_BV: jax.Array, config: SamplingConfig) -> jax.Array:
    """logits / temperature in float32 (temperature 1 for greedy)."""
    logits_BV = logits_BV.astype(jnp.float32)
    t = config.effective_temperature
    return logits_BV if t == 1.0 else logits_BV / t


def log_probs(logits_BV: jax.Array, config: SamplingConfig) -> jax.Array:
    """log_softmax(logits / temperature): the distribution the sampler's logprobs refer to."""
    return jax.nn.log_softmax(scaled_logits(logits_BV, config), axis=-1)


def _top_p_threshold_bisect(probs_BV: jax.Array, top_p: float) -> jax.Array:
    """Exact nucleus threshold: the largest probability value tau with mass(p >= tau) >= top_p.

    Bisection over the int32 bit patterns of the (non-negative) float32 probabilities, which
    order like the floats, so 32 halvings pin tau down exactly.
    """
    bits_BV = jax.lax.bitcast_convert_type(probs_BV, jnp.int32)
    lo_B = jnp.zeros(probs_BV.shape[:1], jnp.int32)  # mass(p >= 0) = 1 >= top_p
    hi_B = jnp.max(bits_BV, axis=-1) + 1  # mass(p >= above max) = 0 < top_p

    def body(_, lo_hi):
        lo_B, hi_B = lo_hi
        mid_B = lo_B + (hi_B - lo_B) // 2
        mass_B = jnp.sum(jnp.where(bits_BV >= mid_B[:, None], probs_BV, 0.0), axis=-1)
        ok_B = mass_B >= top_p
        return jnp.where(ok_B, mid_B, lo_B), jnp.where(ok_B, hi_B, mid_B)

    lo_B, _ = jax.lax.fori_loop(0, 32, body, (lo_B, hi_B))
    return jax.lax.bitcast_convert_type(lo_B, jnp.float32)


def keep_threshold(scaled_BV: jax.Array, config: SamplingConfig) -> jax.Array | None:
    """Per-row cut-off on the scaled logits: tokens with scaled >= threshold are kept.

    Returns None when nothing is truncated (greedy, or top_k == 0 and top_p == 1).
    """
    if not config.truncates:
        return None
    vocab = scaled_BV.shape[-1]
    top_k = min(config.top_k, vocab) if config.top_k else 0
    if top_k:
        vals_BK, _ = jax.lax.top_k(scaled_BV, top_k)
        thresh_B = vals_BK[:, -1]
        if config.top_p >= 1.0:
            return thresh_B
        probs_BK = jax.nn.softmax(vals_BK, axis=-1)  # renormalized over the top-k set
        return _nucleus_in_candidates(vals_BK, probs_BK, config.top_p)[0]
    k = min(TOP_P_CANDIDATES, vocab)
    vals_BK, _ = jax.lax.top_k(scaled_BV, k)
    lse_B = jax.nn.logsumexp(scaled_BV, axis=-1)
    probs_BK = jnp.exp(vals_BK - lse_B[:, None])
    thresh_B, found_B = _nucleus_in_candidates(vals_BK, probs_BK, config.top_p)
    if k == vocab:
        return thresh_B

    def exact(_):
        probs_BV = jnp.exp(scaled_BV - lse_B[:, None])
        tau_B = _top_p_threshold_bisect(probs_BV, config.top_p)
        # Back to logit space: the smallest scaled logit whose probability reaches tau.
        kept_BV = probs_BV >= tau_B[:, None]
        return jnp.min(jnp.where(kept_BV, scaled_BV, jnp.inf), axis=-1)

    slow_B = jax.lax.cond(jnp.all(found_B), lambda _: thresh_B, exact, None)
    return jnp.where(found_B, thresh_B, slow_B)


def _nucleus_in_candidates(
    vals_BK: jax.Array, probs_BK: jax.Array, top_p: float
) -> tuple[jax.Array, jax.Array]:
    """Nucleus cut-off among K descending candidates; found_B says it ends inside them."""
    cum_BK = jnp.cumsum(probs_BK, axis=-1)
    above_BK = cum_BK - probs_BK  # mass strictly above each candidate
    kept_BK = above_BK < top_p
    kept_BK = kept_BK.at[:, 0].set(True)  # always keep the most likely token
    num_B = jnp.sum(kept_BK, axis=-1)
    thresh_B = jnp.take_along_axis(vals_BK, (num_B - 1)[:, None], axis=-1)[:, 0]
    found_B = cum_BK[:, -1] >= top_p
    return thresh_B, found_B


def allowed_tokens(logits_BV: jax.Array, config: SamplingConfig) -> jax.Array:
    """Boolean [B, V]: the tokens the sampler may emit (all True without truncation)."""
    scaled_BV = scaled_logits(logits_BV, config)
    if config.is_greedy:
        return scaled_BV == jnp.max(scaled_BV, axis=-1, keepdims=True)
    thresh_B = keep_threshold(scaled_BV, config)
    if thresh_B is None:
        return jnp.ones(scaled_BV.shape, bool)
    return scaled_BV >= thresh_B[:, None]


def sample(
    logits_BV: jax.Array,
    keys_B: jax.Array,
    config: SamplingConfig,
    greedy_B: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens_B int32, logprobs_B float32).

    greedy_B (bool [B], optional): rows that take the argmax instead (e.g. ReMax's greedy
    baseline row beside the sampled ones); their logprobs follow `config` like the others.

    keys_B holds one PRNG key per row (the caller folds in the step), so a row's draw does not
    depend on the other rows. Sampling inverts the row's CDF with a single uniform: one exp
    pass and one cumsum over the vocabulary, cheaper on CPU than a Gumbel draw per token.
    """
    scaled_BV = scaled_logits(logits_BV, config)
    max_B = jnp.max(scaled_BV, axis=-1)
    if config.is_greedy:
        tokens_B = jnp.argmax(scaled_BV, axis=-1).astype(jnp.int32)
        lse_B = max_B + jnp.log(jnp.sum(jnp.exp(scaled_BV - max_B[:, None]), axis=-1))
    else:
        unnorm_BV = jnp.exp(scaled_BV - max_B[:, None])
        lse_B = max_B + jnp.log(jnp.sum(unnorm_BV, axis=-1))
        thresh_B = keep_threshold(scaled_BV, config)
        if thresh_B is not None:
            unnorm_BV = jnp.where(scaled_BV >= thresh_B[:, None], unnorm_BV, 0.0)
        cdf_BV = jnp.cumsum(unnorm_BV, axis=-1)
        total_B = cdf_BV[:, -1]
        u_B = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_B)
        # u * total < total keeps the draw inside the support despite rounding; the first
        # index whose CDF exceeds it has non-zero mass, so excluded tokens are never drawn.
        x_B = jnp.minimum(u_B * total_B, jnp.nextafter(total_B, 0.0))
        tokens_B = jnp.argmax(cdf_BV > x_B[:, None], axis=-1).astype(jnp.int32)
        if greedy_B is not None:
            tokens_B = jnp.where(
                greedy_B, jnp.argmax(scaled_BV, axis=-1).astype(jnp.int32), tokens_B
            )
    chosen_B = jnp.take_along_axis(scaled_BV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, chosen_B - lse_B
