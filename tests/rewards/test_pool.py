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
