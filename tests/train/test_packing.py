"""--micro_batch_tokens: sequences packed into token-budget micro-batches give the padded
update's loss, gradients and metrics (the padded update computed here in one piece by the
row-per-sequence path, which knows nothing of packing)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.train import packing
from jaxrl4llm.train.logprobs import Sequences, completion_logprobs_jit
from jaxrl4llm.train.step import UpdateBatch, accumulate_gradients, accumulate_packed

CONFIG = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    eos_token_ids=(1,),
    pad_token_id=0,
)
P, T = 6, 12
PROMPT_LEN = np.array([6, 2, 4, 3, 5, 2, 6, 3])
COMP_LEN = np.array([12, 1, 7, 3, 2, 11, 5, 1])  # mixed: 1 to 12 tokens
M = PROMPT_LEN.size


def test_first_fit_decreasing_by_hand():
    # Longest first: 7 -> bin 0; 5 -> bin 1; 4 -> bin 1 (9); 3 -> bin 0 (10); 2 -> bin 2;
    # 1 -> bin 1 (10).
    assert packing.first_fit_decreasing(np.array([3, 7, 2, 5, 1, 4]), 10) == [
        [1, 0],
        [3, 5, 4],
        [2],
    ]
    with pytest.raises(ValueError, match="does not fit a packed row of 4"):
        packing.first_fit_decreasing(np.array([5]), 4)
    assert packing.rows_per_micro_batch(100, 18, 1) == 5
    assert packing.rows_per_micro_batch(100, 18, 4) == 4
    assert packing.rows_per_micro_batch(10, 18, 2) == 2  # one row per device at least


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    prompt_mask = np.arange(P)[None, :] >= (P - PROMPT_LEN)[:, None]
    comp_mask = np.arange(T)[None, :] < COMP_LEN[:, None]
    seqs = Sequences(
        prompt_tokens_BP=jnp.asarray(
            np.where(prompt_mask, rng.integers(2, 48, (M, P)), 0), jnp.int32
        ),
        prompt_mask_BP=jnp.asarray(prompt_mask),
        completion_tokens_BT=jnp.asarray(
            np.where(comp_mask, rng.integers(2, 48, (M, T)), 0), jnp.int32
        ),
        completion_mask_BT=jnp.asarray(comp_mask),
    )
    params = transformer.init_params(CONFIG, jax.random.key(0))
    ref = completion_logprobs_jit(
        transformer.init_params(CONFIG, jax.random.key(1)), CONFIG, seqs, 1.0
    )
    old = jnp.where(
        seqs.completion_mask_BT,
        completion_logprobs_jit(params, CONFIG, seqs, 1.0)
        + jnp.asarray(rng.normal(0, 0.05, (M, T)), jnp.float32),
        0.0,
    )
    keep = np.ones(M, bool)
    keep[3] = False  # a rejected row
    return params, UpdateBatch(
        seqs=seqs,
        advantages=jnp.asarray(rng.normal(size=M), jnp.float32),
        keep_B=jnp.asarray(keep),
        old_logp_BT=old,
        ref_logp_BT=ref,
    )


def test_pack_lays_sequences_out_by_hand():
    _, batch = _batch()
    packed = packing.pack(batch.seqs, budget=2 * (P + T))  # rows of 18 slots, 2 per micro
    lengths = PROMPT_LEN + COMP_LEN  # 18 3 11 6 7 13 11 4
    # FFD into 18 slots, longest first (0 5 2 6 4 3 7 1): [0] [5 7] [2 4] [6 3] [1]: 5 rows,
    # 3 micro-batches of 2 rows used.
    assert packed.tokens_KRL.shape == (4, 2, 18) and int(packed.num_micro) == 3
    segments = np.asarray(packed.segments_KRL).reshape(8, 18)
    assert [(segments[r] > 0).sum() for r in range(5)] == [18, 17, 18, 17, 3]
    assert (segments[5:] == 0).all()
    assert packing.real_share(packed) == (lengths.sum(), 3 * 2 * 18)
    # Row 7 (3 prompt tokens, 1 completion token) follows row 5 (13 tokens) in packed row 1:
    # its completion token is predicted at slot 13 + 3 - 1 of micro-batch 0's row 1.
    assert int(packed.micro_M[7]) == 0 and int(packed.start_M[7]) == 18 + 15
    assert int(packed.micro_M[1]) == 2 and int(packed.start_M[1]) == 1
    tokens = np.asarray(packed.tokens_KRL).reshape(8, 18)
    np.testing.assert_array_equal(
        tokens[1, 13:17],
        np.concatenate(
            [
                np.asarray(batch.seqs.prompt_tokens_BP)[7, -3:],
                np.asarray(batch.seqs.completion_tokens_BT)[7, :1],
            ]
        ),
    )
    np.testing.assert_array_equal(
        np.asarray(packed.positions_KRL).reshape(8, 18)[1, 11:18], [11, 12, 0, 1, 2, 3, 0]
    )
    np.testing.assert_array_equal(segments[1, 11:18], [1, 1, 2, 2, 2, 2, 0])


@pytest.mark.parametrize("agg", rl.AGG_MODES)
def test_packed_update_equals_the_padded_update(agg):
    params, batch = _batch()
    # k3 KL to the reference in the loss, clipping on: every term of the loss enters.
    algorithm = dataclasses.replace(
        rl.get_preset("grpo", clip_low=0.02, clip_high=0.02), agg=agg, kl_coef=0.1
    )
    loss_ref, grads_ref, metrics_ref = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algorithm, num_micro=1, temperature=0.9
    )
    packed = packing.pack(batch.seqs, budget=2 * (P + T))
    loss, grads, metrics = jax.jit(
        lambda p, b, k: accumulate_packed(
            p, b, k, model_config=CONFIG, algorithm=algorithm, temperature=0.9
        )
    )(params, batch, packed)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_ref)) > 1e-3
    expected, got = rl.finalize_metrics(metrics_ref), rl.finalize_metrics(metrics)
    assert set(got) == set(expected) and "policy/kl_ref" in expected
    assert float(expected["policy/clip_frac"]) > 0
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, atol=1e-6, err_msg=key)
