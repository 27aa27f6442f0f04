"""Math verification through the process pool: correctness, blow-ups, crashes, deadlines.

One pool for the whole module (worker start-up is the slow part on a 2-core machine).
"""

from __future__ import annotations

import os
import time

import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.rewards import make_reward_fn
from jaxrl4llm.rewards.pool import PoolConfig, VerifierPool

ITEM_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def verifier():
    with make_reward_fn(
        "math", num_workers=2, item_timeout_s=ITEM_TIMEOUT_S, batch_timeout_s=60.0
    ) as reward_fn:
        yield reward_fn


def _verify(verifier, pairs):
    completions = [c for c, _ in pairs]
    records = [Record(prompt="q", answer=g, metadata={"task": "math"}) for _, g in pairs]
    return [tuple(v)[:2] for v in verifier.verdicts(completions, records)]


def test_equivalent_forms_are_correct(verifier):
    pairs = [
        ("\\boxed{0.5}", "\\frac{1}{2}"),  # decimal vs fraction
        ("\\boxed{\\dfrac{3}{4}}", "0.75"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),  # LaTeX, symbolic
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{½}", "1/2"),  # unicode vulgar fraction
        ("\\boxed{π}", "\\pi"),  # unicode letter
        ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}"),  # sets, nested escaped braces
        ("work... \\boxed{3} no wait \\boxed{\\frac{6}{4}}", "1.5"),  # last box counts
        ("#### reasoning \\boxed{10^{10}}", "10000000000"),
    ]
    assert _verify(verifier, pairs) == [(True, "correct")] * len(pairs)


def test_wrong_missing_and_unparseable_answers(verifier):
    pairs = [
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("\\boxed{(1,2)}", "(2,1)"),
        ("I think it is 5", "5"),  # no box in the default mode
        ("\\boxed{}", "5"),
        ("\\boxed{\\frac{}{}}", "5"),
        ("\\boxed{" + "x" * 2000 + "}", "5"),  # too long for a sympy job
    ]
    assert _verify(verifier, pairs) == [
        (False, "wrong"),
        (False, "wrong"),
        (False, "no_answer"),
        (False, "no_answer"),
        (False, "parse_error"),
        (False, "parse_error"),
    ]


def test_garbage_completion_of_100kb_never_raises(verifier):
    garbage = "".join(chr(0x20 + (i * 7919) % 5000) for i in range(100_000))
    verdicts = _verify(verifier, [(garbage, "5"), (garbage + "\\boxed{5}", "5")])
    assert verdicts[0][0] is False
    assert verdicts[1] == (True, "correct")


def test_power_tower_blow_ups_finish_within_the_timeout(verifier):
    pairs = [
        ("\\boxed{9^{9^{9^9}}}", "5"),
        ("\\boxed{99!!!}", "7"),
        ("\\boxed{(10^{10^{6}})!}", "3"),
        ("\\boxed{12}", "12"),
    ]
    start = time.perf_counter()
    verdicts = _verify(verifier, pairs)
    elapsed = time.perf_counter() - start
    assert [v[0] for v in verdicts] == [False, False, False, True]
    assert {v[1] for v in verdicts[:3]} <= {"timeout", "wrong", "parse_error"}
    # Two workers, three hard items: bounded by the per-item guard, not by sympy.
    assert elapsed < 3 * ITEM_TIMEOUT_S + 10


def test_pool_survives_crash_hang_and_error(verifier):
    from jaxrl4llm.rewards.math_verifier import verify_in_worker

    pool = verifier.pool
    restarts = pool.stats["restarts"]
    results = pool.run(
        [
            (verify_in_worker, ("\\frac{1}{2}", "0.5", 1)),
            (os._exit, (3,)),  # the test hook: a worker that dies mid-job
            (time.sleep, (60,)),  # a hang that ignores every inner timeout
            (int, ("not a number",)),  # a job that raises
            (verify_in_worker, ("2", "3", 1)),
        ]
    )
    assert [r.status for r in results] == ["ok", "crash", "timeout", "error", "ok"]
    assert results[0].value == "correct" and results[4].value == "wrong"
    assert pool.stats["restarts"] == restarts + 2
    # The replaced workers serve the next batch.
    assert _verify(verifier, [("\\boxed{0.5}", "1/2")]) == [(True, "correct")]


def test_batch_deadline_bounds_a_whole_batch():
    with VerifierPool(
        PoolConfig(num_workers=1, item_timeout_s=30.0, batch_timeout_s=1.0, preload=())
    ) as pool:
        start = time.perf_counter()
        results = pool.run([(time.sleep, (30,)), (abs, (-1,))])
        assert time.perf_counter() - start < 15
    assert [r.status for r in results] == ["timeout", "timeout"]
    assert results[1].value == "not started before the batch deadline"


def test_close_stops_the_workers():
    pool = VerifierPool(PoolConfig(num_workers=1, preload=()))
    assert pool.run([(abs, (-2,))])[0].value == 2
    procs = [w.proc for w in pool._workers]
    pool.close()
    assert all(p.poll() is not None for p in procs)


def test_workers_that_cannot_start_fail_their_jobs_without_hanging(capfd):
    with VerifierPool(PoolConfig(num_workers=1, preload=("no_such_module_xyz",))) as pool:
        results = pool.run([(abs, (-1,)), (abs, (-2,))])
    assert [r.status for r in results] == ["crash", "crash"]
    assert "no_such_module_xyz" in capfd.readouterr().err  # the cause reaches the user


def test_math_verify_phases_share_the_item_deadline(monkeypatch):
    # Each phase gets the whole seconds left of a budget derived from the item deadline
    # (5 s -> 4.5 s), not a fixed third of it (1 s). A fake clock: each phase takes 1.1 s.
    import types

    import math_verify

    from jaxrl4llm.rewards import RewardConfig, math_verifier

    budget = RewardConfig(item_timeout_s=5.0).math.budget_s
    assert 4.0 <= budget < 5.0
    clock = [100.0]
    seen = []

    def slow_parse(text, parsing_timeout=None, **kwargs):
        seen.append(parsing_timeout)
        clock[0] += 1.1
        return [text]

    def fake_verify(gold, pred, timeout_seconds=None, **kwargs):
        seen.append(timeout_seconds)
        return True

    monkeypatch.setattr(math_verifier, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(math_verify, "parse", slow_parse)
    monkeypatch.setattr(math_verify, "verify", fake_verify)
    assert math_verifier.verify_in_worker("1", "1", 4.5) == "correct"
    assert seen == [4, 3, 2]
    seen.clear()
    assert math_verifier.verify_in_worker("1", "1", 2.15) == "timeout"  # spent before verify
    assert seen == [2, 1]
    seen.clear()
    assert math_verifier.verify_in_worker("1", "1", 2.5) == "correct"
    assert seen == [2, 1, None]  # 0.3 s left: no alarm (whole seconds); the pool's guard holds
