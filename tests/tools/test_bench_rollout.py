"""tools/bench_rollout.py: the real-token share of the trainer's mini-batches, each cut to the
bucket of its own longest row, against shares worked out by hand."""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np

from jaxrl4llm.sampling.sample_output import SampleOutput

TOOLS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"
)
sys.path.insert(0, TOOLS)
import bench_rollout  # noqa: E402


def _rollout(lengths, N=64, P=4) -> SampleOutput:
    lengths = np.asarray(lengths)
    B = lengths.size
    mask = np.arange(N)[None, :] < lengths[:, None]
    return SampleOutput(
        tokens_BT=jnp.asarray(np.where(mask, 5, 0), jnp.int32),
        logprobs_BT=jnp.zeros((B, N)),
        mask_BT=jnp.asarray(mask),
        lengths_B=jnp.asarray(lengths, jnp.int32),
        truncated_B=jnp.zeros(B, bool),
        prompt_tokens_BP=jnp.full((B, P), 7, jnp.int32),
        prompt_mask_BP=jnp.ones((B, P), bool),
        dropped_B=jnp.zeros(B, bool),
        num_steps=jnp.asarray(int(lengths.max()), jnp.int32),
    )


def test_minibatch_share_counts_each_minibatch_at_its_own_bucket():
    # 47 real tokens; the batch's bucket is 24 (longest 19). Mini-batches of 4: the one
    # holding row 2 runs 4 x 24 columns, the other 4 x 16 (buckets are >= 16).
    out = _rollout([3, 5, 19, 2, 4, 6, 7, 1])
    for seed in range(3):
        share = bench_rollout.minibatch_real_frac(
            out, group=4, mini_batch=4, ppo_epochs=2, max_new_tokens=64, seed=seed
        )
        assert abs(share - 47 / 160) < 1e-12
    # One mini-batch of all 8 rows: the rollout's own cut, 8 x 24.
    whole = bench_rollout.minibatch_real_frac(
        out, group=4, mini_batch=8, ppo_epochs=1, max_new_tokens=64
    )
    assert abs(whole - 47 / 192) < 1e-12
    assert (
        abs(
            bench_rollout.waste(np.array([3, 5, 19, 2, 4, 6, 7, 1]), 19, 100, 64)[
                "update_real_trimmed"
            ]
            - 47 / 192
        )
        < 1e-12
    )
    # 39 decoded tokens past the prefill's first ones, over 50 slot-steps of continuous batching.
    assert (
        bench_rollout.waste(np.array([3, 5, 19, 2, 4, 6, 7, 1]), 19, 100, 64, 50)[
            "sampler_useful_continuous"
        ]
        == 39 / 50
    )


def test_logprob_pass_shares_padded_and_packed_by_hand():
    # Prompts of 4 tokens (block 16, the minimum bucket), completions 47 tokens, bucket 24.
    # Padded: 2 groups' prompts + 47 = 55 real tokens over 2 x 16 + 8 x 24 = 224 positions.
    # Packed at 64, FLOPs counting slots: the 8 rows share one prompt (equal tokens), a
    # prefix of 3 + members (last prompt token + completion) 4 6 20 3 5 7 8 2. Rows of 32
    # leave 29 for members: [20 8] [7 6 5 4 3 2], units of 31 and 30 in 2 rows, both in one
    # micro-batch (R = 2): 64 slots, as few as one row of 64, and shorter. Real tokens: the
    # prefix twice + 55 = 61.
    from jaxrl4llm.train.update.packing import SlotFlops

    out = _rollout([3, 5, 19, 2, 4, 6, 7, 1])
    shares = bench_rollout.logprob_real_fracs(
        out, group=4, max_new_tokens=64, budget=64, flops=SlotFlops(1.0, 0.0, 0.0)
    )
    assert shares == {
        "logprob_real": 55 / 224,
        "logprob_real_packed": 61 / 64,
        "logprob_flops_packed": 64 / 224,
    }


def test_length_mixes_draw_from_the_stored_lengths_and_stretch_the_tail():
    lengths = np.array([2, 4, 6, 10, 64])  # median 6, 99th percentile 61.84
    caps, bound = bench_rollout.mix_caps("step0", 1000, seed=0, lengths=lengths)
    assert bound == 64 and set(caps.tolist()) == {2, 4, 6, 10, 64}
    np.testing.assert_array_equal(
        caps, bench_rollout.mix_caps("step0", 1000, seed=0, lengths=lengths)[0]
    )
    tail, bound = bench_rollout.mix_caps("tail10", 200_000, seed=1, lengths=lengths)
    # The same median, a 99th percentile ten times the stored one's, cut at the bound.
    assert bound == 1024 and tail.min() >= 1 and tail.max() == 1024
    assert abs(np.median(tail) - 6) <= 0.5
    assert abs(np.percentile(tail, 99) / 618.4 - 1) < 0.03
    stored = bench_rollout.step0_lengths()
    assert stored.min() >= 1 and stored.max() <= bench_rollout.STEP0_MAX_NEW_TOKENS
