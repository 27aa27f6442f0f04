"""Partial rollouts (train/rollout/partial.py): the carried buffer by hand on a scripted sampler, a
resumed row continuing its prefix exactly (greedy), and the loop with the flag, killed and
resumed bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import types

import jax
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.models import registry
from jaxrl4llm.rewards.base import RewardBatch
from jaxrl4llm.sampling import page_pool, paged, row_io
from jaxrl4llm.sampling.frontend import Sampler
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.sampling.strategies import GREEDY
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import RolloutConfig
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.infra.metrics import read_metrics
from jaxrl4llm.train.rollout import partial

from tests.compacted_reference import compacted_rollouts
from tests.conftest import build_toy_model
from tests.sampling.test_sampler import alone_logprobs, chosen
from tests.train.test_loop import _config, _one_device

# Scripted rows: record -> for each of its G = 2 rows, the completion length at which it emits
# its stop token (None: never; it runs to max_new_tokens = 6 and is truncated).
SCRIPT = {
    "a": (1, 2),
    "b": (None, 3),
    "c": (2, 1),
    "d": (None, None),
    "e": (1, 1),
    "f": (1, 1),
    "g": (1, 1),
    "h": (1, 1),
}
RECORDS = "abcdefgh"


def _token(record: str, position: int) -> int:
    """The scripted token at 1-based completion position `position` of a record's rows."""
    return 10 * (RECORDS.index(record) + 1) + position


def _place(round_key, row_key):
    """The buffer place (0..3: P = 2 groups of G = 2) whose key is `row_key`."""
    keys = jax.random.key_data(row_io.sample_keys(round_key, np.arange(4), np.zeros(4, np.int32)))
    return int(np.flatnonzero((keys == jax.random.key_data(row_key)).all(axis=1))[0])


class ScriptedSampler:
    """A sampler that continues each row from its prefix along SCRIPT, within the budget."""

    pad_id, mesh = 0, None
    model_config = types.SimpleNamespace(vocab_size=1000)

    def __init__(self):
        self.calls = []

    def encode(self, messages):
        return [[900 + RECORDS.index(m)] for m in messages]

    def generate(
        self,
        params,
        prompts,
        sampling,
        budget,
        key,
        *,
        group_size=1,
        share_prompts=True,
        row_keys=None,
        prefixes=None,
        row_caps=None,
    ):
        """Row r's place in the round's buffer (hence its row of the group) is read from its
        key, fold_in(fold_in(round key, place), 0): the keys partial.py must give."""
        prompts = [p for p in prompts for _ in range(group_size)]
        prefixes = prefixes or [()] * len(prompts)
        places = [_place(key, k) for k in row_keys]
        self.calls.append(
            [(place, len(x), cap) for place, x, cap in zip(places, prefixes, row_caps)]
        )
        B = len(prompts)
        tokens, logp = np.zeros((B, budget), np.int32), np.zeros((B, budget), np.float32)
        lengths, truncated = np.zeros(B, np.int32), np.zeros(B, bool)
        for r, (prompt, prefix, cap) in enumerate(zip(prompts, prefixes, row_caps)):
            if cap == 0:
                continue
            record, start = RECORDS[prompt[0] - 900], len(prefix)
            stop = SCRIPT[record][places[r] % 2]
            n = cap if stop is None or stop - start > cap else stop - start
            lengths[r], truncated[r] = n, stop is None or stop - start > cap
            for i in range(n):
                tokens[r, i] = _token(record, start + i + 1)
                logp[r, i] = -0.01 * tokens[r, i]
        return SampleOutput(
            tokens,
            logp,
            np.arange(budget) < lengths[:, None],
            lengths,
            truncated,
            np.zeros((B, 1), np.int32),
            np.ones((B, 1), bool),
            np.zeros(B, bool),
            np.int32(lengths.max()),
            np.int32(0),
        )

    def decode(self, out, num_rows):
        return [" ".join(map(str, out.tokens_BT[r, : out.lengths_B[r]])) for r in range(num_rows)]


class Rewards:
    def score(self, texts, records, lengths):
        return RewardBatch(
            rewards=np.array([float(r == "a") for r in records], np.float32),
            correct=np.array([r == "a" for r in records]),
            reasons=["correct" if r == "a" else "wrong" for r in records],
        )


def _ctx(max_staleness=1):
    rollout = RolloutConfig(
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=6,
        max_prompt_tokens=8,
        partial_rollout_tokens=2,
        max_staleness=max_staleness,
    )
    return types.SimpleNamespace(
        rollout=rollout,
        sampler=ScriptedSampler(),
        reward_fn=Rewards(),
        data=types.SimpleNamespace(messages=lambda r: r),
    )


def _supply():
    """The data iterator: two records per call, in order, after the step's own."""
    rest = iter(RECORDS[2:])
    return lambda: [next(rest), next(rest)]


def _rows(rows):
    """(record per row, completion tokens per row, behaviour logprobs per row) of a batch."""
    out = jax.device_get(rows.samples.out)
    tokens = [out.tokens_BT[r, :n].tolist() for r, n in enumerate(out.lengths_B)]
    logp = [out.logprobs_BT[r, :n].tolist() for r, n in enumerate(out.lengths_B)]
    return tokens, logp, out


def test_the_buffer_carries_resumes_and_drops_stale_groups():
    ctx, more = _ctx(max_staleness=1), _supply()
    key = jax.random.key(0)
    # Step 1, prompts a, b. Round 1: a finishes (1 and 2 tokens); b's rows reach 2 tokens.
    # Round 2 takes c (the iterator's next two: c, d; d waits): b's row 1 stops at 3, its row 0
    # reaches 4; c finishes. Batch: a, c; b carried (age 1); d pending.
    rows, carried, m = partial.sample_and_score(ctx, None, partial.Carried(), list("ab"), key, more)
    tokens, logp, out = _rows(rows)
    assert tokens == [[11], [11, 12], [31, 32], [31]]
    np.testing.assert_allclose(logp[1], [-0.11, -0.12], rtol=1e-6)
    assert out.truncated_B.tolist() == [False] * 4
    # (buffer place, prefix length, cap) of each row of each call: round 1 starts a and b as
    # groups; round 2 starts c (places 2, 3: after b, still in flight) and resumes b's two
    # rows (places 0, 1).
    assert ctx.sampler.calls == [
        [(0, 0, 2), (1, 0, 2), (2, 0, 2), (3, 0, 2)],
        [(2, 0, 2), (3, 0, 2)],
        [(0, 2, 2), (1, 2, 2)],
    ]
    assert [g.record for g in carried.groups] == ["b"] and carried.groups[0].age == 1
    assert carried.groups[0].lengths_G.tolist() == [4, 3] and carried.pending == ("d",)
    assert rows.verdicts.rewards.tolist() == [1, 1, 0, 0]
    assert {k: m[k].value for k in m if k.startswith("partial/")} == {
        "partial/rounds": 1 * 2,
        "partial/new_groups": 3,
        # Round 1: a 1 + 2, b 2 + 2 tokens, 2 prompts; round 2: c 2 + 1, b 2 + 1 tokens,
        # c's prompt and b's two rows (prompt 1 + 2 tokens each).
        "partial/decoded_tokens": 13,
        "partial/prefilled_tokens": 9,
        "partial/carried_rows": 2,
        "partial/dropped_rows": 0,
        "partial/staleness_0": 4,
        "partial/staleness_1": 0,
    }

    # The buffer through the checkpoint's JSON: exactly the same.
    state = json.loads(json.dumps(carried.to_state()))
    restored = partial.Carried.from_state(state, 2, 6, 0)
    for x, y in zip(carried.groups, restored.groups):
        for f in ("tokens_GT", "logprobs_GT", "lengths_G", "stopped_G"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))
        assert (x.record, x.prompt, x.age, x.dropped) == (y.record, y.prompt, y.age, y.dropped)
    assert restored.pending == carried.pending

    # Step 2, prompts e, f (pending: d, e, f). Round 1: b resumed from 4 (row 0) runs to 6 and
    # is truncated; d starts. Round 2 takes e, which finishes; d reaches 4 and is carried.
    rows, carried2, m = partial.sample_and_score(ctx, None, restored, list("ef"), key, more)
    tokens, logp, out = _rows(rows)
    assert tokens == [[21, 22, 23, 24, 25, 26], [21, 22, 23], [51], [51]]
    # b's behaviour logprobs: its parts of step 1 and step 2, concatenated.
    np.testing.assert_allclose(logp[0], [-0.21, -0.22, -0.23, -0.24, -0.25, -0.26], rtol=1e-6)
    assert out.truncated_B.tolist() == [True, False, False, False]
    # Round 1: d starts (places 2, 3) and b (carried, place 0) resumes only its unfinished
    # row 0, capped at the 2 tokens --max_new_tokens leaves it. Round 2: b is done, so d moves
    # to places 0, 1 and resumes, and e starts in places 2, 3.
    assert ctx.sampler.calls[3:] == [
        [(2, 0, 2), (3, 0, 2)],
        [(0, 4, 2)],
        [(2, 0, 2), (3, 0, 2)],
        [(0, 2, 2), (1, 2, 2)],
    ]
    # Decoded: b 2, d 4 + 4, e 2. Prefilled: b's row (1 + 4), d's and e's prompts once each,
    # d's two rows (1 + 2) each.
    assert (m["partial/decoded_tokens"].value, m["partial/prefilled_tokens"].value) == (12, 13)
    assert [(g.record, g.age) for g in carried2.groups] == [("d", 1)]
    assert carried2.pending == ("f",)
    assert (m["partial/staleness_0"].value, m["partial/staleness_1"].value) == (2, 2)

    # With --max_staleness=0 the same step drops d instead of carrying it.
    rows, carried0, m = partial.sample_and_score(
        _ctx(max_staleness=0), None, restored, list("ef"), key, _supply()
    )
    assert carried0.groups == () and m["partial/dropped_rows"].value == 2
    assert m["partial/carried_rows"].value == 0 and "partial/staleness_1" not in m


def test_a_resumed_row_continues_exactly_like_an_uninterrupted_greedy_decode(toy_model_dir):
    """Parts of 3 tokens, each resumed by prefilling prompt + the tokens so far, give the
    tokens (and logprobs) of one uninterrupted 9-token greedy decode."""
    config, params, tokenizer = registry.load_model(toy_model_dir)
    sampler = Sampler(config, tokenizer, stop_ids=())  # every row runs its whole budget
    prompts = sampler.encode(["copy 3", "copy 1 answer"])
    key = jax.random.key(0)
    whole = jax.device_get(sampler.generate(params, prompts, GREEDY, 9, key))
    prefixes, logps = [[], []], [[], []]
    for _ in range(3):
        part = jax.device_get(sampler.generate(params, prompts, GREEDY, 3, key, prefixes=prefixes))
        for r in range(2):
            prefixes[r] = prefixes[r] + part.tokens_BT[r].tolist()
            logps[r] = logps[r] + part.logprobs_BT[r].tolist()
    assert prefixes == whole.tokens_BT.tolist()
    np.testing.assert_allclose(logps, whole.logprobs_BT, atol=1e-5)
    assert len(set(map(tuple, prefixes))) == 2  # the rows differ: the test can fail


def test_windowed_rows_resumed_over_rounds_and_steps_equal_a_forward_alone(toy_model_dir):
    """A sliding window of 4 (shorter than every prompt): rows sampled in parts of 3 tokens,
    each part prefilling the prompt + the completion so far, some groups carried to the next
    step and resumed there. A trained row's behaviour logprobs (its parts' concatenated) equal
    log_softmax of one forward over its prompt ++ whole completion alone (unpadded, no
    cache)."""
    config, params, tokenizer = registry.load_model(toy_model_dir)
    config = dataclasses.replace(config, sliding_window=4)
    budget = 3
    rollout = RolloutConfig(
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=12,
        max_prompt_tokens=12,
        partial_rollout_tokens=budget,
        max_staleness=2,
    )
    scored = []

    class Recorded(Rewards):
        def score(self, texts, records, lengths):
            scored.append(list(records))
            return super().score(texts, records, lengths)

    messages = lambda record: [{"role": "user", "content": record}]  # noqa: E731
    sampler = Sampler(config, tokenizer, stop_ids=(3, 15))  # rows end at mixed lengths
    ctx = types.SimpleNamespace(
        rollout=rollout,
        sampler=sampler,
        reward_fn=Recorded(),
        data=types.SimpleNamespace(messages=messages),
    )
    records = iter(["copy 1", "copy 2", "copy 3", "copy 1 answer", "copy 2 is", "copy 3 is"] * 2)
    more = lambda: [next(records), next(records)]  # noqa: E731
    carried, stale, rows_seen = partial.Carried(), 0, []
    for step in range(3):
        rows, carried, m = partial.sample_and_score(
            ctx, params, carried, more(), jax.random.key(step), more
        )
        stale += m["partial/staleness_1"].value + m["partial/staleness_2"].value
        out = jax.device_get(rows.samples.out)
        for r, record in enumerate(scored[-1]):
            n = int(out.lengths_B[r])
            prompt, completion = sampler.encode([messages(record)])[0], out.tokens_BT[r, :n]
            ref = alone_logprobs(params, config, prompt, completion)
            np.testing.assert_allclose(
                out.logprobs_BT[r, :n], chosen(ref, completion), atol=1e-5, rtol=0
            )
            rows_seen.append((prompt, completion, out.logprobs_BT[r, :n]))
    # Rows made of 3 or more parts (resumed twice or more), and groups resumed a step later.
    prompt, completion, logp = max(rows_seen, key=lambda row: len(row[1]))
    assert len(completion) > 2 * budget and stale > 0
    # The window matters for these lengths: without it the longest row's logprobs differ.
    unwindowed = dataclasses.replace(config, sliding_window=None)
    ref = alone_logprobs(params, unwindowed, prompt, completion)
    assert np.abs(chosen(ref, completion) - logp).max() > 1e-2


@pytest.fixture(scope="module")
def early_stop_model(tmp_path_factory):
    """The toy policy with most words (not the digits 1-3) as stop tokens: completions end
    after a few tokens, at lengths that vary, so some groups finish in a round and others
    carry over."""
    path = build_toy_model(tmp_path_factory.mktemp("early_stop"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["eos_token_id"] = [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 14, 15, 16, 17, 18, 19, 20]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _partial_config(model, data, workdir, **overrides):
    return _config(
        model,
        data,
        workdir,
        prompts_per_step=4,
        group_size=2,
        max_new_tokens=6,
        partial_rollout_tokens=2,
        max_staleness=2,
        mini_batch_size=4,
        **overrides,
    )


def test_a_partial_run_carries_rows_and_counts_them(early_stop_model, copy_task_file, tmp_path):
    """Three steps that carry rows, sampled by the compacted sampler's calls (the tests'
    reference); the paged engine, with a pool of one group at full length (rows wait for
    pages, are evicted and restored), runs the same steps (what it prefills differs:
    test_partial_pool.py)."""
    config = _partial_config(early_stop_model, copy_task_file, tmp_path / "a", num_steps=3)
    with compacted_rollouts():
        loop.run(config, devices=_one_device())
    records = read_metrics(str(tmp_path / "a"))
    for r in records:  # every step trains P = 4 full groups, staleness 0..2
        assert sum(r[f"partial/staleness_{k}"] for k in range(3)) == 8
        assert r["reward/accuracy"] == r["reward/accuracy"]  # scored, not NaN
    assert any(r["partial/carried_rows"] > 0 for r in records)
    assert any(r["partial/staleness_1"] + r["partial/staleness_2"] > 0 for r in records)

    r = config.rollout
    pool = page_pool.min_pool_pages(r.max_prompt_tokens, r.max_new_tokens, 2, paged.PAGE_SIZE)
    loop.run(
        config.replace(
            workdir=str(tmp_path / "b"),
            kv_cache_tokens=pool * paged.PAGE_SIZE,
        ),
        devices=_one_device(),
    )
    for ra, rb in zip(records, read_metrics(str(tmp_path / "b")), strict=True):
        for k in ra:
            if k.startswith(("partial/", "reward/", "response/")) and "prefilled" not in k:
                assert ra[k] == rb[k], k
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("engine", ["compacted", "paged"])
def test_a_killed_partial_run_resumes_bit_identically(
    early_stop_model, copy_task_file, tmp_path, engine
):
    """A run killed (kill -9) after logging step 3 but before saving it restarts from
    checkpoint 2, carried rows included, and logs the metrics of a run that never stopped;
    on the paged engine (the step's rounds on one pool of pages) and with the compacted
    sampler's calls (the rounds as several hosts run them, tests/compacted_reference.py)."""
    sampler = compacted_rollouts() if engine == "compacted" else contextlib.nullcontext()
    straight = _partial_config(early_stop_model, copy_task_file, tmp_path / "a", num_steps=4)
    killed = _partial_config(
        early_stop_model, copy_task_file, tmp_path / "b", num_steps=3, checkpoint_every=2
    )
    with sampler:
        loop.run(straight, devices=_one_device())
        loop.run(killed, devices=_one_device())
        shutil.rmtree(tmp_path / "b" / "checkpoints" / "3")  # what kill -9 leaves
        metadata = tmp_path / "b" / "checkpoints" / "2" / "data" / "metadata"
        saved = json.loads(metadata.read_text())
        assert saved["in_flight"]["groups"], "nothing carried at the checkpoint: a weak test"
        loop.run(killed.replace(num_steps=4), devices=_one_device())
    a, b = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        same = {k for k in ra if not k.startswith(("time/", "throughput/", "memory/"))}
        assert {k: ra[k] for k in same} == {k: rb[k] for k in same}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(partial_rollout_tokens=6), r"--partial_rollout_tokens=6 must be in \[1, "),
        (
            dict(partial_rollout_tokens=2, algorithm=rl.get_preset("dapo")),
            "does not combine with --dynamic_sampling",
        ),
        (
            dict(partial_rollout_tokens=2, algorithm=rl.get_preset("remax")),
            "does not combine with --advantage=remax",
        ),
        (
            dict(partial_rollout_tokens=2, recompute_old_logprobs=False),
            "does not combine with --norecompute_old_logprobs",
        ),
        (dict(max_staleness=3), "--max_staleness=3 applies only to partial rollouts"),
    ],
)
def test_unsupported_partial_settings_are_refused(overrides, message, tmp_path):
    config = _config("unused", "unused", tmp_path, max_new_tokens=6, **overrides)
    with pytest.raises(ValueError, match=message):
        validate(config, 1)
