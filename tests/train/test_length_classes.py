"""--micro_batch_length_classes: a mini-batch's rows sorted by length into its micro-batches,
each micro-batch run at the shortest length class that holds it. The gradient must be the
full mini-batch's (computed here in one piece at max_new_tokens columns, without any sorting,
splitting or cutting), and the columns computed must be those worked out by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel, rl
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.rl.metrics import Metric
from jaxrl4llm.sampling.buckets import bucket_completion_length
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.update import minibatches
from jaxrl4llm.train.update.batch import UpdateBatch, length_classes, micro_batch_order
from jaxrl4llm.train.update.logprobs import Sequences, completion_logprobs_jit
from jaxrl4llm.train.update.step import accumulate, accumulate_gradients

CONFIG = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=160,
    eos_token_ids=(1,),
    pad_token_id=0,
)
P, N = 6, 96
LENGTHS = np.array([40, 5, 3, 60, 2, 9, 33, 1])  # longest 60: the rollout cuts to 64
B = LENGTHS.size


def test_length_classes_halve_down_to_16():
    assert length_classes(64, 3) == (16, 32, 64)
    assert length_classes(64, 1) == ()
    assert length_classes(256, 4) == (32, 64, 128, 256)
    assert length_classes(24, 4) == (16, 24)  # ceil(24 / 2) = 12 is raised to 16
    assert length_classes(16, 4) == ()  # one class: no branches
    assert length_classes(8, 3) == ()  # below 16 only the length itself


def test_micro_batch_order_puts_sorted_rows_in_the_strided_micro_batches():
    lengths = np.array([4, 9, 1, 7, 30, 2, 8, 8, 5, 6, 3, 20])
    perm = micro_batch_order(lengths, num_micro=3)
    assert sorted(perm.tolist()) == list(range(12))
    micro = np.asarray(parallel.split_strided(jnp.asarray(lengths[perm]), 3))
    # Longest first, four rows per micro-batch: 30 20 9 8 | 8 7 6 5 | 4 3 2 1.
    assert [sorted(m.tolist(), reverse=True) for m in micro] == [
        [30, 20, 9, 8],
        [8, 7, 6, 5],
        [4, 3, 2, 1],
    ]
    with pytest.raises(ValueError, match="do not split into 3 micro-batches"):
        micro_batch_order(lengths[:10], num_micro=3)


def _batch(params, ref_params) -> UpdateBatch:
    rng = np.random.default_rng(0)
    mask = np.arange(N)[None, :] < LENGTHS[:, None]
    prompt_mask = np.arange(P)[None, :] >= (P - rng.integers(2, P + 1, B))[:, None]
    seqs = Sequences(
        prompt_tokens_BP=jnp.asarray(
            np.where(prompt_mask, rng.integers(2, 48, (B, P)), 0), jnp.int32
        ),
        prompt_mask_BP=jnp.asarray(prompt_mask),
        completion_tokens_BT=jnp.asarray(np.where(mask, rng.integers(2, 48, (B, N)), 0), jnp.int32),
        completion_mask_BT=jnp.asarray(mask),
    )
    ref = completion_logprobs_jit(ref_params, CONFIG, seqs, 1.0)
    old = jnp.where(
        seqs.completion_mask_BT, completion_logprobs_jit(params, CONFIG, seqs, 1.0) - 0.03, 0.0
    )
    return UpdateBatch(
        seqs=seqs,
        advantages=jnp.asarray(rng.normal(size=B), jnp.float32),
        keep_B=jnp.arange(B) != 4,
        old_logp_BT=old,
        ref_logp_BT=ref,
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_sorted_micro_batches_at_their_length_classes_give_the_full_gradient(agg):
    params = transformer.init_params(CONFIG, jax.random.key(0))
    ref_params = transformer.init_params(CONFIG, jax.random.key(1))
    algorithm = dataclasses.replace(rl.get_preset("grpo"), agg=agg, kl_coef=0.1)
    config = TrainConfig().replace(
        algorithm=algorithm,
        max_new_tokens=N,
        prompts_per_step=2,
        group_size=4,
        micro_batch_size=2,
        micro_batch_length_classes=3,
    )
    padded = _batch(params, ref_params)
    # Reference: the whole mini-batch in one piece, N columns, the configured algorithm.
    loss_ref, grads_ref, _ = accumulate_gradients(
        params,
        padded,
        model_config=CONFIG,
        algorithm=config.algorithm,
        num_micro=1,
        temperature=1.0,
    )
    rollout_batch = padded.trimmed(bucket_completion_length(60, N))  # as the rollout cuts it
    ((mb, classes, (real, computed), _),) = minibatches.minibatches(
        rollout_batch, config, jax.random.key(0), None
    )
    assert classes == (16, 32, 64) and real == LENGTHS.sum()
    # Sorted 60, 40 | 33, 9 | 5, 3 | 2, 1 in 4 micro-batches of 2: run at 64, 64, 16, 16.
    assert computed == 2 * (64 + 64 + 16 + 16)
    loss, grads, _ = accumulate_gradients(
        params,
        mb,
        model_config=CONFIG,
        algorithm=config.update_algorithm,
        num_micro=4,
        temperature=1.0,
        length_classes=classes,
    )
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5, atol=1e-7)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-7)


def test_each_micro_batch_runs_at_its_class_on_device():
    """The device picks the class the host counted: a gradient function that reports the
    columns it was given sums to 2 x (64 + 64 + 16 + 16)."""
    params = {"w": jnp.zeros(())}
    config = TrainConfig().replace(
        max_new_tokens=N,
        prompts_per_step=2,
        group_size=4,
        micro_batch_size=2,
        micro_batch_length_classes=3,
    )
    batch = _batch(
        transformer.init_params(CONFIG, jax.random.key(0)),
        transformer.init_params(CONFIG, jax.random.key(1)),
    ).trimmed(64)
    ((mb, classes, (_, computed), _),) = minibatches.minibatches(
        batch, config, jax.random.key(0), None
    )

    def grad_fn(params, micro, denominator):
        rows, columns = micro.seqs.completion_mask_BT.shape
        return (jnp.float32(0.0), {"columns": Metric.sum(jnp.float32(rows * columns))}), params

    _, _, metrics = jax.jit(
        lambda p, b: accumulate(
            p,
            b,
            grad_fn,
            jnp.float32(1.0),
            num_micro=4,
            prompt_group=1,
            param_axes={"w": ()},
            sharding=None,
            length_classes=classes,
        )
    )(params, mb)
    assert float(metrics["columns"].value) == computed == 320
