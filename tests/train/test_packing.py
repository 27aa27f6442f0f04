"""--micro_batch_tokens: sequences packed into token-budget micro-batches give the padded
update's loss, gradients and metrics (the padded update computed here in one piece by the
row-per-sequence path, which knows nothing of packing)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import parallel, rl
from jaxrl4llm.models import attention, masks, transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.update import packing, packing_plan
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import Sequences, completion_logprobs_jit
from jaxrl4llm.train.update.step import accumulate_gradients, accumulate_packed

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
# Modelled FLOPs that count slots only (no attention term): the plan with the fewest slots.
SLOTS = packing.SlotFlops(layers=1.0, unembed=0.0, pair=0.0)


def test_first_fit_decreasing_by_hand():
    # Longest first: 7 -> bin 0; 5 -> bin 1; 4 -> bin 1 (9); 3 -> bin 0 (10); 2 -> bin 2;
    # 1 -> bin 1 (10).
    assert packing_plan.first_fit_decreasing(np.array([3, 7, 2, 5, 1, 4]), 10) == [
        [1, 0],
        [3, 5, 4],
        [2],
    ]
    with pytest.raises(ValueError, match="does not fit a packed row of 4"):
        packing_plan.first_fit_decreasing(np.array([5]), 4)


def test_row_lengths_and_the_fewest_slots_by_hand():
    # Two per octave from the longest sequence's bucket (at least 16), then the cap itself.
    assert packing_plan.row_lengths(18, 100) == [24, 32, 48, 64, 96, 100]
    assert packing_plan.row_lengths(5, 20) == [16, 20]
    assert packing_plan.row_lengths(18, 18) == [18]
    with pytest.raises(ValueError, match="does not fit the per-device budget of 18"):
        packing_plan.row_lengths(19, 18)


def _plan(lengths, budget, flops, data_parallel=1):
    """(L, R, micro-batches) of the plan for single sequences of `lengths` (no prompt)."""
    lengths = np.asarray(lengths)
    chosen = packing_plan.plan(
        [[m] for m in range(lengths.size)],
        np.zeros_like(lengths),
        lengths,
        budget,
        data_parallel,
        flops,
    )
    return chosen.length, chosen.rows_per_device, chosen.num_micro


def test_plan_counts_slots_and_attention_by_hand():
    # 40 + 30 + 30 + 20 = 120 tokens: rows of 48 -> [40] [30] [30] [20] = 192 slots (R 1 or
    # 2); 64 -> [40 20] [30 30] = 128; 96 -> [40 30 20] [30] = 192; 100 -> 200.
    assert _plan([30, 40, 20, 30], 100, SLOTS) == (64, 1, 2)
    # Two devices, rows of at most 50: 48 -> 4 rows = 2 micro-batches (192 slots); 50 ->
    # [40] [30] [30 20] = 3 rows, 2 micro-batches of 2 rows = 200.
    assert _plan([30, 40, 20, 30], 100, SLOTS, data_parallel=2) == (48, 1, 2)
    # 24 + 4 x 8 = 56 tokens, budget 64. Rows of 24: [24] [8 8 8] [8] (R = 1: 72 slots in
    # 3 micro-batches; R = 2: 96); 32: [24 8] [8 8 8] (R = 2: 64 slots in one micro-batch);
    # 48: 2 rows, 96; 64: one row, 64 slots. Slots alone: 64 in one micro-batch, the
    # shorter row: (32, 2).
    assert _plan([24, 8, 8, 8, 8], 64, SLOTS) == (32, 2, 1)
    # One FLOP per attended pair too: 24 x 1: 72 + 3 x 576 = 1800; 32 x 2: 64 + 2 x 1024 =
    # 2112; 64: 64 + 4096. Rows of 24 win, and nothing is within 5% of them.
    assert _plan([24, 8, 8, 8, 8], 64, packing.SlotFlops(1.0, 0.0, 1.0)) == (24, 1, 3)
    # Eight sequences of 8, budget 64: rows of 16 (2 each), 4 per micro-batch = 64 slots in
    # one micro-batch, as few as one row of 64 and shorter.
    assert _plan([8] * 8, 64, SLOTS) == (16, 4, 1)


def test_units_share_a_prompt_and_split_a_group_that_does_not_fit():
    # Rows 0-2 share a 5-token prompt: the prefix holds 4 tokens, each member its prompt's
    # last token + its completion (5, 3, 7 tokens). Rows of 16 leave 12 for members: FFD
    # [7 5] [3]. Row 3 is alone: one unit of 3 + 3 tokens.
    units = packing_plan.units(
        [[0, 1, 2], [3]], np.array([5, 5, 5, 3]), np.array([4, 2, 6, 3]), length=16
    )
    assert units == [
        packing_plan.Unit(4, (2, 0), 16),
        packing_plan.Unit(4, (1,), 7),
        packing_plan.Unit(0, (3,), 6),
    ]
    # A one-token prompt has nothing to share.
    assert packing_plan.units([[0, 1]], np.array([1, 1]), np.array([3, 4]), 16) == [
        packing_plan.Unit(0, (0,), 4),
        packing_plan.Unit(0, (1,), 5),
    ]


def test_prompt_groups_are_rows_with_equal_real_prompt_tokens():
    tokens = np.array([[0, 5, 6], [7, 5, 6], [0, 5, 6], [0, 0, 6]])
    mask = np.array([[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 0, 1]], bool)
    assert packing_plan.prompt_groups(tokens, mask) == [[0, 1, 2], [3]]


def test_padded_flops_by_hand():
    flops = packing.SlotFlops(layers=2.0, unembed=3.0, pair=1.0)
    # Groups of 2 sharing a 4-column prompt, 3 completion columns, 4 rows: 2 prompts x
    # (4 x 2 + 16) + 4 rows x 3 x (2 + 7) + 12 x 3 unembedded.
    assert flops.padded(4, 4, 3, prompt_group=2) == 2 * 24 + 4 * 3 * 9 + 36
    # Unshared: 4 rows of 4 + 3 - 1 = 6 columns: 4 x (12 + 36) + 36.
    assert flops.padded(4, 4, 3, prompt_group=1) == 4 * 48 + 36
    # Packed: 2 rows of 8 slots: 2 x (8 x 5 + 64).
    assert flops.packed(1, 2, 8) == 2 * 104


def test_packed_flops_count_the_chunked_kernels_blocks_by_hand():
    # Blocks of 4, so rows of >= 8 slots run the chunked kernel (attention.AttentionConfig).
    flops = packing.SlotFlops(1.0, 0.0, 1.0, attention.AttentionConfig(packed_block=4))
    # One group of 3 sharing a 5-token prompt (completions of 3): the prefix (4 slots) and 3
    # members of 4 (the prompt's last token + 3), one block each. Query blocks see: the
    # prefix itself; each member the prefix and itself: 7 of 16 block pairs.
    unit_list = packing_plan.units([[0, 1, 2]], np.full(3, 5), np.full(3, 3), 16)
    seg, pre, pos = packing_plan.row_segments(unit_list, [[0]], 16, np.full(3, 5), np.full(3, 3))
    np.testing.assert_array_equal(seg[0], np.repeat([1, 2, 3, 4], 4))
    np.testing.assert_array_equal(pre[0], np.repeat([1, 1, 1, 1], 4))
    # Each member's positions continue the prompt's (4, 5, 6, 7), whatever its slots.
    np.testing.assert_array_equal(pos[0], np.concatenate([np.arange(4)] + [np.arange(4, 8)] * 3))
    assert flops.packed(1, 1, 16, flops.row_blocks(seg, pre, pos)) == 16 + 7 * 16
    # With a window of 5 positions the last member (slots 12-15, positions 4-7) still sees
    # the prefix's block (positions 0-3: 3 > 4 - 5), 12 slots back.
    windowed = dataclasses.replace(flops, window=5)
    assert windowed.packed(1, 1, 16, windowed.row_blocks(seg, pre, pos)) == 16 + 7 * 16
    # Beside it in one micro-batch, a row of one 16-token sequence (its 10 causal block
    # pairs, which hold the first row's 7): the kernel runs the union for both rows.
    alone = np.ones((1, 16), np.int32)
    blocks = flops.row_blocks(
        np.concatenate([seg, alone]),
        np.concatenate([pre, alone]),
        np.concatenate([pos, np.arange(16)[None]]),
    )
    assert flops.packed(1, 2, 16, blocks) == 32 + 2 * 10 * 16
    # Under two blocks a row runs the reference: every [L, L] pair.
    assert flops.row_blocks(seg[:, :4], pre[:, :4], pos[:, :4]) is None
    # Four 4-token sequences, no prompts: rows of 16 (the shortest row), each its own block.
    assert _plan([4, 4, 4, 4], 16, flops) == (16, 1, 1)
    singles = [[m] for m in range(4)]
    chosen = packing_plan.plan(singles, np.zeros(4, int), np.full(4, 4), 16, 1, flops)
    assert chosen.flops == 16 + 4 * 16


def test_completion_lengths_count_masked_off_tokens_inside_a_completion():
    # Row 1: a multi-turn completion whose tokens 2-3 (an observation) are off the mask.
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 0, 0, 1], [0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(packing_plan.completion_lengths(mask), [2, 5, 0])


def _batch(seed=0, groups=None):
    """Mixed lengths; `groups`: (first row, rows) blocks whose rows take the first row's
    prompt (as a rollout's groups share one)."""
    rng = np.random.default_rng(seed)
    prompt_len = PROMPT_LEN.copy()
    for first, rows in groups or ():
        prompt_len[first : first + rows] = prompt_len[first]
    prompt_mask = np.arange(P)[None, :] >= (P - prompt_len)[:, None]
    comp_mask = np.arange(T)[None, :] < COMP_LEN[:, None]
    prompt_tokens = np.where(prompt_mask, rng.integers(2, 48, (M, P)), 0)
    for first, rows in groups or ():
        prompt_tokens[first : first + rows] = prompt_tokens[first]
    seqs = Sequences(
        prompt_tokens_BP=jnp.asarray(prompt_tokens, jnp.int32),
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
    packed = packing.pack(batch.seqs, budget=24, flops=SLOTS)
    lengths = PROMPT_LEN + COMP_LEN  # 18 3 11 6 7 13 11 4 (73)
    # Rows of 24 (the budget), FFD longest first (0 5 2 6 4 3 7 1): [0 3] [5 2] [6 4 7] [1]:
    # 4 rows = 96 slots, one row per micro-batch (one device).
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
    packed = packing.pack(batch.seqs, budget=36, data_parallel=2, flops=SLOTS)
    assert packed.tokens_KRL.shape == (4, 2, 18) and int(packed.num_micro) == 3
    assert int(packed.micro_M[7]) == 0 and int(packed.start_M[7]) == 18 + 13 + 3 - 1


def test_pack_keeps_masked_off_tokens_inside_a_completion():
    _, batch = _batch()
    mask = np.asarray(batch.seqs.completion_mask_BT).copy()
    mask[0, 3:5] = False  # row 0: 12 tokens, an observation at 3-4 off the loss mask
    observation = np.zeros_like(mask)
    observation[0, 3:5] = True
    seqs = batch.seqs.replace(completion_mask_BT=jnp.asarray(mask))
    # Off the loss mask and on no other: a gap, whose positions the padded passes skip.
    with pytest.raises(ValueError, match=r"completion rows \[0\] .* observation_mask_BT"):
        packing.pack(seqs, budget=36, flops=SLOTS)
    seqs = seqs.replace(observation_mask_BT=jnp.asarray(observation))
    packed = packing.pack(seqs, budget=36, flops=SLOTS)
    row = int(packed.micro_M[0])
    segments = np.asarray(packed.segments_KRL)[row, 0]
    own = segments == segments[int(packed.start_M[0])]
    assert own.sum() == PROMPT_LEN[0] + COMP_LEN[0]  # the observation stays in the sequence
    np.testing.assert_array_equal(
        np.asarray(packed.tokens_KRL)[row, 0][own][PROMPT_LEN[0] :],
        np.asarray(batch.seqs.completion_tokens_BT)[0],
    )


# Two groups of 4 rows sharing a prompt: rows 0-3 (6 tokens), rows 4-7 (5 tokens).
GROUPS = ((0, 4), (4, 4))


def test_shared_prompts_lay_out_by_hand():
    _, batch = _batch(groups=GROUPS)
    packed = packing.pack(batch.seqs, budget=24, flops=SLOTS)
    # Group 0: a prefix of 5 tokens, members (last prompt token + completion) of 13 2 8 4
    # tokens; rows of 24 leave 19: FFD [13 4 2] [8], units of 24 and 13. Group 1: a prefix
    # of 4, members 3 12 6 2 into 20: [12 6 2] [3], units of 24 and 7. Rows (FFD of units):
    # [rows 0 3 1] [rows 5 6 7] [row 2, row 4].
    assert packed.tokens_KRL.shape == (8, 1, 24) and int(packed.num_micro) == 3
    segments = np.asarray(packed.segments_KRL)[:, 0]
    prefixes = np.asarray(packed.prefixes_KRL)[:, 0]
    positions = np.asarray(packed.positions_KRL)[:, 0]
    np.testing.assert_array_equal(segments[0], [1] * 5 + [2] * 13 + [3] * 4 + [4] * 2)
    np.testing.assert_array_equal(prefixes[0], [1] * 24)  # every member sees the prefix
    np.testing.assert_array_equal(
        positions[0], list(range(18)) + [5, 6, 7, 8] + [5, 6]
    )  # members continue from the prompt's last token (position 5)
    np.testing.assert_array_equal(segments[2], [1] * 5 + [2] * 8 + [3] * 4 + [4] * 3 + [0] * 4)
    np.testing.assert_array_equal(prefixes[2], [1] * 13 + [3] * 7 + [0] * 4)
    np.testing.assert_array_equal(positions[2][13:20], [0, 1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(np.asarray(packed.micro_M), [0, 0, 2, 0, 2, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(packed.start_M)[[0, 3, 1, 2, 4]], [5, 18, 22, 5, 17])
    prompt0 = np.asarray(batch.seqs.prompt_tokens_BP)[0]
    tokens = np.asarray(packed.tokens_KRL)[:, 0]
    np.testing.assert_array_equal(tokens[0, :5], prompt0[:5])  # the prefix once
    np.testing.assert_array_equal(tokens[0, [5, 18, 22]], [prompt0[5]] * 3)  # in each member
    np.testing.assert_array_equal(
        tokens[0, 19:22], np.asarray(batch.seqs.completion_tokens_BT)[3, :3]
    )
    # Real tokens: each group's prefix twice (split) + each member's token + completions.
    assert packing.real_share(packed) == (2 * 5 + 2 * 4 + 8 + COMP_LEN.sum(), 3 * 24)


def test_a_shared_prompt_mask_by_hand():
    """A packed row: a prefix of 3 tokens (segment 1), two members of 2 tokens that see it
    (segments 2, 3), a sequence of its own (segment 4), one empty slot."""
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 4, 4, 0]], jnp.int32)
    prefixes = jnp.asarray([[1, 1, 1, 1, 1, 1, 1, 4, 4, 0]], jnp.int32)
    visible = np.asarray(masks.visible_mask(segments, 10, 0, query_prefix_BT=prefixes))
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 0, 0],  # member 2 skips member 1
            [1, 1, 1, 0, 0, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ],
        bool,
    )
    np.testing.assert_array_equal(visible[0], expected)
    # The chunked online softmax (blocks of 4, with its custom backward) and XLA's
    # dot_product_attention take the same mask: outputs and gradients equal the reference's.
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (1, 10, 4, 8))  # [B, T, N, H]
    k = jax.random.normal(keys[1], (1, 2, 8, 10))  # [B, K, H, S]
    v = jax.random.normal(keys[2], (1, 2, 10, 8))  # [B, K, S, H]

    def run(impl):
        config = attention.AttentionConfig(impl=impl, block_q=4, block_k=4, packed_block=4)

        def f(q, k, v):
            out = attention.attention(q, k, v, segments, 0, config, query_prefix_BT=prefixes)
            return jnp.sum(jnp.sin(out[0, :9])), out  # the empty slot's output is unused

        (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out[0, :9], grads

    out_ref, grads_ref = run("reference")
    for impl in ("chunked", "xla"):
        out, grads = run(impl)
        np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), atol=1e-5, err_msg=impl)
        for g, g_ref in zip(grads, grads_ref):
            np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-5, err_msg=impl)
    with pytest.raises(ValueError, match="impl 'splash' takes segment ids by equality only"):
        attention.attention(
            q, k, v, segments, 0, attention.AttentionConfig(impl="splash"), query_prefix_BT=prefixes
        )


@pytest.mark.parametrize(
    "agg, share_prompts",
    [(agg, True) for agg in rl.AGG_MODES] + [("token-mean", False)],
)
def test_packed_update_equals_the_padded_update(agg, share_prompts):
    """Two groups of 4 sharing prompts, packed into rows of 24 (each group split over two
    rows, test_shared_prompts_lay_out_by_hand); without shared prompts, a sequence each."""
    params, batch = _batch(groups=GROUPS)
    # k3 KL to the reference in the loss, clipping on: every term of the loss enters.
    algorithm = dataclasses.replace(
        rl.get_preset("grpo", clip_low=0.02, clip_high=0.02), agg=agg, kl_coef=0.1
    )
    loss_ref, grads_ref, metrics_ref = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algorithm, num_micro=1, temperature=0.9
    )
    packed = packing.pack(
        batch.seqs, budget=24, flops=packing.SlotFlops.of(CONFIG), share_prompts=share_prompts
    )
    assert int(packed.num_micro) == (3 if share_prompts else 4)
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


def test_packed_lora_update_equals_the_padded_lora_update():
    """LoRA adapters (B random, so every adapter gets a gradient) on the frozen base, shared
    prompts packed into rows of 24: the padded LoRA update's loss and adapter gradients."""
    from jaxrl4llm.models import lora as lora_lib

    from tests.train.test_lora_training import LORA, _random_b

    base, batch = _batch(groups=GROUPS)
    adapters = _random_b(lora_lib.init_adapters(CONFIG, LORA, jax.random.key(1)))
    algorithm = dataclasses.replace(rl.get_preset("grpo"), agg="seq-mean-token-mean", kl_coef=0.1)
    common = dict(model_config=CONFIG, algorithm=algorithm, temperature=1.0)
    loss_ref, grads_ref, _ = accumulate_gradients(
        adapters, batch, num_micro=1, frozen=base, lora=LORA, **common
    )
    packed = packing.pack(batch.seqs, budget=24, flops=packing.SlotFlops.of(CONFIG))
    loss, grads, _ = jax.jit(
        lambda a, f, b, k: accumulate_packed(a, b, k, frozen=f, lora=LORA, **common)
    )(adapters, base, batch, packed)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-6)
    assert min(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_ref)) > 1e-4


def test_packed_update_on_8_devices_equals_one_device():
    """data x fsdp = 2 x 4: a micro-batch is 8 packed rows, one per device (shared prompts);
    the sharded packed update equals the padded update on one device."""
    params, batch = _batch(groups=GROUPS)
    algorithm = dataclasses.replace(rl.get_preset("grpo"), agg="token-mean", kl_coef=0.1)
    loss_ref, grads_ref, _ = accumulate_gradients(
        params, batch, model_config=CONFIG, algorithm=algorithm, num_micro=1, temperature=1.0
    )
    mesh = parallel.make_mesh("data:2,fsdp:4,tensor:1")
    sharding = parallel.ActivationSharding(mesh)
    packed = packing.pack(batch.seqs, budget=8 * 24, data_parallel=8, flops=SLOTS)
    assert packed.tokens_KRL.shape[1] == 8  # one row of 24 slots per device
    assert (np.asarray(packed.prefixes_KRL) != np.asarray(packed.segments_KRL)).any()
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


def _choice(batch, budget):
    """The trainer's mini-batch of the whole batch (train/update/minibatches.py) with
    --micro_batch_tokens=budget on the toy model."""
    from jaxrl4llm.sampling.layout import RowLayout
    from jaxrl4llm.train.config import TrainConfig
    from jaxrl4llm.train.update.minibatches import minibatches

    config = TrainConfig().replace(
        prompts_per_step=2, group_size=4, micro_batch_tokens=budget, max_new_tokens=T
    )
    batch = batch.replace(layout=RowLayout(4))
    (mini,) = minibatches(batch, config, jax.random.key(0), None, CONFIG)
    return mini


def test_the_update_packs_only_where_that_models_fewer_flops():
    # Mixed lengths: packed (3 rows of 24, each group's prompt once per row) below the
    # padded update (2 prompts of 6 columns + 8 rows x 12 completion columns).
    _, batch = _batch(groups=GROUPS)
    mini = _choice(batch, 24)
    assert mini.packing.batch is not None and mini.packing.flops_ratio < 1
    assert mini.tokens == packing.real_share(mini.packing.batch)
    # Every completion 12 tokens: nothing to remove but the prompt block's padding, and each
    # group (5 + 4 x 13 tokens) splits over rows of 24, its prompt copied into each: the
    # padded update runs, cut to its 12 columns, with the ratio it won by.
    full = jnp.ones_like(batch.seqs.completion_mask_BT)
    mini = _choice(batch.replace(seqs=batch.seqs.replace(completion_mask_BT=full)), 24)
    assert mini.packing.batch is None and mini.packing.flops_ratio > 1
    assert mini.tokens == (M * T, M * T)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(micro_batch_tokens=-1), "--micro_batch_tokens=-1 must be >= 0"),
        # 128 + 64 = 192 tokens per sequence, 4 data-parallel devices: at least 768.
        (dict(micro_batch_tokens=767), "--micro_batch_tokens=767 must be 0 .off. or >= 768"),
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
        validate(base.replace(**overrides), num_devices=8, num_hosts=1)
    validate(base.replace(micro_batch_tokens=768), num_devices=8, num_hosts=1)
    validate(base.replace(micro_batch_tokens=768, lora_rank=8), num_devices=8, num_hosts=1)
    with pytest.raises(FlagError, match="run on one host .this run has 2."):
        validate(base.replace(micro_batch_tokens=768), num_devices=8, num_hosts=2)
