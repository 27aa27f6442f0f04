"""The jitted update: micro-batch accumulation equals the full mini-batch, for every mode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import (
    Sequences,
    completion_logprobs,
    completion_logprobs_jit,
    logits_chunk_size,
)
from jaxrl4llm.train.update.state import OptimizerConfig, TrainState
from jaxrl4llm.train.update.step import accumulate_gradients, train_step

from tests.train.float_checks import LINEAR_OPT, assert_trees_close, param_step

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
B, P, T = 8, 6, 5


def _batch(seed=0, with_old=True, with_ref=True):
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(2, P + 1, size=B)
    comp_len = rng.integers(1, T + 1, size=B)
    prompt_mask = np.arange(P)[None, :] >= (P - prompt_len)[:, None]
    comp_mask = np.arange(T)[None, :] < comp_len[:, None]
    seqs = Sequences(
        prompt_tokens_BP=jnp.asarray(
            np.where(prompt_mask, rng.integers(2, 48, (B, P)), 0), jnp.int32
        ),
        prompt_mask_BP=jnp.asarray(prompt_mask),
        completion_tokens_BT=jnp.asarray(
            np.where(comp_mask, rng.integers(2, 48, (B, T)), 0), jnp.int32
        ),
        completion_mask_BT=jnp.asarray(comp_mask),
    )
    keep = np.ones(B, bool)
    keep[3] = False  # a rejected row
    noise = lambda: jnp.asarray(rng.normal(0, 0.05, (B, T)), jnp.float32)  # noqa: E731
    return (
        seqs,
        UpdateBatch(
            seqs=seqs,
            advantages=jnp.asarray(rng.normal(size=B), jnp.float32),
            keep_B=jnp.asarray(keep),
            old_logp_BT=None,
            ref_logp_BT=None,
        ),
        noise,
    )


@pytest.fixture(scope="module")
def params():
    return transformer.init_params(CONFIG, jax.random.key(0))


def test_completion_logprobs_match_a_full_forward(params):
    seqs, _, _ = _batch()
    logp, entropy = completion_logprobs(params, CONFIG, seqs, temperature=0.7, chunk_size=2)
    tokens = jnp.concatenate([seqs.prompt_tokens_BP, seqs.completion_tokens_BT], 1)
    mask = jnp.concatenate([seqs.prompt_mask_BP, seqs.completion_mask_BT], 1)
    positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
    logits, _ = transformer.forward(params, CONFIG, tokens, positions, mask)
    logp_all = jax.nn.log_softmax(logits[:, P - 1 : -1] / 0.7)
    expected = jnp.take_along_axis(logp_all, seqs.completion_tokens_BT[..., None], -1)[..., 0]
    expected_entropy = -(jnp.exp(logp_all) * logp_all).sum(-1)
    m = np.asarray(seqs.completion_mask_BT)
    np.testing.assert_allclose(np.asarray(logp)[m], np.asarray(expected)[m], atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy)[m], np.asarray(expected_entropy)[m], atol=1e-5)


def _grouped(batch: UpdateBatch, group: int) -> UpdateBatch:
    """Rows [i*group, (i+1)*group) take row i*group's prompt, as the sampler lays them out."""
    lead = np.arange(B) // group * group
    seqs = batch.seqs.replace(
        prompt_tokens_BP=batch.seqs.prompt_tokens_BP[lead],
        prompt_mask_BP=batch.seqs.prompt_mask_BP[lead],
    )
    return batch.replace(seqs=seqs)


def test_shared_prompt_logprobs_and_update_equal_the_per_row_ones(params):
    _, batch, noise = _batch(seed=5)
    batch = _grouped(batch, 4)
    per_row = completion_logprobs(params, CONFIG, batch.seqs, 0.8, chunk_size=2)
    shared = completion_logprobs(params, CONFIG, batch.seqs, 0.8, chunk_size=2, prompt_group=4)
    m = np.asarray(batch.seqs.completion_mask_BT)
    for a, b in zip(per_row, shared):  # logprobs, entropies
        np.testing.assert_allclose(np.asarray(b)[m], np.asarray(a)[m], atol=1e-5)
    batch = batch.replace(ref_logp_BT=per_row[0] + noise())
    algo = rl.get_preset("grpo")  # k3 KL in the loss: the reference enters too
    # LINEAR_OPT: a step proportional to the gradient, so the updates compare the gradients
    # and not the sign of a near-zero gradient's rounding (see float_checks).
    steps = []
    for group, num_micro in ((1, 1), (4, 1), (4, 2)):
        state = TrainState.create(jax.tree.map(jnp.copy, params), LINEAR_OPT, seed=0)
        state, metrics = train_step(
            state,
            batch,
            model_config=CONFIG,
            algorithm=algo,
            optimizer=LINEAR_OPT,
            num_micro=num_micro,
            temperature=0.8,
            remat=True,
            prompt_group=group,
        )
        steps.append((param_step(params, state.params), metrics))
    for step, metrics in steps[1:]:
        np.testing.assert_allclose(
            metrics["policy/loss"].value, steps[0][1]["policy/loss"].value, rtol=1e-5, atol=1e-7
        )
        # Rounding is ~1e-7 of the largest step; a prompt shared with the wrong rows or a
        # micro-batch left out changes the step by a sizeable fraction of it.
        assert_trees_close(step, steps[0][0], rel=1e-4)
    assert float(steps[0][1]["optim/grad_norm"].value) > 0
    grads = [
        accumulate_gradients(
            params,
            batch,
            model_config=CONFIG,
            algorithm=algo,
            num_micro=1,
            temperature=0.8,
            prompt_group=g,
        )[1]
        for g in (1, 4)
    ]
    assert_trees_close(grads[1], grads[0], rel=1e-5)
    with pytest.raises(ValueError, match="whole prompt groups of 4"):
        accumulate_gradients(
            params,
            batch,
            model_config=CONFIG,
            algorithm=algo,
            num_micro=4,
            temperature=1.0,
            prompt_group=4,
        )


def test_shared_prompt_group_needs_whole_groups_per_slice_and_device():
    layout = RowLayout(4)
    assert layout.prompt_group(32) == 4
    assert layout.prompt_group(32, slices=2) == 4
    assert layout.prompt_group(32, slices=16) == 1  # 2 rows per micro-batch
    assert RowLayout(3).prompt_group(8) == 1  # a bucketed batch of 8 rows, groups of 3
    assert RowLayout(4, share_prompts=False).prompt_group(32) == 1  # --noshare_prompts
    assert layout.shuffled().prompt_group(32) == 1  # rows reshuffled into mini-batches
    assert layout.prompt_group(64, slices=2, data_parallel=8) == 4  # 1 group per device
    assert layout.prompt_group(64, slices=4, data_parallel=8) == 1  # 2 rows per device
    assert layout.repeat(["a", "b"]) == ["a"] * 4 + ["b"] * 4


def test_logits_chunk_size_fits_the_budget():
    assert logits_chunk_size(32, 128, 49152) == 8  # 32 x 8 x 49152 x 4 B = 48 MiB
    assert logits_chunk_size(1, 128, 49152) == 128  # never past the completion length
    assert logits_chunk_size(4096, 128, 200_000) == 1  # at least one position


@pytest.mark.parametrize("agg", rl.AGG_MODES)
def test_micro_batches_equal_the_full_mini_batch(params, agg):
    _, batch, noise = _batch(seed=1)
    batch = batch.replace(old_logp_BT=None, ref_logp_BT=None)
    algo = dataclasses.replace(rl.get_preset("grpo"), agg=agg, kl_in=None, kl_coef=0.0)
    full = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algo, num_micro=1, temperature=1.0
    )
    split = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algo, num_micro=4, temperature=1.0
    )
    np.testing.assert_allclose(split[0], full[0], rtol=1e-5, atol=1e-7)
    # Measured: micro-batching moves the gradients by <= 3e-7 of their largest magnitude; a
    # wrong loss normalization or a dropped micro-batch moves them by a sizeable fraction.
    assert_trees_close(split[1], full[1], rel=1e-5)
    assert float(optax.global_norm(full[1])) > 0
    full_m, split_m = rl.finalize_metrics(full[2]), rl.finalize_metrics(split[2])
    assert set(split_m) == set(full_m) and "policy/entropy" in full_m
    for key in full_m:
        np.testing.assert_allclose(split_m[key], full_m[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_micro_batches_equal_with_old_and_ref_logprobs(params):
    _, batch, noise = _batch(seed=2)
    seqs = batch.seqs
    logp, _ = completion_logprobs(params, CONFIG, seqs, 1.0)
    batch = batch.replace(old_logp_BT=logp + noise(), ref_logp_BT=logp + noise())
    algo = rl.get_preset("grpo", clip_low=0.01, clip_high=0.01)  # some tokens clip
    full = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algo, num_micro=1, temperature=1.0
    )
    split = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algo, num_micro=2, temperature=1.0
    )
    assert float(rl.finalize_metrics(full[2])["policy/clip_frac"]) > 0
    assert_trees_close(split[1], full[1], rel=1e-5)


def test_rejected_rows_do_not_move_the_gradient(params):
    _, batch, _ = _batch(seed=3)
    algo = rl.get_preset("lite_ppo")
    base = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algo, num_micro=1, temperature=1.0
    )[1]
    # Change only the rejected row's tokens and advantage: the gradient must not change.
    seqs = batch.seqs.replace(completion_tokens_BT=batch.seqs.completion_tokens_BT.at[3].set(7))
    changed = batch.replace(seqs=seqs, advantages=batch.advantages.at[3].set(100.0))
    other = accumulate_gradients(
        params, changed, model_config=CONFIG, algorithm=algo, num_micro=1, temperature=1.0
    )[1]
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def test_train_step_moves_params_towards_higher_advantage_tokens(params):
    _, batch, _ = _batch(seed=4)
    batch = batch.replace(advantages=jnp.ones(B), keep_B=jnp.ones(B, bool))
    opt = OptimizerConfig(learning_rate=0.05, max_grad_norm=0.0)
    algo = rl.get_preset("reinforce", binary_reward=None)
    before, _ = completion_logprobs(params, CONFIG, batch.seqs, 1.0)
    state = TrainState.create(jax.tree.map(jnp.copy, params), opt, seed=0)
    state, metrics = train_step(
        state,
        batch,
        model_config=CONFIG,
        algorithm=algo,
        optimizer=opt,
        num_micro=2,
        temperature=1.0,
    )
    after, _ = completion_logprobs(state.params, CONFIG, batch.seqs, 1.0)
    m = batch.seqs.completion_mask_BT
    # A = +1 everywhere: gradient ascent on the sampled tokens' logprobs.
    assert float(jnp.sum(after * m)) > float(jnp.sum(before * m))
    assert float(metrics["optim/grad_norm"].value) > 0


def test_chunked_teacher_forced_pass_equals_one_pass(params):
    """Reference / old-logprob passes in strided row chunks (whole prompt groups) equal one
    pass over all rows."""
    _, batch, _ = _batch(seed=6)
    seqs = _grouped(batch, 2).seqs
    one = completion_logprobs_jit(params, CONFIG, seqs, 0.9)
    for chunks, group in ((2, 1), (4, 1), (2, 2), (4, 2)):
        out = completion_logprobs_jit(
            params, CONFIG, seqs, 0.9, num_chunks=chunks, prompt_group=group
        )
        np.testing.assert_allclose(out, one, atol=1e-5)
    assert float(jnp.abs(one).sum()) > 0
    with pytest.raises(ValueError, match="whole groups of 2"):
        completion_logprobs_jit(params, CONFIG, seqs, 0.9, num_chunks=8, prompt_group=2)
