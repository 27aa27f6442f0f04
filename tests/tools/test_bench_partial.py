"""tools/bench_partial.py: partial rollouts decode nothing twice, and with one round a step
prefills and decodes what a step without them does."""

from __future__ import annotations

import argparse

from tools import bench_partial


def _figures(mix, **kw):
    args = argparse.Namespace(
        prompts=4, group=4, prompt_tokens=20, max_staleness=2, steps=4, seed=1, **kw
    )
    return bench_partial.run_mix(mix, args)


def test_one_round_is_a_normal_step():
    """A budget of max_new_tokens: every group finishes in its first round, so each step
    prefills its P prompts once (shared) and decodes exactly the tokens it trains."""
    f = _figures("step0", budget=64)
    assert f["rounds"] == 1
    assert f["prefilled_per_step"] == f["normal_prefilled"] == 4 * 20
    assert f["kept_prefilled_per_step"] == f["normal_prefilled"]
    assert f["decoded_per_step"] == f["normal_decoded"]
    assert f["redecoded_share"] == 0


def test_rounds_decode_nothing_twice():
    """A budget that does not divide max_new_tokens (24 of 64, 100 of 1024): rows resume
    over several rounds and steps, and no token is decoded twice or past the limit."""
    for mix, budget in (("step0", 24), ("tail10", 100)):
        f = _figures(mix, budget=budget)
        assert f["rounds"] > 1
        assert f["redecoded_share"] == 0, mix
        # A resumed row prefills its prompt and its completion so far again; with pages kept
        # over a step's rounds only the rows carried into a step do.
        assert f["prefilled_per_step"] > f["kept_prefilled_per_step"] >= f["normal_prefilled"]
