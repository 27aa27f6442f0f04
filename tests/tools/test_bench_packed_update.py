"""tools/bench_packed_update.py: the synthetic mini-batch it times, against the forced lengths
and the prompt layout written out by hand."""

from __future__ import annotations

import os
import sys

import numpy as np

TOOLS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"
)
sys.path.insert(0, TOOLS)
import bench_packed_update  # noqa: E402
import bench_rollout  # noqa: E402


def test_synthetic_batch_has_the_mix_lengths_and_one_prompt_per_group():
    args = bench_packed_update._parse(["--length_mix=tail10", "--prompts=3", "--group=2"])
    seqs = bench_packed_update.synthetic_sequences(args, vocab=50)
    caps, max_new = bench_rollout.mix_caps("tail10", 6, 0)
    mask = np.asarray(seqs.sequence_mask_BT)
    np.testing.assert_array_equal(mask.sum(axis=1), np.minimum(caps, max_new))
    assert (np.asarray(seqs.completion_tokens_BT)[~mask] == 0).all()
    prompt_mask = np.asarray(seqs.prompt_mask_BP)
    assert (prompt_mask.sum(axis=1) == 58).all() and prompt_mask[:, -1].all()  # left-padded
    prompts = np.asarray(seqs.prompt_tokens_BP)
    assert (prompts[0] == prompts[1]).all() and (prompts[2] == prompts[3]).all()
    assert (prompts[1] != prompts[2]).any()
