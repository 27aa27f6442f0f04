"""VerifierPool deadlines and failure reports: per-item deadlines from each item's start,
one slow item costs one worker, a dead worker is reported with its real exit code / signal."""

from __future__ import annotations

import os
import signal
import time

from jaxrl4llm.rewards.pool import PoolConfig, VerifierPool


def test_a_crashed_worker_is_reported_with_its_exit_code_or_signal():
    # Read right after the socket closes, the exit status was often not reaped yet ("None").
    with VerifierPool(PoolConfig(num_workers=2, preload=())) as pool:
        for _ in range(2):
            results = pool.run(
                [
                    (os._exit, (3,)),
                    (signal.raise_signal, (signal.SIGKILL,)),
                    (signal.raise_signal, (signal.SIGSEGV,)),
                    (abs, (-4,)),
                ]
            )
            assert [r.status for r in results] == ["crash", "crash", "crash", "ok"]
            assert results[0].value == "verifier worker exited with code 3"
            assert results[1].value.startswith("verifier worker was killed by SIGKILL")
            assert results[2].value == "verifier worker was killed by SIGSEGV"
            assert results[3].value == 4


def test_one_slow_item_costs_one_worker_not_the_batch():
    with VerifierPool(
        PoolConfig(num_workers=2, item_timeout_s=2.0, batch_timeout_s=60.0, preload=())
    ) as pool:
        results = pool.run([(time.sleep, (30,))] + [(abs, (-i,)) for i in range(40)])
    assert results[0].status == "timeout" and results[0].value == "item deadline (2 s)"
    assert [r.status for r in results[1:]] == ["ok"] * 40
    assert [r.value for r in results[1:]] == list(range(40))


def test_each_item_has_its_deadline_from_its_own_start():
    # Three 1.2 s items on one worker take 3.6 s: a deadline counted from the batch start
    # (2 s) would fail the last two; each item's own 2 s from its start passes all three.
    with VerifierPool(
        PoolConfig(num_workers=1, item_timeout_s=2.0, batch_timeout_s=60.0, preload=())
    ) as pool:
        results = pool.run([(time.sleep, (1.2,))] * 3)
    assert [r.status for r in results] == ["ok"] * 3


def test_the_batch_deadline_scales_with_the_work():
    """batch_timeout_s + the jobs' allowances / workers: four 0.6 s jobs on one worker (2.4 s)
    pass a 1 s batch deadline once each job brings its 1 s allowance, and miss it without."""
    config = PoolConfig(num_workers=1, item_timeout_s=5.0, batch_timeout_s=1.0, preload=())
    with VerifierPool(config) as pool:
        assert pool.batch_deadline_s([1.0] * 4) == 5.0
        pool.run([(abs, (-1,))])  # the worker's start is not part of what is timed below
        scaled = pool.run([(time.sleep, (0.6,))] * 4, [1.0] * 4)
        fixed = pool.run([(time.sleep, (0.6,))] * 4)
    assert [r.status for r in scaled] == ["ok"] * 4
    assert "timeout" in [r.status for r in fixed]


def test_every_verifier_brings_an_allowance():
    from jaxrl4llm.rewards.base import JOB_COST_S, Job
    from jaxrl4llm.rewards.code import TEST_COST_S, CodeConfig, CodeVerifier
    from jaxrl4llm.rewards.sandbox import SandboxConfig

    assert Job(abs, (1,)).cost_s == JOB_COST_S > 0  # math, countdown, knights and knaves, gym
    verifier = CodeVerifier(CodeConfig(sandbox=SandboxConfig(isolation="none", unsafe=True)))
    tests = '{"style": "assert", "cases": ["assert f() == 1", "assert f() == 1", "f()"]}'
    job = verifier.plan_one(
        "```python\ndef f():\n    return 1\n```", {"metadata": {"tests": tests}}
    )
    assert job.cost_s == 3 * TEST_COST_S
