"""--compute_dtype=bfloat16 over float32 params: bfloat16 matmuls, float32 master weights,
gradients and optimizer state, and a run that learns like float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm import rl
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences, completion_logprobs
from jaxrl4llm.train.update.state import OptimizerConfig, TrainState
from jaxrl4llm.train.update.step import train_step

from tests.train.float_checks import LINEAR_OPT

F32 = ModelConfig(
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
    attention_bias=True,
)
BF16 = dataclasses.replace(F32, compute_dtype="bfloat16")


def _batch(seed=0, B=8, P=6, T=5):
    rng = np.random.default_rng(seed)
    prompt_mask = np.arange(P)[None, :] >= (P - rng.integers(2, P + 1, B))[:, None]
    comp_mask = np.arange(T)[None, :] < rng.integers(1, T + 1, B)[:, None]
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
    return UpdateBatch(
        seqs=seqs,
        advantages=jnp.asarray(rng.normal(size=B), jnp.float32),
        keep_B=jnp.ones(B, bool),
        old_logp_BT=None,
        ref_logp_BT=None,
    )


def test_cast_for_compute_casts_matrices_only():
    params = transformer.init_params(F32, jax.random.key(0))
    cast = transformer.cast_for_compute(params, BF16)
    assert cast["embed"].dtype == jnp.bfloat16
    assert (
        cast["layers"]["q"].dtype == jnp.bfloat16 and cast["layers"]["down"].dtype == jnp.bfloat16
    )
    # Norm scales and biases keep float32 (the norms compute in float32 anyway).
    assert cast["layers"]["attn_norm"].dtype == jnp.float32
    assert cast["layers"]["q_bias"].dtype == jnp.float32
    assert cast["final_norm"].dtype == jnp.float32
    assert transformer.cast_for_compute(params, F32) is params  # None: unchanged


def test_bf16_compute_logprobs_are_bf16_rounded_f32_ones():
    """The bf16-compute logprobs equal a float32 pass over weights rounded to bfloat16 (to
    activation rounding), and differ from the float32 pass by about bf16's resolution."""
    params = transformer.init_params(F32, jax.random.key(1))
    batch = _batch()
    m = np.asarray(batch.seqs.completion_mask_BT)
    lp16, _ = completion_logprobs(params, BF16, batch.seqs)
    lp32, _ = completion_logprobs(params, F32, batch.seqs)
    rounded = jax.tree.map(
        lambda w: w.astype(jnp.bfloat16).astype(jnp.float32) if w.ndim >= 2 else w, params
    )
    lp_rounded, _ = completion_logprobs(rounded, F32, batch.seqs)
    assert lp16.dtype == jnp.float32
    err16 = np.abs(np.asarray(lp16) - np.asarray(lp32))[m].max()
    assert 0 < err16 < 0.05, err16  # bf16 has ~3 significant digits
    np.testing.assert_allclose(np.asarray(lp16)[m], np.asarray(lp_rounded)[m], atol=0.02)


def test_bf16_compute_update_keeps_float32_state_and_the_f32_gradient_direction():
    params = transformer.init_params(F32, jax.random.key(2))
    batch = _batch(seed=3)
    opt = LINEAR_OPT  # a step proportional to the gradient (see float_checks)
    static = dict(
        algorithm=dataclasses.replace(rl.get_preset("grpo"), kl_coef=0.0),
        optimizer=opt,
        num_micro=1,
        temperature=1.0,
    )
    new = {}
    for name, cfg in (("f32", F32), ("bf16", BF16)):
        state = TrainState.create(jax.tree.map(jnp.copy, params), opt, seed=0)
        new[name], _ = train_step(state, batch, model_config=cfg, **static)
    for leaf in jax.tree.leaves((new["bf16"].params, new["bf16"].opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    # The updates are the clipped gradients: measured cosine 0.99999 (bf16 rounding of the
    # activations); a bf16 gradient path that lost a term or a scale falls far below 0.999.
    # (Adam's default step, ~lr * sign(g), would compare signs instead: cosine 0.996.)
    d32 = jax.tree.leaves(jax.tree.map(lambda a, b: a - b, new["f32"].params, params))
    d16 = jax.tree.leaves(jax.tree.map(lambda a, b: a - b, new["bf16"].params, params))
    u32, u16 = (
        np.concatenate([np.ravel(x) for x in d32]),
        np.concatenate([np.ravel(x) for x in d16]),
    )
    cosine = u32 @ u16 / np.linalg.norm(u32) / np.linalg.norm(u16)
    assert cosine > 0.999, cosine


def test_bf16_compute_run_learns_the_copy_task(toy_model_dir, copy_task_file, tmp_path):
    """The GRPO learning test of test_loop.py (float32: 0.02 -> 0.88 over 40 steps), with
    bfloat16 compute over float32 params: the same bar, and the state stays float32."""
    config = TrainConfig().replace(
        model=toy_model_dir,
        data=copy_task_file,
        instruction="",
        prompts_per_step=8,
        group_size=4,
        max_prompt_tokens=16,
        max_new_tokens=1,
        algorithm=rl.get_preset("grpo"),
        optimizer=OptimizerConfig(learning_rate=1e-2),
        num_steps=40,
        mesh="data:1,fsdp:1,tensor:1",
        eval_prompts=0,
        checkpoint_every=1000,
        workdir=str(tmp_path),
        answer_mode="lenient",
        trackers="",
        compute_dtype="bfloat16",
    )
    summary = loop.run(config, devices=jax.devices()[:1])
    accuracy = np.array([r["reward/accuracy"] for r in read_metrics(str(tmp_path))])
    start, end = accuracy[:5].mean(), accuracy[-8:].mean()
    assert start < 0.1 and end > start + 0.25, f"bf16 compute: {start:.2f} -> {end:.2f}"
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(summary["state"].params))


def test_bf16_params_at_a_small_learning_rate_lose_the_update_and_are_warned_about():
    """A paper flagfile's learning rate (1e-6) on bfloat16 parameters: the real update step
    moves almost no weight (each Adam step ~1e-6 is below half the bf16 spacing of a weight
    of ~0.02, ~6e-5), while float32 master weights move every weight with a gradient; the
    config warns about exactly that combination."""
    params = transformer.init_params(F32, jax.random.key(4))
    opt = OptimizerConfig(learning_rate=1e-6)
    static = dict(
        algorithm=dataclasses.replace(rl.get_preset("grpo"), kl_coef=0.0),
        optimizer=opt,
        num_micro=1,
        temperature=1.0,
    )
    changed = {}
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        start = jax.tree.map(lambda x, d=dtype: np.asarray(x.astype(d)), params)
        state = TrainState.create(jax.tree.map(jnp.asarray, start), opt, seed=0)
        new, _ = train_step(state, _batch(seed=5), model_config=F32, **static)  # donates
        moved = [
            np.asarray(a) != b for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(start))
        ]
        changed[name] = sum(m.sum() for m in moved) / sum(m.size for m in moved)
    # Measured: 0.97 of the weights move in float32, 0.025 in bfloat16.
    assert changed["f32"] > 0.5, changed  # every weight with a gradient moves
    assert changed["bf16"] < 0.1 * changed["f32"], changed
    warned = TrainConfig().replace(param_dtype="bfloat16", learning_rate=1e-6)
    assert len(warned.precision_warnings()) == 1
    assert "--param_dtype=float32 --compute_dtype=bfloat16" in warned.precision_warnings()[0]
    assert not warned.replace(param_dtype="float32").precision_warnings()
    assert not warned.replace(learning_rate=1e-4).precision_warnings()
