"""The non-finite update guard: a NaN / inf loss or gradient skips the update, counted, and a
run that keeps skipping stops with a clear error instead of training (and saving) NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences
from jaxrl4llm.train.update.state import OptimizerConfig, TrainState
from jaxrl4llm.train.update.step import train_step

CONFIG = ModelConfig(
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    max_position_embeddings=32,
    eos_token_ids=(1,),
    pad_token_id=0,
)
OPT = OptimizerConfig(learning_rate=0.05)
B, P, T = 4, 3, 3


def _batch(advantages) -> UpdateBatch:
    rng = np.random.default_rng(0)
    seqs = Sequences(
        prompt_tokens_BP=jnp.asarray(rng.integers(2, 16, (B, P)), jnp.int32),
        prompt_mask_BP=jnp.ones((B, P), bool),
        completion_tokens_BT=jnp.asarray(rng.integers(2, 16, (B, T)), jnp.int32),
        completion_mask_BT=jnp.ones((B, T), bool),
    )
    return UpdateBatch(
        seqs=seqs,
        advantages=jnp.asarray(advantages, jnp.float32),
        keep_B=jnp.ones(B, bool),
        old_logp_BT=None,
        ref_logp_BT=None,
    )


def _step(state, batch):
    return train_step(
        state,
        batch,
        model_config=CONFIG,
        algorithm=rl.get_preset("grpo", kl_coef=0.0),
        optimizer=OPT,
        num_micro=2,
        temperature=1.0,
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_gradient_skips_the_update(bad):
    params = transformer.init_params(CONFIG, jax.random.key(0))
    state = TrainState.create(params, OPT, seed=0)
    before = jax.device_get(state)  # host copies: the state is donated to the step
    # One row's advantage is NaN / inf: its gradient (and the global norm) is not finite.
    state, metrics = _step(state, _batch([1.0, -1.0, bad, 0.5]))
    assert float(metrics["optim/skipped_updates"].value) == 1.0
    assert not np.isfinite(float(metrics["optim/grad_norm"].value))
    after = jax.device_get(state)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)  # params, Adam moments and count untouched
    # The next, finite batch updates as if the bad one had never been seen.
    state, metrics = _step(state, _batch([1.0, -1.0, 0.25, 0.5]))
    assert float(metrics["optim/skipped_updates"].value) == 0.0
    moved = jax.device_get(state.params)
    assert not np.array_equal(moved["embed"], before.params["embed"])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(moved))
    count = [x for x in jax.tree.leaves(jax.device_get(state.opt_state)) if x.shape == ()]
    assert count and all(int(c) == 1 for c in count)  # Adam's counts: one applied update
