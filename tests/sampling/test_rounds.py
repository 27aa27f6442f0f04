"""Sampling rounds on a fake sampler and verifier: ReMax's greedy row, DAPO's dynamic sampling
(which groups it keeps, where it stops, what it logs, how rounds of different prompt widths
join)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.rewards.base import RewardBatch
from jaxrl4llm.rl.metrics import finalize_metrics
from jaxrl4llm.sampling.config import DynamicSampling
from jaxrl4llm.sampling.frontend import Samples
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.rounds import Rounds, sample_and_score
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.train.config.checks import validate

T = 3


class FakeSampler:
    """Row p * n + g of a call holds record p's sample g: token value 10 * record + g. Prompt
    widths cycle through `widths`, one per call."""

    mesh, pad_id = None, 0

    def __init__(self, widths):
        self.widths, self.calls = list(widths), []

    def sample(self, params, messages, sampling, max_new_tokens, key, layout, greedy_last=0):
        n, W = layout.group_size, self.widths[len(self.calls) % len(self.widths)]
        self.calls.append((list(messages), n, greedy_last))
        tok = np.array([[10 * m + g] * T for m in messages for g in range(n)], np.int32)
        B = tok.shape[0]
        prompt = np.full((B, W), 7, np.int32)
        out = SampleOutput(
            tokens_BT=jnp.asarray(tok),
            logprobs_BT=jnp.zeros((B, T)),
            mask_BT=jnp.ones((B, T), bool),
            lengths_B=jnp.full((B,), T, jnp.int32),
            truncated_B=jnp.zeros((B,), bool),
            prompt_tokens_BP=jnp.asarray(prompt),
            prompt_mask_BP=jnp.ones((B, W), bool),
            dropped_B=jnp.zeros((B,), bool),
            num_steps=jnp.int32(T),
        )
        return Samples(out, [f"{m}:{g}" for m in messages for g in range(n)], layout)


class FakeVerifier:
    """Record r's sample g is correct iff VERDICTS[r][g]; reward 1 / 0 (+ 0.5 on greedy rows,
    so a test can tell the baseline from the rows)."""

    def __init__(self, verdicts):
        self.verdicts = verdicts

    def score(self, texts, records, lengths=None):
        correct = np.array([self.verdicts[r][int(t.split(":")[1])] for t, r in zip(texts, records)])
        greedy = np.array(
            [int(t.split(":")[1]) == len(self.verdicts[r]) - 1 for t, r in zip(texts, records)]
        )
        return RewardBatch(
            rewards=correct + 0.5 * greedy,
            correct=correct,
            reasons=["correct" if c else "wrong" for c in correct],
        )


def _ctx(verdicts, widths=(4,)):
    return types.SimpleNamespace(
        sampler=FakeSampler(widths),
        reward_fn=FakeVerifier(verdicts),
        data=types.SimpleNamespace(messages=lambda r: r),
        rollout=types.SimpleNamespace(sampling=None, max_new_tokens=T),
        turn_handlers=None,
    )


def _rounds(preset, **overrides):
    """The rounds of --algorithm=preset (DynamicSampling follows it) with `overrides`."""
    dynamic = dataclasses.replace(DynamicSampling.for_preset(preset), **overrides)
    return Rounds.for_run(rl.get_preset(preset), dynamic)


def _feed(batches):
    it = iter(batches)
    return lambda: next(it)


def test_dynamic_sampling_gathers_groups_with_both_verdicts_and_joins_prompt_widths():
    # G = 2; records 0 and 3 have a correct and a wrong sample, 1 and 2 do not.
    verdicts = {0: [True, False], 1: [False, False], 2: [True, True], 3: [False, True]}
    ctx = _ctx(verdicts, widths=(4, 6))
    rows, metrics = sample_and_score(
        ctx, None, [0, 1], jax.random.key(0), RowLayout(2), _rounds("dapo"), _feed([[2, 3]])
    )
    assert [c[0] for c in ctx.sampler.calls] == [[0, 1], [2, 3]]  # a second round, new prompts
    assert rows.samples.texts == ["0:0", "0:1", "3:0", "3:1"]
    np.testing.assert_array_equal(np.asarray(rows.samples.out.tokens_BT)[:, 0], [0, 1, 30, 31])
    np.testing.assert_array_equal(rows.verdicts.correct, [True, False, False, True])
    # Round 1's prompts (width 4) left-padded to round 2's 6: pad id, mask False.
    prompt, pmask = (
        np.asarray(x) for x in (rows.samples.out.prompt_tokens_BP, rows.samples.out.prompt_mask_BP)
    )
    assert prompt.shape == (4, 6)
    np.testing.assert_array_equal(prompt[:2, :2], 0)
    np.testing.assert_array_equal(pmask, [[False, False] + [True] * 4] * 2 + [[True] * 6] * 2)
    got = finalize_metrics(
        {k: v for k, v in metrics.items() if k.startswith(("rollout", "reward"))}
    )
    assert got == pytest.approx(
        {
            "rollout/rounds": 2.0,
            "rollout/frac_groups_filtered": 0.5,
            "rollout/groups_short": 0.0,
            "reward/accuracy_sampled": 4 / 8,
        }
    )


def test_dynamic_sampling_stops_after_the_cap_and_fills_the_batch():
    verdicts = {r: [False, False] for r in range(8)}
    verdicts[5] = [True, False]
    ctx = _ctx(verdicts)
    rows, metrics = sample_and_score(
        ctx,
        None,
        [0, 1],
        jax.random.key(0),
        RowLayout(2),
        _rounds("dapo", max_resample_rounds=2),
        _feed([[2, 3], [4, 5], [6, 7]]),
    )
    assert len(ctx.sampler.calls) == 3  # 1 + 2 extra rounds, no more
    # The one group with spread first, then the first group set aside; same P x G shape.
    assert rows.samples.texts == ["5:0", "5:1", "0:0", "0:1"]
    assert np.asarray(rows.samples.out.tokens_BT).shape == (4, T)
    got = finalize_metrics({k: v for k, v in metrics.items() if k.startswith("rollout")})
    assert got == pytest.approx(
        {"rollout/rounds": 3.0, "rollout/frac_groups_filtered": 5 / 6, "rollout/groups_short": 1.0}
    )


def test_dynamic_sampling_without_an_iterator_resamples_the_same_prompts():
    ctx = _ctx({0: [True, True], 1: [False, True]})
    sample_and_score(
        ctx, None, [0, 1], jax.random.key(0), RowLayout(2), _rounds("dapo", max_resample_rounds=1)
    )
    assert [c[0] for c in ctx.sampler.calls] == [[0, 1], [0, 1]]


def test_remax_samples_one_greedy_row_per_prompt_and_uses_its_reward_as_baseline():
    # G = 2 sampled rows + the greedy row (index 2) per prompt.
    verdicts = {0: [True, False, True], 1: [False, True, False]}
    ctx = _ctx(verdicts)
    rows, _ = sample_and_score(ctx, None, [0, 1], jax.random.key(0), RowLayout(2), _rounds("remax"))
    assert ctx.sampler.calls == [([0, 1], 3, 1)]  # one call, G + 1 rows
    assert rows.samples.texts == ["0:0", "0:1", "1:0", "1:1"]  # greedy rows left out
    np.testing.assert_array_equal(np.asarray(rows.samples.out.tokens_BT)[:, 0], [0, 1, 10, 11])
    np.testing.assert_allclose(rows.baseline_B, [1.5, 1.5, 0.5, 0.5])
    np.testing.assert_array_equal(rows.baseline_correct_B, [True, True, False, False])
    np.testing.assert_array_equal(rows.verdicts.rewards, [1.0, 0.0, 0.0, 1.0])


def test_remax_on_several_hosts_is_refused_before_anything_loads(monkeypatch):
    """ReMax's greedy rows are picked on one host; DAPO's dynamic sampling runs on several
    (tests/train/test_multihost.py)."""
    from jaxrl4llm.train.config import TrainConfig

    remax, dapo = (
        TrainConfig().replace(algorithm=name, mesh="data:1,fsdp:1,tensor:1")
        for name in ("remax", "dapo")
    )
    validate(remax, 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    validate(dapo, 1)
    with pytest.raises(ValueError, match="runs on one host only"):
        validate(remax, 1)


class PromptingHandler:
    """A turn handler whose environments' resets rewrite each record's prompt."""

    def __init__(self, records, same_in_group=True):
        self.records, self.same = list(records), same_in_group

    def prompt_records(self):
        return [100 + r + (0 if self.same else i) for i, r in enumerate(self.records)]


class TurnSampler(FakeSampler):
    def sample(
        self, params, messages, sampling, max_new_tokens, key, layout, greedy_last=0, **turns
    ):
        self.turns = turns
        return super().sample(params, messages, sampling, max_new_tokens, key, layout, greedy_last)


def test_prompts_written_by_the_environments_resets_are_sampled():
    ctx = _ctx({1: [1, 0], 2: [0, 1]})
    ctx.sampler = TurnSampler((4,))
    ctx.rollout.turns = "limits"
    ctx.turn_handlers = PromptingHandler
    sample_and_score(ctx, None, [1, 2], jax.random.key(0), RowLayout(2), _rounds("grpo"))
    # One prompt per group (rows 0-1 are record 1's, rows 2-3 record 2's), as reset wrote it.
    assert ctx.sampler.calls[0][0] == [101, 102]
    assert ctx.sampler.turns["limits"] == "limits"
    ctx.turn_handlers = lambda records: PromptingHandler(records, same_in_group=False)
    with pytest.raises(ValueError, match="rows of prompt 0 different prompts"):
        sample_and_score(ctx, None, [1, 2], jax.random.key(0), RowLayout(2), _rounds("grpo"))
