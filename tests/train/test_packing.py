"""--micro_batch_tokens: sequences packed into token-budget micro-batches give the padded
update's loss, gradients and metrics (the padded update computed here in one piece by the
row-per-sequence path, which knows nothing of packing)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel, rl
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


def test_row_lengths_and_the_fewest_slots_by_hand():
    # Two per octave from the longest sequence's bucket (at least 16), then the cap itself.
    assert packing.row_lengths(18, 100) == [24, 32, 48, 64, 96, 100]
    assert packing.row_lengths(5, 20) == [16, 20]
    assert packing.row_lengths(18, 18) == [18]
    with pytest.raises(ValueError, match="does not fit the per-device budget of 18"):
        packing.row_lengths(19, 18)
    # 40 + 30 + 30 + 20 = 120 tokens: rows of 48 -> [40] [30] [30] [20] = 192 slots; 64 ->
    # [40 20] [30 30] = 128; 96 -> [40 30 20] [30] = 192; 100 -> the same, 200.
    lengths = np.array([30, 40, 20, 30])
    assert packing.row_length(lengths, budget=100) == 64
    # Two devices: a micro-batch is two rows; rows of 48 -> 4 rows = 2 micro-batches (192
    # slots); rows of 50 (the cap 100 / 2) -> 3 rows = 2 micro-batches, 200 slots.
    assert packing.row_length(lengths, budget=100, data_parallel=2) == 48


def test_completion_lengths_count_masked_off_tokens_inside_a_completion():
    # Row 1: a multi-turn completion whose tokens 2-3 (an observation) are off the mask.
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 0, 0, 1], [0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(packing.completion_lengths(mask), [2, 5, 0])


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
    packed = packing.pack(batch.seqs, budget=36)
    lengths = PROMPT_LEN + COMP_LEN  # 18 3 11 6 7 13 11 4 (73)
    # Row lengths 24, 32, 36. FFD into 24 slots, longest first (0 5 2 6 4 3 7 1):
    # [0 3] [5 2] [6 4 7] [1]: 4 rows = 96 slots; 32 and 36 cannot do better than 3 rows
    # (96, 108), so the shorter row wins. One row per micro-batch (one device).
    assert packed.tokens_KRL.shape == (8, 1, 24) and int(packed.num_micro) == 4
    segments = np.asarray(packed.segments_KRL).reshape(8, 24)
    assert [(segments[r] > 0).sum() for r in range(4)] == [24, 24, 22, 3]
    assert (segments[4:] == 0).all()
    assert packing.real_share(packed) == (lengths.sum(), 4 * 24)
    # Row 7 (3 prompt tokens, 1 completion token) follows rows 6 and 4 (11 + 7 tokens) in
    # packed row 2: its completion token is predicted at slot 18 + 3 - 1.
    assert int(packed.micro_M[7]) == 2 and int(packed.start_M[7]) == 20
    assert int(packed.micro_M[1]) == 3 and int(packed.start_M[1]) == 1
    tokens = np.asarray(packed.tokens_KRL).reshape(8, 24)
    np.testing.assert_array_equal(
        tokens[2, 18:22],
        np.concatenate(
            [
                np.asarray(batch.seqs.prompt_tokens_BP)[7, -3:],
                np.asarray(batch.seqs.completion_tokens_BT)[7, :1],
            ]
        ),
    )
    np.testing.assert_array_equal(
        np.asarray(packed.positions_KRL).reshape(8, 24)[2, 9:23],
        [9, 10, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0],
    )
    np.testing.assert_array_equal(segments[2, 9:23], [1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 0])
    # Two data-parallel devices: rows of at most 36 / 2 = 18 slots, two per micro-batch:
    # [0] [5 7] [2 4] [6 3] [1] (FFD into 18), 5 rows in 3 micro-batches.
    packed = packing.pack(batch.seqs, budget=36, data_parallel=2)
    assert packed.tokens_KRL.shape == (4, 2, 18) and int(packed.num_micro) == 3
    assert int(packed.micro_M[7]) == 0 and int(packed.start_M[7]) == 18 + 13 + 3 - 1


def test_pack_keeps_masked_off_tokens_inside_a_completion():
    _, batch = _batch()
    mask = np.asarray(batch.seqs.completion_mask_BT).copy()
    mask[0, 3:5] = False  # row 0: 12 tokens, an observation at 3-4 off the loss mask
    seqs = batch.seqs.replace(completion_mask_BT=jnp.asarray(mask))
    packed = packing.pack(seqs, budget=36)
    row = int(packed.micro_M[0])
    segments = np.asarray(packed.segments_KRL)[row, 0]
    own = segments == segments[int(packed.start_M[0])]
    assert own.sum() == PROMPT_LEN[0] + COMP_LEN[0]  # the observation stays in the sequence
    np.testing.assert_array_equal(
        np.asarray(packed.tokens_KRL)[row, 0][own][PROMPT_LEN[0] :],
        np.asarray(batch.seqs.completion_tokens_BT)[0],
    )


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


def test_packed_update_on_8_devices_equals_one_device():
    """data x fsdp = 2 x 4: a micro-batch is 8 packed rows, one per device; the sharded
    packed update equals the padded update on one device."""
    params, batch = _batch()
    algorithm = dataclasses.replace(rl.get_preset("grpo"), agg="token-mean", kl_coef=0.1)
    loss_ref, grads_ref, _ = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algorithm, num_micro=1, temperature=1.0
    )
    mesh = parallel.make_mesh("data:2,fsdp:4,tensor:1")
    sharding = parallel.ActivationSharding(mesh)
    packed = packing.pack(batch.seqs, budget=8 * 24, data_parallel=8)
    assert packed.tokens_KRL.shape[1] == 8  # one row of 24 slots per device
    sharded_params = parallel.shard_pytree(params, transformer.param_logical_axes(CONFIG), mesh)
    sharded_batch = jax.tree.map(
        lambda x: jax.device_put(x, parallel.batch_sharding(mesh, x.ndim)), batch
    )
    loss, grads, _ = jax.jit(
        lambda p, b, k: accumulate_packed(
            p, b, k, model_config=CONFIG, algorithm=algorithm, temperature=1.0, sharding=sharding
        )
    )(sharded_params, sharded_batch, packed)
    assert len(jax.tree.leaves(grads)[0].sharding.device_set) == 8
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(micro_batch_tokens=-1), "--micro_batch_tokens=-1 must be >= 0"),
        # 128 + 64 = 192 tokens per sequence, 4 data-parallel devices: at least 768.
        (dict(micro_batch_tokens=767), "--micro_batch_tokens=767 must be 0 .off. or >= 768"),
        (dict(micro_batch_tokens=768, lora_rank=8), "LoRA .--lora_rank=8. runs on padded"),
        (
            dict(micro_batch_tokens=768, micro_batch_length_classes=2),
            "--micro_batch_length_classes=2 sorts padded micro-batches",
        ),
    ],
)
def test_micro_batch_tokens_flag_checks(overrides, message):
    from jaxrl4llm.config.errors import FlagError
    from jaxrl4llm.train.config import TrainConfig

    base = TrainConfig().replace(
        max_prompt_tokens=128, max_new_tokens=64, mesh="data:1,fsdp:4,tensor:2"
    )
    with pytest.raises(FlagError, match=message):
        base.replace(**overrides).validate(num_devices=8, num_hosts=1)
    base.replace(micro_batch_tokens=768).validate(num_devices=8, num_hosts=1)
    with pytest.raises(FlagError, match="run on one host .this run has 2."):
        base.replace(micro_batch_tokens=768).validate(num_devices=8, num_hosts=2)
