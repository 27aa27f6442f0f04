"""A sliding window over packed rows counts positions, not slots.

With shared prompts a group's completions follow one another after one copy of the prompt,
so the second completion is further from the prompt in slots than in positions; the window
must count positions (models/masks.py). Checked here: packed logprobs against transformers'
own Mistral, and, over random packed layouts, packed logprobs, values and gradients against
the unpacked path (left-padded rows, where slots and positions agree; that path is checked
against transformers in tests/models/test_weights.py) for every implementation that runs
packed rows, on 1 and 2 devices.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel, rl
from jaxrl4llm.models import transformer, weights
from jaxrl4llm.models.attention import AttentionConfig
from jaxrl4llm.train.update import critic, packing
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences, completion_logprobs_jit
from jaxrl4llm.train.update.step import accumulate_gradients, accumulate_packed

from tests.train import test_packing

# test_packing's toy decoder, as a Mistral (the family with a sliding window).
CONFIG = dataclasses.replace(test_packing.CONFIG, model_type="mistral")
# Every implementation that runs packed rows with prefix segments on CPU: the reference, the
# chunked kernel (block skipping with blocks of 4 and of 3; every block pair) and XLA's
# dot_product_attention (cuDNN's call on GPU). Splash takes no prefix segments (refused, see
# test_packing.py); on packed rows without them it counts slots, which are positions there
# (tests/models/test_packed_attention.py runs it with a window in the Pallas interpreter).
IMPLS = {
    "reference": AttentionConfig("reference"),
    "chunked": AttentionConfig("chunked", packed_block=4),
    "chunked3": AttentionConfig("chunked", packed_block=3),
    "chunked_all_pairs": AttentionConfig("chunked", packed_block=4, skip_blocks=False),
    "xla": AttentionConfig("xla"),
}


def _sequences(rng, groups: int, group_size: int, max_prompt: int = 7, max_comp: int = 12):
    """`groups` prompts of 2..max_prompt tokens, each with `group_size` completions of
    unequal lengths 1..max_comp (left-padded prompts, right-padded completions)."""
    M = groups * group_size
    prompt_len = np.repeat(rng.integers(2, max_prompt + 1, groups), group_size)
    comp_len = rng.integers(1, max_comp + 1, M)
    prompt_mask = np.arange(max_prompt)[None] >= (max_prompt - prompt_len)[:, None]
    prompts = np.repeat(rng.integers(2, CONFIG.vocab_size, (groups, max_prompt)), group_size, 0)
    comp_mask = np.arange(max_comp)[None] < comp_len[:, None]
    return Sequences(
        prompt_tokens_BP=jnp.asarray(np.where(prompt_mask, prompts, 0), jnp.int32),
        prompt_mask_BP=jnp.asarray(prompt_mask),
        completion_tokens_BT=jnp.asarray(
            np.where(comp_mask, rng.integers(2, CONFIG.vocab_size, (M, max_comp)), 0), jnp.int32
        ),
        completion_mask_BT=jnp.asarray(comp_mask),
    )


def _packed_logprobs(params, config, packed, mask_MT, attention, sharding=None):
    """[M, T] completion logprobs read back from each packed micro-batch (a Python loop over
    them, so that jax.grad runs through)."""
    out = jnp.zeros(mask_MT.shape, jnp.float32)
    for k in range(int(packed.num_micro)):
        logp_RL, _ = packing.packed_logprobs(
            params, config, packed, k, 1.0, sharding=sharding, attention=attention
        )
        mine = (packed.micro_M == k)[:, None]
        out = jnp.where(mine, packing.unpack(logp_RL, packed.start_M, mask_MT.shape[1]), out)
    return jnp.where(mask_MT, out, 0.0)


# (seed, window, share_prompts, group size, groups, budget, devices): windows shorter than
# every row (2, 5) and longer than any (64); a budget that splits groups over rows (24) or
# packs several units in a row (48, 96).
LAYOUTS = [
    (0, 5, True, 3, 2, 48, 1),
    (1, 2, True, 4, 2, 24, 1),
    (2, 5, False, 2, 3, 48, 1),
    (3, 64, True, 3, 2, 96, 1),
    (4, 5, True, 2, 3, 96, 2),
    (5, 3, False, 4, 1, 48, 2),
]


@pytest.mark.parametrize("seed,window,share,group,groups,budget,devices", LAYOUTS)
def test_packed_logprobs_values_and_gradients_equal_the_unpacked_path(
    seed, window, share, group, groups, budget, devices
):
    rng = np.random.default_rng(seed)
    config = dataclasses.replace(CONFIG, sliding_window=window)
    seqs = _sequences(rng, groups, group)
    mask = seqs.completion_mask_BT
    params = transformer.init_params(config, jax.random.key(seed))
    weights_MT = jnp.asarray(rng.normal(size=mask.shape), jnp.float32)
    flops = packing.SlotFlops.of(config)
    mesh = None
    if devices > 1:
        mesh = parallel.make_mesh(f"data:{devices},fsdp:1,tensor:1", jax.devices()[:devices])
    sharding = None if mesh is None else parallel.ActivationSharding(mesh)
    packed = packing.pack_on_mesh(seqs, budget * devices, mesh, flops=flops, share_prompts=share)
    if share:  # some row holds a group's prompt once and several completions after it
        assert (np.asarray(packed.prefixes_KRL) != np.asarray(packed.segments_KRL)).any()

    def padded_loss(p):
        logp = completion_logprobs_jit(p, config, seqs, 1.0)
        return jnp.sum(weights_MT * logp), logp

    (_, expected), grads_ref = jax.value_and_grad(padded_loss, has_aux=True)(params)
    if mesh is not None:
        params = parallel.shard_pytree(params, transformer.param_logical_axes(config), mesh)
    for name, attention in IMPLS.items():

        def packed_loss(p, attention=attention):
            logp = _packed_logprobs(p, config, packed, mask, attention, sharding)
            return jnp.sum(weights_MT * logp), logp

        (_, got), grads = jax.jit(jax.value_and_grad(packed_loss, has_aux=True))(params)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, err_msg=name)
        for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
            scale = max(float(jnp.abs(g_ref).max()), 1e-6)
            assert float(jnp.abs(g - g_ref).max()) <= 2e-5 * scale, name
    # The critic's packed values run the same packed rows (the trainer's default attention).
    critic_params = critic.from_policy(transformer.init_params(config, jax.random.key(seed)))
    head = jax.random.normal(jax.random.key(7), critic_params[critic.HEAD].shape)
    critic_params[critic.HEAD] = head
    values = critic.values_jit(critic_params, config, seqs)
    if mesh is not None:
        critic_params = parallel.shard_pytree(critic_params, critic.logical_axes(config), mesh)
    packed_values = critic.packed_values_jit(critic_params, config, packed, mask, sharding)
    np.testing.assert_allclose(np.asarray(packed_values), np.asarray(values), atol=2e-5)


def test_packed_update_under_a_short_window_equals_the_padded_update():
    """The trainer's packed update (accumulate_packed: shared prompts, a window of 4 shorter
    than every sequence but the shortest) gives the padded update's loss and gradients."""
    rng = np.random.default_rng(11)
    config = dataclasses.replace(CONFIG, sliding_window=4)
    seqs = _sequences(rng, 2, 4)
    M = seqs.completion_mask_BT.shape[0]
    params = transformer.init_params(config, jax.random.key(3))
    old = completion_logprobs_jit(params, config, seqs, 1.0)
    batch = UpdateBatch(
        seqs=seqs,
        advantages=jnp.asarray(rng.normal(size=M), jnp.float32),
        keep_B=jnp.ones(M, bool),
        old_logp_BT=jnp.where(seqs.completion_mask_BT, old - 0.03, 0.0),
        ref_logp_BT=jnp.where(seqs.completion_mask_BT, old + 0.02, 0.0),
    )
    algorithm = dataclasses.replace(rl.get_preset("grpo"), agg="token-mean", kl_coef=0.1)
    common = dict(model_config=config, algorithm=algorithm, temperature=1.0)
    loss_ref, grads_ref, _ = accumulate_gradients(params, batch, num_micro=1, **common)
    packed = packing.pack(seqs, 40, flops=packing.SlotFlops.of(config))
    assert (np.asarray(packed.prefixes_KRL) != np.asarray(packed.segments_KRL)).any()
    loss, grads, _ = jax.jit(lambda p, b, k: accumulate_packed(p, b, k, **common))(
        params, batch, packed
    )
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-6)


# --------------------------------------------------------------- against transformers


def _mistral(tmp_path, window: int):
    """A 2-layer random Mistral written by transformers itself, loaded by our loader."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    hf_config = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=window,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # larger weights than the init, so a wrong mask shows
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p) if p.ndim == 1 else 2.0 * p)
    path = str(tmp_path / f"mistral_w{window}")
    model.save_pretrained(path)
    config, params = weights.load_hf(path)
    assert config.sliding_window == window
    return torch, model, config, params


@pytest.mark.parametrize("window", [8, 64])
def test_packed_logprobs_equal_transformers_mistral(tmp_path, window):
    """The issue's case: one 6-token prompt with three 12-token completions, window 8 (and
    64, longer than the rows). transformers scores each prompt + completion as its own row;
    the trainer's packed pass (shared prompt or not; the reference and the chunked kernel)
    gives the same completion logprobs."""
    torch, model, config, params = _mistral(tmp_path, window)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 96, 6)
    completions = rng.integers(3, 96, (3, 12))
    expected = np.zeros((3, 12), np.float32)
    for m in range(3):
        ids = torch.tensor(np.concatenate([prompt, completions[m]])[None])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.double(), -1)[0].numpy()
        expected[m] = logp[np.arange(5, 17), completions[m]]
    seqs = Sequences(
        prompt_tokens_BP=jnp.asarray(np.repeat(prompt[None], 3, 0), jnp.int32),
        prompt_mask_BP=jnp.ones((3, 6), bool),
        completion_tokens_BT=jnp.asarray(completions, jnp.int32),
        completion_mask_BT=jnp.ones((3, 12), bool),
    )
    flops = packing.SlotFlops.of(config)
    for share in (True, False):
        packed = packing.pack(seqs, 64, flops=flops, share_prompts=share)
        assert int(packed.num_micro) == 1
        got = packing.logprobs_jit(params, config, packed, seqs.completion_mask_BT, 1.0)
        err = np.abs(np.asarray(got) - expected).max(axis=1)
        assert err.max() <= 2e-5, (share, err)
        chunked = _packed_logprobs(
            params, config, packed, seqs.completion_mask_BT, IMPLS["chunked"]
        )
        assert np.abs(np.asarray(chunked) - expected).max() <= 2e-5, share
