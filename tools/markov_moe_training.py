"""A tiny mixture of experts trained on a peaked Markov chain, for tools/bench_routing_replay.py.

The chain: every token of the vocabulary but 0 has 4 distinct random successors, drawn with
probabilities SUCCESSOR_PROBS (0.9, 0.07, 0.02, 0.01): next-token distributions as peaked as a
trained language model's on its confident tokens. A model that has learnt the chain predicts
with cross-entropy ENTROPY_RATE (0.405 nats) and top-1 accuracy 0.9. Training is plain
next-token cross-entropy with Adam, plus 0.01 x the load-balancing loss (the Switch
Transformer's, as transformers' Qwen3-MoE trains with it) so the routers spread the tokens.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl4llm.models import routing_stats, transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.transformer import Params
from jaxrl4llm.models.unembedding import unembed

SUCCESSOR_PROBS = np.array([0.9, 0.07, 0.02, 0.01])
ENTROPY_RATE = float(-np.sum(SUCCESSOR_PROBS * np.log(SUCCESSOR_PROBS)))
BALANCE_LOSS_COEF = 0.01


@dataclasses.dataclass(frozen=True)
class MarkovChain:
    """successors_VS[v]: the tokens that may follow v, most likely first (row 0 unused)."""

    successors_VS: np.ndarray

    @classmethod
    def random(cls, vocab_size: int, seed: int) -> MarkovChain:
        rng = np.random.default_rng(seed)
        tokens = np.arange(1, vocab_size)
        rows = [rng.choice(tokens, len(SUCCESSOR_PROBS), replace=False) for _ in range(vocab_size)]
        return cls(np.stack(rows))

    def walks(self, starts: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
        """[len(starts), length] token walks, each from its start token."""
        tokens = np.empty((len(starts), length), dtype=np.int32)
        tokens[:, 0] = starts
        for t in range(1, length):
            pick = rng.choice(len(SUCCESSOR_PROBS), size=len(starts), p=SUCCESSOR_PROBS)
            tokens[:, t] = self.successors_VS[tokens[:, t - 1], pick]
        return tokens

    def batch(self, rows: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """Walks from uniformly random start tokens."""
        vocab_size = self.successors_VS.shape[0]
        return self.walks(rng.integers(1, vocab_size, size=rows), length, rng)

    def prompts(self, count: int, rng: np.random.Generator) -> list[list[int]]:
        """`count` walks of 8 to 23 tokens: the bench's prompts, from the trained task."""
        return [
            [int(t) for t in self.batch(1, int(rng.integers(8, 24)), rng)[0]] for _ in range(count)
        ]


class TrainingReport(NamedTuple):
    """Cross-entropy (nats per token) and top-1 accuracy on fresh walks, before and after."""

    loss_before: float
    loss_after: float
    accuracy_after: float
    balance_loss_after: float


def next_token_losses(
    params: Params, config: ModelConfig, tokens_BT: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(mean cross-entropy, top-1 accuracy, load-balancing loss) of predicting tokens 1.."""
    mask_BT = jnp.ones(tokens_BT.shape, bool)
    positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    h_BTD, _, routing = transformer.routed_hidden_states(
        params, config, tokens_BT, positions_BT, mask_BT
    )
    assert routing is not None  # a mixture of experts
    logits_BTV = unembed(params, config, h_BTD)[:, :-1]
    targets_BT = tokens_BT[:, 1:]
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
    accuracy = jnp.mean(jnp.argmax(logits_BTV, axis=-1) == targets_BT)
    assert config.moe is not None
    balance = routing_stats.load_balancing_loss(
        routing.logits_BTE, config.moe.experts_per_token, None, routing.experts_BTK
    )
    return jnp.mean(cross_entropy), accuracy, balance


def train(
    params: Params,
    config: ModelConfig,
    chain: MarkovChain,
    steps: int,
    *,
    rows: int = 32,
    length: int = 64,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> tuple[Params, TrainingReport]:
    """(trained params, TrainingReport): `steps` Adam steps of `rows` fresh walks each."""
    optimizer = optax.adam(optax.cosine_decay_schedule(learning_rate, max(steps, 1), 0.1))
    evaluate = jax.jit(lambda p, tokens: next_token_losses(p, config, tokens))

    def loss(p, tokens):
        cross_entropy, _, balance = next_token_losses(p, config, tokens)
        return cross_entropy + BALANCE_LOSS_COEF * balance

    @jax.jit
    def step(p, opt_state, tokens):
        grads = jax.grad(loss)(p, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    rng = np.random.default_rng(seed)
    held_out = jnp.asarray(chain.batch(rows, length, np.random.default_rng(seed + 1)))
    loss_before = float(evaluate(params, held_out)[0])
    opt_state = optimizer.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state, jnp.asarray(chain.batch(rows, length, rng)))
    cross_entropy, accuracy, balance = (float(x) for x in evaluate(params, held_out))
    return params, TrainingReport(loss_before, cross_entropy, accuracy, balance)
