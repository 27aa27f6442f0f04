"""The update runs on the batch's longest completion (bucketed), not max_new_tokens: the
buckets, and the loss / gradients / teacher-forced logprobs of a trimmed batch equal those of
the same batch padded to max_new_tokens (computed without any trimming code)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling.buckets import bucket_completion_length
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences, completion_logprobs_jit
from jaxrl4llm.train.update.step import accumulate_gradients

CONFIG = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    eos_token_ids=(1,),
    pad_token_id=0,
)
B, P, N = 8, 6, 64  # N = max_new_tokens; the longest completion below is 19 tokens


def test_buckets_are_two_per_octave_capped_at_max_new_tokens():
    expected = {
        0: 16,
        1: 16,
        16: 16,
        17: 24,
        24: 24,
        25: 32,
        33: 48,
        49: 64,
        65: 96,
        97: 128,
        129: 192,
        300: 384,
        1000: 1024,
    }
    for length, bucket in expected.items():
        assert bucket_completion_length(length, 4096) == bucket, length
    assert bucket_completion_length(100, 128) == 128
    assert bucket_completion_length(1, 1) == 1 and bucket_completion_length(5, 8) == 8
    with pytest.raises(ValueError, match="max_new_tokens=8"):
        bucket_completion_length(9, 8)


def _sample_output(seed=0, lengths=None) -> SampleOutput:
    """A sampler output padded to N columns whose rows hold 1..19 tokens (or `lengths`)."""
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = rng.integers(1, 20, B)
        lengths[2] = 19
    lengths = np.asarray(lengths)
    mask = np.arange(N)[None, :] < lengths[:, None]
    prompt_mask = np.arange(P)[None, :] >= (P - rng.integers(2, P + 1, B))[:, None]
    tokens = np.where(mask, rng.integers(2, 48, (B, N)), 0)
    return SampleOutput(
        tokens_BT=jnp.asarray(tokens, jnp.int32),
        logprobs_BT=jnp.asarray(np.where(mask, -rng.random((B, N)), 0.0), jnp.float32),
        mask_BT=jnp.asarray(mask),
        lengths_B=jnp.asarray(lengths, jnp.int32),
        truncated_B=jnp.zeros(B, bool),
        prompt_tokens_BP=jnp.asarray(
            np.where(prompt_mask, rng.integers(2, 48, (B, P)), 0), jnp.int32
        ),
        prompt_mask_BP=jnp.asarray(prompt_mask),
        dropped_B=jnp.zeros(B, bool),
        num_steps=jnp.asarray(int(lengths.max()), jnp.int32),
    )


def _update_batch(out: SampleOutput, params, ref_params, advantages) -> UpdateBatch:
    seqs = Sequences(out.prompt_tokens_BP, out.prompt_mask_BP, out.tokens_BT, out.mask_BT)
    ref = completion_logprobs_jit(ref_params, CONFIG, seqs, 1.0)
    old = completion_logprobs_jit(params, CONFIG, seqs, 1.0) + 0.05 * out.logprobs_BT
    return UpdateBatch(
        seqs=seqs,
        advantages=advantages,
        keep_B=jnp.arange(B) != 5,
        old_logp_BT=jnp.where(out.mask_BT, old, 0.0),
        ref_logp_BT=ref,
    )


def _assert_same_update(loss, grads, loss_ref, grads_ref):
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5, atol=1e-7)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-7)


# The two modes whose denominator depends on the columns: per-row counts and the constant.
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_trimmed_update_equals_the_padded_one(agg):
    params = transformer.init_params(CONFIG, jax.random.key(0))
    ref_params = transformer.init_params(CONFIG, jax.random.key(1))
    out = _sample_output()
    advantages = jnp.asarray(np.random.default_rng(1).normal(size=B), jnp.float32)
    algorithm = dataclasses.replace(rl.get_preset("grpo"), agg=agg, kl_coef=0.1)
    config = TrainConfig().replace(algorithm=algorithm, max_new_tokens=N)
    # Reference: the batch as sampled, N columns, the algorithm as configured (for
    # seq-mean-token-sum-norm its constant is then the padded length N).
    padded = _update_batch(out, params, ref_params, advantages)
    loss_ref, grads_ref, _ = accumulate_gradients(
        params,
        padded,
        model_config=CONFIG,
        algorithm=config.algorithm,
        num_micro=2,
        temperature=1.0,
    )
    # What the trainer runs: the rollout trims to the bucket, the loop uses update_algorithm.
    T = bucket_completion_length(int(out.num_steps), N)
    assert T == 24
    trimmed = _update_batch(out.trimmed(T), params, ref_params, advantages)
    assert trimmed.seqs.completion_tokens_BT.shape == (B, T)
    np.testing.assert_allclose(
        np.asarray(trimmed.ref_logp_BT), np.asarray(padded.ref_logp_BT)[:, :T], atol=1e-5
    )
    loss, grads, _ = accumulate_gradients(
        params,
        trimmed,
        model_config=CONFIG,
        algorithm=config.update_algorithm,
        num_micro=2,
        temperature=1.0,
    )
    _assert_same_update(loss, grads, loss_ref, grads_ref)


def test_each_minibatch_runs_on_its_own_longest_completion():
    """Mini-batches of the rollout's rows are cut to the bucket of their own longest row; each
    one's loss and gradients equal those of the same rows padded to max_new_tokens."""
    from jaxrl4llm.train.update import minibatches

    params = transformer.init_params(CONFIG, jax.random.key(0))
    ref_params = transformer.init_params(CONFIG, jax.random.key(1))
    lengths = np.array([3, 5, 19, 2, 4, 6, 7, 1])  # only row 2 needs more than 16 columns
    out = _sample_output(lengths=lengths)
    row_ids = jnp.arange(B, dtype=jnp.float32) / 8 - 0.4  # distinct advantages name the rows
    algorithm = dataclasses.replace(
        rl.get_preset("grpo"), agg="seq-mean-token-sum-norm", kl_coef=0.1
    )
    config = TrainConfig().replace(
        algorithm=algorithm,
        max_new_tokens=N,
        prompts_per_step=2,
        group_size=4,
        mini_batch_size=4,
        ppo_epochs=2,
    )
    padded = _update_batch(out, params, ref_params, row_ids)
    rollout_batch = padded.trimmed(bucket_completion_length(19, N))  # as the rollout cuts it
    seen, columns = [], []
    for mb, classes, (real, computed), _ in minibatches.minibatches(
        rollout_batch, config, jax.random.key(3), None
    ):
        rows = np.rint((np.asarray(mb.advantages) + 0.4) * 8).astype(int)
        seen += rows.tolist()
        T = mb.seqs.completion_tokens_BT.shape[1]
        assert T == (24 if 2 in rows else 16) and real == lengths[rows].sum()
        assert classes == () and computed == 4 * T
        columns.append(T)
        for x in (mb.old_logp_BT, mb.ref_logp_BT, mb.seqs.completion_mask_BT):
            assert x.shape == (4, T)
        # The same rows at N columns, the algorithm as configured (constant = N).
        reference = jax.tree.map(lambda x: x[rows], padded)
        loss_ref, grads_ref, _ = accumulate_gradients(
            params,
            reference,
            model_config=CONFIG,
            algorithm=config.algorithm,
            num_micro=1,
            temperature=1.0,
        )
        loss, grads, _ = accumulate_gradients(
            params,
            mb,
            model_config=CONFIG,
            algorithm=config.update_algorithm,
            num_micro=1,
            temperature=1.0,
        )
        _assert_same_update(loss, grads, loss_ref, grads_ref)
    assert sorted(seen) == sorted(list(range(B)) * 2)  # every row once per epoch
    assert sorted(columns) == [16, 16, 24, 24]


def test_update_batch_trimmed_cuts_every_per_token_array():
    out = _sample_output()
    per_token = jnp.asarray(np.random.default_rng(2).normal(size=(B, N)), jnp.float32)
    batch = UpdateBatch(
        seqs=Sequences(out.prompt_tokens_BP, out.prompt_mask_BP, out.tokens_BT, out.mask_BT),
        advantages=per_token,
        keep_B=jnp.ones(B, bool),
        old_logp_BT=per_token + 1,
        ref_logp_BT=None,
        old_values_BT=per_token + 2,
        returns_BT=per_token + 3,
    )
    cut = batch.trimmed(24)
    assert cut.seqs.prompt_tokens_BP.shape == (B, P) and cut.keep_B.shape == (B,)
    assert cut.ref_logp_BT is None
    for name, offset in (
        ("advantages", 0),
        ("old_logp_BT", 1),
        ("old_values_BT", 2),
        ("returns_BT", 3),
    ):
        np.testing.assert_array_equal(
            np.asarray(getattr(cut, name)), np.asarray(per_token)[:, :24] + offset, err_msg=name
        )
    np.testing.assert_array_equal(
        np.asarray(cut.seqs.completion_tokens_BT), np.asarray(out.tokens_BT)[:, :24]
    )
    assert batch.trimmed(N) is batch and batch.trimmed(N + 8) is batch
